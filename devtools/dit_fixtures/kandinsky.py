"""Tiny Kandinsky 5 (video: 16 latent + 16 image + 1 mask channels; image: a Flux latent): one text
block, then 2 visual blocks of self-attention (latent grid) and cross-attention (text)."""

from __future__ import annotations

import torch

import random_dits
from random_dits import Fixture, Spec

_K5 = {"image_model": "kandinsky5", "in_visual_dim": 16, "out_visual_dim": 16, "in_text_dim": 32, "in_text_dim2": 32,
       "time_dim": 32, "model_dim": 64, "ff_dim": 128, "patch_size": (1, 2, 2), "num_text_blocks": 1,
       "num_visual_blocks": 2, "axes_dims": (8, 12, 12)}


def _text(generator, batch, shape):  # Qwen2.5-VL tokens and the pooled CLIP-L text (32 wide here)
    return random_dits.text_tokens(generator, batch, 12, 32), {"pooled_output": torch.randn(batch, 32,
                                                                                            generator=generator)}


def _image_config(config):  # ComfyUI tells the image model by its real width (2560) only
    import comfy.supported_models

    return comfy.supported_models.Kandinsky5Image(config)


FIXTURES = {
    "kandinsky5": Fixture(
        spec=Spec("Kandinsky5", 16, 8, True, 4), config={**_K5, "visual_embed_dim": 132}, family="Kandinsky 5",
        blocks=2, calls="-g-g-", grid=(3, 8, 6), text=_text),
    "kandinsky5_image": Fixture(
        spec=Spec("Kandinsky5Image", 16, 8, False), config={**_K5, "visual_embed_dim": 64},
        family="Kandinsky 5 image", blocks=2, calls="-g-g-", grid=(8, 6), text=_text, build=_image_config),
}
