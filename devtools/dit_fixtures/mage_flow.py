"""A tiny Mage-Flow (ComfyUI 0.33): one Qwen-Image block, 2 heads of 32, patch 1 on a Flux.2
latent (128 channels, 16x down), with a reference image as ReferenceLatent gives it."""

from __future__ import annotations

import torch

from random_dits import CONTEXT_DIM, TEXT_TOKENS, Fixture, Spec

_CONFIG = {"image_model": "mage_flow", "in_channels": 128, "out_channels": 128, "num_layers": 1,
           "attention_head_dim": 32, "num_attention_heads": 2, "joint_attention_dim": CONTEXT_DIM,
           "axes_dims_rope": (8, 12, 12)}


def _text(generator, batch, shape):
    return torch.randn(batch, TEXT_TOKENS, CONTEXT_DIM, generator=generator), {}


def _reference(generator, shape):
    # a 64x48 px reference image's latent: 4x3 more tokens after the main grid
    return {"reference_latents": [torch.randn(1, 128, 48 // 16, 64 // 16, generator=generator)]}


FIXTURES = {
    "mage_flow": Fixture(Spec("MageFlow", 128, 16, False), _CONFIG, "Mage-Flow", 1, "g", (8, 6), text=_text,
                         shared=_reference),
}
