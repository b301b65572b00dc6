"""Mage-Flow (MageFlowTransformer2DModel, ComfyUI 0.33): Qwen-Image's double-stream blocks at
patch 1 on a Flux.2 latent, joint attention over [text, image, reference images], each reference
appended at patch 1 after the main image; text is not rotated, the image is.

ToMe: its blocks are Qwen-Image's, handed as Qwen-Image's are (img = [main image, references],
txt apart, rotary positions over [text, img], a per-sample modulation); it has no
index_timestep_zero reference method, so no call is refused for one."""

from __future__ import annotations

from ..dit import Family, block_paths
from .flux import text_first_tokens
from .qwen import MERGE, geometry, plan

FAMILIES = (
    Family("Mage-Flow", ("MageFlow",), ("MageFlowTransformer2DModel",), True, False,
           lambda m: block_paths(m, "transformer_blocks"), plan, lambda m: (1, m.patch_size, m.patch_size),
           text_first_tokens, geometry, merge=MERGE._replace(check=None, leaves_alone=None)),
)
