"""Tiny LTX-Video: 2 blocks of self-attention (video) and cross-attention (text); 128-channel
latent, 32x spatial and 8x temporal VAE, patch 1: 17 frames of 128x96 px are a 3x4x3 grid."""

from __future__ import annotations

import torch

import random_dits
from random_dits import Fixture, Spec


def _text(generator, batch, shape):  # T5-XXL tokens (4096 wide; 32 here) and their mask
    mask = torch.ones(batch, 12, dtype=torch.long)
    return random_dits.text_tokens(generator, batch, 12, 32), {"attention_mask": mask}


FIXTURES = {
    "ltxv": Fixture(
        spec=Spec("LTXV", 128, 32, True, 8),
        config={"image_model": "ltxv", "num_layers": 2, "attention_head_dim": 32, "num_attention_heads": 2,
                "cross_attention_dim": 64, "caption_channels": 32, "in_channels": 128, "out_channels": 128},
        family="LTX-Video", blocks=2, calls="g-g-", grid=(3, 4, 3), text=_text),
}
