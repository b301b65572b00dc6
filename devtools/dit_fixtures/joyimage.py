"""A tiny JoyImage (ComfyUI 0.33): one double-stream block, 2 heads of 32, patch (1, 2, 2) on the
Wan 2.1-format latent (5-D, T = 1), with a reference image as ReferenceLatent gives it."""

from __future__ import annotations

import torch

from dit_fixtures._tiny import keep_tiny
from random_dits import CONTEXT_DIM, TEXT_TOKENS, Fixture, Spec

_CONFIG = {"image_model": "joyimage", "in_channels": 16, "hidden_size": 64, "patch_size": [1, 2, 2],
           "num_layers": 1, "num_attention_heads": 2, "text_dim": CONTEXT_DIM, "rope_dim_list": [8, 12, 12],
           "theta": 10000}


def _text(generator, batch, shape):
    return torch.randn(batch, TEXT_TOKENS, CONTEXT_DIM, generator=generator), {}


def _reference(generator, shape):
    # a 64x48 px reference image's latent: 4x3 tokens between the main grid and the text
    return {"reference_latents": [torch.randn(1, 16, 1, 48 // 8, 64 // 8, generator=generator)]}


FIXTURES = {
    "joyimage": Fixture(Spec("JoyImage", 16, 8, False, five_d=True), _CONFIG, "JoyImage", 1, "g", (8, 6),
                        text=_text, shared=_reference, build=keep_tiny("JoyImage")),
}
