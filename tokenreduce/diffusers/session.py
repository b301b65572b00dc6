"""Per-run state of a patch applied to a diffusers model: which run a model call belongs to,
whether the patch is active at its timestep, and the run's report.

diffusers has no sampling-run boundary a patch can see (ComfyUI's sampler wrapper, the WebUI's
process hooks): a pipeline calls its UNet or transformer once or twice per step, timesteps
falling. So a run starts with the first model call after the patch was applied, or after a
model call whose timestep is not below the previous one's (a new pipeline call starts high
again); CFG's two calls of one step have the same timestep and belong to the same step.

Timesteps stand in for ComfyUI's sigmas: the window ``start_percent``..``end_percent`` of
sampling is the timesteps ``(1 - start) * scale``..``(1 - end) * scale``, where ``scale`` is
what the model's timestep is at the highest noise (999 for the SD UNets' discrete schedules,
1000 or 1 for the flow-matching transformers, as their pipelines pass it), the same mapping as
ComfyUI's ``percent_to_sigma`` for those schedules.
"""

from __future__ import annotations

import logging
import time

import torch

from ..describe import run_lines
from ..run import RunReport, RunState
from ..window import SigmaWindow

LOG = logging.getLogger("tokenreduce")


class Session:
    """One applied patch's runs: opens a call context per model call, folds it back after."""

    def __init__(self, label: str, settings, timestep_scale: float, header: str):
        self.label = label
        self.settings = settings
        self.header = header
        start, end = settings.start_percent, settings.end_percent
        self.window = SigmaWindow((1 - start) * timestep_scale, (1 - end) * timestep_scale)
        self.always_active = start <= 0 and end >= 1
        self.run: RunState | None = None
        self.context: dict | None = None  # the current model call's (patches read it)
        self.latent_hw: tuple[int, int] | None = None  # of the current model call
        self._timesteps: list[float] = []  # distinct timesteps of the run, in order
        self._started = 0.0
        self._ended = 0.0
        self.last_report: RunReport | None = None
        self.preflight = None  # latent shape -> warnings, raises for settings that cannot fit (the node's checks)
        self._checked = False  # the run's first call was checked

    def open_call(self, timestep) -> dict:
        """The context of a model call at ``timestep`` (a tensor or a number)."""
        t = torch.as_tensor(timestep)
        now = time.perf_counter()
        value = None if self.run is None else self.run.sigma(t)
        if self.run is None or (self._timesteps and value > self._timesteps[-1]):  # rising again: a new run
            self._finish()
            self.run = RunState(self.window, always_active=self.always_active)
            self._timesteps, self._started, self._checked = [], now, False
            value = self.run.sigma(t)
        if not self._timesteps or value != self._timesteps[-1]:
            self._timesteps.append(value)
        self.context = self.run.open_call(t)
        self.context["timestep"] = t
        return self.context

    def check_latent(self, shape: tuple) -> None:
        """The node's preflight checks, once per run, on the latent of its first call."""
        if self.preflight is None or self._checked:
            return
        self._checked = True
        for warning in self.preflight(tuple(shape)):
            self.run.warn_once(warning)

    def close_call(self) -> None:
        if self.context is not None and self.run is not None:
            self.run.close_call(self.context, self.context["timestep"])
            self._ended = time.perf_counter()
        self.context = None

    def _finish(self) -> None:
        """Turn the run so far into its report (and log its warnings once)."""
        if self.run is None:
            return
        s = self.settings
        schedule = [*self._timesteps, min(0.0, self._timesteps[-1] - 1)] if self._timesteps else None
        self.last_report = self.run.report(self.label, s.start_percent, s.end_percent,
                                           max(0.0, self._ended - self._started), True, schedule)
        for warning in self.last_report.warnings:
            LOG.warning("%s", warning)
        self.run = None

    def report(self) -> RunReport | None:
        """The report of the last run (ends the current one: the next model call starts a new run)."""
        self._finish()
        return self.last_report

    def lines(self) -> list[str]:
        """The node's lines for the last run, as ComfyUI draws them on the node."""
        report = self.report()
        return [self.header] if report is None else run_lines(self.header, report)
