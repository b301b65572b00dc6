"""The model families the benchmark builds with random weights: how to build one, its text
conditioning, and how its latent relates to the image. Nothing here assumes a UNet: the
latent's channels and dimensions are read from the model's own latent format, so a DiT
(image or video) is one more entry in ``FAMILIES``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable  # (tiny, seed, dtype) -> ModelPatcher with random weights
    conditioning: Callable  # (tiny, seed) -> a conditioning in ComfyUI's format
    tiny_only: bool = False  # no full-size layout to build
    downscale: int = 8  # image pixels per latent pixel, each side
    frames: int = 1  # latent frames of a video family (latent_dimensions 3)


def _unet(family: str, tiny: bool, seed: int, dtype):
    import random_models

    return random_models.make_model(family, tiny=tiny, seed=seed, dtype=dtype)


def _unet_conditioning(family: str, tiny: bool, seed: int) -> list:
    import random_models

    return random_models.conditioning(family, tiny, seed=seed)


def _tiny_sd3(tiny: bool, seed: int, dtype):
    import random_models

    return random_models.make_dit(seed)


def _tiny_sd3_conditioning(tiny: bool, seed: int) -> list:
    import random_models

    return random_models.dit_conditioning(seed=seed)


FAMILIES: dict[str, Family] = {
    name: Family(name, partial(_unet, name), partial(_unet_conditioning, name)) for name in ("SD15", "SD21", "SDXL")
}
# A DiT (MMDiT) with no UNet transformer blocks: our nodes refuse it, the built-in does
# nothing; it keeps the harness honest about not assuming a UNet.
FAMILIES["SD3"] = Family("SD3", _tiny_sd3, _tiny_sd3_conditioning, tiny_only=True)


def latent_shape(model, batch: int, size: int, downscale: int = 8, frames: int = 1) -> tuple[int, ...]:
    """The latent of a ``size`` x ``size`` px image (or video of ``frames`` latent frames)
    for this model, from its latent format."""
    latent_format = model.get_model_object("latent_format")
    side = size // downscale
    if getattr(latent_format, "latent_dimensions", 2) == 3:
        return (batch, latent_format.latent_channels, frames, side, side)
    return (batch, latent_format.latent_channels, side, side)
