"""Cosmos 1.0 (GeneralDIT), Cosmos Predict2 (MiniTrainDIT) and Anima (MiniTrainDIT behind an LLM
text adapter): per block a self-attention over the frame-major (t, h, w) latent tokens and a
cross-attention to the text (Cosmos 1.0: in the order of its block_config, "FA-CA-MLP").

The padding mask and the i2v mask are channels of the latent, not tokens. Anima's LLM adapter
runs its attention without the host's transformer options, so the override never sees it."""

from __future__ import annotations

import math

from ..dit import IMAGE, OTHER, Family, Geometry, Slot, TokenLayout, block_paths, direct_call_refusal, video_grid

# ToMe: both generations hand each block the video as a 5-D grid it flattens itself (1.0: [T, H,
# W, B, D]; Predict2 and Anima: [B, T, H, W, D] with a per-frame modulation [B, T, D]) and a
# rotary table [L, 1, 1, D] shared by the batch: no token sequence to merge, no per-sample table.
_V1_REFUSAL = direct_call_refusal("its blocks take the video as a [T, H, W, B, D] grid, not a token sequence, with a "
                                  "rotary table shared by the batch")
_REFUSAL = direct_call_refusal("its blocks take the latent as a [B, T, H, W, D] grid, not a token sequence, "
                               "modulated per frame, with a rotary table shared by the batch")


def plan(model) -> tuple[Slot, ...]:
    return tuple(slot for i in range(len(model.blocks)) for slot in (Slot(IMAGE, i), Slot(OTHER, i)))


def patch(model) -> tuple[int, int, int]:
    return (model.patch_temporal, model.patch_spatial, model.patch_spatial)


def geometry(model) -> Geometry:
    attention = model.blocks[0].self_attn
    return Geometry(attention.n_heads, attention.head_dim, True)  # [B, heads, N, head_dim] (skip_reshape)


def tokens(model, patch, x, context, kwargs) -> TokenLayout:
    if x.ndim == 4:  # an image latent: one frame
        x = x.unsqueeze(2)
    grid = video_grid(x, patch)  # the model pads the latent to whole patches
    return TokenLayout(grid, joint=None, image=(math.prod(grid), 0))


def _blocks(model) -> tuple[str, ...]:
    return block_paths(model, "blocks")


# Cosmos 1.0: blocks is a ModuleDict ("block0", ...), each a list of building blocks run in order.
_SELF, _CROSS = ("fa", "full_attn"), ("ca", "cross_attn")


def _v1_blocks(model) -> tuple[str, ...]:
    return tuple(f"blocks.{name}" for name in model.blocks)


def _v1_plan(model) -> tuple[Slot, ...]:
    slots = []
    for i, block in enumerate(model.blocks.values()):
        for part in block.blocks:
            if part.block_type in _SELF:
                slots.append(Slot(IMAGE, i))
            elif part.block_type in _CROSS:
                slots.append(Slot(OTHER, i))
    return tuple(slots)


def _v1_geometry(model) -> Geometry:
    attention = next(part.block.attn for part in model.blocks["block0"].blocks if part.block_type in _SELF)
    return Geometry(attention.heads, attention.dim_head, True)  # [B, heads, N, head_dim] (skip_reshape)


def _v1_check(model) -> str | None:
    kinds = {part.block_type for block in model.blocks.values() for part in block.blocks}
    unknown = kinds - set(_SELF) - set(_CROSS) - {"mlp", "ff"}
    return f"its blocks have building blocks {sorted(unknown)} the Cosmos plan does not know" if unknown else None


FAMILIES = (
    Family("Cosmos 1.0", ("CosmosT2V", "CosmosI2V"), ("GeneralDIT",), True, True,
           _v1_blocks, _v1_plan, patch, tokens, _v1_geometry, _v1_check, merge_refusal=_V1_REFUSAL),
    Family("Cosmos Predict2", ("CosmosI2VPredict2",), ("MiniTrainDIT",), True, True,
           _blocks, plan, patch, tokens, geometry, merge_refusal=_REFUSAL),
    # ComfyUI also detects the Predict2 text-to-video models as CosmosT2IPredict2 (the same keys):
    # their video grid is still placed, only the temporal factor does not apply.
    Family("Cosmos Predict2 image", ("CosmosT2IPredict2",), ("MiniTrainDIT",), True, False,
           _blocks, plan, patch, tokens, geometry, merge_refusal=_REFUSAL),
    Family("Anima", ("Anima",), ("Anima",), True, False, _blocks, plan, patch, tokens, geometry,
           merge_refusal=_REFUSAL),
)
