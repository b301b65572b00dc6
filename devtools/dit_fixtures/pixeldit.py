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


FIXTURES = {
    # the patch block (joint), the pixel block (patch grid only); 128x96 px -> 8x6 patches
    "pixeldit": Fixture(Spec("PixelDiTT2I", 3, 1, False), _CONFIG, "PixelDiT", 2, "gg", (8, 6), text=_text),
}
