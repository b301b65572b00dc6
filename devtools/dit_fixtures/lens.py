"""A tiny Lens (ComfyUI 0.33): one dual-stream block, 2 heads of 32, two text-encoder layers side
by side; one token per pixel of the Flux.2-format latent (128 packed channels, 16x down)."""

from __future__ import annotations

import torch

from random_dits import CONTEXT_DIM, TEXT_TOKENS, Fixture, Spec

_CONFIG = {"image_model": "lens", "in_channels": 128, "out_channels": 32, "num_layers": 1, "attention_head_dim": 32,
           "num_attention_heads": 2, "enc_hidden_dim": CONTEXT_DIM, "axes_dims_rope": (8, 12, 12),
           "multi_layer_encoder_feature": True, "selected_layer_index": (0, 1)}


def _text(generator, batch, shape):
    return torch.randn(batch, TEXT_TOKENS, 2 * CONTEXT_DIM, generator=generator), {}


FIXTURES = {
    "lens": Fixture(Spec("Lens", 128, 16, False), _CONFIG, "Lens", 1, "g", (8, 6), text=_text),
}
