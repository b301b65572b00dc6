"""Genmo Mochi: asymmetric joint attention, one call per block over [video, text] (the video
first, frame-major; the text cropped to its ``num_tokens`` real tokens, 256 at most)."""

from __future__ import annotations

import math

from ..dit import JOINT, BlockArgs, DiTMerge, Family, Geometry, Slot, TokenLayout, block_paths, video_grid


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


# ToMe: the block-replace lookup hands img (the video grid alone), the text apart (txt), a
# per-sample modulation and two rotary tables over the grid without a batch dimension (rope_cos,
# rope_sin: [N, heads, D/2]): merged, each batch item gets its own rows of both.
MERGE = DiTMerge(lambda m: {i: ("double_block", i) for i in range(len(m.blocks))}, {
    "double_block": BlockArgs("img", lambda lay: (math.prod(lay.grid), 0), pe="rope_cos", pe_dim=1,
                              in_pe=lambda lay: (math.prod(lay.grid), 0), pe_also=("rope_sin",), pe_batch=False),
})

FAMILIES = (
    Family("Mochi", ("GenmoMochi",), ("AsymmDiTJoint",), True, True,
           lambda m: block_paths(m, "blocks"), plan, patch, tokens, geometry, merge=MERGE),
)
