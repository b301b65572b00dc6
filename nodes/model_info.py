"""What a patch node will touch in a given MODEL, and the words to report it."""

from __future__ import annotations

from dataclasses import dataclass

from .unet_layout import TransformerSite, UNetLayout, unet_layout


def model_family(model) -> str:
    """The host's name for the model type (SD15, SDXL, Flux, ...)."""
    config = getattr(model.model, "model_config", None)
    return type(config).__name__ if config is not None else type(model.model).__name__


@dataclass(frozen=True)
class PatchTarget:
    family: str
    layout: UNetLayout | None
    max_downsample: int
    sites: tuple[TransformerSite, ...] | None  # None: nothing to patch, see message
    message: str = ""


def patch_target(model, method: str, max_downsample: str) -> PatchTarget:
    """Resolve ``max_downsample`` ("auto" or a number) for this model, and find the blocks.

    Never silent: a model without UNet transformer blocks, or a level that has none, comes
    back with ``sites=None`` and a message that says why and what would work.
    """
    family = model_family(model)
    layout = unet_layout(model.get_model_object("diffusion_model"), family)
    if layout is None or not layout.sites:
        return PatchTarget(family, layout, 0, None,
                           f"WARNING: {method} does nothing on this {family} model: it has no UNet transformer "
                           f"blocks (DiT models such as SD3 and Flux are not supported). The model is returned unchanged.")
    levels = layout.levels
    resolved = levels[0] if max_downsample == "auto" else int(max_downsample)
    sites = layout.within(resolved)
    if not sites:
        return PatchTarget(family, layout, resolved, None,
                           f"WARNING: {method} does nothing on this {family} model with max_downsample {max_downsample}: "
                           f"its transformer blocks are at downsample {', '.join(map(str, levels))}. "
                           f"Use max_downsample auto or {levels[0]} or more. The model is returned unchanged.")
    return PatchTarget(family, layout, resolved, sites)


def describe_sites(target: PatchTarget) -> str:
    """e.g. 'max_downsample 1 (auto): 5 of 16 transformer blocks (downsample 1: 5)'."""
    per_level = ", ".join(f"downsample {level}: {len(target.layout.at(level))}"
                          for level in target.layout.levels if level <= target.max_downsample)
    return (f"max_downsample {target.max_downsample}: {len(target.sites)} of {len(target.layout.sites)} "
            f"transformer blocks ({per_level})")
