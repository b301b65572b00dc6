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


# The DiTs: tiny random-weight models of the families ToDo supports (devtools/random_dits.py),
# a few blocks deep so that blocks remain between the first and last ones ToDo leaves alone
# (skip_first_blocks / skip_last_blocks). Their text is shorter than real prompts (12 tokens;
# Wan's T5 pads to 512 as in ComfyUI) and their width (64 per head group) a fraction of the real
# ones, so attention, whose cost grows with the tokens squared, takes a larger share of their
# forward than of a real model's: read their speed-ups with their Amdahl columns.
DIT_DEPTH = {
    "sd3": {"depth": 4,  # MMDiT's width is 64 per block: the text projection must match it
            "context_embedder_config": {"target": "torch.nn.Linear",
                                        "params": {"in_features": 32, "out_features": 256}},
            "pos_embed_max_size": 64, "num_patches": 64 * 64},  # positions for up to 1024 px
    "flux_dev": {"depth": 2, "depth_single_blocks": 4},
    "wan21_t2v": {"num_layers": 6},
}
WAN_LATENT_FRAMES = 5  # 17 video frames


def _dit(family: str, tiny: bool, seed: int, dtype):
    import random_dits

    return random_dits.make_dit(family, seed=seed, dtype=dtype, **DIT_DEPTH[family])


def _dit_conditioning(family: str, tiny: bool, seed: int) -> list:
    import random_dits

    positive, _ = random_dits.conditioning(family, seed=seed, frames=4 * WAN_LATENT_FRAMES - 3)
    return positive


FAMILIES: dict[str, Family] = {
    name: Family(name, partial(_unet, name), partial(_unet_conditioning, name)) for name in ("SD15", "SDXL", "SD21")
}
FAMILIES.update({
    "SD3": Family("SD3", partial(_dit, "sd3"), partial(_dit_conditioning, "sd3"), tiny_only=True),
    "Flux": Family("Flux", partial(_dit, "flux_dev"), partial(_dit_conditioning, "flux_dev"), tiny_only=True),
    "Wan21": Family("Wan21", partial(_dit, "wan21_t2v"), partial(_dit_conditioning, "wan21_t2v"), tiny_only=True,
                    frames=WAN_LATENT_FRAMES),
})


def latent_shape(model, batch: int, size: int, downscale: int = 8, frames: int = 1) -> tuple[int, ...]:
    """The latent of a ``size`` x ``size`` px image (or video of ``frames`` latent frames)
    for this model, from its latent format."""
    latent_format = model.get_model_object("latent_format")
    side = size // downscale
    if getattr(latent_format, "latent_dimensions", 2) == 3:
        return (batch, latent_format.latent_channels, frames, side, side)
    return (batch, latent_format.latent_channels, side, side)
