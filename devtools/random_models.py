"""Random-weight Stable Diffusion models built with ComfyUI's own classes.

No trained weights can be downloaded where the tests run, so tests, the demo and the
benchmark build models in the exact SD1.5 / SD2.x / SDXL layouts (``full``) or in the same
layouts at a fraction of the width (``tiny``, for fast CPU tests), with weights drawn from a
private generator. ``write_checkpoint`` saves a full single-file checkpoint (UNet, CLIP, VAE)
that ComfyUI's loader detects as the real model type.

Runs inside the host venv with the ComfyUI folder importable.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.overrides import TorchFunctionMode

# As ComfyUI's model detection reports the real models (comfy/model_detection.py).
_COMMON = {"use_checkpoint": False, "image_size": 32, "in_channels": 4, "out_channels": 4,
           "use_spatial_transformer": True, "legacy": False, "use_temporal_attention": False,
           "use_temporal_resblock": False}
FULL_UNET_CONFIGS = {
    "SD15": {**_COMMON, "adm_in_channels": None, "model_channels": 320, "num_res_blocks": [2, 2, 2, 2],
             "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0], "channel_mult": [1, 2, 4, 4],
             "transformer_depth_middle": 1, "use_linear_in_transformer": False, "context_dim": 768,
             "num_heads": 8, "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]},
    "SD21": {**_COMMON, "adm_in_channels": None, "model_channels": 320, "num_res_blocks": [2, 2, 2, 2],
             "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0], "channel_mult": [1, 2, 4, 4],
             "transformer_depth_middle": 1, "use_linear_in_transformer": True, "context_dim": 1024,
             "num_head_channels": 64, "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]},
    "SDXL": {**_COMMON, "num_classes": "sequential", "adm_in_channels": 2816, "model_channels": 320,
             "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10], "channel_mult": [1, 2, 4],
             "transformer_depth_middle": 10, "use_linear_in_transformer": True, "context_dim": 2048,
             "num_head_channels": 64, "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10]},
}
# Same block structure, a fraction of the width and depth: seconds per step on a CPU.
TINY_OVERRIDES = {
    "SD15": {"model_channels": 32, "context_dim": 64, "num_heads": 2},
    "SD21": {"model_channels": 32, "context_dim": 64, "num_head_channels": 16, "num_heads": -1},
    "SDXL": {"model_channels": 32, "context_dim": 64, "num_head_channels": 16, "num_heads": -1, "transformer_depth": [0, 0, 1, 1, 2, 2],
             "transformer_depth_middle": 1, "transformer_depth_output": [0, 0, 0, 1, 1, 1, 2, 2, 2]},
}
CONTEXT_TOKENS = 77
SDXL_POOLED = 1280
DIT_CONTEXT_DIM = 64  # the tiny SD3's text context and pooled vector width


def unet_config(family: str, tiny: bool) -> dict:
    config = dict(FULL_UNET_CONFIGS[family])
    if tiny:
        config.update(TINY_OVERRIDES[family])
    return config


def _model_config(family: str, config: dict, dtype: torch.dtype = torch.float32):
    import comfy.supported_models as supported

    cls = {"SD15": supported.SD15, "SD21": supported.SD20, "SDXL": supported.SDXL}[family]
    model_config = cls(config)
    # The class adds its own head layout (unet_extra_config); ours must win for tiny models.
    model_config.unet_config.update({k: v for k, v in config.items() if k in ("num_heads", "num_head_channels")})
    model_config.set_inference_dtype(dtype, None)
    return model_config


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Fill every parameter from a private generator as PyTorch's default layer init would
    (weights uniform in +-1/sqrt(fan_in)), norm scales 1, biases 0. ComfyUI builds its layers
    without initialising them, so this is needed for finite, deterministic outputs. The
    generator lives where the parameters do: a model built on a GPU (the full-size models of the
    GPU table) is filled there in a second, not in minutes on the CPU (other values than a CPU
    build, as deterministic)."""
    device = next(module.parameters(), torch.empty(0)).device
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.dim() >= 2:
                bound = 1 / math.sqrt(math.prod(param.shape[1:]))
                param.copy_((torch.rand(param.shape, generator=generator, device=device) * 2 - 1) * bound)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)


