"""Cosmos Predict2 (MiniTrainDIT) and Anima (the same DiT behind an LLM text adapter): per block a
self-attention over the frame-major (t, h, w) latent tokens, then a cross-attention to the text.

The padding mask and the i2v mask are channels of the latent, not tokens. Anima's LLM adapter
runs its attention without the host's transformer options, so the override never sees it.
Cosmos 1.0 (GeneralDIT) is not here (see refusals.py)."""

from __future__ import annotations

import math

from ..dit import IMAGE, OTHER, Family, Geometry, Slot, TokenLayout, block_paths, video_grid


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


FAMILIES = (
    Family("Cosmos Predict2", ("CosmosI2VPredict2",), ("MiniTrainDIT",), True, True,
           _blocks, plan, patch, tokens, geometry),
    # ComfyUI also detects the Predict2 text-to-video models as CosmosT2IPredict2 (the same keys):
    # their video grid is still placed, only the temporal factor does not apply.
    Family("Cosmos Predict2 image", ("CosmosT2IPredict2",), ("MiniTrainDIT",), True, False,
           _blocks, plan, patch, tokens, geometry),
    Family("Anima", ("Anima",), ("Anima",), True, False, _blocks, plan, patch, tokens, geometry),
)
