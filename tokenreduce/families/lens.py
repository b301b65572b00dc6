"""Lens (LensTransformer2DModel, ComfyUI 0.33): dual-stream blocks, joint attention over [image,
text] (the image first). The latent comes packed (Flux.2 format, 128 channels), one token per
latent pixel: patch 1."""

from __future__ import annotations

import math

from ..dit import BlockArgs, DiTMerge, Family, TokenLayout, block_paths, image_grid
from . import qwen
from .qwen import geometry, plan  # the same blocks list and attention attributes


def tokens(model, patch, x, context, kwargs) -> TokenLayout:
    grid = image_grid(x, patch)
    # the text is [B, tokens, layers * width] with several encoder layers side by side
    return TokenLayout(grid, joint=(grid[1] * grid[2] + context.shape[1], 0), image=None)


# ToMe: each block is handed img (the image alone) and txt apart, the rotary positions
# ([1, 1, L, ...]) and an additive mask ([B, 1, 1, L]) over [image, text], and a per-sample
# modulation (vec).
MERGE = DiTMerge(qwen.MERGE.keys, {
    "double_block": BlockArgs("img", lambda lay: (math.prod(lay.grid), 0), pe="pe", pe_dim=2,
                              in_pe=lambda lay: lay.joint, mask="attn_mask"),
})

FAMILIES = (
    Family("Lens", ("Lens",), ("LensTransformer2DModel",), True, False,
           lambda m: block_paths(m, "transformer_blocks"), plan, lambda m: (1, 1, 1), tokens, geometry, merge=MERGE),
)
