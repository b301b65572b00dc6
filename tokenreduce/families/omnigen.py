"""OmniGen2 (OmniGen2Transformer2DModel): text-only context refiners, image-only noise refiners,
then joint layers over [text, reference images, image grid]. With reference images a
reference-image refiner runs between the noise refiners and the joint layers, which this plan
does not place: such model calls are left alone (tokens() says so)."""

from __future__ import annotations

from ..dit import IMAGE, JOINT, OTHER, Family, Geometry, Slot, TokenLayout, block_paths, direct_call_refusal, image_grid
from .lumina import MERGE as LUMINA_MERGE
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


# ToMe: OmniGen2 calls its layers directly as Lumina's (no patches_replace["dit"] lookup in
# ComfyUI 0.3.75 or 0.33), layer(x, mask, rotary_emb, temb, transformer_options=...), its rotary
# table [B, L, 1, ...] over the layer's tokens and its mask None: Lumina's merge, reached through
# object patches on the noise refiners (the grid) and the joint layers ([text, grid]); calls with
# reference images are left alone (merge_check says why).
def merge_check(model, kwargs) -> str | None:
    if kwargs.get("ref_latents"):
        return ("its reference images run through a reference-image refiner of their own before the joint layers, "
                "which ToMe's plan does not place")
    return None


MERGE = LUMINA_MERGE._replace(check=merge_check, leaves_alone="calls with reference images (ref_latents)")

FAMILIES = (
    Family("OmniGen2", ("Omnigen2",), ("OmniGen2Transformer2DModel",), True, False,
           lambda m: block_paths(m, "noise_refiner", "layers"), plan, lambda m: (1, m.patch_size, m.patch_size),
           tokens, geometry, merge=MERGE),
)


# Boogu-Image (BooguTransformer2DModel, ComfyUI 0.33): OmniGen2's refiners, then dual-stream layers
# (a joint call over [text, image], then an image-only self-attention call each), then OmniGen2's
# single-stream layers over [text, image]. The same reference-image caveat.

def boogu_plan(model) -> tuple[Slot, ...]:
    refiners, doubles = len(model.noise_refiner), len(model.double_stream_layers)
    return (tuple(Slot(OTHER, -1) for _ in model.context_refiner)  # text only
            + tuple(Slot(IMAGE, i) for i in range(refiners))
            + tuple(Slot(kind, refiners + i) for i in range(doubles) for kind in (JOINT, IMAGE))
            + tuple(Slot(JOINT, refiners + doubles + i) for i in range(len(model.single_stream_layers))))


def boogu_geometry(model) -> Geometry:
    attention = model.double_stream_layers[0].img_self_attn  # OmniGen2's attention, as every layer's
    return Geometry(attention.heads, attention.dim_head, True)


# ToMe: the noise refiners and single-stream layers are OmniGen2's layer calls, but each dual-stream
# layer(img, instruct, joint_rotary, img_rotary, temb, ...) takes the instruction tokens as a stream
# of their own with two rotary tables and returns (img, instruct): not described, so none merge.
BOOGU_REFUSAL = direct_call_refusal("its dual-stream layers take the instruction tokens as a stream of their own, "
                                    "with two rotary tables, and return the (image, instruction) pair")

FAMILIES += (
    Family("Boogu-Image", ("Boogu",), ("BooguTransformer2DModel",), True, False,
           lambda m: block_paths(m, "noise_refiner", "double_stream_layers", "single_stream_layers"), boogu_plan,
           lambda m: (1, m.patch_size, m.patch_size), tokens, boogu_geometry, merge_refusal=BOOGU_REFUSAL),
)
