"""Tiny random-weight models of the host's UNet variants (instruct-pix2pix, unCLIP, SDXL refiner,
SSD-1B / Vega / KOALA, the x4 upscaler, Zero123, LotusD, SVD / SV3D), built with ComfyUI's own
config and model classes, and the conditioning each one's ``extra_conds`` expects.

Each variant is its config class built from a tiny unet_config in the variant's block layout
(what ComfyUI's model detection would report, at a fraction of the width and depth).
Runs inside the host venv with the ComfyUI folder importable.
"""

from __future__ import annotations

import types

import torch

from random_models import CONTEXT_TOKENS, SDXL_POOLED, build_random, unet_config

_SDXL = unet_config("SDXL", tiny=True)
_SD15 = unet_config("SD15", tiny=True)
_SD21 = unet_config("SD21", tiny=True)
_SDXL_LIKE = {"transformer_depth": [0, 0, 1, 1, 1, 1], "transformer_depth_middle": 1,
              "transformer_depth_output": [0, 0, 0, 1, 1, 1, 1, 1, 1]}
_VIDEO = {**_SD21, "in_channels": 8, "adm_in_channels": 768, "use_temporal_attention": True,
          "use_temporal_resblock": True, "extra_ff_mix_layer": True, "use_spatial_context": True,
          "merge_strategy": "learned_with_images", "merge_factor": 0.0, "video_kernel_size": [3, 1, 1],
          "disable_temporal_crossattention": False, "max_ddpm_temb_period": 10000}

# config name -> the tiny unet_config
CONFIGS: dict[str, dict] = {
    "SD15_instructpix2pix": {**_SD15, "in_channels": 8},
    "Stable_Zero123": {**_SD15, "in_channels": 8},
    "SD21UnclipL": {**_SD21, "adm_in_channels": 1536, "num_classes": "sequential"},
    "SD21UnclipH": {**_SD21, "adm_in_channels": 2048, "num_classes": "sequential"},
    "LotusD": {**_SD21, "adm_in_channels": 4, "num_classes": "sequential"},
    "SD_X4Upscaler": {**_SD21, "in_channels": 7, "num_classes": 1000, "num_heads": 2, "num_head_channels": -1,
                      "disable_self_attentions": [True, True, True, False],
                      "transformer_depth": [1, 1, 1, 1, 1, 1, 1, 1], "channel_mult": [1, 2, 2, 4],
                      "transformer_depth_output": [1] * 12},
    "SDXL_instructpix2pix": {**_SDXL, "in_channels": 8},
    "SDXLRefiner": {**_SDXL, "adm_in_channels": 2560, "context_dim": 64, "num_res_blocks": [2, 2, 2, 2],
                    "channel_mult": [1, 2, 4, 4], "transformer_depth": [0, 0, 1, 1, 1, 1, 0, 0],
                    "transformer_depth_middle": 1, "transformer_depth_output": [0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0]},
    "SSD1B": {**_SDXL, **_SDXL_LIKE},
    "Segmind_Vega": {**_SDXL, **_SDXL_LIKE},
    "KOALA_700M": {**_SDXL, "num_res_blocks": [1, 1, 1], "transformer_depth": [0, 1, 1],
                   "transformer_depth_middle": 1, "transformer_depth_output": [0, 0, 1, 1, 1, 1]},
    "KOALA_1B": {**_SDXL, "num_res_blocks": [1, 1, 1], "transformer_depth": [0, 1, 2],
                 "transformer_depth_middle": 1, "transformer_depth_output": [0, 0, 1, 1, 2, 2]},
    "SVD_img2vid": _VIDEO,
    "SV3D_u": {**_VIDEO, "adm_in_channels": 256},
    "SV3D_p": {**_VIDEO, "adm_in_channels": 1280},
}
CC_PROJECTION_IN = 4  # Zero123's camera pose, appended to the image embedding


def make_model(name: str, seed: int = 0):
    """A ModelPatcher around a tiny random-weight model of the host config ``name``."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models as supported

    config = CONFIGS[name]
    model_config = getattr(supported, name)(dict(config))
    # The class adds its own head layout (unet_extra_config); ours must win for tiny models.
    model_config.unet_config.update({k: v for k, v in config.items() if k in ("num_heads", "num_head_channels")})
    model_config.set_inference_dtype(torch.float32, None)
    state_dict = {}
    if name == "Stable_Zero123":
        width = config["context_dim"]
        generator = torch.Generator().manual_seed(seed + 7)
        state_dict = {"cc_projection.weight": torch.randn(width, width + CC_PROJECTION_IN, generator=generator) * 0.1,
                      "cc_projection.bias": torch.zeros(width)}

    def build():
        with torch.no_grad():  # Zero123 copies its projection into its parameters
            return model_config.get_model(state_dict)

    model = build_random(build, seed)
    model.eval()
    return comfy.model_patcher.ModelPatcher(model, load_device=comfy.model_management.get_torch_device(),
                                            offload_device=comfy.model_management.unet_offload_device())


def conditioning(name: str, height: int, width: int, seed: int = 1) -> list:
    """A positive or negative conditioning for ``name`` with what its extra_conds read: a concat
    latent or image, unCLIP image embeddings with noise augmentation, pooled vectors."""
    config = CONFIGS[name]
    generator = torch.Generator().manual_seed(seed)
    context_dim = config["context_dim"] + (CC_PROJECTION_IN if name == "Stable_Zero123" else 0)
    extras: dict = {}
    if config["in_channels"] == 8:
        extras["concat_latent_image"] = torch.randn(1, 4, height, width, generator=generator)
    if name == "SD_X4Upscaler":
        extras["concat_image"] = torch.rand(1, 3, height, width, generator=generator) * 2 - 1
        extras["noise_augmentation"] = 0.2
    if name.startswith("SD21Unclip"):
        dim = config["adm_in_channels"] // 2
        embeds = types.SimpleNamespace(image_embeds=torch.randn(1, dim, generator=generator))
        extras["unclip_conditioning"] = [{"clip_vision_output": embeds, "strength": 1.0, "noise_augmentation": 0.1}]
    if name.startswith("SDXL") or name in ("SSD1B", "Segmind_Vega", "KOALA_700M", "KOALA_1B"):
        extras["pooled_output"] = torch.randn(1, SDXL_POOLED, generator=generator)
    return [[torch.randn(1, CONTEXT_TOKENS, context_dim, generator=generator), extras]]
