"""Tiny CogVideoX (1.0 layout with rotary positions): 2 joint blocks over [text, video]; 16-channel
latent, 8x spatial and 4x temporal VAE, patch 2: 9 frames of 128x96 px are a 3x8x6 grid."""

from __future__ import annotations

import torch

import random_dits
from random_dits import Fixture, Spec

_COG = {"image_model": "cogvideox", "num_attention_heads": 2, "attention_head_dim": 32, "time_embed_dim": 32,
        "num_layers": 2, "patch_size": 2, "text_embed_dim": 32, "use_rotary_positional_embeddings": True}


def _text(generator, batch, shape):  # T5-XXL tokens (226; 12 here)
    return random_dits.text_tokens(generator, batch, 12, 32), {}


def _image(generator, shape):  # CogVideoXImageToVideo: the image latent in frame 0
    image = torch.zeros(shape)
    image[:, :, :1] = torch.randn([shape[0], shape[1], 1, *shape[3:]], generator=generator)
    return {"concat_latent_image": image}


FIXTURES = {
    "cogvideox_t2v": Fixture(
        spec=Spec("CogVideoX_T2V", 16, 8, True, 4), config={**_COG, "in_channels": 16}, family="CogVideoX",
        blocks=2, calls="gg", grid=(3, 8, 6), text=_text),
    "cogvideox_i2v": Fixture(
        spec=Spec("CogVideoX_I2V", 16, 8, True, 4), config={**_COG, "in_channels": 32}, family="CogVideoX",
        blocks=2, calls="gg", grid=(3, 8, 6), text=_text, shared=_image),
    "cogvideox_inpaint": Fixture(  # 32 extra channels (image and mask latents); the model pads what it gets
        spec=Spec("CogVideoX_Inpaint", 16, 8, True, 4), config={**_COG, "in_channels": 48}, family="CogVideoX",
        blocks=2, calls="gg", grid=(3, 8, 6), text=_text, shared=_image),
}
