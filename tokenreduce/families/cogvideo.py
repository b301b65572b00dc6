"""CogVideoX (1.0 and 1.5; text to video, image to video, inpainting): one joint call per block
over [text, video] (the video frame-major; 1.5 patches time by 2 as well). The i2v image and the
inpainting mask are latent channels, not tokens."""

from __future__ import annotations

import math

from ..dit import JOINT, Family, Geometry, Slot, TokenLayout, block_paths, direct_call_refusal, video_grid

# ToMe: block(hidden_states=, encoder_hidden_states=, temb=, image_rotary_emb=) by keyword, the
# video and the text apart, returning both; the rotary table a (cos, sin) pair [L, D] shared by
# the batch (None on the 2B model, which adds positions to the tokens).
MERGE_REFUSAL = direct_call_refusal("its blocks are called by keyword with the video and the text apart, return the "
                                    "pair, and take the rotary table as a (cos, sin) pair shared by the batch")


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


FAMILIES = (
    # rope: the 5B and 1.5 models rotate the video tokens' q and k; the 2B adds positions to the tokens.
    Family("CogVideoX", ("CogVideoX_T2V", "CogVideoX_I2V", "CogVideoX_Inpaint"), ("CogVideoXTransformer3DModel",),
           True, True, lambda m: block_paths(m, "blocks"), plan, patch, tokens, geometry,
           merge_refusal=MERGE_REFUSAL),
)
