"""Ideogram 4 (Ideogram4Transformer2DModel, ComfyUI 0.33): single-stream layers over [text,
image], or over the image alone when a call has no text. The latent comes packed (each 2x2 patch
already in the 128 channels), so every latent pixel is one token: patch 1."""

from __future__ import annotations

from ..dit import JOINT, Family, Geometry, Slot, TokenLayout, block_paths, image_grid, NO_BLOCK_REPLACE


def plan(model) -> tuple[Slot, ...]:
    return tuple(Slot(JOINT, i) for i in range(len(model.layers)))


def geometry(model) -> Geometry:
    attention = model.layers[0].attention
    return Geometry(attention.num_heads, attention.head_dim, True)


def tokens(model, patch, x, context, kwargs) -> TokenLayout:
    grid = image_grid(x, patch)
    text = 0 if context is None else context.shape[1]  # no text: the unconditional, image-only pass
    return TokenLayout(grid, joint=(text + grid[1] * grid[2], text), image=None)


FAMILIES = (
    Family("Ideogram 4", ("Ideogram4",), ("Ideogram4Transformer2DModel",), True, False,
           lambda m: block_paths(m, "layers"), plan, lambda m: (1, 1, 1), tokens, geometry,
           merge_refusal=NO_BLOCK_REPLACE),
)
