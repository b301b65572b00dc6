"""Ideogram 4 (Ideogram4Transformer2DModel, ComfyUI 0.33): single-stream layers over [text,
image], or over the image alone when a call has no text. The latent comes packed (each 2x2 patch
already in the 128 channels), so every latent pixel is one token: patch 1."""

from __future__ import annotations

from ..dit import JOINT, Family, Geometry, Slot, TokenLayout, block_paths, direct_call_refusal, image_grid

# ToMe: layer(h, attn_mask, freqs_cis, adaln_input) is a layer call the seam could take, but
# freqs_cis is one table for the whole batch (from the first sample's positions, no batch rows) fed
# to a fused norm-and-rotary kernel: a per-sample merge has no per-sample table to hand it.
MERGE_REFUSAL = direct_call_refusal("its layers take one rotary table for the whole batch (made from the first "
                                    "sample's positions), which a per-sample merge cannot follow")


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
           merge_refusal=MERGE_REFUSAL),
)
