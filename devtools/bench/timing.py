"""The timing harness: every configuration's passes interleaved round by round after warm-up
passes, ``evals`` model evaluations per pass, peak memory per pass; then one untimed
profiling pass per configuration for merge planning time and the attention working set."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from .memory import AttentionWorkingSet, PeakMemory

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # --clock: cpu, the process's CPU seconds
_clock = [time.perf_counter]


def use_clock(name: str) -> None:
    """The clock every timed pass and the Amdahl breakdown read (``CLOCKS``)."""
    _clock[0] = CLOCKS[name]


def now() -> float:
    return _clock[0]()


@dataclass
class Measured:
    times: list = field(default_factory=list)  # seconds per model evaluation, one per timed pass
    out: object = None  # the model output of the last pass
    peak_mib: float | None = None  # the highest peak of its timed passes
    first_seconds: float | None = None  # its first warm-up pass (with --compile: includes compiling)
    plan_seconds: float | None = None  # ToMe: merge planning per evaluation, from the profiling pass
    attention_mib: float | None = None  # the attention working set, from the profiling pass
    compiles_in_timed_passes: int | None = None  # compiled models: graphs compiled after warm-up (0 expected)


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def measure(step, models: dict, *, repeats: int, warmup: dict[str, int], progress: Callable,
            compiled: frozenset = frozenset()) -> dict[str, Measured]:
    """Time every model's passes interleaved: its warm-up passes (``warmup[name]``) first, then
    round by round one pass of each (the order rotated every round). A machine whose speed
    drifts during a run (turbo, neighbours on a shared host) then shifts every configuration
    alike, not the ones measured last. For the models named in ``compiled``, counts the graphs
    dynamo compiles during the timed passes. ``progress(name)`` is called after each pass."""
    names = list(models)
    measured = {name: Measured() for name in names}
    for name in names:
        for i in range(warmup[name]):
            start = now()
            step(models[name])
            if i == 0:
                measured[name].first_seconds = now() - start
            progress(name)
    for name in compiled:
        measured[name].compiles_in_timed_passes = 0
    memory = PeakMemory()
    for round_ in range(repeats):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            entry = measured[name]
            graphs = _compiled_graphs() if name in compiled else 0
            memory.reset()
            start = now()
            out = step(models[name])
            entry.times.append((now() - start) / step.evals)
            entry.out = out
            peak = memory.peak_mib()
            if peak is not None:
                entry.peak_mib = max(entry.peak_mib or 0.0, peak)
            if name in compiled:
                entry.compiles_in_timed_passes += _compiled_graphs() - graphs
            progress(name)
    return measured


def profile(step, model, measured: Measured, sessions_of: Callable, attention: str | None) -> None:
    """One more, untimed pass of an eager model: the time its ToMe sessions spend planning
    merges (device-synchronised) and the largest attention working set of the pass (hooks
    that would otherwise weigh on the timed passes)."""
    sessions = [s for s in sessions_of(model) if s.label == "TokenReduceToMe"]
    working_set = AttentionWorkingSet(attention)
    for session in sessions:
        session.profile = True
    try:
        step(working_set.attached(model))
    finally:
        for session in sessions:
            session.profile = False
    if sessions:
        measured.plan_seconds = sum(s.last_report.plan_seconds for s in sessions) / step.evals
    measured.attention_mib = working_set.peak_mib
