"""Per-run state of a patch applied to a diffusers model: which run a model call belongs to,
whether the patch is active at its timestep, and the run's report.

diffusers has no sampling-run boundary a patch can see (ComfyUI's sampler wrapper, the WebUI's
process hooks): a pipeline calls its UNet or transformer once or twice per step, timesteps
falling. A patched pipeline's run starts with the first model call after the patch was applied,
or after its scheduler was set up again (``set_timesteps``, at the start of every pipeline call:
a new ``scheduler.timesteps``), whatever the timesteps, so two one-step calls are two runs. A
model patched on its own (no pipeline to read) starts a run after a call whose timestep is above
the previous one's (a new pipeline call starts high again); CFG's two calls of one step have the
same timestep and belong to the same step.

Timesteps stand in for ComfyUI's sigmas: the window ``start_percent``..``end_percent`` of
sampling is the timesteps ``sigma(start) * scale``..``sigma(end) * scale``, where ``scale`` is
what the model's timestep is at the highest noise (999 for the SD UNets' discrete schedules,
1000 or 1 for the flow-matching transformers, as their pipelines pass it) and ``sigma(p)`` is
ComfyUI's ``percent_to_sigma``: ``1 - p`` for discrete schedules and unshifted flows, shifted
by the scheduler's ``shift`` (``flow_shift``) for flow schedules (``window.flow_sigma``). A
model whose timestep rises as sampling goes (Lumina 2's pipeline passes ``1 - sigma``) is read
turned round (``scale - timestep``: ``rising_timestep``).

Where every step is inside the window (``start_percent`` 0, ``end_percent`` 1) a patched
pipeline's calls read no timestep from the device: the run's timesteps are kept as tensors and
read once, for the report, when the run ends.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ..change import keep_change
from ..describe import run_lines
from ..run import RunReport, RunState, call_context
from ..window import LATE, SigmaWindow, flow_sigma, late_level, levels_to_late, schedule_reach

LOG = logging.getLogger("tokenreduce")


def _config(scheduler) -> Callable:
    """``get(name, default)`` of a scheduler's config (a FrozenDict, or an object; none: defaults)."""
    config = getattr(scheduler, "config", None)
    if config is None:
        return lambda name, default=None: default
    return config.get if hasattr(config, "get") else lambda name, default=None: getattr(config, name, default)


def flow_shift(scheduler) -> float | None:
    """The constant shift of a flow-matching scheduler's sigmas (``shift``, or ``flow_shift`` of
    the multistep schedulers with ``use_flow_sigmas``), 1.0 for none, None for a scheduler that is
    not a flow schedule or shifts by the image size (``use_dynamic_shifting``: no constant to
    read before the pipeline's call)."""
    config = getattr(scheduler, "config", None)
    if config is None:
        return None
    get = _config(scheduler)
    if get("use_dynamic_shifting", False):
        return None
    if get("use_flow_sigmas", False):
        return float(get("flow_shift", 1.0) or 1.0)
    if "shift" in config and "num_train_timesteps" in config and get("prediction_type", None) is None:
        return float(getattr(scheduler, "shift", None) or get("shift", 1.0))  # FlowMatch*: its set_shift counts
    return None


def is_flow(scheduler) -> bool:
    """Whether a scheduler samples a flow (its sigmas the noise share of ``(1 - s) x0 + s n``, the
    model's output a velocity): diffusers' FlowMatch* schedulers, and the multistep ones with
    ``use_flow_sigmas`` or ``prediction_type`` flow_prediction."""
    get = _config(scheduler)
    return type(scheduler).__name__.startswith("FlowMatch") or bool(get("use_flow_sigmas", False)) or \
        get("prediction_type", None) == "flow_prediction"


def _scheduler_units(scheduler, timestep_scale: float) -> float:
    """What one unit of the model's timestep is in ``scheduler``'s timesteps: a flow scheduler's
    ``num_train_timesteps`` per ``timestep_scale`` (1000 where the pipeline passes the sigma); the
    other schedulers hand the model their own timesteps."""
    if not is_flow(scheduler):
        return 1.0
    return float(_config(scheduler)("num_train_timesteps", 1000) or 1000) / timestep_scale


