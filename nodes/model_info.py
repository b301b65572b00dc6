"""What a patch node will touch in a given MODEL, and the words to report it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .unet_layout import TransformerSite, UNetLayout, unet_layout

LEVEL_CHOICES = ["auto", "1", "2", "4", "8"]


def model_family(model) -> str:
    """The host's name for the model type (SD15, SDXL, Flux, ...)."""
    config = getattr(model.model, "model_config", None)
    return type(config).__name__ if config is not None else type(model.model).__name__


@dataclass(frozen=True)
class PatchTarget:
    family: str
    layout: UNetLayout | None
    level: int  # the resolved level setting ("auto" -> this model's finest transformer level)
    sites: tuple[TransformerSite, ...] | None  # None: nothing to patch, see message
    message: str = ""
    refused: bool = False  # no setting of the node can work on this model: an error, not a warning

    def count_at(self, level: int) -> int:
        return sum(1 for site in self.sites if site.downsample == level)

    def header(self, method: str) -> str:
        """One line for the node: what is patched in this model."""
        levels = ", ".join(str(lv) for lv in sorted({site.downsample for site in self.sites}))
        return f"{method} · {self.family} · {len(self.sites)} of {len(self.layout.sites)} blocks at downsample {levels}"


def patch_target(model, method: str, setting: str, choice: str,
                 select: Callable[[UNetLayout, int], tuple[TransformerSite, ...]]) -> PatchTarget:
    """Resolve a level setting (``choice``: "auto" or a downsample) for this model and select
    the blocks to patch with ``select(layout, level)``.

    Never silent: a model without UNet transformer blocks comes back ``refused`` (no setting
    can work there); a setting that selects none of its blocks comes back with ``sites=None``
    and a warning that says what would work.
    """
    family = model_family(model)
    layout = unet_layout(model.get_model_object("diffusion_model"), family)
    if layout is None or not layout.sites:
        return PatchTarget(family, layout, 0, None,
                           f"{method} cannot patch this {family} model: it has no UNet transformer blocks. "
                           f"{method} works on UNet models (SD1.x, SD2.x, SDXL); DiT models such as SD3 and Flux "
                           f"are not supported. Remove this node for this model.", refused=True)
    levels = layout.levels
    level = levels[0] if choice == "auto" else int(choice)
    sites = select(layout, level)
    if not sites:
        return PatchTarget(family, layout, level, None,
                           f"WARNING: {method} does nothing on this {family} model with {setting} {choice}: "
                           f"its transformer blocks are at downsample {', '.join(map(str, levels))}. "
                           f"Use {setting} auto or {levels[0]}. The model is returned unchanged.")
    return PatchTarget(family, layout, level, sites)
