"""Wan 2.1 / 2.2: per block self-attention over the video tokens, then cross-attention to the
text (and, for Wan 2.1 i2v, to CLIP image tokens)."""

from __future__ import annotations

import math

from ..dit import IMAGE, OTHER, Family, Geometry, Slot, TokenLayout, block_paths, video_grid


def plan(model) -> tuple[Slot, ...]:
    slots = []
    for i, block in enumerate(model.blocks):
        slots.append(Slot(IMAGE, i))  # self-attention over the video tokens, then cross-attention
        image_context = type(block.cross_attn).__name__ == "WanI2VCrossAttention"  # Wan 2.1 i2v: CLIP tokens too
        slots.extend([Slot(OTHER, i)] * (2 if image_context else 1))
    return tuple(slots)


def patch(model) -> tuple[int, int, int]:
    return tuple(model.patch_size)


def geometry(model) -> Geometry:
    attention = model.blocks[0].self_attn
    return Geometry(attention.num_heads, attention.head_dim, False)


def tokens(model, patch, x, context, kwargs) -> TokenLayout | None:
    if kwargs.get("context_latents") is not None:  # in-context reference streams (0.33): not handled
        return None
    concat = kwargs.get("time_dim_concat")
    grid = video_grid(x, patch, x.shape[2] + (concat.shape[2] if concat is not None else 0))
    # Fun models put a reference frame's tokens before the video.
    prefix = grid[1] * grid[2] if (getattr(model, "ref_conv", None) is not None
                                   and kwargs.get("reference_latent") is not None) else 0
    return TokenLayout(grid, joint=None, image=(prefix + math.prod(grid), prefix))


FAMILIES = (
    Family("Wan 2.1 / 2.2", ("WAN21_T2V", "WAN21_I2V", "WAN22_T2V"), ("WanModel",), True, True,
           lambda m: block_paths(m, "blocks"), plan, patch, tokens, geometry),
)
