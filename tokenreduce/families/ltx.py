"""LTX-Video (LTXV): per transformer block a self-attention over the video tokens (frame-major,
patch (1, 1, 1): the VAE does all the downscaling), then a cross-attention to the text.

Guide frames (LTXVAddGuide and the like: ``keyframe_idxs``) are appended to the token sequence
after the video; ComfyUI 0.33 also drops tokens by the denoise mask and, with guide strengths,
splits each self-attention into several masked calls. Such a model call is left alone (its
layout is not placed) rather than reduced with guide tokens mixed into the grid."""

from __future__ import annotations

import math

from ..dit import (IMAGE, OTHER, BlockArgs, DiTMerge, Family, Geometry, Slot, TokenLayout, block_paths, clean_frames,
                   video_grid)


def plan(model) -> tuple[Slot, ...]:
    return tuple(slot for i in range(len(model.transformer_blocks)) for slot in (Slot(IMAGE, i), Slot(OTHER, i)))


def patch(model) -> tuple[int, int, int]:
    return tuple(model.patchifier.patch_size)


def geometry(model) -> Geometry:
    attention = model.transformer_blocks[0].attn1
    return Geometry(attention.heads, attention.dim_head, False)


def tokens(model, patch, x, context, kwargs) -> TokenLayout | None:
    keyframes = kwargs.get("keyframe_idxs")
    if keyframes is not None and keyframes.shape[2] > 0:  # guide tokens after the video: not placed
        return None
    grid = video_grid(x, patch)
    return TokenLayout(grid, joint=None, image=(math.prod(grid), 0), whole_frames=clean_frames(kwargs))


# ToMe: each block is handed img (the video tokens alone), txt (the text, with its mask
# attention_mask: cross-attention only), the rotary positions of the video tokens (0.3.75: a
# [B, 1, L, ...] tensor; 0.33: a (matrix [B, L, heads, ...], split mode) pair) and the timestep
# modulation vec ([B, 1, ...], or per token [B, L, ...] where the denoise mask differs per frame).
MERGE = DiTMerge(lambda m: {i: ("double_block", i) for i in range(len(m.transformer_blocks))}, {
    "double_block": BlockArgs("img", lambda lay: lay.image, pe="pe", pe_dim=lambda pe: 1 if isinstance(pe, tuple) else 2,
                              in_pe=lambda lay: lay.image, modulation="vec"),
})

FAMILIES = (
    Family("LTX-Video", ("LTXV",), ("LTXVModel",), True, True,
           lambda m: block_paths(m, "transformer_blocks"), plan, patch, tokens, geometry, merge=MERGE),
)
