"""Flux.1 (dev, schnell, Fill, Kontext), Flux.2, Chroma, Chroma Radiance and LongCat-Image:
double-stream then single-stream blocks, every attention call joint over [text, main image,
reference images]. Reference images are tokens only where the model appends them: the host's
Flux ``model_base`` (which Chroma's derives from) passes ReferenceLatent's latents on as
``ref_latents`` to every one of these models, and Chroma's and Chroma Radiance's ignore them."""

from __future__ import annotations

from ..dit import JOINT, BlockArgs, DiTMerge, Family, Geometry, Slot, TokenLayout, block_paths, image_grid, ref_tokens


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


def merge_keys(model) -> dict:
    """ToMe: the block-replace key of each block (by its index in the plan)."""
    double = len(model.double_blocks)
    return {**{i: ("double_block", i) for i in range(double)},
            **{double + i: ("single_block", i) for i in range(len(model.single_blocks))}}


def merge_check(model, kwargs) -> str | None:
    if kwargs.get("ref_latents") and kwargs.get("ref_latents_method") == "index_timestep_zero":
        return ("its reference images are modulated apart (index_timestep_zero) over token ranges the block is "
                "given outside its arguments, which merging would shift")
    return None


# Double blocks: img = [main image, references], positions and mask over [text, img]; single
# blocks: img = [text, main image, references]. Only the main image's grid merges.
MERGE = DiTMerge(merge_keys, {
    "double_block": BlockArgs("img", lambda lay: (lay.joint[0] - lay.joint[1], 0), pe="pe", pe_dim=2,
                              in_pe=lambda lay: lay.joint, mask="attn_mask"),
    "single_block": BlockArgs("img", lambda lay: lay.joint, pe="pe", pe_dim=2, in_pe=lambda lay: lay.joint,
                              mask="attn_mask"),
}, merge_check, leaves_alone="calls with reference images modulated apart (ref_latents_method index_timestep_zero)")

FAMILIES = (
    Family("Flux.1", ("Flux", "FluxSchnell", "FluxInpaint"), ("Flux",), True, False,
           blocks, plan, patch, text_first_tokens, geometry, merge=MERGE),
    # Its global modulation hands the blocks vec as a pair of modulations (per sample).
    Family("Flux.2", ("Flux2",), ("Flux",), True, False, blocks, plan, patch, text_first_tokens, geometry,
           merge=MERGE),
    Family("Chroma", ("Chroma",), ("Chroma",), True, False, blocks, plan, patch, text_image_tokens, geometry,
           merge=MERGE),
    Family("Chroma Radiance", ("ChromaRadiance",), ("ChromaRadiance",), True, False, blocks, plan, patch,
           text_image_tokens, geometry, merge=MERGE),
    # The Flux model class itself; the host config only shifts its rope positions (rope_options).
    Family("LongCat-Image", ("LongCatImage",), ("Flux",), True, False, blocks, plan, patch, text_first_tokens,
           geometry, merge=MERGE),
)
