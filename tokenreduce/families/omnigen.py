"""OmniGen2 (OmniGen2Transformer2DModel): text-only context refiners, image-only noise refiners,
then joint layers over [text, reference images, image grid]. With reference images a
reference-image refiner runs between the noise refiners and the joint layers, which this plan
does not place: such model calls are left alone (tokens() says so)."""

from __future__ import annotations

from ..dit import Family, Geometry, TokenLayout, block_paths, image_grid
from .lumina import plan  # the same order: text refiners, noise refiners, joint layers


def geometry(model) -> Geometry:
    attention = model.layers[0].attn  # 0.33 passes grouped k/v heads (enable_gqa); 0.3.75 repeats them
    return Geometry(attention.heads, attention.dim_head, True)


def tokens(model, patch, x, context, kwargs) -> TokenLayout | None:
    if kwargs.get("ref_latents"):  # the reference refiner's extra calls are not in the plan
        return None
    grid = image_grid(x, patch)
    image = grid[1] * grid[2]
    return TokenLayout(grid, joint=(context.shape[1] + image, context.shape[1]), image=(image, 0))


FAMILIES = (
    Family("OmniGen2", ("Omnigen2",), ("OmniGen2Transformer2DModel",), True, False,
           lambda m: block_paths(m, "noise_refiner", "layers"), plan, lambda m: (1, m.patch_size, m.patch_size),
           tokens, geometry),
)
