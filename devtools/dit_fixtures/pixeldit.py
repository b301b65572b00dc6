"""A tiny PixelDiT T2I (ComfyUI 0.33): one patch block and one pixel block, 2 heads each, 16x16 px
patches of the RGB image."""

from __future__ import annotations

import torch

from random_dits import CONTEXT_DIM, TEXT_TOKENS, Fixture, Spec

_CONFIG = {"image_model": "pixeldit_t2i", "in_channels": 3, "num_groups": 2, "hidden_size": 64,
           "pixel_hidden_size": 8, "pixel_attn_hidden_size": 32, "pixel_num_groups": 2, "patch_depth": 1,
           "pixel_depth": 1, "patch_size": 16, "txt_embed_dim": CONTEXT_DIM, "txt_max_length": 64}


def _text(generator, batch, shape):
    return torch.randn(batch, TEXT_TOKENS, CONTEXT_DIM, generator=generator), {}


def _low_quality(generator, shape):
    # PiDConditioning: the 4x-smaller image's 8x-VAE latent (128x96 px -> 4x3) and its degradation
    return {"lq_latent": torch.randn(1, 16, shape[-2] // 32, shape[-1] // 32, generator=generator),
            "degrade_sigma": torch.tensor([0.1])}


FIXTURES = {
    # the patch block (joint), the pixel block (patch grid only); 128x96 px -> 8x6 patches
    "pixeldit": Fixture(Spec("PixelDiTT2I", 3, 1, False), _CONFIG, "PixelDiT", 2, "gg", (8, 6), text=_text),
    "pid": Fixture(Spec("PiD", 3, 1, False), {**_CONFIG, "image_model": "pid", "lq_hidden_dim": 16,
                                               "lq_num_res_blocks": 1, "lq_interval": 1},
                   "PiD", 2, "gg", (8, 6), text=_text, shared=_low_quality),
}
