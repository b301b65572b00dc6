"""Tiny Genmo Mochi: 2 asymmetric joint blocks over [video, text]; 12-channel latent, 8x spatial
and 6x temporal VAE, patch 2: 13 frames of 128x96 px are a 3x8x6 grid. ComfyUI asserts the video
MLP width of the real model (12288 = 128 * 96)."""

from __future__ import annotations

import torch

import random_dits
from random_dits import Fixture, Spec

TEXT = 32  # T5-XXL tokens (256 padded; the mask counts the real ones: num_tokens)


def _text(generator, batch, shape):
    mask = torch.ones(batch, TEXT, dtype=torch.long)
    mask[:, TEXT - 4:] = 0  # padding: the model crops the text to the 28 real tokens
    return random_dits.text_tokens(generator, batch, TEXT, 32), {"attention_mask": mask}


FIXTURES = {
    "mochi": Fixture(
        spec=Spec("GenmoMochi", 12, 8, True, 6),
        config={"image_model": "mochi_preview", "depth": 2, "patch_size": 2, "num_heads": 2, "hidden_size_x": 128,
                "hidden_size_y": 32, "mlp_ratio_x": 96.0, "mlp_ratio_y": 2.0, "learn_sigma": False, "in_channels": 12,
                "qk_norm": True, "qkv_bias": False, "out_bias": True, "attn_drop": 0.0, "patch_embed_bias": True,
                "posenc_preserve_area": True, "timestep_mlp_bias": True, "attend_to_padding": False,
                "timestep_scale": 1000.0, "use_t5": True, "t5_feat_dim": 32, "t5_token_length": TEXT,
                "rope_theta": 10000.0},
        family="Mochi", blocks=2, calls="gg", grid=(3, 8, 6), text=_text),
}