class Session:
    """One applied patch's runs: opens a call context per model call, folds it back after."""

    def __init__(self, label: str, settings, timestep_scale: float, header: str, scheduler=None,
                 rising_timestep: bool = False):
        self.label = label
        self.settings = settings
        self.header = header
        self.timestep_scale = timestep_scale
        # a model whose timestep rises as sampling goes (Lumina 2: 1 - sigma): read as
        # timestep_scale minus it, so the window, the runs and the reach see a falling noise level
        self.rising_timestep = rising_timestep
        self.scheduler = scheduler or (lambda: None)  # () -> the pipeline's scheduler now, or None (a bare model)
        start, end = settings.start_percent, settings.end_percent
        self.window = self._window(None)
        self.always_active = start <= 0 and end >= 1
        self.run: RunState | None = None
        self.context: dict | None = None  # the current model call's (patches read it)
        self.call = None  # the current model call's arguments (a reader)
        self.latent_hw: tuple[int, int] | None = None  # of the current model call
        self.patch = None  # the patch (its end_run is called when a run ends)
        self._marker = None  # the scheduler's timesteps tensor of the current run
        self._last: float | None = None  # the last timestep read (a bare model's runs)
        self._timesteps: list = []  # the timestep tensor of each call of the run, read when it ends
        self._started = 0.0
        self._ended = 0.0
        self.last_report: RunReport | None = None
        self.preflight = None  # latent shape -> warnings, raises for settings that cannot fit (the node's checks)
        self._checked = False  # the run's first call was checked
        self._slot = (None, 0)  # plan reuse: (the step of the last model call that asked, its calls so far)

    def _window(self, scheduler) -> SigmaWindow:
        """The window in timesteps, as ComfyUI's percent_to_sigma for this scheduler's schedule."""
        to_timestep = self._percent_to_timestep(scheduler)
        return SigmaWindow(to_timestep(self.settings.start_percent), to_timestep(self.settings.end_percent))

    def _percent_to_timestep(self, scheduler):
        """percent of sampling -> timestep, for this scheduler's schedule (flow-matching ones shifted)."""
        shift = flow_shift(scheduler) if scheduler is not None else None
        if shift is None:
            return lambda percent: (1 - percent) * self.timestep_scale
        return lambda percent: flow_sigma(percent, shift) * self.timestep_scale

    def _reach(self, timesteps, t: torch.Tensor, scheduler) -> float:
        """The share of sampling a run covers, from its first call's timestep ``t`` (one read per
        run): a pipeline's share of its scheduler's timesteps at or below it (an image-to-image
        pipeline at strength 0.3 starts at the last 30 %: its strength, whatever the schedule's
        spacing or shift, the image-size shift of Flux's scheduler included); a bare model's from
        the timestep itself (``schedule_reach``)."""
        first = float(t.max())
        if timesteps is not None and getattr(timesteps, "numel", lambda: 0)() > 1:
            # in the scheduler's units: a flow scheduler's timesteps are its sigmas times its
            # num_train_timesteps, where Flux's pipelines pass the model the sigma itself
            first *= _scheduler_units(scheduler, self.timestep_scale)
            return float((timesteps.float() <= first + 1e-3).float().mean())
        return schedule_reach(self._percent_to_timestep(scheduler), first)

    def late_sigma(self) -> float | None:
        """The noise level at ``window.LATE`` of this run's schedule, where the quality budget reads a
        DiT block's change (``todo_blocks.py``): a pipeline's flow scheduler's own sigmas from its
        begin index (an image-to-image run's own steps); for a model called on its own the
        unshifted flow schedule's, as its percents are mapped (``_percent_to_timestep``). None: a
        scheduler that is not a flow schedule, or too few steps. No device read (the schedulers
        keep their sigmas on the CPU)."""
        scheduler = self.scheduler()
        if scheduler is None:
            return flow_sigma(LATE)
        sigmas = self._flow_sigmas(scheduler)
        return None if sigmas is None else late_level(sigmas)

    def level_before_late(self, steps: int) -> float | None:
        """The noise level ``steps`` steps before ``late_sigma``'s (the run's first where it has
        fewer): where ToMe's correct_from_whole makes the plan its late step reuses at the most.
        None: not known (a model called without its pipeline, a scheduler that is not a flow
        schedule, too few steps)."""
        scheduler = self.scheduler()
        sigmas = self._flow_sigmas(scheduler) if scheduler is not None else None
        levels = levels_to_late(sigmas) if sigmas is not None else ()
        return levels[max(0, len(levels) - 1 - steps)] if levels else None

    @staticmethod
    def _flow_sigmas(scheduler) -> torch.Tensor | None:
        """A flow scheduler's sigmas from its begin index (an image-to-image run's own steps), on the
        CPU; None for another scheduler."""
        sigmas = getattr(scheduler, "sigmas", None)
        if not is_flow(scheduler) or not torch.is_tensor(sigmas):
            return None
        begin = getattr(scheduler, "begin_index", None) or 0
        return sigmas[begin:].detach().float().cpu()

    def open_call(self, timestep, call=None) -> dict:
        """The context of a model call at ``timestep`` (a tensor or a number) with the arguments
        ``call`` (a reader, ``hooks.argument_reader``): inactive, and no timestep read, where the
        patch steps aside from such calls (``CallPatch.steps_aside``: auto left all of them alone)."""
        t = torch.as_tensor(timestep)
        if self.rising_timestep:
            t = self.timestep_scale - t
        now = time.perf_counter()
        scheduler = self.scheduler()
        marker = getattr(scheduler, "timesteps", None) if scheduler is not None else None
        if marker is not None:  # a pipeline: a new run where its scheduler was set up again (no device read)
            new = self.run is None or marker is not self._marker
        else:  # a bare model: a new run where the timestep rises
            value = self.run.sigma(t) if self.run is not None else None
            new = self.run is None or (self._last is not None and value > self._last)
        if new:
            self._finish()
            self.window = self._window(scheduler)
            reach = self._reach(marker, t, scheduler)
            self.run = RunState(self.window, always_active=self.always_active,
                                measure_change=self.settings.measure_change, reach=reach)
            self._timesteps, self._started, self._checked, self._marker = [], now, False, marker
            self._slot = (None, 0)
        if marker is None:
            self._last = self.run.sigma(t)
        self._timesteps.append(t)
        aside = call is not None and self.patch is not None and self.patch.steps_aside(self.run, call)
        self.call = call
        self.context = self.run.open_call(t, aside=aside)
        self.context["timestep"] = t
        return self.context

    def plan_key(self, context: dict, x: torch.Tensor, text) -> tuple[tuple, int]:
        """Plan reuse across steps (ToMe's ``plan_every``): which calls of the run may share a plan,
        and this call's step. diffusers says no cond/uncond rows (ComfyUI's ``cond_or_uncond``):
        a pipeline that calls its model for cond and uncond apart (Wan's) calls them in the same
        order every step, so the key holds the call's place among its step's calls, beside the
        device and shape of its latent or tokens ``x`` (the batch included) and of its ``text``
        (None where it has none). The step is the scheduler's ``step_index`` under a pipeline (no
        device read), else the run's count of distinct timesteps (one read a call). Asked once per
        model call (kept in ``context``)."""
        found = context.get("plan key")
        if found is None:
            scheduler = self.scheduler()
            if scheduler is not None and hasattr(type(scheduler), "step_index"):
                index = scheduler.step_index  # None before its first step: its begin_index, or 0
                step = int(index if index is not None else (getattr(scheduler, "begin_index", None) or 0))
            else:
                step = self.run.step(context["timestep"])
            place = self._slot[1] + 1 if self._slot[0] == step else 0
            self._slot = (step, place)
            shapes = (x.device, tuple(x.shape), tuple(text.shape) if torch.is_tensor(text) else ())
            found = context["plan key"] = (("diffusers", place, *shapes), step)
        return found

    def _unreduced(self, rerun):
        """``rerun()`` with this session's patch passing through: an inactive call context, which the
        patch prepares for as for any call (its per-call state, a DiT's merge, is cleared)."""
        saved = self.context, self.call
        self.context = call_context(False)
        try:
            if self.patch is not None:
                self.patch.prepare(self.context, self.call)
            return rerun()
        finally:
            self.context, self.call = saved

    def check_latent(self, shape: tuple) -> None:
        """The node's preflight checks, once per run, on the latent of its first call."""
        if self.preflight is None or self._checked:
            return
        self._checked = True
        for warning in self.preflight(tuple(shape)):
            self.run.warn_once(warning)

    def close_call(self, output=None, rerun=None) -> None:
        """After a model call that returned ``output``; ``rerun()`` runs the same call again (the
        model's own forward, below its hooks): measure_change's unreduced call, at the run's first
        call that reduced (``change.py``)."""
        if rerun is not None and self.context is not None and self.run is not None and \
                self.run.claims_change(self.context):
            keep_change(self.run, self.label, output, lambda: self._unreduced(rerun),
                        self.context["timestep"].device, self.context["timestep"])
        if self.context is not None and self.run is not None:
            close = getattr(self.patch, "close_call", None)
            if close is not None:
                close(self.context)
            self.run.close_call(self.context, self.context["timestep"])
            self._ended = time.perf_counter()
        self.context = self.call = None

    def _finish(self) -> None:
        """Turn the run so far into its report (and log its warnings once)."""
        if self.run is None:
            return
        s = self.settings
        if self.patch is not None:
            self.patch.end_run(self.run)
        schedule = _schedule(self._timesteps)
        self.last_report = self.run.report(self.label, s.start_percent, s.end_percent,
                                           max(0.0, self._ended - self._started), True, schedule)
        for warning in self.last_report.warnings:
            LOG.warning("%s", warning)
        self.run, self._timesteps, self._last = None, [], None

    def report(self) -> RunReport | None:
        """The report of the last run (ends the current one: the next model call starts a new run)."""
        self._finish()
        return self.last_report

    def lines(self) -> list[str]:
        """The node's lines for the last run, as ComfyUI draws them on the node."""
        report = self.report()
        return [self.header] if report is None else run_lines(self.header, report)


def _schedule(timesteps: list) -> list[float] | None:
    """The distinct timesteps of a run's calls, in order, and one below the last (the report's
    schedule): read from the device once, when the run ends."""
    if not timesteps:
        return None
    maxima = [t.detach().reshape(-1).max().float() for t in timesteps]
    if len({m.device for m in maxima}) == 1:
        values = torch.stack(maxima).cpu().tolist()
    else:  # offloading moved the model (and its timesteps) between calls
        values = [float(m) for m in maxima]
    distinct = [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]
    return [*distinct, min(0.0, distinct[-1] - 1)]
