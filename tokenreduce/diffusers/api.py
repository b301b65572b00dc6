"""``apply_patch`` / ``remove_patch``: the ComfyUI nodes' methods on diffusers pipelines and models.

The inputs are the nodes' (``tokenreduce.methods``: the same names, defaults, ranges, rules and
messages), the target and info text are the core's (``target``, ``describe``), and the patches
are the core's where a host-free one exists (ToMe's plans and partitions, ToDo's pooling and
keep plans); this module only finds the models in what it is given and wires the patches in
with forward hooks and attention processors, all of which ``remove_patch`` takes out again.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from pathlib import Path

import torch

from ..catalog import TODO_NODE, TOME_NODE
from ..describe import header, todo_info, tome_dit_info, tome_info
from ..layout import DIT, UNET
from ..methods import (dit_method_problem, todo_level_factors, todo_select, tome_dit_only, tome_select,
                       tome_unet_only, tome_without_frames)
from ..pays import auto_rule, decisions_at
from ..preflight import todo_factors, tome_strides
from ..run import RunReport
from ..target import Target, resolve_target
from .hooks import Hooks, track_calls
from .families import supported
from .models import denoisers, is_pipeline, model_layout, unwrapped
from .session import Session
from .todo import DiTToDo, UNetToDo
from .tome import DiffusersToMe
from .tome_dit import MERGES, DiffusersToMeDiT, merges

LOG = logging.getLogger("tokenreduce")
NODES = {"tome": TOME_NODE, "todo": TODO_NODE}
ATTRIBUTE = "_tokenreduce_patch"  # on a patched model: its ModelPatch


def decisions_path() -> Path:
    """Where ``reduce_when auto`` keeps its decisions for diffusers: the user's cache directory."""
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "tokenreduce" / "auto_decisions.json"


class ModelPatch:
    """One method applied to one model: its hooks, swapped processors and runs."""

    def __init__(self, model: torch.nn.Module, label: str, session: Session, target: Target, info: str,
                 warnings: list[str], hooks: Hooks, patch):
        self.model, self.label, self.session, self.target = model, label, session, target
        self.info, self.warnings, self.hooks, self.patch = info, warnings, hooks, patch

    def remove(self) -> None:
        self.hooks.remove()
        if isinstance(self.patch, (DiTToDo, UNetToDo, DiffusersToMeDiT)):
            self.patch.uninstall()
        self.model.__dict__.pop(ATTRIBUTE, None)


class TokenReducePatch:
    """What ``apply_patch`` returns: what was patched (``info``, ``header``, ``warnings``, as the
    node says it), each run's report (``report()``, ``report_lines()``), and ``remove()``. Also a
    context manager that removes the patch on exit."""

    def __init__(self, method: str, settings, patches: list[ModelPatch]):
        self.method, self.settings, self.patches = method, settings, patches

    @property
    def info(self) -> str:
        return "\n".join(p.info for p in self.patches)

    @property
    def header(self) -> str:
        return "\n".join(p.session.header for p in self.patches)

    @property
    def warnings(self) -> list[str]:
        return [w for p in self.patches for w in p.warnings]

    def report(self) -> RunReport | None:
        """The last run's report (of the first patched model: a pipeline's UNet or transformer)."""
        return self.patches[0].session.report()

    def report_lines(self) -> list[str]:
        """The lines the ComfyUI node draws after a run: tokens per level, steps, time, warnings."""
        lines = []
        for p in self.patches:
            lines += p.session.lines()
            report = p.session.last_report
            lines += [] if report is None else list(report.warnings)
        return lines

    def remove(self) -> None:
        for p in self.patches:
            p.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def _method(method: str):
    node = NODES.get(str(method).lower())
    if node is None:
        raise ValueError(f"method {method!r} is not one of 'ToMe', 'ToDo'.")
    return node


