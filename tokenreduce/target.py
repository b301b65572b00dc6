"""Which sites of a model a node's settings select, or why none."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .layout import Layout, Site


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


def resolve_target(layout: Layout | None, family: str, method: str, setting: str, choice: str,
                   select: Callable[[Layout, int], tuple[Site, ...]]) -> Target:
    """Resolve a level setting (``choice``: "auto" or a downsample) for this model and select
    the sites to patch with ``select(layout, level)``.

    Never silent: a model without UNet transformer blocks comes back ``refused`` (no setting
    can work there); a setting that selects none of its blocks comes back with ``sites=None``
    and a warning that says what would work.
    """
    if layout is None or not layout.sites:
        return Target(family, layout, 0, None,
                      f"{method} cannot patch this {family} model: it has no UNet transformer blocks. "
                      f"{method} works on UNet models (SD1.x, SD2.x, SDXL); DiT models such as SD3 and Flux "
                      f"are not supported. Remove this node for this model.", refused=True)
    levels = layout.levels
    level = levels[0] if choice == "auto" else int(choice)
    sites = select(layout, level)
    if not sites:
        return Target(family, layout, level, None,
                      f"WARNING: {method} does nothing on this {family} model with {setting} {choice}: "
                      f"its transformer blocks are at downsample {', '.join(map(str, levels))}. "
                      f"Use {setting} auto or {levels[0]}. The model is returned unchanged.")
    return Target(family, layout, level, sites)
