"""Lumina 2 and Z-Image (NextDiT): text-only refiners, image-only noise refiners, then joint
layers over [caption (padded), image grid (padded)]."""

from __future__ import annotations

from ..dit import IMAGE, JOINT, OTHER, Family, Geometry, Slot, TokenLayout, block_paths, ceil_div, image_grid


def plan(model) -> tuple[Slot, ...]:
    refiners = len(model.noise_refiner)
    return (tuple(Slot(OTHER, -1) for _ in model.context_refiner)  # text only
            + tuple(Slot(IMAGE, i) for i in range(refiners))
            + tuple(Slot(JOINT, refiners + i) for i in range(len(model.layers))))


def geometry(model) -> Geometry:
    attention = model.layers[0].attention  # keys are repeated to every query head before the call
    return Geometry(attention.n_local_heads, attention.head_dim, True)


def tokens(model, patch, x, context, kwargs) -> TokenLayout | None:
    if kwargs.get("ref_latents"):  # Z-Image with reference images: the main image comes last; not handled
        return None
    grid = image_grid(x, patch)
    multiple = getattr(model, "pad_tokens_multiple", None) or 1
    text = ceil_div(context.shape[1], multiple) * multiple  # caption, padded to the multiple (Z-Image: 32)
    image = ceil_div(grid[1] * grid[2], multiple) * multiple  # the grid, then pad tokens
    return TokenLayout(grid, joint=(text + image, text), image=(image, 0))


# ToMe: NextDiT calls its layers directly, with no block-replace lookup (patches_replace["dit"]) in
# ComfyUI 0.3.75 or 0.33; its "double_block" patches run after each layer, too late to merge. It
# could be reached by wrapping each layer module on the clone (an object patch); not done.
MERGE_REFUSAL = ("its model calls its layers with no block-replace lookup (patches_replace['dit']) and its "
                 "double_block patches run only after each layer")

FAMILIES = (
    Family("Lumina 2 / Z-Image", ("Lumina2", "ZImage"), ("NextDiT",), True, False,
           lambda m: block_paths(m, "noise_refiner", "layers"), plan, lambda m: (1, m.patch_size, m.patch_size),
           tokens, geometry, merge_refusal=MERGE_REFUSAL),
)
