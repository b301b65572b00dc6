"""What ``apply_patch`` was given: the denoisers of a diffusers pipeline (or the model itself),
and the layout of each (the core's ``layout.Layout``: a UNet's transformer blocks with their
levels, or a DiT family's blocks), recognised by class name as tomesd does, without importing
diffusers.
"""

from __future__ import annotations

import torch

from ..layout import DIT, UNET, Layout, Site
from .families import DiffusersFamily, family_of

DENOISERS = ("unet", "transformer", "transformer_2")  # pipeline attributes, in the order they run
UNET_BLOCK = "BasicTransformerBlock"
# UNet blocks whose ``attentions`` are plain self-attention ``Attention`` modules, called on the
# [B, C, H, W] feature map (UNet2DModel: DDPM, consistency models; its mid block)
PLAIN_ATTENTION_BLOCKS = ("AttnDownBlock2D", "AttnUpBlock2D", "UNetMidBlock2D")


def is_pipeline(obj) -> bool:
    return any(cls.__name__ == "DiffusionPipeline" for cls in type(obj).__mro__)


def denoisers(pipe_or_model) -> list[torch.nn.Module]:
    """The models to patch: a pipeline's UNet or transformer(s), or the model given."""
    if isinstance(pipe_or_model, torch.nn.Module):
        return [pipe_or_model]
    if not is_pipeline(pipe_or_model):
        raise TypeError(f"apply_patch takes a diffusers pipeline or model (a torch.nn.Module), not "
                        f"{type(pipe_or_model).__name__}.")
    found = [getattr(pipe_or_model, name) for name in DENOISERS if getattr(pipe_or_model, name, None) is not None]
    if not found:
        raise ValueError(f"This {type(pipe_or_model).__name__} has no UNet or transformer to patch "
                         f"(looked for {', '.join(DENOISERS)}).")
    return found


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model under a torch.compile wrapper."""
    return getattr(model, "_orig_mod", model)


def _unet_level(path: str, levels: int) -> int:
    """Downsample of a UNet2DConditionModel block's token grid, from where it sits."""
    part, _, rest = path.partition(".")
    if part == "down_blocks":
        return 2 ** int(rest.split(".")[0])
    if part == "up_blocks":
        return 2 ** (levels - 1 - int(rest.split(".")[0]))
    return 2 ** (levels - 1)  # mid_block


def unet2d_layout(unet: torch.nn.Module) -> Layout | None:
    """A diffusers UNet's self-attention sites, or None for another model: a UNet2DConditionModel's
    transformer blocks, and the plain self-attentions of UNet2DModel's attention blocks."""
    if not hasattr(unet, "down_blocks") or not hasattr(unet, "up_blocks"):
        return None
    levels = len(unet.down_blocks)
    sites = tuple(Site(path, _unet_level(path, levels), path) for path, module in unet.named_modules()
                  if type(module).__name__ == UNET_BLOCK or _plain_attention(unet, path, module))
    return Layout(UNET, sites)


def _plain_attention(unet: torch.nn.Module, path: str, module: torch.nn.Module) -> bool:
    """Whether ``module`` (at ``path``) is one of a plain attention block's self-attentions."""
    block, _, rest = path.rpartition(".attentions.")
    return (type(module).__name__ == "Attention" and rest.isdigit() and block != ""
            and type(unet.get_submodule(block)).__name__ in PLAIN_ATTENTION_BLOCKS)


def self_attention(block: torch.nn.Module) -> torch.nn.Module:
    """The self-attention of a site's module: a transformer block's ``attn1``, or the plain
    attention itself (a UNet2DModel's, called on the feature map)."""
    return getattr(block, "attn1", block)


def transformer_layout(model: torch.nn.Module, family: DiffusersFamily) -> Layout:
    """A diffusers transformer's blocks (a site each, in call order)."""
    paths = [f"{name}.{i}" for name in family.blocks for i in range(len(getattr(model, name, ())))]
    return Layout(DIT, tuple(Site(("block", i), 1, path) for i, path in enumerate(paths)), family=family)


def model_layout(model: torch.nn.Module) -> tuple[str, Layout | None]:
    """The model's name for the report (its class) and its layout, None if nothing we know."""
    family = family_of(model)
    if family is not None:
        return family.name, transformer_layout(model, family)
    layout = unet2d_layout(model)
    if layout is None or not any(type(m).__name__ == UNET_BLOCK for m in model.modules()):
        return type(model).__name__, layout  # UNet2DModel (DDPM, consistency models): not an SD UNet
    sdxl = getattr(getattr(model, "config", None), "addition_embed_type", None) == "text_time"
    return ("SDXL" if sdxl else "SD") + f" {type(model).__name__}", layout