def _settings(node, inputs: dict):
    unknown = sorted(set(inputs) - set(node.method.names))
    if unknown:
        raise TypeError(f"{node.node_id}: unknown input{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                        f"{node.method.name}'s inputs are {', '.join(node.method.names)}.")
    try:
        return node.method.settings({**node.method.defaults(), **inputs})
    except ValueError as problem:
        raise ValueError(f"{node.node_id}: {problem}") from None


def _refusal(method: str, name: str, layout, cls: str) -> str:
    """Why no setting of ``method`` can patch this model (of class ``cls``) here (the node's
    refusal, in terms of diffusers' classes and of the families this adapter knows)."""
    if layout is not None and layout.kind == DIT:
        if method == "ToMe":
            return (f"ToMe cannot patch this {name} model ({cls}): ToMe merges whole blocks of these diffusers DiT "
                    f"transformers: {', '.join(sorted(MERGES))}; not yet of {cls}. For this model use ToDo "
                    f"(apply_patch(model, \"ToDo\")), which supports {name}.")
        return (f"{method} cannot patch this {name} model: it has no UNet transformer blocks. {method} works on UNet "
                f"models (SD1.x, SD2.x, SDXL). For this model use ToDo (apply_patch(model, \"ToDo\")), which "
                f"supports {name}.")
    if layout is not None:  # a UNet with no self-attention either method reaches
        return (f"{method} cannot patch this {name} model: it has no self-attention {method} reaches. {method} works "
                f"on UNet2DConditionModel's transformer blocks (SD1.x, SD2.x, SDXL) and on the plain self-attentions "
                f"of UNet2DModel's AttnDownBlock2D, AttnUpBlock2D and UNetMidBlock2D (DDPM, consistency models); "
                f"this {cls} has none.")
    return (f"{method} cannot patch this {name} model. It works on diffusers' UNet2DConditionModel (SD1.x, SD2.x, "
            f"SDXL), UNet2DModel with attention blocks (DDPM, consistency models) and on these DiT transformers: "
            f"{', '.join(sorted(MERGES)) if method == 'ToMe' else supported()}; {name} is not one of them.")


def _refuse_foreign_tome(model: torch.nn.Module, label: str) -> None:
    if any(type(m).__name__ == "ToMeBlock" for m in model.modules()):
        raise ValueError(f"{label}: tomesd is applied to this model; it merges the tokens before this patch sees "
                         f"them. Remove it first (tomesd.remove_patch), or use one of the two.")


def _patch_model(given: torch.nn.Module, method: str, label: str, settings, rule, scheduler=None) -> ModelPatch:
    """Patch one model (``given``: it, or its torch.compile wrapper)."""
    model = unwrapped(given)
    name, layout = model_layout(model)
    kinds = (UNET, DIT) if method != "ToMe" or merges(layout and layout.family) else (UNET,)
    setting, choice = ("max_downsample", settings.max_downsample) if method == "ToMe" else ("level", settings.level)
    select = tome_select if method == "ToMe" else todo_select(settings)
    target = resolve_target(layout, name, method, setting, choice, select, kinds)
    if target.refused:
        raise ValueError(f"{label}: {_refusal(method, name, layout, type(model).__name__)}")
    if target.sites is None:
        raise ValueError(f"{label}: {target.message}")
    _refuse_foreign_tome(model, label)
    video = target.layout.kind == DIT and target.layout.family.video
    if method == "ToMe":  # stride_t acts on video DiTs only: said (or the ratio refused) elsewhere
        warnings = [] if video else tome_without_frames(label, settings, name)
        dit_only = target.layout.kind == DIT
        warnings += tome_unet_only(settings, name) if dit_only else tome_dit_only(settings, name)
        info = None if target.layout.kind == DIT else tome_info(settings, target)  # DiTs: once the patch knows its blocks
    else:
        info, warnings = todo_info(settings, target)
    hooks = Hooks()
    dit = target.layout.kind == DIT
    family = target.layout.family
    session = Session(label, settings, family.timestep_scale if dit else 999.0, header(method, target), scheduler,
                      rising_timestep=dit and family.rising_timestep)
    if method == "ToMe" and dit:
        patch = DiffusersToMeDiT(settings, family, target.sites, label, session, rule)
    elif method == "ToMe":
        patch = DiffusersToMe(settings, target, label, session, rule)
        session.preflight = tome_strides(label, target.levels, settings.stride_x, settings.stride_y)
    elif not dit:
        named = todo_level_factors(target.level, settings)
        patch = UNetToDo({lv: f for _, lv, f in named if lv in target.levels}, settings.method, target.sites, label,
                         session, rule)
        session.preflight = todo_factors(label, [nf for nf in named if nf[1] in target.levels])
    else:
        problem = dit_method_problem(label, family, settings.method)
        if problem:
            raise ValueError(problem)
        patch = DiTToDo(family, settings.factor, settings.temporal_factor, settings.method, target.sites, label,
                        session, rule)
    patch.install(hooks, model)
    if info is None:
        info = tome_dit_info(settings, target, patch)
    patch.wrapped = given is not model  # a torch.compile wrapper: the model runs compiled
    session.patch = patch
    # On a compiled model's wrapper the call hooks run outside the compiled region: it compiles whole.
    track_calls(hooks, model, session, patch.prepare, hooked=given)
    LOG.info("%s", info)
    for warning in warnings:
        LOG.warning("%s", warning)
    applied = ModelPatch(model, label, session, target, info, warnings, hooks, patch)
    model.__dict__[ATTRIBUTE] = applied
    return applied


def remove_patch(pipe_or_model) -> None:
    """Take every TokenReduce patch out of this pipeline's denoisers (or this model): hooks and
    attention processors as they were. Nothing applied: nothing to do."""
    for model in denoisers(pipe_or_model):
        applied = unwrapped(model).__dict__.get(ATTRIBUTE)
        if applied is not None:
            applied.remove()


def apply_patch(pipe_or_model, method: str = "ToMe", /, **inputs) -> TokenReducePatch:
    """Apply ToMe or ToDo, with the ComfyUI node's inputs (``tokenreduce.methods``; defaults for
    those not given), to a diffusers pipeline's UNet or transformer(s), or to such a model.
    ``method`` is positional only: ToDo has an input named ``method`` (its pooling).
    Applying again replaces the earlier patch (never stacks). Raises ValueError, with the node's
    message, for values it cannot use and for a model it cannot patch."""
    node = _method(method)
    settings = _settings(node, inputs)
    models = denoisers(pipe_or_model)
    rule = auto_rule(settings.reduce_when, decisions_at(decisions_path()), max_change=settings.max_change)
    remove_patch(pipe_or_model)
    scheduler = None
    if is_pipeline(pipe_or_model):  # its scheduler as it is at each call (a script may replace it)
        pipeline = weakref.ref(pipe_or_model)
        scheduler = lambda: getattr(pipeline(), "scheduler", None)  # noqa: E731
    applied = []
    try:
        for model in models:
            applied.append(_patch_model(model, node.method.name, node.node_id, settings, rule, scheduler))
    except Exception:
        for done in applied:
            done.remove()
        raise
    return TokenReducePatch(node.method.name, settings, applied)
