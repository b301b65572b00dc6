"""Tiny HunyuanVideo relatives: SkyReels i2v, HunyuanVideo 1.5 SR (distilled), HunyuanImage 2.1
and its refiner. All are ComfyUI's HunyuanVideo class: 2 text-refiner calls (left alone), then
one joint call per double and single block."""

from __future__ import annotations

import torch

import random_dits
from random_dits import Fixture, Spec

TEXT = 24  # llama / Qwen2.5-VL tokens after the template is trimmed
BYT5 = 8  # byT5 glyph tokens (quoted text in the prompt)
VISION = 729  # SigLIP last_hidden_state (1.5 SR gets it from the i2v workflow)

_BASE = {"image_model": "hunyuan_video", "mlp_ratio": 4.0, "hidden_size": 64, "num_heads": 2, "depth": 1,
         "depth_single_blocks": 1, "theta": 256, "qkv_bias": True, "context_in_dim": 64, "meanflow": False,
         "meanflow_sum": False, "guidance_embed": False, "use_cond_type_embedding": False, "vision_in_dim": None}


def _text(pooled: bool, byt5: bool, guidance: bool = False):
    def text(generator, batch, shape):
        extras = {"pooled_output": torch.randn(batch, 768, generator=generator) if pooled else None}
        if byt5:
            extras["conditioning_byt5small"] = torch.randn(batch, BYT5, 1472, generator=generator)
        if guidance:
            extras["guidance"] = 3.5
        return random_dits.text_tokens(generator, batch, TEXT, 64), extras
    return text


def _skyreels_image(generator, shape):  # HunyuanImageToVideo's SkyReels input: the image latent, concatenated
    image = torch.zeros(shape)
    image[:, :, :1] = torch.randn([shape[0], shape[1], 1, *shape[3:]], generator=generator)
    return {"concat_latent_image": image}


def _sr_inputs(generator, shape):  # HunyuanVideo15SuperResolution: low-res latent channels and SigLIP tokens
    output = random_dits._clip_vision_output(last_hidden_state=torch.randn(shape[0], VISION, 1152,
                                                                           generator=generator))
    return {"concat_latent_image": torch.randn([shape[0], 2 * shape[1] + 2, *shape[2:]], generator=generator),
            "clip_vision_output": output}


FIXTURES = {
    "hunyuan_video_skyreels_i2v": Fixture(
        spec=Spec("HunyuanVideoSkyreelsI2V", 16, 8, True, 4),
        config={**_BASE, "in_channels": 32, "out_channels": 16, "vec_in_dim": 768, "patch_size": [1, 2, 2],
                "axes_dim": [8, 12, 12], "byt5": False},
        family="HunyuanVideo", blocks=2, calls="--gg", grid=(3, 8, 6),
        text=_text(pooled=True, byt5=False, guidance=True), shared=_skyreels_image),
    "hunyuan_video15_sr": Fixture(  # 98 input channels: noise 32, low-res latent 32 + 32, 2 masks
        spec=Spec("HunyuanVideo15_SR_Distilled", 32, 16, True, 4),
        config={**_BASE, "in_channels": 98, "out_channels": 32, "vec_in_dim": None, "patch_size": [1, 1, 1],
                "axes_dim": [8, 12, 12], "byt5": True, "use_cond_type_embedding": True, "vision_in_dim": 1152},
        family="HunyuanVideo", blocks=2, calls="--gg", grid=(3, 8, 6),
        text=_text(pooled=False, byt5=True), shared=_sr_inputs),
    "hunyuan_image21": Fixture(  # 2-D latent, 32x VAE, patch 1: 128x96 px is a 4x3 grid; byT5 after the text
        spec=Spec("HunyuanImage21", 64, 32, False),
        config={**_BASE, "in_channels": 64, "out_channels": 64, "vec_in_dim": None, "patch_size": [1, 1],
                "axes_dim": [16, 16], "byt5": True, "guidance_embed": True},
        family="HunyuanImage 2.1", blocks=2, calls="--gg", grid=(4, 3),
        text=_text(pooled=False, byt5=True, guidance=True)),
    "hunyuan_image21_refiner": Fixture(  # one-frame 3-D latent, 16x VAE, patch 1; the image concatenated
        spec=Spec("HunyuanImage21Refiner", 64, 16, False, five_d=True),
        config={**_BASE, "in_channels": 128, "out_channels": 64, "vec_in_dim": None, "patch_size": [1, 1, 1],
                "axes_dim": [8, 12, 12], "byt5": False},
        family="HunyuanImage 2.1", blocks=2, calls="--gg", grid=(8, 6),
        text=_text(pooled=False, byt5=False)),
}
