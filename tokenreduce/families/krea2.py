"""Krea 2 (SingleStreamDiT, ComfyUI 0.33): a text-fusion transformer over the Qwen3-VL layer
stack (2 layerwise and 2 refiner blocks, text only), then single-stream blocks over [text,
image, reference images]. References join the sequence only with a reference method (the
conditioning's or the model's default)."""

from __future__ import annotations

from ..dit import (JOINT, OTHER, BlockArgs, DiTMerge, Family, Geometry, Slot, TokenLayout, block_paths, image_grid,
                   ref_tokens)


def plan(model) -> tuple[Slot, ...]:
    fusion = model.txtfusion
    return (tuple(Slot(OTHER, -1) for _ in (*fusion.layerwise_blocks, *fusion.refiner_blocks))
            + tuple(Slot(JOINT, i) for i in range(len(model.blocks))))


def geometry(model) -> Geometry:
    attention = model.blocks[0].attn  # grouped k/v heads are repeated to every query head before the call
    return Geometry(attention.heads, attention.headdim, True)


def tokens(model, patch, x, context, kwargs) -> TokenLayout | None:
    if x.ndim == 5 and x.shape[2] != 1:  # frames are folded into the batch: not an image grid
        return None
    grid = image_grid(x, patch)
    refs = kwargs.get("ref_latents") if kwargs.get("ref_latents_method", model.default_ref_method) else None
    text = context.shape[1]
    return TokenLayout(grid, joint=(text + grid[1] * grid[2] + ref_tokens(refs, *patch[1:]), text), image=None)


def merge_check(model, kwargs) -> str | None:
    method = kwargs.get("ref_latents_method", model.default_ref_method)
    if kwargs.get("ref_latents") and method == "index_timestep_zero":
        return ("its references (reference_latents_method index_timestep_zero) are modulated apart from a token index "
                "its blocks are given outside their tokens, which merging would shift")
    return None


# ToMe: SingleStreamDiT calls its blocks directly (no patches_replace["dit"] lookup in ComfyUI
# 0.33), each as block(x, vec, freqs, None, timestep_zero_index=..., transformer_options=...):
# the host reaches each through an object patch on its forward that hands these positional
# arguments on under ``layer_args``' names (DiTMerge.layer_args, as NextDiT's layers). x is
# [text, image, references], the rotary table (Flux's EmbedND, [B, 1, L, ...]) runs over the
# same tokens, the mask is None, the modulation per sample. Only the grid merges.
MERGE = DiTMerge(lambda m: {i: ("single_block", i) for i in range(len(m.blocks))}, {
    "single_block": BlockArgs("img", lambda lay: lay.joint, pe="pe", pe_dim=2, in_pe=lambda lay: lay.joint,
                              mask="mask"),
}, merge_check, layer_args=("img", "vec", "pe", "mask"),
   leaves_alone="calls with references modulated apart (ref_latents_method index_timestep_zero)")

FAMILIES = (
    Family("Krea 2", ("Krea2",), ("SingleStreamDiT",), True, False, lambda m: block_paths(m, "blocks"), plan,
           lambda m: (1, m.patch, m.patch), tokens, geometry, merge=MERGE),
)
