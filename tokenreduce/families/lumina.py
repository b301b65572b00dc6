"""Lumina 2 and Z-Image (NextDiT): text-only refiners, image-only noise refiners, then joint
layers over [caption (padded), image grid (padded)]."""

from __future__ import annotations

from ..dit import (IMAGE, JOINT, OTHER, BlockArgs, DiTMerge, Family, Geometry, Slot, TokenLayout, block_paths,
                   ceil_div, image_grid)


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


def merge_keys(model) -> dict:
    """ToMe: the key each block's replacement is found under (by its index in the plan). NextDiT
    has no block-replace lookup: an object patch on each merged layer looks these up (``layer_args``)."""
    refiners = len(model.noise_refiner)
    return {**{i: ("noise_refiner", i) for i in range(refiners)},
            **{refiners + i: ("layer", i) for i in range(len(model.layers))}}


def merge_check(model, kwargs) -> str | None:
    if kwargs.get("ref_latents"):
        return ("its reference images (ref_latents, Z-Image Omni) put tokens of their own before the caption and the "
                "image, modulated apart over token ranges (timestep_zero_index) the layers are given outside their "
                "tokens, which merging would shift")
    return None


# ToMe: NextDiT calls its layers directly (no patches_replace["dit"] lookup in ComfyUI 0.3.75 or
# 0.33; its double_block patches run after each layer, too late to merge), each as
# layer(x, x_mask, freqs_cis, adaln_input, [timestep_zero_index=...,] transformer_options=...).
# The host reaches each merged layer through an object patch on its forward that hands these
# positional arguments on under ``layer_args``' names. Noise refiners are handed [grid, pad
# tokens]; joint layers [caption (padded), grid, pad tokens]; the rotary table freqs_cis
# ([B, L, 1, ...]) runs over the same tokens, the mask (None in both hosts) over them too, the
# modulation (adaln_input) is per sample. Only the grid merges, never caption or pad tokens.
MERGE = DiTMerge(merge_keys, {
    "noise_refiner": BlockArgs("img", lambda lay: lay.image, pe="pe", pe_dim=1, in_pe=lambda lay: lay.image,
                               mask="mask"),
    "layer": BlockArgs("img", lambda lay: lay.joint, pe="pe", pe_dim=1, in_pe=lambda lay: lay.joint, mask="mask"),
}, merge_check, layer_args=("img", "mask", "pe", "vec"),
   leaves_alone="calls with reference images (ref_latents, Z-Image Omni)")

FAMILIES = (
    Family("Lumina 2 / Z-Image", ("Lumina2", "ZImage"), ("NextDiT",), True, False,
           lambda m: block_paths(m, "noise_refiner", "layers"), plan, lambda m: (1, m.patch_size, m.patch_size),
           tokens, geometry, merge=MERGE),
)
