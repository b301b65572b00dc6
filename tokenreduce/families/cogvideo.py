"""CogVideoX (1.0 and 1.5; text to video, image to video, inpainting): one joint call per block
over [text, video] (the video frame-major; 1.5 patches time by 2 as well). The i2v image and the
inpainting mask are latent channels, not tokens."""

from __future__ import annotations

import math

from ..dit import JOINT, BlockArgs, DiTMerge, Family, Geometry, Slot, TokenLayout, block_paths, video_grid


def plan(model) -> tuple[Slot, ...]:
    return tuple(Slot(JOINT, i) for i in range(len(model.blocks)))


def patch(model) -> tuple[int, int, int]:
    return (model.patch_size_t or 1, model.patch_size, model.patch_size)


def geometry(model) -> Geometry:
    block = model.blocks[0]
    return Geometry(block.num_heads, block.head_dim, False)


def tokens(model, patch, x, context, kwargs) -> TokenLayout:
    grid = video_grid(x, patch)  # the model pads the latent to whole patches
    text = context.shape[1]
    return TokenLayout(grid, joint=(text + math.prod(grid), text), image=None)


# ToMe: the model (ComfyUI 0.33) calls its blocks directly (no patches_replace["dit"] lookup), by
# keyword: block(hidden_states=, encoder_hidden_states=, temb=, image_rotary_emb=,
# transformer_options=), the video grid alone and the text apart, returning both. The host reaches
# each merged block through an object patch on its forward (DiTMerge.layer_args). The rotary table
# is a (cos, sin) pair [N, D] over the grid without a batch dimension, which the block broadcasts
# as [1, 1, N, D] (it takes no table per sample): where it is given the plan is made once for the
# batch and both tables are handed on merged, still batch-less (BlockArgs.pe_shared). The 2B model
# hands None (its positions are added to the tokens before the blocks). The modulation (temb) is
# per sample. Only the grid merges.
def _grid(layout: TokenLayout) -> tuple[int, int]:
    return (math.prod(layout.grid), 0)  # the video alone: in img and in the tables


MERGE = DiTMerge(lambda m: {i: ("double_block", i) for i in range(len(m.blocks))}, {
    "double_block": BlockArgs("img", _grid, pe="pe", pe_dim=1, in_pe=_grid, pe_batch=False, pe_items=2,
                              pe_shared=True),
}, layer_args=("img", "txt", "vec", "pe"), layer_returns={"double_block": ("img", "txt")})

FAMILIES = (
    # rope: the 5B and 1.5 models rotate the video tokens' q and k; the 2B adds positions to the tokens.
    Family("CogVideoX", ("CogVideoX_T2V", "CogVideoX_I2V", "CogVideoX_Inpaint"), ("CogVideoXTransformer3DModel",),
           True, True, lambda m: block_paths(m, "blocks"), plan, patch, tokens, geometry,
           merge=MERGE),
)
