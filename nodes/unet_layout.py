"""Where a ComfyUI diffusion model has UNet transformer blocks, and at which downsample.

Walks the UNet's input, middle and output blocks the way its forward pass does, counting the
resolution changes, so every BasicTransformerBlock is known by the ``(block, block_index)``
key ComfyUI passes to attention patches and by its module path (for object patches). Classes
are recognised by name: this module imports nothing from the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _named(module: object, *names: str) -> bool:
    return type(module).__name__ in names


def _changes_resolution(layer: torch.nn.Module) -> bool:
    # Downsample/Upsample layers, or ResBlocks built with up/down (resblock_updown configs).
    return _named(layer, "Downsample", "Upsample") or (_named(layer, "ResBlock") and bool(getattr(layer, "updown", False)))


@dataclass(frozen=True)
class TransformerSite:
    """One BasicTransformerBlock of the UNet."""

    block: tuple[str, int]  # ComfyUI's transformer_options["block"], e.g. ("input", 1)
    block_index: int  # index inside its SpatialTransformer
    downsample: int  # of its token grid relative to the latent
    path: str  # module path under the model, for object patches

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.block[0], self.block[1], self.block_index)

    def describe(self) -> str:
        return f"{self.block[0]} {self.block[1]}" + (f".{self.block_index}" if self.block_index else "")


@dataclass(frozen=True)
class UNetLayout:
    family: str
    sites: tuple[TransformerSite, ...]

    @property
    def levels(self) -> tuple[int, ...]:
        """Downsamples that have transformer blocks, finest first."""
        return tuple(sorted({site.downsample for site in self.sites}))

    def within(self, max_downsample: int) -> tuple[TransformerSite, ...]:
        return tuple(site for site in self.sites if site.downsample <= max_downsample)

    def at(self, downsample: int) -> tuple[TransformerSite, ...]:
        return tuple(site for site in self.sites if site.downsample == downsample)


def _sites_in(container: torch.nn.Module, block: tuple[str, int], downsample: int, path: str) -> list[TransformerSite]:
    sites = []
    for j, layer in enumerate(container):
        if _named(layer, "SpatialTransformer"):
            for k, _ in enumerate(layer.transformer_blocks):
                sites.append(TransformerSite(block, k, downsample, f"{path}.{j}.transformer_blocks.{k}"))
    return sites


def unet_layout(diffusion_model: torch.nn.Module, family: str) -> UNetLayout | None:
    """The transformer sites of an SD-style UNet, or None if the model is not one (a DiT)."""
    if not all(hasattr(diffusion_model, name) for name in ("input_blocks", "middle_block", "output_blocks")):
        return None
    base = "diffusion_model"
    sites: list[TransformerSite] = []
    downsample = 1
    for i, container in enumerate(diffusion_model.input_blocks):
        sites += _sites_in(container, ("input", i), downsample, f"{base}.input_blocks.{i}")
        if any(_changes_resolution(layer) for layer in container):
            downsample *= 2
    sites += _sites_in(diffusion_model.middle_block, ("middle", 0), downsample, f"{base}.middle_block")
    for i, container in enumerate(diffusion_model.output_blocks):
        sites += _sites_in(container, ("output", i), downsample, f"{base}.output_blocks.{i}")
        if any(_changes_resolution(layer) for layer in container):
            downsample //= 2
    return UNetLayout(family, tuple(sites))
