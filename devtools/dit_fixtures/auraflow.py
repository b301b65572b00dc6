"""A tiny AuraFlow (MMDiT): one double and one single layer, 4-channel SDXL latent, patch 2."""

from __future__ import annotations

import torch

from random_dits import TEXT_TOKENS, Fixture, Spec

TEXT_DIM = 2048  # detection keys AuraFlow on this text width (Pile-T5-XL)
_CONFIG = {"in_channels": 4, "out_channels": 4, "patch_size": 2, "dim": 64, "n_layers": 2, "n_double_layers": 1,
           "n_heads": 2, "global_conddim": 64, "cond_seq_dim": TEXT_DIM, "max_seq": 16 * 16}


def _text(generator, batch, shape):
    return torch.randn(batch, TEXT_TOKENS, TEXT_DIM, generator=generator), {}


FIXTURES = {
    "auraflow": Fixture(Spec("AuraFlow", 4, 8, False), _CONFIG, "AuraFlow", 2, "gg", (8, 6), text=_text),
}
