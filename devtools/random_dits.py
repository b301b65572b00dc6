"""Tiny random-weight DiTs built with ComfyUI's own classes, for the tests of ToDo on DiTs.

Every variant of the image and video DiT families ToDo supports, at a few blocks and a width
of 64 to 256, detected by ComfyUI's own ``model_config_from_unet_config`` as the real model
type; their conditioning, latents and reference inputs in the form ComfyUI's nodes give the
sampler; the smallest Flux.1 and Wan diffusion-model files ComfyUI's ``UNETLoader`` detects;
and a DiT that ToDo does not support (Hunyuan 3D 2.0: a shape model, no image or video grid).
Checked in ComfyUI 0.3.75 and 0.33.0; where the trees differ (fields a model's dataclass
lacks) the config is trimmed to what the running tree accepts.

    FAMILIES, IMAGE_FAMILIES, VIDEO_FAMILIES, FIXTURES (dit_fixtures/: the families added since, one module per group)
    available(family)                     -> whether the running ComfyUI has its config
    make_dit(family, seed=0, **config)    -> ModelPatcher (float32); config overrides the tiny unet_config
    conditioning(family, batch=1, seed=1, frames=9, height_px=128, width_px=128, text_mask=False)
                                          -> (positive, negative) in ComfyUI's [[context, extras]] form
    latent(family, batch=1, height_px=128, width_px=128, frames=9)
                                          -> the empty latent the sampler gets ([B, C, H, W] or 5-D)
    tested_size(family)                   -> the size the DiT tests run it at (each fixture's ``grid``)
    noise_mask(family, latent)            -> None, or Wan 2.2 5B's first-frame mask (image to video)
    make_unsupported_dit(seed=0)          -> a tiny Hunyuan 3D 2.0
    write_flux_diffusion_model(path, ...), write_wan_diffusion_model(path, variant, ...),
    write_wan_vace_diffusion_model(path), write_ltxv_diffusion_model(path),
    write_unsupported_dit(path)           -> files UNETLoader detects (Flux.1 dev, Wan 2.1 / VACE,
                                             LTX-Video, Hunyuan 3D 2.0)

Runs inside a host venv with the ComfyUI folder importable (imports only torch and comfy, and
``random_models`` beside it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import torch

from random_models import build_random, randomize_

TEXT_TOKENS = 12  # image families' text tokens (real: T5 256/512, Qwen2.5-VL ~100s, ...)
CONTEXT_DIM = 32  # stands for T5 4096 / Qwen2.5-VL 3584 / Gemma 2304 / Qwen3 2560 / Mistral 15360
POOLED_DIM = 32  # stands for CLIP-L 768 (Flux) / CLIP-L+G 2048 (SD3)
WAN_TEXT_TOKENS = 512  # ComfyUI's Wan T5 tokenizer pads to min_length 512
WAN_CLIP_TOKENS = 257  # CLIP-H penultimate_hidden_states [B, 257, 1280] (Wan 2.1 i2v)
HY_TEXT_TOKENS = 24  # llama tokens after the template is trimmed (varies with the prompt)
HY15_BYT5_TOKENS = 8  # byT5 glyph tokens (HunyuanVideo 1.5, quoted text in the prompt)
HY15_VISION_TOKENS = 729  # SigLIP last_hidden_state [B, 729, 1152] (HunyuanVideo 1.5 i2v)


class Spec(NamedTuple):
    config: str  # the comfy.supported_models class detection must pick
    channels: int  # latent channels
    space_down: int  # VAE downscale in pixels
    video: bool  # 5-D latent [B, C, T, H, W] with the time downscale below
    time_down: int = 1
    five_d: bool = False  # an image model with a 5-D latent (T = 1): Qwen-Image


FAMILY_SPECS = {
    # Image DiTs
    "flux_dev": Spec("Flux", 16, 8, False),
    "flux_schnell": Spec("FluxSchnell", 16, 8, False),
    "flux_kontext": Spec("Flux", 16, 8, False),  # the dev model with reference_latents in the conditioning
    "chroma": Spec("Chroma", 16, 8, False),
    "flux2": Spec("Flux2", 128, 16, False),
    "qwen_image": Spec("QwenImage", 16, 8, False, five_d=True),
    "qwen_image_edit": Spec("QwenImage", 16, 8, False, five_d=True),
    "lumina2": Spec("Lumina2", 16, 8, False),
    "z_image": Spec("ZImage", 16, 8, False),
    "sd3": Spec("SD3", 16, 8, False),
    "sd35_medium": Spec("SD3", 16, 8, False),
    # Video DiTs
    "wan21_t2v": Spec("WAN21_T2V", 16, 8, True, 4),
    "wan21_i2v": Spec("WAN21_I2V", 16, 8, True, 4),
    "wan22_t2v_a14b": Spec("WAN21_T2V", 16, 8, True, 4),  # each A14B expert is a Wan 2.1-layout model
    "wan22_i2v_a14b": Spec("WAN21_T2V", 16, 8, True, 4),  # in_dim 36 but no img_emb: detected as t2v
    "wan22_ti2v_5b": Spec("WAN22_T2V", 48, 16, True, 4),
    "hunyuan_video": Spec("HunyuanVideo", 16, 8, True, 4),
    "hunyuan_video_i2v": Spec("HunyuanVideoI2V", 16, 8, True, 4),
    "hunyuan_video15": Spec("HunyuanVideo15", 32, 16, True, 4),
    "hunyuan_video15_i2v": Spec("HunyuanVideo15", 32, 16, True, 4),
}


class Fixture(NamedTuple):
    """A tiny model of a family whose fixture lives in a module of ``dit_fixtures/`` (one per
    family group), with the expected attention calls of one model call that the DiT tests check."""

    spec: Spec
    config: dict  # the tiny unet_config detection reports (or ``build`` builds)
    family: str  # the family as the node names it (``Family.name``)
    blocks: int  # its blocks that make grid calls (the node's "N of M blocks")
    calls: str  # one model call's attention calls at the test sizes: "g" grid call, "-" left alone
    grid: tuple  # the token grid at the test sizes ((h, w) of an image, (t, h, w) of a video)
    # (generator, batch, latent shape) -> (context, extras) of one text conditioning
    text: Callable = None
    # (generator, latent shape) -> the extras positive and negative share (image inputs)
    shared: Callable = None
    # unet_config -> the host's model config, where detection cannot pick the family at tiny size
    build: Callable = None
    # latent -> noise mask (image to video), or None
    mask: Callable = None
    # unet_config overrides for a few blocks more (the benchmark: blocks must remain between the
    # first and last ones ToDo leaves alone); None: the first depth key found is set to 4
    deep: dict = None
    # (generator, latent shape) -> the latent the sampler gets, where the empty one would not do
    # (a model that samples from the input image itself); None: the empty latent
    latent: Callable = None
    # diffusion model -> None: after randomize_, sets the weights a real model keeps in another
    # form than randomize_'s (norm scales stored zero-centred, applied as 1 + scale); None: nothing
    weights: Callable = None


def text_tokens(generator, batch: int, tokens: int = 12, width: int = 32):
    """Random text-encoder tokens [batch, tokens, width] (the tiny models' text width: CONTEXT_DIM)."""
    return torch.randn(batch, tokens, width, generator=generator)


def _collect_fixtures() -> dict:
    import importlib
    import pkgutil

    import dit_fixtures

    found = {}
    for info in pkgutil.iter_modules(dit_fixtures.__path__):
        module = importlib.import_module(f"dit_fixtures.{info.name}")
        found.update(module.FIXTURES)
    return found


FIXTURES = _collect_fixtures()


def available(family: str) -> bool:
    """Whether the running ComfyUI has the family's model config (some exist only in later trees)."""
    import comfy.supported_models as supported

    return hasattr(supported, FAMILY_SPECS[family].config)


FAMILY_SPECS.update({name: fixture.spec for name, fixture in FIXTURES.items()})
FAMILIES = tuple(FAMILY_SPECS)
IMAGE_FAMILIES = tuple(f for f, s in FAMILY_SPECS.items() if not s.video)
VIDEO_FAMILIES = tuple(f for f, s in FAMILY_SPECS.items() if s.video)

_WAN = {"image_model": "wan2.1", "dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 2, "patch_size": (1, 2, 2),
        "freq_dim": 256, "text_dim": 64, "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}
_HUNYUAN = {"image_model": "hunyuan_video", "mlp_ratio": 4.0, "hidden_size": 64, "num_heads": 2, "depth": 1,
            "depth_single_blocks": 1, "axes_dim": [8, 12, 12], "theta": 256, "qkv_bias": True, "meanflow": False,
            "meanflow_sum": False}
_HUNYUAN10 = {**_HUNYUAN, "out_channels": 16, "vec_in_dim": 768, "context_in_dim": 64, "patch_size": [1, 2, 2],
              "guidance_embed": True, "byt5": False, "use_cond_type_embedding": False, "vision_in_dim": None}
# HunyuanVideo 1.5: 32-channel latent, patch 1, 65 input channels (noise, image, mask), byT5 glyph
# tokens and SigLIP vision tokens on the text side.
_HUNYUAN15 = {**_HUNYUAN, "in_channels": 65, "out_channels": 32, "vec_in_dim": None, "context_in_dim": 64,
              "patch_size": [1, 1, 1], "guidance_embed": False, "byt5": True, "use_cond_type_embedding": True,
              "vision_in_dim": 1152, "meanflow_sum": True}
_MMDIT = {"in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": 2, "input_size": None,
          "pos_embed_scaling_factor": None, "pos_embed_max_size": 16, "num_patches": 256,
          "adm_in_channels": POOLED_DIM, "x_block_self_attn_layers": [],
          "context_embedder_config": {"target": "torch.nn.Linear",
                                      "params": {"in_features": CONTEXT_DIM, "out_features": 128}}}


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _tiny_config(family: str) -> dict:
    """The unet_config ComfyUI's detection would report for a tiny model of the family."""
    if family in FIXTURES:
        return dict(FIXTURES[family].config)
    if family in ("flux_dev", "flux_schnell", "flux_kontext", "flux2"):
        if family == "flux2":  # Flux.2 [dev] as detection reports it, at hidden 64 / 4 heads of 16
            config = {"image_model": "flux2", "axes_dim": [4, 4, 4, 4], "num_heads": 4, "mlp_ratio": 3.0,
                      "theta": 2000, "out_channels": 128, "in_channels": 128, "global_modulation": True,
                      "vec_in_dim": None, "mlp_silu_act": True, "qkv_bias": False, "ops_bias": False,
                      "default_ref_method": "index", "ref_index_scale": 10.0, "txt_ids_dims": [3], "patch_size": 1,
                      "guidance_embed": True}
        else:
            config = {"image_model": "flux", "axes_dim": [4, 6, 6], "num_heads": 4, "mlp_ratio": 4.0, "theta": 10000,
                      "out_channels": 16, "in_channels": 16, "qkv_bias": True, "txt_ids_dims": [], "patch_size": 2,
                      "vec_in_dim": POOLED_DIM, "guidance_embed": family != "flux_schnell"}
        return {**config, "hidden_size": 64, "context_in_dim": CONTEXT_DIM, "depth": 1, "depth_single_blocks": 1}
    if family == "chroma":  # approximator in_dim 64 = 16 (t) + 16 (guidance) + 32 (modulation index)
        return {"image_model": "chroma", "axes_dim": [4, 6, 6], "num_heads": 4, "mlp_ratio": 4.0, "theta": 10000,
                "out_channels": 64, "in_channels": 64, "qkv_bias": True, "patch_size": 2, "hidden_size": 64,
                "context_in_dim": CONTEXT_DIM, "depth": 1, "depth_single_blocks": 1, "vec_in_dim": None,
                "txt_ids_dims": [], "guidance_embed": False, "in_dim": 64, "out_dim": 64, "hidden_dim": 64,
                "n_layers": 1}
    if family in ("qwen_image", "qwen_image_edit"):  # real: 60 layers, 24 heads of 128, context 3584
        return {"image_model": "qwen_image", "in_channels": 64, "out_channels": 16, "num_layers": 1,
                "attention_head_dim": 32, "num_attention_heads": 2, "joint_attention_dim": CONTEXT_DIM,
                "axes_dims_rope": (8, 12, 12)}
    if family == "lumina2":  # real: dim 2304, 24 heads / 8 kv heads, 26 layers, 2 refiners each
        return {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 64, "cap_feat_dim": CONTEXT_DIM,
                "n_layers": 1, "n_refiner_layers": 1, "qk_norm": True, "n_heads": 4, "n_kv_heads": 2,
                "axes_dims": [4, 6, 6], "axes_lens": [300, 512, 512], "rope_theta": 10000.0, "ffn_dim_multiplier": 4.0}
    if family == "z_image":
        # Real: dim 3840, 30 heads of 128, pad_tokens_multiple 32. dim >= 256 here: the modulation
        # feeds a 256-wide time embedding to Linear(min(dim, 256), ...).
        return {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 256, "cap_feat_dim": CONTEXT_DIM,
                "n_layers": 1, "n_refiner_layers": 1, "qk_norm": True, "n_heads": 2, "n_kv_heads": 2,
                "axes_dims": [32, 48, 48], "axes_lens": [1536, 512, 512], "rope_theta": 256.0,
                "ffn_dim_multiplier": 8.0 / 3.0, "z_image_modulation": True, "time_scale": 1000.0,
                "pad_tokens_multiple": 32}
    if family == "sd3":  # MMDiT: hidden 64 * depth, heads = depth
        return dict(_MMDIT)
    if family == "sd35_medium":  # real: x-block self-attention in layers 0..12
        return {**_MMDIT, "qk_norm": "rms", "x_block_self_attn_layers": [0]}
    if family in ("wan21_t2v", "wan22_t2v_a14b"):
        return {**_WAN, "model_type": "t2v", "in_dim": 16, "out_dim": 16}
    if family == "wan21_i2v":  # CLIP-vision tokens (img_emb), 16 image + 4 mask channels
        return {**_WAN, "model_type": "i2v", "in_dim": 36, "out_dim": 16}
    if family == "wan22_i2v_a14b":
        return {**_WAN, "model_type": "t2v", "in_dim": 36, "out_dim": 16}
    if family == "wan22_ti2v_5b":
        return {**_WAN, "model_type": "t2v", "in_dim": 48, "out_dim": 48}
    if family == "hunyuan_video":
        return {**_HUNYUAN10, "in_channels": 16}
    if family == "hunyuan_video_i2v":  # "v1 (concat)": 16 image channels + 1 inverted mask channel
        return {**_HUNYUAN10, "in_channels": 33}
    if family in ("hunyuan_video15", "hunyuan_video15_i2v"):
        return dict(_HUNYUAN15)
    raise ValueError(f"unknown DiT family {family!r}; one of {', '.join(FAMILIES)}")


def unet_config(family: str, **overrides) -> dict:
    """The tiny unet_config of the family, trimmed to what the running tree accepts (``for_host``)."""
    return for_host({**_tiny_config(family), **overrides})


def for_host(config: dict) -> dict:
    """A Flux, Chroma or HunyuanVideo unet_config written for the newest tree, trimmed to the
    fields the running tree's model dataclass has (0.3.75's FluxParams has no txt_ids_dims, its
    HunyuanVideoParams no meanflow_sum); other configs as they are. photo_fixtures' trained
    Flux is built through it too."""
    params = None
    if config.get("image_model") in ("flux", "flux2"):
        import comfy.ldm.flux.model as module

        params = module.FluxParams
    elif config.get("image_model") == "chroma":
        import comfy.ldm.chroma.model as module

        params = module.ChromaParams
    elif config.get("image_model") == "hunyuan_video":
        import comfy.ldm.hunyuan_video.model as module

        params = module.HunyuanVideoParams
    if params is not None:
        keep = _fields(params) | {"image_model"}
        config = {k: v for k, v in config.items() if k in keep}
    return config


def model_config(family: str, dtype: torch.dtype = torch.float32, **overrides):
    """The host's model config for the tiny model, as its detection picks it."""
    import comfy.model_detection
    import comfy.supported_models as supported

    config = unet_config(family, **overrides)
    expected = FAMILY_SPECS[family].config
    if family == "z_image":
        # ComfyUI tells Z-Image from Lumina 2 only by dim == 3840: check that detection picks
        # ZImage at that width, then build the same class at the tiny width.
        found = comfy.model_detection.model_config_from_unet_config({**config, "dim": 3840})
        assert type(found) is supported.ZImage, type(found)
        found = supported.ZImage(config)
    elif family in FIXTURES and FIXTURES[family].build is not None:
        found = FIXTURES[family].build(config)
    else:
        found = comfy.model_detection.model_config_from_unet_config(config)
    if type(found).__name__ != expected:
        raise RuntimeError(f"{family}: detected as {type(found).__name__}, expected {expected} ({config})")
    found.set_inference_dtype(dtype, None)
    return found


def _patcher(model):
    import comfy.model_management
    import comfy.model_patcher

    return comfy.model_patcher.ModelPatcher(model, load_device=comfy.model_management.get_torch_device(),
                                            offload_device=comfy.model_management.unet_offload_device())


def make_dit(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | None = None,
             **overrides):
    """A ModelPatcher around a tiny random-weight model of ``family``; ``overrides`` change its
    unet_config (``depth=2`` for a Flux with two double blocks, ``num_layers=4`` for Wan, ...);
    ``device``: its weights built and filled there (the full-size models of the GPU table)."""
    config = model_config(family, dtype, **overrides)
    model = build_random(lambda: config.get_model({}, device=device), seed,
                         FIXTURES[family].weights if family in FIXTURES else None)
    model.eval()
    return _patcher(model)


# Hunyuan 3D 2.0 as detection reports it (16 heads always), at hidden 64 and one block of each
# kind: a DiT that stays refused in every tree (its tokens are shape latents, not a grid).
_HUNYUAN3D = {"image_model": "hunyuan3d2", "in_channels": 64, "context_in_dim": CONTEXT_DIM, "hidden_size": 64,
              "mlp_ratio": 4.0, "num_heads": 16, "depth": 1, "depth_single_blocks": 1, "qkv_bias": True,
              "guidance_embed": False}


def make_unsupported_dit(seed: int = 0):
    """A tiny Hunyuan 3D 2.0: a DiT ToDo does not support (detected as Hunyuan3Dv2, refused
    as a shape model)."""
    import comfy.model_detection

    config = comfy.model_detection.model_config_from_unet_config(dict(_HUNYUAN3D))
    assert type(config).__name__ == "Hunyuan3Dv2", type(config)
    config.set_inference_dtype(torch.float32, None)
    model = build_random(lambda: config.get_model({}), seed)
    model.eval()
    return _patcher(model)


# --- latents and conditioning as ComfyUI's nodes give them to the sampler -----------------------

def tested_size(family: str, latent_frames: int = 3) -> dict:
    """The size the DiT tests run ``family`` at, which each fixture's ``grid`` is given for:
    128x96 px, never square, so a layout with height and width swapped fails; a video
    ``latent_frames`` latent frames (odd, so a frame off by one or a halved time axis shows)
    whatever its VAE's time downscale: 9 frames at 4x, 13 at 6x, 17 at 8x."""
    size = dict(height_px=128, width_px=96)
    spec = FAMILY_SPECS[family]
    return {**size, "frames": (latent_frames - 1) * spec.time_down + 1} if spec.video else size


def latent_shape(family: str, batch: int = 1, height_px: int = 128, width_px: int = 128, frames: int = 9) -> list[int]:
    spec = FAMILY_SPECS[family]
    shape = [batch, spec.channels, height_px // spec.space_down, width_px // spec.space_down]
    if spec.video:
        shape.insert(2, (frames - 1) // spec.time_down + 1)
    elif spec.five_d:
        shape.insert(2, 1)  # Qwen-Image: Wan 2.1 latent format, T = 1 (fix_empty_latent_channels)
    return shape


def latent(family: str, batch: int = 1, height_px: int = 128, width_px: int = 128, frames: int = 9) -> torch.Tensor:
    """The empty latent (EmptySD3LatentImage, EmptyHunyuanLatentVideo, ...) as the sampler gets
    it; ``frames`` (pixel frames) only for video families."""
    shape = latent_shape(family, batch, height_px, width_px, frames)
    if family in FIXTURES and FIXTURES[family].latent is not None:
        return FIXTURES[family].latent(torch.Generator().manual_seed(3), shape)
    return torch.zeros(shape)


def noise_mask(family: str, latent_image: torch.Tensor) -> torch.Tensor | None:
    """Wan 2.2 5B image to video (Wan22ImageToVideoLatent): frame 0 is the clean image (mask 0),
    the other frames are denoised. None for every other family."""
    if family in FIXTURES:
        return None if FIXTURES[family].mask is None else FIXTURES[family].mask(latent_image)
    if family != "wan22_ti2v_5b":
        return None
    mask = torch.ones([latent_image.shape[0], 1, *latent_image.shape[2:]])
    mask[:, :, :1] = 0.0
    return mask


def _clip_vision_output(**tensors):
    import comfy.clip_vision

    output = comfy.clip_vision.Output()
    for key, value in tensors.items():
        output[key] = value
    return output


def _image_extras(family: str, generator: torch.Generator, shape: list[int]) -> dict:
    """What the image-conditioning nodes (ReferenceLatent, TextEncodeQwenImageEdit,
    WanImageToVideo, HunyuanImageToVideo, ...) add; the same for positive and negative."""
    spec = FAMILY_SPECS[family]
    if family in ("flux_kontext", "qwen_image_edit"):
        # A raw VAE latent of a 64x48 px reference image, as ReferenceLatent stores it.
        ref = [1, spec.channels, 48 // spec.space_down, 64 // spec.space_down]
        if spec.five_d:
            ref.insert(2, 1)
        return {"reference_latents": [torch.randn(ref, generator=generator)]}
    config = _tiny_config(family) if spec.video else {}
    extras = {}
    if family in ("wan21_i2v", "wan22_i2v_a14b"):  # WanImageToVideo: image and mask channels
        mask = torch.ones([1, 1] + shape[2:])
        mask[:, :, :1] = 0.0
        extras.update(concat_latent_image=torch.randn([shape[0], 16] + shape[2:], generator=generator),
                      concat_mask=mask)
    if family == "wan21_i2v":
        extras["clip_vision_output"] = _clip_vision_output(
            penultimate_hidden_states=torch.randn(shape[0], WAN_CLIP_TOKENS, 1280, generator=generator))
    if family == "hunyuan_video_i2v":  # HunyuanImageToVideo "v1 (concat)"
        mask = torch.ones([1, 1] + shape[2:])
        mask[:, :, :1] = 0.0
        extras.update(concat_latent_image=torch.randn([shape[0], 16, 1] + shape[3:], generator=generator),
                      concat_mask=mask)
    if family == "hunyuan_video15_i2v":  # HunyuanVideo15ImageToVideo: full-length concat latent, frame 0 encoded
        image = torch.zeros([shape[0], 32] + shape[2:])
        image[:, :, :1] = torch.randn([shape[0], 32, 1] + shape[3:], generator=generator)
        mask = torch.ones([1, 1] + shape[2:])
        mask[:, :, :1] = 0.0
        extras.update(concat_latent_image=image, concat_mask=mask, clip_vision_output=_clip_vision_output(
            last_hidden_state=torch.randn(shape[0], HY15_VISION_TOKENS, config["vision_in_dim"], generator=generator)))
    return extras


def conditioning(family: str, batch: int = 1, seed: int = 1, frames: int = 9, height_px: int = 128,
                 width_px: int = 128, text_mask: bool = False, text_dim: int | None = None,
                 pooled_dim: int | None = None):
    """Random (positive, negative) in ComfyUI's ``[[context, extras]]`` form with the extras the
    family's model reads. Image inputs (reference latents, i2v images, CLIP vision) are sized
    for ``latent(family, batch, height_px, width_px, frames)`` and shared by both, as the
    conditioning nodes do; the text differs. ``text_mask``: a HunyuanVideo text mask with 6
    padded positions (ComfyUI crashes with it at batch > 1). ``text_dim``, ``pooled_dim``: the
    widths of the text tokens and the pooled text where the model is not the tiny one (the model
    files: T5-XXL's 4096, CLIP-L's 768)."""
    generator = torch.Generator().manual_seed(seed)
    shape = latent_shape(family, batch, height_px, width_px, frames)
    if family in FIXTURES:
        fixture = FIXTURES[family]
        shared = fixture.shared(generator, shape) if fixture.shared is not None else {}

        def one() -> list:
            context, extras = fixture.text(generator, batch, shape)
            return [[context, {**shared, **extras}]]

        return one(), one()
    shared = _image_extras(family, generator, shape)

    def text() -> list:
        extras = dict(shared)
        if family.startswith("wan"):
            width = text_dim or _tiny_config(family)["text_dim"]
            return [[torch.randn(batch, WAN_TEXT_TOKENS, width, generator=generator), extras]]
        if family.startswith("hunyuan"):
            config = _tiny_config(family)
            context = torch.randn(batch, HY_TEXT_TOKENS, config["context_in_dim"], generator=generator)
            # encode_adm reads kwargs["pooled_output"]: 1.5 has no CLIP-L, its encoder stores None.
            extras["pooled_output"] = (torch.randn(batch, config["vec_in_dim"], generator=generator)
                                       if config["vec_in_dim"] else None)
            if config["guidance_embed"]:
                extras["guidance"] = 6.0
            if config["byt5"]:
                extras["conditioning_byt5small"] = torch.randn(batch, HY15_BYT5_TOKENS, 1472, generator=generator)
            if text_mask:
                mask = torch.ones(batch, HY_TEXT_TOKENS, dtype=torch.long)
                mask[:, HY_TEXT_TOKENS - 6:] = 0
                extras["attention_mask"] = mask
            return [[context, extras]]
        context = torch.randn(batch, TEXT_TOKENS, text_dim or CONTEXT_DIM, generator=generator)
        if family in ("flux_dev", "flux_schnell", "flux_kontext", "sd3", "sd35_medium"):
            extras["pooled_output"] = torch.randn(batch, pooled_dim or POOLED_DIM, generator=generator)
        elif family in ("chroma", "flux2"):
            # T5 / Mistral give no pooled output; CLIPTextEncode still stores the key (None), and
            # 0.3.75's Flux.encode_adm reads kwargs["pooled_output"] unconditionally.
            extras["pooled_output"] = None
        if family in ("flux_dev", "flux_kontext", "flux2"):
            extras["guidance"] = 2.5 if family == "flux_kontext" else 3.5
        if family in ("lumina2", "z_image"):
            extras["attention_mask"] = torch.ones(batch, TEXT_TOKENS, dtype=torch.long)
        return [[context, extras]]

    return text(), text()


# --- model files ComfyUI's loader detects ---------------------------------------------------------

def flux_file_state_dict(seed: int = 0, dtype: torch.dtype = torch.float16, variant: str = "dev",
                         context_dim: int = 4096, pooled_dim: int = 768) -> dict:
    """The smallest random-weight Flux.1 diffusion model (BFL key names, no prefix) that
    ``comfy.sd.load_diffusion_model`` detects as Flux.1 in 0.3.75 and 0.33.0; text widths as
    the real encoders give (T5-XXL 4096, CLIP-L pooled 768).

    Fixed by the detectors: hidden size 3072 (0.3.75 hard-codes 24 heads and axes [16, 56, 56],
    and the model needs hidden / heads == sum(axes) = 128), mlp ratio 4, at least one double
    block (detection keys on ``double_blocks.0.img_attn.norm.key_norm.scale``); single blocks may
    be 0. About 0.4 G parameters (~0.8 GB in float16). Norm scales are saved as ``*.scale``, as
    in BFL's files (0.33 renames them on load). "dev" (also Kontext: the same keys) has
    ``guidance_in`` (-> Flux), "schnell" none (-> FluxSchnell)."""
    hidden, mlp = 3072, 4 * 3072
    generator = torch.Generator().manual_seed(seed)
    sd = {}

    def linear(name, out_features, in_features):
        bound = 1 / math.sqrt(in_features)
        sd[f"{name}.weight"] = ((torch.rand(out_features, in_features, generator=generator) * 2 - 1) * bound).to(dtype)
        sd[f"{name}.bias"] = torch.zeros(out_features, dtype=dtype)

    linear("img_in", hidden, 64)
    linear("txt_in", hidden, context_dim)
    embedders = [("time_in", 256), ("vector_in", pooled_dim)] + ([("guidance_in", 256)] if variant != "schnell" else [])
    for name, in_features in embedders:
        linear(f"{name}.in_layer", hidden, in_features)
        linear(f"{name}.out_layer", hidden, hidden)
    block = "double_blocks.0"
    for stream in ("img", "txt"):
        linear(f"{block}.{stream}_mod.lin", 6 * hidden, hidden)
        linear(f"{block}.{stream}_attn.qkv", 3 * hidden, hidden)
        linear(f"{block}.{stream}_attn.proj", hidden, hidden)
        for norm in ("query_norm", "key_norm"):
            sd[f"{block}.{stream}_attn.norm.{norm}.scale"] = torch.ones(128, dtype=dtype)
        linear(f"{block}.{stream}_mlp.0", mlp, hidden)
        linear(f"{block}.{stream}_mlp.2", hidden, mlp)
    linear("final_layer.adaLN_modulation.1", 2 * hidden, hidden)
    linear("final_layer.linear", 64, hidden)
    return sd


def write_flux_diffusion_model(path: str, seed: int = 0, dtype: torch.dtype = torch.float16, variant: str = "dev",
                               context_dim: int = 4096, pooled_dim: int = 768) -> None:
    """``flux_file_state_dict`` as a diffusion-model file (``UNETLoader`` detects it as Flux.1)."""
    import comfy.utils

    sd = flux_file_state_dict(seed, dtype, variant, context_dim, pooled_dim)
    comfy.utils.save_torch_file({k: v.contiguous() for k, v in sd.items()}, path)


# What detection reads from a Wan file (model_detection, the "head.modulation" branch): dim from
# head.modulation, num_heads = dim // 128 (so dim >= 128), ffn_dim, the block count, in_dim from
# patch_embedding, out_dim from head.head; i2v iff img_emb.proj.0.bias; vace iff
# vace_patch_embedding. text_dim is not read: the model is always built with 4096.
WAN_FILE_VARIANTS = {  # variant -> (model_type, in_dim, out_dim, what detection picks)
    "t2v": ("t2v", 16, 16, "WAN21_T2V"),
    "i2v": ("i2v", 36, 16, "WAN21_I2V"),
    "wan22_i2v_a14b": ("t2v", 36, 16, "WAN21_T2V"),
    "ti2v_5b": ("t2v", 48, 48, "WAN22_T2V"),
    "vace": ("vace", 16, 16, "WAN21_Vace"),
}


def wan_file_state_dict(variant: str = "t2v", seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict:
    """A Wan diffusion model's state dict in the real files' key layout (no prefix) at the
    smallest sizes detection accepts: dim 128 (1 head), ffn 256, 1 block."""
    import comfy.ldm.wan.model as wan
    import comfy.ops

    model_type, in_dim, out_dim, _ = WAN_FILE_VARIANTS[variant]
    common = dict(patch_size=(1, 2, 2), in_dim=in_dim, dim=128, ffn_dim=256, freq_dim=256, text_dim=4096,
                  out_dim=out_dim, num_heads=1, num_layers=1, window_size=(-1, -1), qk_norm=True,
                  cross_attn_norm=True, eps=1e-6, operations=comfy.ops.disable_weight_init, dtype=torch.float32)
    if model_type == "vace":
        net = wan.VaceWanModel(vace_layers=1, vace_in_dim=96, **common)
    else:
        net = wan.WanModel(model_type=model_type, **common)
    randomize_(net, seed)
    return {k: t.detach().contiguous().to(dtype) for k, t in net.state_dict().items()}


def write_wan_diffusion_model(path: str, variant: str = "t2v", seed: int = 0) -> None:
    """A tiny random Wan diffusion-model file (1.8 to 5.5 MB) that UNETLoader detects as the
    variant's model (see WAN_FILE_VARIANTS)."""
    import comfy.utils

    comfy.utils.save_torch_file(wan_file_state_dict(variant, seed), path)


# LTX-Video as detection reads a file (model_detection, the "adaln_single" branch): the block
# count, attention_head_dim = attn2.to_k rows // 32 and cross_attention_dim from its columns, then
# the "transformer" part of the file's "config" metadata over them (the real files carry it).
LTXV_FILE_CONFIG = {"num_attention_heads": 2, "attention_head_dim": 32, "cross_attention_dim": 64,
                    "caption_channels": 4096, "in_channels": 128, "out_channels": 128}


def write_ltxv_diffusion_model(path: str, seed: int = 0) -> None:
    """A tiny random LTX-Video diffusion-model file (2 blocks, 2 heads of 32; T5-XXL's 4096-wide
    tokens in, ~0.9 MB) with its "config" metadata, which UNETLoader detects as LTXV."""
    import json

    import comfy.utils

    model = make_dit("ltxv", seed, **LTXV_FILE_CONFIG).model.diffusion_model
    metadata = {"config": json.dumps({"transformer": LTXV_FILE_CONFIG})}
    comfy.utils.save_torch_file({k: t.detach().contiguous().to(torch.bfloat16) for k, t in model.state_dict().items()},
                                path, metadata=metadata)


def write_ltx2_diffusion_model(path: str, seed: int = 0) -> None:
    """A tiny random LTX-2 (``LTXAV``, ComfyUI 0.33) diffusion-model file: the fixture's 2 audio-video
    blocks (devtools/dit_fixtures/ltx2.py) with that config as the file's "config" metadata over
    what detection reads (its audio blocks make it LTXAV)."""
    import json

    import comfy.utils

    config = FIXTURES["ltxav"].config
    model = make_dit("ltxav", seed).model.diffusion_model
    metadata = {"config": json.dumps({"transformer": config})}
    comfy.utils.save_torch_file({k: t.detach().contiguous().to(torch.bfloat16) for k, t in model.state_dict().items()},
                                path, metadata=metadata)


def write_wan_vace_diffusion_model(path: str, seed: int = 0) -> None:
    """``write_wan_diffusion_model`` of the VACE variant (1 block, 1 VACE block on a 96-channel
    hint: 32 frame latent + 64 mask channels), detected as WAN21_Vace."""
    write_wan_diffusion_model(path, "vace", seed)


def write_wan_scaled_fp8(path: str, seed: int = 0) -> None:
    """The Wan file above as an "fp8_scaled" file, the format of the scaled fp8 models users
    download: every linear weight in float8_e4m3fn with its ``scale_weight``, and the
    ``scaled_fp8`` marker ComfyUI's loader looks for (0.3.75 runs it with its scaled fp8 ops,
    0.33 converts it to its mixed-precision quantised layers)."""
    import comfy.utils

    sd = {}
    for key, tensor in wan_file_state_dict("t2v", seed, torch.float32).items():
        if key.endswith(".weight") and tensor.dim() == 2:
            scale = tensor.abs().max().clamp(min=1e-8) / 448.0  # float8_e4m3fn's largest value
            sd[key] = (tensor / scale).to(torch.float8_e4m3fn)
            sd[f"{key[:-len('.weight')]}.scale_weight"] = scale.reshape(())
        else:
            sd[key] = tensor.to(torch.bfloat16)
    sd["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    comfy.utils.save_torch_file(sd, path)


def write_attention_lora(path: str, model: str = "wan21_t2v", seed: int = 0, rank: int = 4,
                         scale: float = 0.05) -> None:
    """A random LoRA on every attention projection of the Wan 2.1 or Flux.1 diffusion-model file
    above (``model``: "wan21_t2v" or "flux"), in ComfyUI's generic key format
    (``diffusion_model.<key>.lora_up/lora_down.weight``), as the few-step distillation LoRAs
    users stack on those models touch them."""
    import comfy.utils

    state = wan_file_state_dict("t2v") if model == "wan21_t2v" else flux_file_state_dict()
    generator = torch.Generator().manual_seed(seed)
    sd = {}
    for key, weight in state.items():
        if key.endswith(".weight") and weight.dim() == 2 and "attn" in key:
            base = f"diffusion_model.{key[:-len('.weight')]}"
            sd[f"{base}.lora_down.weight"] = torch.randn(rank, weight.shape[1], generator=generator) * scale
            sd[f"{base}.lora_up.weight"] = torch.randn(weight.shape[0], rank, generator=generator) * scale
    comfy.utils.save_torch_file(sd, path)


def write_unsupported_dit(path: str, seed: int = 0) -> None:
    """A DiT file UNETLoader loads and ToDo does not support: a tiny Hunyuan 3D 2.0 (0.2 MB)."""
    import comfy.utils

    model = make_unsupported_dit(seed).model.diffusion_model
    comfy.utils.save_torch_file({k: t.detach().contiguous().to(torch.bfloat16)
                                 for k, t in model.state_dict().items()}, path)
