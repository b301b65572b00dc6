"""Genmo Mochi: asymmetric joint attention, one call per block over [video, text] (the video
first, frame-major; the text cropped to its ``num_tokens`` real tokens, 256 at most)."""

from __future__ import annotations

import math

from ..dit import JOINT, Family, Geometry, Slot, TokenLayout, block_paths, video_grid


def plan(model) -> tuple[Slot, ...]:
    return tuple(Slot(JOINT, i) for i in range(len(model.blocks)))


def patch(model) -> tuple[int, int, int]:
    return (1, model.patch_size, model.patch_size)


def geometry(model) -> Geometry:
    attention = model.blocks[0].attn
    return Geometry(attention.num_heads, attention.head_dim, True)  # transposed to [B, heads, N, head_dim]


def tokens(model, patch, x, context, kwargs) -> TokenLayout:
    grid = video_grid(x, patch)
    text = min(int(kwargs.get("num_tokens", 256)), context.shape[1])  # the model keeps q_y[:, :num_tokens]
    return TokenLayout(grid, joint=(math.prod(grid) + text, 0), image=None)


FAMILIES = (
    # ToMe: reachable through its block-replace lookup, but its blocks are handed two rotary
    # tables (rope_cos, rope_sin) without a batch dimension.
    Family("Mochi", ("GenmoMochi",), ("AsymmDiTJoint",), True, True,
           lambda m: block_paths(m, "blocks"), plan, patch, tokens, geometry,
           merge_refusal="its blocks are handed two rotary tables (rope_cos, rope_sin) without a batch dimension, "
                         "which ToMe's block description does not take yet"),
)
