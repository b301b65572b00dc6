"""AuraFlow (MMDiT): joint double layers over [8 register tokens, text, image] (text and image
streams concatenated in that order), then single layers over the same sequence. Positions are
a learned table added to the image tokens before the blocks, so nothing is rotated into q/k."""

from __future__ import annotations

import math

from ..dit import JOINT, BlockArgs, DiTMerge, Family, Geometry, Slot, TokenLayout, block_paths, image_grid

REGISTER_TOKENS = 8  # learned tokens the model puts before the text


def plan(model) -> tuple[Slot, ...]:
    return tuple(Slot(JOINT, i) for i in range(len(model.double_layers) + len(model.single_layers)))


def geometry(model) -> Geometry:
    attention = (model.double_layers or model.single_layers)[0].attn
    return Geometry(attention.n_heads, attention.head_dim, True)


def tokens(model, patch, x, context, kwargs) -> TokenLayout:
    grid = image_grid(x, patch)  # odd sizes are padded up to the patch
    text = REGISTER_TOKENS + context.shape[1]
    return TokenLayout(grid, joint=(text + grid[1] * grid[2], text), image=None)


def merge_keys(model) -> dict:
    """ToMe: the block-replace key of each layer (by its index in the plan)."""
    double = len(model.double_layers)
    return {**{i: ("double_block", i) for i in range(double)},
            **{double + i: ("single_block", i) for i in range(len(model.single_layers))}}


# ToMe: double layers are handed img (the image alone) and txt ([registers, text]) apart, single
# layers img = [registers, text, image]; the modulation (vec) is per sample, positions are
# already added to the image tokens.
MERGE = DiTMerge(merge_keys, {
    "double_block": BlockArgs("img", lambda lay: (math.prod(lay.grid), 0)),
    "single_block": BlockArgs("img", lambda lay: lay.joint),
})

FAMILIES = (
    Family("AuraFlow", ("AuraFlow",), ("MMDiT",), False, False,
           lambda m: block_paths(m, "double_layers", "single_layers"), plan,
           lambda m: (1, m.patch_size, m.patch_size), tokens, geometry, merge=MERGE),
)
