"""Kandinsky 5 (video and image): text-only encoder blocks (left alone), then per visual block a
self-attention over the frame-major (t, h, w) latent tokens and a cross-attention to the text.

The i2v image and mask are latent channels; ``time_dim_replace`` overwrites latent frames: no
extra tokens. An image latent is one frame."""

from __future__ import annotations

import math

from ..dit import IMAGE, OTHER, Family, Geometry, Slot, TokenLayout, block_paths, video_grid


def plan(model) -> tuple[Slot, ...]:
    text = tuple(Slot(OTHER, -1) for _ in model.text_transformer_blocks)
    return text + tuple(slot for i in range(len(model.visual_transformer_blocks))
                        for slot in (Slot(IMAGE, i), Slot(OTHER, i)))


def patch(model) -> tuple[int, int, int]:
    return tuple(model.patch_size)


def geometry(model) -> Geometry:
    attention = model.visual_transformer_blocks[0].self_attention
    return Geometry(attention.num_heads, attention.head_dim, True)  # transposed to [B, heads, N, head_dim]


def tokens(model, patch, x, context, kwargs) -> TokenLayout:
    if x.ndim == 4:
        x = x.unsqueeze(2)
    grid = video_grid(x, patch)  # the model pads the latent to whole patches
    return TokenLayout(grid, joint=None, image=(math.prod(grid), 0))


def blocks(model) -> tuple[str, ...]:
    return block_paths(model, "visual_transformer_blocks")


FAMILIES = (
    Family("Kandinsky 5", ("Kandinsky5",), ("Kandinsky5",), True, True, blocks, plan, patch, tokens, geometry),
    Family("Kandinsky 5 image", ("Kandinsky5Image",), ("Kandinsky5",), True, False, blocks, plan, patch, tokens,
           geometry),
)
