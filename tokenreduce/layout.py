"""Where a diffusion model's attention sites are, at which token grid, and under which key the
host calls them.

A layout is one value per model: its kind (how the host lets a patch in) and its sites. UNets
(SD1.x, SD2.x, SDXL) are walked module by module: every BasicTransformerBlock is a site, known
by the ``(block, number, index)`` key ComfyUI passes to attention patches, by its level (the
downsample of its token grid relative to the latent) and by its module path (for object
patches). Classes are recognised by name: nothing here imports a host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .dit import OTHER, Family
from .families import recognise
from .families.refusals import VIDEO_UNET
from .grid import downsample_of

UNET = "unet"  # attention patches per transformer block (attn1_patch, ...) with the block's grid
DIT = "dit"  # the host's attention override, which sees every attention call of a model call
REFUSED = "refused"  # a DiT the pack recognises and does not reduce, for the stated reason


class Site(NamedTuple):
    """One attention site: a transformer block."""

    key: tuple  # how the host names its calls, e.g. ("input", 1, 0) for a UNet block
    level: int  # downsample of its token grid relative to the latent
    path: str  # module path under the model, for object patches


@dataclass(frozen=True)
class Layout:
    kind: str
    sites: tuple[Site, ...]
    family: Family | None = None  # DiT: its family
    plan: tuple = ()  # DiT: the attention calls of one model call, in order (dit.Slot)
    reason: str = ""  # REFUSED: why

    @property
    def levels(self) -> tuple[int, ...]:
        """Levels that have sites, finest first."""
        return tuple(sorted({site.level for site in self.sites}))

    def within(self, max_level: int) -> tuple[Site, ...]:
        return tuple(site for site in self.sites if site.level <= max_level)

    def at(self, levels) -> tuple[Site, ...]:
        return tuple(site for site in self.sites if site.level in levels)

    def count_at(self, level: int) -> int:
        return sum(1 for site in self.sites if site.level == level)


def model_layout(diffusion_model: torch.nn.Module, config) -> Layout | None:
    """The layout of a diffusion model (``config``: the host's model config, its class, or its
    name): a UNet's or a DiT family's, a REFUSED one that says why, or None for a model the
    pack knows nothing of."""
    layout = unet_layout(diffusion_model)
    if layout is not None:
        return layout
    family, reason = recognise(config, diffusion_model)
    if family is not None:
        return dit_layout(diffusion_model, family)
    return None if reason is None else Layout(REFUSED, (), reason=reason)


def dit_layout(diffusion_model: torch.nn.Module, family: Family) -> Layout:
    """A DiT's blocks that run attention over its grid (a site each, in call order)."""
    plan = family.plan(diffusion_model)
    paths = family.blocks(diffusion_model)
    blocks = sorted({slot.block for slot in plan if slot.kind != OTHER})
    sites = tuple(Site(("block", b), 1, f"diffusion_model.{paths[b]}") for b in blocks)
    return Layout(DIT, sites, family, plan)


# --- UNets ---------------------------------------------------------------------------------

def _named(module: object, *names: str) -> bool:
    return type(module).__name__ in names


def _changes_resolution(layer: torch.nn.Module) -> bool:
    # Downsample/Upsample layers, or ResBlocks built with up/down (resblock_updown configs).
    return _named(layer, "Downsample", "Upsample") or (_named(layer, "ResBlock") and bool(getattr(layer, "updown", False)))


def _sites_in(container: torch.nn.Module, block: tuple[str, int], level: int, path: str) -> list[Site]:
    sites = []
    for j, layer in enumerate(container):
        if _named(layer, "SpatialTransformer"):
            for k, transformer in enumerate(layer.transformer_blocks):
                if getattr(transformer, "disable_self_attn", False):
                    continue  # its attn1 attends to the text (the x4 upscaler's finer levels): no self-attention
                sites.append(Site((*block, k), level, f"{path}.{j}.transformer_blocks.{k}"))
    return sites


def unet_layout(diffusion_model: torch.nn.Module) -> Layout | None:
    """The transformer blocks of an SD-style UNet, walked the way its forward pass goes; None
    if the model is not one."""
    if not all(hasattr(diffusion_model, name) for name in ("input_blocks", "middle_block", "output_blocks")):
        return None
    if any(_named(module, "SpatialVideoTransformer") for module in diffusion_model.modules()):
        return Layout(REFUSED, (), reason=VIDEO_UNET)
    base = "diffusion_model"
    sites: list[Site] = []
    level = 1
    for i, container in enumerate(diffusion_model.input_blocks):
        sites += _sites_in(container, ("input", i), level, f"{base}.input_blocks.{i}")
        if any(_changes_resolution(layer) for layer in container):
            level *= 2
    sites += _sites_in(diffusion_model.middle_block, ("middle", 0), level, f"{base}.middle_block")
    for i, container in enumerate(diffusion_model.output_blocks):
        sites += _sites_in(container, ("output", i), level, f"{base}.output_blocks.{i}")
        if any(_changes_resolution(layer) for layer in container):
            level //= 2
    return Layout(UNET, tuple(sites))


def unet_call_key(extra_options: dict) -> tuple | None:
    """The site key of the UNet block an attention patch runs in (as ``Site.key``)."""
    block = extra_options.get("block")
    if block is None:
        return None
    return (block[0], block[1], extra_options.get("block_index", 0))


def unet_call_grid(extra_options: dict) -> tuple[tuple[int, int], int] | None:
    """The token grid of the UNet block an attention patch runs in and its level, from the
    block's actual activations (not guessed from token counts); None where the host gives no
    shapes. Callers check that the tokens they received are that grid (``h * w`` of them):
    another patch may have reshaped them, or the block may be temporal attention."""
    activations = extra_options.get("activations_shape")
    original = extra_options.get("original_shape")
    if activations is None or original is None:
        return None
    grid = (activations[-2], activations[-1])
    return grid, downsample_of((original[-2], original[-1]), grid)
