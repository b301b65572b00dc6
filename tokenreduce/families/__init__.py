"""The DiT families ToDo reduces, registered in one place, and how a model is recognised.

Each family group has a module of its own here (its call plan, token layout and geometry,
nothing else). A model is recognised by what it is: its host config class and that class's
bases, its diffusion-model class and that class's bases. A config or module class a family
lists by name is that family; one that only *derives* from a family's class (a new variant
that may add a token stream: Wan VACE, a Flux with another input) is refused with that reason,
never reduced by accident. Configs ToDo does not reduce are listed with their reason in
``refusals.py``.
"""

from __future__ import annotations

from typing import NamedTuple

from ..dit import Family
from . import (auraflow, cogvideo, cosmos, flux, hidream, hunyuan, ideogram4, joyimage, kandinsky, krea2, lens, ltx,
               ltx2, lumina, mage_flow, minimax, mochi, omnigen, pixeldit, qwen, sd3, wan, wan_s2v, zimage_pixel)
from .refusals import REFUSED
from .unets import UNETS

FAMILIES: tuple[Family, ...] = tuple(family for module in (
    flux, qwen, lumina, sd3, wan, wan_s2v, hunyuan, zimage_pixel, auraflow, ltx, hidream, cosmos, mage_flow, omnigen,
    ideogram4, joyimage, kandinsky, mochi, lens, pixeldit, cogvideo, krea2, minimax, ltx2) for family in module.FAMILIES)


class Recognition(NamedTuple):
    family: Family | None  # the family that reduces this model
    reason: str | None  # else, why ToDo does not reduce it (None with no family: not a DiT ToDo knows of)


def lineage(obj) -> tuple[str, ...]:
    """Class names of an object (or of a class, or just a name) from the most derived up."""
    if isinstance(obj, str):
        return (obj,)
    cls = obj if isinstance(obj, type) else type(obj)
    return tuple(c.__name__ for c in cls.__mro__ if c is not object)


def _by_config(name: str) -> Family | None:
    return next((family for family in FAMILIES if name in family.configs), None)


def _by_module(name: str) -> Family | None:
    return next((family for family in FAMILIES if name in family.model_classes), None)


def recognise(config, diffusion_model) -> Recognition:
    """The family of a diffusion model whose host config is ``config`` (the config object, its
    class, or only its name where the host gives no class), or why it is not reduced."""
    configs, modules = lineage(config), lineage(diffusion_model)
    family = _by_config(configs[0])
    if family is not None:
        if modules[0] not in family.model_classes:
            return Recognition(None, f"its {configs[0]} config is {family.name}'s, but the model is a {modules[0]}, "
                                     f"not the {' or '.join(family.model_classes)} ToDo knows: its attention calls "
                                     f"may differ from {family.name}'s")
        reason = family.check(diffusion_model)
        return Recognition(None, reason) if reason else Recognition(family, None)
    if configs[0] in REFUSED:
        return Recognition(None, REFUSED[configs[0]])
    for base in configs[1:]:
        family = _by_config(base)
        if family is not None:
            return Recognition(None, f"{configs[0]} is a variant of {family.name} ({base}) that ToDo does not know: "
                                     f"built on {modules[0]}, it may add token streams or blocks the {family.name} "
                                     f"plan does not place, so it is not reduced")
    for base in modules[1:]:
        family = _by_module(base)
        if family is not None:
            return Recognition(None, f"its model class {modules[0]} derives from {base} ({family.name}) but ToDo does "
                                     f"not know it: it may add token streams or blocks, so it is not reduced")
    return Recognition(None, None)


def dit_family(config, diffusion_model) -> Family | None:
    return recognise(config, diffusion_model).family


def supported_names() -> str:
    return ", ".join(family.name for family in FAMILIES)
