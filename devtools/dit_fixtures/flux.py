"""Tiny Flux relatives: Flux.1 Fill (inpainting: image and mask channels concatenated to the
latent, the same token grid), Chroma Radiance (pixel space, patch 16 on RGB, NeRF head) and
LongCat-Image (the Flux model class with Qwen2.5-VL text, 3584 wide, and no pooled text)."""

from __future__ import annotations

import dataclasses

import torch

from random_dits import CONTEXT_DIM, POOLED_DIM, Fixture, Spec, text_tokens

_FLUX = {"image_model": "flux", "axes_dim": [4, 6, 6], "num_heads": 4, "mlp_ratio": 4.0, "theta": 10000,
         "out_channels": 16, "in_channels": 16, "qkv_bias": True, "txt_ids_dims": [], "patch_size": 2,
         "vec_in_dim": POOLED_DIM, "guidance_embed": True, "hidden_size": 64, "context_in_dim": CONTEXT_DIM,
         "depth": 1, "depth_single_blocks": 1}
# Chroma's approximator in_dim 64 = 16 (t) + 16 (guidance) + 32 (modulation index); NeRF head tiny, untiled.
_RADIANCE = {"image_model": "chroma_radiance", "axes_dim": [4, 6, 6], "num_heads": 4, "mlp_ratio": 4.0,
             "theta": 10000, "out_channels": 3, "in_channels": 3, "qkv_bias": True, "patch_size": 16,
             "hidden_size": 64, "context_in_dim": CONTEXT_DIM, "depth": 1, "depth_single_blocks": 1,
             "vec_in_dim": None, "txt_ids_dims": [], "guidance_embed": False, "in_dim": 64, "out_dim": 64,
             "hidden_dim": 64, "n_layers": 1, "nerf_hidden_size": 16, "nerf_mlp_ratio": 2, "nerf_depth": 1,
             "nerf_max_freqs": 4, "nerf_tile_size": 0, "nerf_final_head_type": "linear",
             "nerf_embedder_dtype": None, "use_x0": False, "use_sequential_txt_ids": False}
LONGCAT_TEXT_DIM = 3584  # detection keys LongCat-Image on this context width (Qwen2.5-VL 7B)


def _detect_trimmed(params_path: str):
    """Detection of the config trimmed to the fields the running tree's params dataclass has
    (0.3.75's ChromaRadianceParams has no use_x0 or txt_ids_dims)."""

    def build(config):
        import importlib

        import comfy.model_detection

        module, name = params_path.rsplit(".", 1)
        fields = {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name))}
        return comfy.model_detection.model_config_from_unet_config(
            {k: v for k, v in config.items() if k in fields or k == "image_model"})

    return build


def _fill_text(generator, batch, shape):
    return text_tokens(generator, batch), {"pooled_output": torch.randn(batch, POOLED_DIM, generator=generator),
                                           "guidance": 30.0}


def _fill_shared(generator, shape):
    # InpaintModelConditioning: the masked image's latent and the pixel mask (its centre to repaint).
    mask = torch.zeros([1, 1, shape[-2] * 8, shape[-1] * 8])
    mask[..., shape[-2] * 2:shape[-2] * 6, shape[-1] * 2:shape[-1] * 6] = 1.0
    return {"concat_latent_image": torch.randn(shape, generator=generator), "concat_mask": mask}


def _radiance_text(generator, batch, shape):
    return text_tokens(generator, batch), {"pooled_output": None}


def _longcat_text(generator, batch, shape):
    return text_tokens(generator, batch, width=LONGCAT_TEXT_DIM), {"pooled_output": None}


FIXTURES = {
    # 16 noise + 16 masked-image + 64 mask channels (the 8x8 pixel mask folded into channels).
    "flux_fill": Fixture(Spec("FluxInpaint", 16, 8, False), {**_FLUX, "in_channels": 96}, "Flux.1", 2, "gg", (8, 6),
                         text=_fill_text, shared=_fill_shared),
    # Pixel space: the 128x96 px image is the model input, 16x16 px per token.
    "chroma_radiance": Fixture(Spec("ChromaRadiance", 3, 1, False), _RADIANCE, "Chroma Radiance", 2, "gg", (8, 6),
                               text=_radiance_text, build=_detect_trimmed("comfy.ldm.chroma_radiance.model."
                                                                          "ChromaRadianceParams")),
    "longcat_image": Fixture(Spec("LongCatImage", 16, 8, False),
                             {**_FLUX, "vec_in_dim": None, "guidance_embed": False, "context_in_dim": LONGCAT_TEXT_DIM,
                              "txt_ids_dims": [1, 2]}, "LongCat-Image", 2, "gg", (8, 6), text=_longcat_text),
}
