"""Qwen-Image (and Edit): dual-stream blocks, joint attention over [text, image, references]."""

from __future__ import annotations

from ..dit import JOINT, BlockArgs, DiTMerge, Family, Geometry, Slot, block_paths
from .flux import text_first_tokens


def plan(model) -> tuple[Slot, ...]:
    return tuple(Slot(JOINT, i) for i in range(len(model.transformer_blocks)))


def geometry(model) -> Geometry:
    attention = model.transformer_blocks[0].attn
    return Geometry(attention.heads, attention.dim_head, True)


def merge_check(model, kwargs) -> str | None:
    method = kwargs.get("ref_latents_method", getattr(model, "default_ref_method", None))
    if kwargs.get("ref_latents") and method == "index_timestep_zero":
        return ("its reference images are modulated apart (index_timestep_zero) from a token index the block is "
                "given outside its arguments, which merging would shift")
    return None


# ToMe: each block is handed img = [main image, references] and txt apart; the rotary positions
# run over [text, img] ([B, 1, L, ...]); the text mask is applied inside the block (over the text
# only) and the modulation (vec) is per sample. Only the main image's grid merges.
MERGE = DiTMerge(lambda m: {i: ("double_block", i) for i in range(len(m.transformer_blocks))}, {
    "double_block": BlockArgs("img", lambda lay: (lay.joint[0] - lay.joint[1], 0), pe="pe", pe_dim=2,
                              in_pe=lambda lay: lay.joint),
}, merge_check, leaves_alone="calls with reference images modulated apart (ref_latents_method index_timestep_zero)")

FAMILIES = (
    Family("Qwen-Image", ("QwenImage",), ("QwenImageTransformer2DModel",), True, False,
           lambda m: block_paths(m, "transformer_blocks"), plan, lambda m: (1, m.patch_size, m.patch_size),
           text_first_tokens, geometry, merge=MERGE),
)
