"""A tiny Ideogram 4 (ComfyUI 0.33): one layer, 2 heads of 32, text features 32 wide; the
Flux.2-format latent (128 packed channels, 16x down) is one token per latent pixel."""

from __future__ import annotations

import torch

from dit_fixtures._tiny import keep_tiny
from random_dits import CONTEXT_DIM, TEXT_TOKENS, Fixture, Spec

_CONFIG = {"image_model": "ideogram4", "in_channels": 128, "num_layers": 1, "num_attention_heads": 2,
           "attention_head_dim": 32, "intermediate_size": 64, "adaln_dim": 32, "llm_features_dim": CONTEXT_DIM,
           "rope_theta": 10000, "mrope_section": [6, 5, 5], "norm_eps": 1e-5}


def _text(generator, batch, shape):
    return torch.randn(batch, TEXT_TOKENS, CONTEXT_DIM, generator=generator), {}


FIXTURES = {
    "ideogram4": Fixture(Spec("Ideogram4", 128, 16, False), _CONFIG, "Ideogram 4", 1, "g", (8, 6), text=_text,
                         build=keep_tiny("Ideogram4")),
}
