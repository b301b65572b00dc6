"""Flux.1 (dev, schnell, Fill, Kontext), Flux.2, Chroma, Chroma Radiance and LongCat-Image:
double-stream then single-stream blocks, every attention call joint over [text, main image,
reference images]. Reference images are tokens only where the model appends them: the host's
Flux ``model_base`` (which Chroma's derives from) passes ReferenceLatent's latents on as
``ref_latents`` to every one of these models, and Chroma's and Chroma Radiance's ignore them."""

from __future__ import annotations

from ..dit import JOINT, Family, Geometry, Slot, TokenLayout, block_paths, image_grid, ref_tokens


def plan(model) -> tuple[Slot, ...]:
    return tuple(Slot(JOINT, i) for i in range(len(model.double_blocks) + len(model.single_blocks)))


def patch(model) -> tuple[int, int, int]:
    return (1, model.patch_size, model.patch_size)


def geometry(model) -> Geometry:
    return Geometry(model.num_heads, model.hidden_size // model.num_heads, True)


def text_first_tokens(model, patch, x, context, kwargs) -> TokenLayout:
    """[text, main image, reference images...]: Flux, Chroma, Flux.2, Qwen-Image."""
    grid = image_grid(x, patch)
    text = context.shape[1]
    return TokenLayout(grid, joint=(text + grid[1] * grid[2] + ref_tokens(kwargs.get("ref_latents"), *patch[1:]), text),
                       image=None)


def text_image_tokens(model, patch, x, context, kwargs) -> TokenLayout:
    """[text, main image], whatever ``ref_latents`` the call is given: Chroma's forward drops them
    (``**kwargs``), and Chroma Radiance, a Chroma that patchifies the RGB image itself (patch 16),
    does too (its NeRF head decodes per patch, with no attention)."""
    grid = image_grid(x, patch)
    text = context.shape[1]
    return TokenLayout(grid, joint=(text + grid[1] * grid[2], text), image=None)


def blocks(model) -> tuple[str, ...]:
    return block_paths(model, "double_blocks", "single_blocks")


FAMILIES = (
    Family("Flux.1", ("Flux", "FluxSchnell", "FluxInpaint"), ("Flux",), True, False,
           blocks, plan, patch, text_first_tokens, geometry),
    Family("Flux.2", ("Flux2",), ("Flux",), True, False, blocks, plan, patch, text_first_tokens, geometry),
    Family("Chroma", ("Chroma",), ("Chroma",), True, False, blocks, plan, patch, text_image_tokens, geometry),
    Family("Chroma Radiance", ("ChromaRadiance",), ("ChromaRadiance",), True, False, blocks, plan, patch,
           text_image_tokens, geometry),
    # The Flux model class itself; the host config only shifts its rope positions (rope_options).
    Family("LongCat-Image", ("LongCatImage",), ("Flux",), True, False, blocks, plan, patch, text_first_tokens,
           geometry),
)