_EMPTY = (torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty, torch.Tensor.new_empty_strided)


class _EmptyIsNaN(TorchFunctionMode):
    """Floating tensors made with ``torch.empty`` and its kin come out NaN instead of whatever
    the memory held: a buffer that a model's own code leaves unset is found, not computed with."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _EMPTY and isinstance(out, torch.Tensor) and out.is_floating_point():
            with torch.no_grad():
                out.fill_(math.nan)
        return out


@contextlib.contextmanager
def unset_is_nan():
    """Build a random model in this (``build_random``): what its constructor leaves unset is NaN."""
    with _EmptyIsNaN():
        yield


def fill_unset_(model: torch.nn.Module, seed: int) -> None:
    """After ``randomize_`` (and the family's own fills): every buffer a model built under
    ``unset_is_nan`` still holds unset (NaN) is filled. ComfyUI makes some buffers with
    ``torch.empty`` because the real files carry them (MiniMax-H3's ``rope.inv_freq`` and
    ``adaln_t_table``, MMDiT's ``pos_embed``, ...); computing with them reads uninitialised
    memory, now and then NaN. Rotary frequency tables (``inv_freq``) get RoPE's own
    ``theta ** -(i / n)`` at theta 10000; every other unset value a deterministic random one.
    Buffers the model's constructor computes are left as they are. Raises where a parameter is
    still unset (``randomize_`` fills the diffusion model's; another module's would be garbage)."""
    generator = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if not buffer.is_floating_point() or not (unset := torch.isnan(buffer)).any():
                continue
            if name.rsplit(".", 1)[-1] == "inv_freq":
                n = buffer.shape[-1]
                values = (10000.0 ** -(torch.arange(n, dtype=torch.float64) / n)).expand(buffer.shape)
            else:
                values = torch.rand(buffer.shape, generator=generator) * 2 - 1
            buffer.copy_(torch.where(unset, values.to(buffer.device, buffer.dtype), buffer))
        unset = [name for name, tensor in (*model.named_parameters(), *model.named_buffers())
                 if tensor.is_floating_point() and torch.isnan(tensor).any()]
    if unset:
        raise RuntimeError(f"{type(model).__name__}: unset (NaN) after building and filling: {', '.join(unset)}")


def build_random(build, seed: int, fill=None):
    """``build()`` (a host model whose ``diffusion_model`` is the network) with every weight and
    buffer set: built under ``unset_is_nan``, its diffusion model's parameters randomized,
    MMDiT's position table computed, ``fill(diffusion_model)`` (a family's own weights) run, then
    whatever is still unset filled (``fill_unset_``)."""
    with unset_is_nan():
        model = build()
    randomize_(model.diffusion_model, seed)
    fill_pos_embed_(model.diffusion_model)
    if fill is not None:
        fill(model.diffusion_model)
    fill_unset_(model, seed)
    return model


def fill_pos_embed_(diffusion_model: torch.nn.Module) -> None:
    """MMDiT (SD3) keeps its absolute position table in a *buffer* made with ``torch.empty``
    (real files carry it), which ``randomize_`` (parameters only) leaves as uninitialised
    memory: outputs would differ between runs, or be NaN. Fill it with the 2-D sin-cos table
    ComfyUI itself computes when a file has none. Other models are left as they are."""
    pos_embed = getattr(diffusion_model, "pos_embed", None)
    size = getattr(diffusion_model, "pos_embed_max_size", None)
    if not isinstance(pos_embed, torch.Tensor) or pos_embed.dim() != 3 or not size:
        return
    from comfy.ldm.modules.diffusionmodules.mmdit import get_2d_sincos_pos_embed_torch

    with torch.no_grad():
        table = get_2d_sincos_pos_embed_torch(pos_embed.shape[-1], size, size)
        pos_embed.copy_(table.reshape(pos_embed.shape).to(pos_embed.dtype))


def make_model(family: str = "SD15", tiny: bool = True, seed: int = 0, v_prediction: bool = False,
               dtype: torch.dtype = torch.float32, device: torch.device | None = None):
    """A ModelPatcher around a random-weight UNet of that family, on ComfyUI's torch device
    (``device``: its weights built and filled there)."""
    import comfy.model_base
    import comfy.model_management
    import comfy.model_patcher

    model_config = _model_config(family, unet_config(family, tiny), dtype)
    model_type = comfy.model_base.ModelType.V_PREDICTION if v_prediction else comfy.model_base.ModelType.EPS
    cls = comfy.model_base.SDXL if family == "SDXL" else comfy.model_base.BaseModel
    model = build_random(lambda: cls(model_config, model_type=model_type, device=device), seed)
    model.eval()
    device = comfy.model_management.get_torch_device()
    return comfy.model_patcher.ModelPatcher(model, load_device=device,
                                            offload_device=comfy.model_management.unet_offload_device())


def conditioning(family: str, tiny: bool, batch: int = 1, seed: int = 1) -> list:
    """A random text conditioning in ComfyUI's format for that family."""
    context_dim = unet_config(family, tiny)["context_dim"]
    generator = torch.Generator().manual_seed(seed)
    extras = {}
    if family == "SDXL":
        extras["pooled_output"] = torch.randn(batch, SDXL_POOLED, generator=generator)
    return [[torch.randn(batch, CONTEXT_TOKENS, context_dim, generator=generator), extras]]


def smooth_latent(batch: int, height: int, width: int, seed: int = 2, channels: int = 4,
                  frames: int | None = None) -> torch.Tensor:
    """A spatially smooth latent (as real latents are): coarse noise upsampled bicubically;
    with ``frames``, a video latent (batch, channels, frames, height, width) upsampled
    trilinearly."""
    generator = torch.Generator().manual_seed(seed)
    if frames is None:
        coarse = torch.randn(batch, channels, max(2, height // 8), max(2, width // 8), generator=generator)
        return torch.nn.functional.interpolate(coarse, size=(height, width), mode="bicubic", align_corners=False)
    coarse = torch.randn(batch, channels, max(1, frames // 4), max(2, height // 8), max(2, width // 8),
                         generator=generator)
    return torch.nn.functional.interpolate(coarse, size=(frames, height, width), mode="trilinear", align_corners=False)


def write_checkpoint(path: str, family: str = "SD15", seed: int = 0) -> None:
    """A full-size random-weight single-file checkpoint that ComfyUI loads as ``family``."""
    import comfy.sd
    import comfy.utils

    # Built in half precision: a full SDXL in float32 would need over 20 GB while saving.
    patcher = make_model(family, tiny=False, seed=seed, dtype=torch.float16)
    model_config = patcher.model.model_config
    clip_target = model_config.clip_target()
    clip = comfy.sd.CLIP(target=clip_target, embedding_directory=None, model_options={"dtype": torch.float16})
    clip_model = clip.cond_stage_model
    randomize_(clip_model, seed + 1)
    vae_sd = _random_vae_state_dict(seed + 2)
    # The model config's per-part key mappings exist unchanged from 0.3.75 to today;
    # BaseModel.state_dict_for_saving, which wraps them, changed its signature in 0.33.
    sd = model_config.process_unet_state_dict_for_saving(dict(patcher.model.diffusion_model.state_dict()))
    sd.update(model_config.process_clip_state_dict_for_saving(clip.get_sd()))
    sd.update(model_config.process_vae_state_dict_for_saving(vae_sd))
    sd = {k: v.contiguous().to(torch.float16) for k, v in sd.items()}
    comfy.utils.save_torch_file(sd, path)


def _random_vae_state_dict(seed: int) -> dict:
    """The SD (kl-f8) VAE with random weights, in the checkpoint's key layout."""
    from comfy.ldm.models.autoencoder import AutoencoderKL

    ddconfig = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    vae = AutoencoderKL(ddconfig=ddconfig, embed_dim=4)
    randomize_(vae, seed)
    return dict(vae.state_dict())


def make_dit(seed: int = 0):
    """A tiny random-weight SD3 (MMDiT): a diffusion model with no UNet transformer blocks."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models as supported

    config = {"in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": 2, "pos_embed_scaling_factor": None,
              "pos_embed_max_size": 16, "num_patches": 256, "adm_in_channels": DIT_CONTEXT_DIM,
              "context_embedder_config": {"target": "torch.nn.Linear",
                                          "params": {"in_features": DIT_CONTEXT_DIM, "out_features": 128}}}
    model_config = supported.SD3(config)
    model_config.set_inference_dtype(torch.float32, None)
    model = build_random(lambda: model_config.get_model({}), seed)
    return comfy.model_patcher.ModelPatcher(model, load_device=comfy.model_management.get_torch_device(),
                                            offload_device=comfy.model_management.unet_offload_device())


def dit_conditioning(batch: int = 1, seed: int = 1) -> list:
    """A random text conditioning for the tiny SD3 of ``make_dit`` (context and pooled vectors)."""
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(batch, CONTEXT_TOKENS, DIT_CONTEXT_DIM, generator=generator),
             {"pooled_output": torch.randn(batch, DIT_CONTEXT_DIM, generator=generator)}]]


def write_dit(path: str, seed: int = 0) -> None:
    """The tiny SD3 of ``make_dit`` as a diffusion-model file (``UNETLoader`` detects it as SD3)."""
    import comfy.utils

    sd = make_dit(seed).model.diffusion_model.state_dict()
    comfy.utils.save_torch_file({k: v.contiguous() for k, v in sd.items()}, path)


def write_lora(path: str, seed: int = 0, rank: int = 4, scale: float = 0.02) -> None:
    """A random LoRA for the self-attention projections of every full-size SD1.5 transformer
    block, in ComfyUI's generic key format (``<unet key>.lora_up/lora_down.weight``)."""
    import comfy.utils

    generator = torch.Generator().manual_seed(seed)
    config = FULL_UNET_CONFIGS["SD15"]
    sd = {}
    blocks = [("input_blocks", i, 1) for i in (1, 2, 4, 5, 7, 8)] + [("middle_block", None, 1)]
    blocks += [("output_blocks", i, 1) for i in range(3, 12)]
    widths = {1: 320, 2: 320, 4: 640, 5: 640, 7: 1280, 8: 1280}
    out_widths = {3: 1280, 4: 1280, 5: 1280, 6: 640, 7: 640, 8: 640, 9: 320, 10: 320, 11: 320}
    for part, index, sub in blocks:
        width = (widths.get(index) if part == "input_blocks" else
                 out_widths.get(index) if part == "output_blocks" else config["model_channels"] * 4)
        prefix = f"diffusion_model.{part}.{index}.{sub}" if index is not None else f"diffusion_model.{part}.{sub}"
        for projection in ("to_q", "to_k", "to_v", "to_out.0"):
            key = f"{prefix}.transformer_blocks.0.attn1.{projection}"
            sd[f"{key}.lora_down.weight"] = torch.randn(rank, width, generator=generator) * scale
            sd[f"{key}.lora_up.weight"] = torch.randn(width, rank, generator=generator) * scale
    comfy.utils.save_torch_file(sd, path)


def write_controlnet(path: str, seed: int = 0) -> None:
    """A full-size random-weight SD1.5 ControlNet (ldm layout, ``control_model.`` keys) that
    ``ControlNetLoader`` detects from its shapes, as it does a trained one."""
    import comfy.ops
    import comfy.utils
    from comfy.cldm.cldm import ControlNet

    config = {k: v for k, v in FULL_UNET_CONFIGS["SD15"].items() if k not in ("out_channels", "transformer_depth_output")}
    net = ControlNet(hint_channels=3, dtype=torch.float16, operations=comfy.ops.disable_weight_init, **config)
    randomize_(net, seed)
    comfy.utils.save_torch_file({f"control_model.{k}": v.contiguous().to(torch.float16)
                                 for k, v in net.state_dict().items()}, path)
