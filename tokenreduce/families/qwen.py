"""Qwen-Image (and Edit): dual-stream blocks, joint attention over [text, image, references]."""

from __future__ import annotations

from ..dit import JOINT, Family, Geometry, Slot, block_paths
from .flux import text_first_tokens


def plan(model) -> tuple[Slot, ...]:
    return tuple(Slot(JOINT, i) for i in range(len(model.transformer_blocks)))


def geometry(model) -> Geometry:
    attention = model.transformer_blocks[0].attn
    return Geometry(attention.heads, attention.dim_head, True)


FAMILIES = (
    Family("Qwen-Image", ("QwenImage",), ("QwenImageTransformer2DModel",), True, False,
           lambda m: block_paths(m, "transformer_blocks"), plan, lambda m: (1, m.patch_size, m.patch_size),
           text_first_tokens, geometry),
)
