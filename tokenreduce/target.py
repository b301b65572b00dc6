"""Which sites of a model a node's settings select, or why none."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .families import supported_names
from .layout import UNET, Layout, Site


@dataclass(frozen=True)
class Target:
    family: str  # the host's name for the model type (SD15, SDXL, Flux, ...)
    layout: Layout | None
    level: int  # the resolved level setting ("auto" -> this model's finest level with sites)
    sites: tuple[Site, ...] | None  # None: nothing to patch, see message
    message: str = ""
    refused: bool = False  # no setting of the node can work on this model: an error, not a warning

    @property
    def levels(self) -> tuple[int, ...]:
        """Levels of the selected sites, finest first."""
        return tuple(sorted({site.level for site in self.sites}))

    def count_at(self, level: int) -> int:
        return sum(1 for site in self.sites if site.level == level)


def refusal(method: str, family: str, layout: Layout | None, kinds: tuple[str, ...]) -> str:
    """Why no setting of ``method`` can patch this model, and what to do instead."""
    reason = layout.reason if layout is not None else ""
    if kinds == (UNET,):
        pointer = (f"For this model use Token Downsampling (ToDo, TokenReduce), which supports {layout.family.name}"
                   if layout is not None and layout.family is not None else
                   f"Token Downsampling (ToDo, TokenReduce) does not reduce it either: {reason}" if reason else
                   f"For DiT models use Token Downsampling (ToDo, TokenReduce); it supports {supported_names()}")
        return (f"{method} cannot patch this {family} model: it has no UNet transformer blocks. {method} works on "
                f"UNet models (SD1.x, SD2.x, SDXL). {pointer}. Remove this node for this model.")
    if reason:
        return f"{method} cannot patch this {family} model: {reason}. Remove this node for this model."
    return (f"{method} cannot patch this {family} model. It works on UNet models (SD1.x, SD2.x, SDXL) and on "
            f"these DiT families: {supported_names()}; {family} is not one of them. Remove this node for this model.")


def resolve_target(layout: Layout | None, family: str, method: str, setting: str, choice: str,
                   select: Callable[[Layout, int], tuple[Site, ...]], kinds: tuple[str, ...] = (UNET,)) -> Target:
    """Resolve a level setting (``choice``: "auto" or a downsample) for this model and select
    the sites to patch with ``select(layout, level)``; ``kinds``: the layouts the method
    patches.

    Never silent: a model the method cannot patch comes back ``refused`` (no setting can work
    there); a setting that selects none of its sites comes back with ``sites=None`` and a
    warning that says what would work.
    """
    if layout is None or layout.kind not in kinds or not layout.sites:
        return Target(family, layout, 0, None, refusal(method, family, layout, kinds), refused=True)
    levels = layout.levels
    level = levels[0] if choice == "auto" else int(choice)
    sites = select(layout, level)
    if not sites:
        where = (f"its transformer blocks are at downsample {', '.join(map(str, levels))}. Use {setting} auto or "
                 f"{levels[0]}" if layout.kind == UNET else
                 f"its {len(layout.sites)} blocks attend over one token grid (downsample 1): use {setting} auto or 1, "
                 f"and let skip_first_blocks + skip_last_blocks leave fewer than {len(layout.sites)} blocks unreduced")
        return Target(family, layout, level, None,
                      f"WARNING: {method} does nothing on this {family} model with {setting} {choice}: "
                      f"{where}. The model is returned unchanged.")
    return Target(family, layout, level, sites)
