"""Per-run state of one patch, and its lifecycle inside ComfyUI's sampler.

A patch node creates one ``PatchSession`` for the MODEL it returns. The session is shared by
every clone of that MODEL (the host deep-copies ``model_options`` on clone, so the session
and the patch objects opt out of copying) and holds nothing between runs: an OUTER_SAMPLE
wrapper opens a fresh ``RunState`` when sampling starts and drops it in ``finally``, so an
interrupted run leaves nothing behind and the next run starts clean.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from comfy.patcher_extension import WrappersMP

from ..tokenreduce import SigmaWindow, steps_of

LOG = logging.getLogger("tokenreduce")
WRAPPER_KEY = "tokenreduce"


@dataclass(frozen=True)
class LevelTokens:
    """What a patch did to the tokens of one grid (first block call that reduced there)."""

    downsample: int
    grid: tuple[int, int]
    tokens: dict  # stage ("q", "k/v", "cross q", "mlp") -> (tokens before, tokens after)


@dataclass(frozen=True)
class RunReport:
    """Numbers (no tensors) kept from the last run, for the node's report and benchmarks."""

    sampling_seconds: float
    plan_seconds: float  # time spent planning merges; measured only when the session profiles
    skipped_calls: int  # block calls left alone because their tokens were not the block's grid
    completed: bool = True  # False: the run was interrupted or failed
    steps: int = 0  # steps of the run's schedule
    active_steps: tuple[int, ...] = ()  # 1-based steps in which the patch reduced tokens
    levels: tuple[LevelTokens, ...] = ()
    warnings: tuple[str, ...] = ()
    refused: bool = False  # the settings do not fit this latent: the run stopped before its first step


@dataclass
class RunState:
    """Everything one sampling run accumulates; discarded when the run ends."""

    window: SigmaWindow
    profile: bool = False
    plan_seconds: float = 0.0
    skipped_calls: int = 0
    # The plan made at the start of the current call of each transformer block, by site key;
    # None where the block is not reduced in this call. Overwritten on every block call.
    plans: dict = field(default_factory=dict)
    # What the patch did, for the report: tokens per grid, and the noise levels it acted at.
    levels: dict = field(default_factory=dict)
    active_sigmas: set = field(default_factory=set)
    warnings: list = field(default_factory=list)
    # Plans shared by the blocks of one grid within one UNet call (ToMe's plan sharing),
    # by grid; emptied when the next UNet call starts.
    call_plans: dict = field(default_factory=dict)
    _sigmas: torch.Tensor | None = None
    _sigma: float = 0.0
    _generators: dict = field(default_factory=dict)

    def sigma(self, extra_options: dict) -> float:
        """The noise level of the current UNet call. Every block of a call gets the same
        tensor, so it is read from the device once per call, not once per block."""
        sigmas = extra_options["sigmas"]
        if sigmas is not self._sigmas:
            self._sigmas, self._sigma = sigmas, float(sigmas.max())
        return self._sigma

    def in_window(self, extra_options: dict) -> bool:
        return self.window.contains(self.sigma(extra_options))

    def record(self, grid: tuple[int, int], downsample: int, tokens) -> None:
        """Note that the current UNet call was reduced in a block of this grid; ``tokens()``
        gives the stage -> (before, after) counts, asked once per grid and run."""
        if grid not in self.levels:
            self.levels[grid] = LevelTokens(downsample, grid, tokens())
        self.active_sigmas.add(self._sigma)

    def timed(self, device: torch.device, work):
        """Run work(); with profiling on, add its duration (device-synchronised) to plan_seconds."""
        if not self.profile:
            return work()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        result = work()
        sync()
        self.plan_seconds += time.perf_counter() - start
        return result

    def generator(self, device: torch.device, seed: int) -> torch.Generator:
        """A private generator seeded with ``seed``; never the global torch RNG."""
        # On CUDA draw on the device (no host round trip); elsewhere on the CPU.
        where = device if device.type == "cuda" else torch.device("cpu")
        generator = self._generators.get(where)
        if generator is None:
            generator = self._generators[where] = torch.Generator(device=where)
        return generator.manual_seed(seed)


class PatchSession:
    """Shared by the patch functions of one node output and its OUTER_SAMPLE wrapper."""

    def __init__(self, label: str, start_percent: float, end_percent: float, preflight=None):
        self.label = label
        # Checks the settings against the latent size before the first step: raises with a
        # message for the user, or returns warnings for the run's report; None: nothing
        # depends on the size.
        self.preflight = preflight
        self.start_percent = start_percent
        self.end_percent = end_percent
        self.run: RunState | None = None
        # Reports: the graph node to tell (None outside a prompt), what the node patched, and
        # a callable given (session, report) when a run ends (sends it to the browser).
        self.node_id: str | None = None
        self.header = label
        self.on_report = None
        self.profile = False  # set by benchmarks: time merge planning (synchronises the device)
        self.last_report: RunReport | None = None
        self._warned_outside_sampler = False

    def __deepcopy__(self, memo):
        # ModelPatcher.clone() deep-copies model_options; the clone must share this session.
        return self

    def window_for(self, model_sampling) -> SigmaWindow:
        return SigmaWindow(model_sampling.percent_to_sigma(self.start_percent),
                           model_sampling.percent_to_sigma(self.end_percent))

    def outer_sample_wrapper(self, executor, *args, **kwargs):
        # CFGGuider.outer_sample(noise, latent_image, sampler, sigmas, ...)
        noise = args[0] if args else kwargs.get("noise")
        schedule = args[3] if len(args) > 3 else kwargs.get("sigmas")
        warnings = []
        if self.preflight is not None and getattr(noise, "ndim", 0) == 4:
            try:
                warnings = self.preflight(tuple(noise.shape[-2:]))  # before any step: nothing half-applied
            except ValueError as refused:
                self._finish(RunReport(0.0, 0.0, 0, completed=False, warnings=(str(refused),), refused=True))
                raise
        guider = executor.class_obj
        window = self.window_for(guider.model_patcher.get_model_object("model_sampling"))
        previous, self.run = self.run, RunState(window, profile=self.profile, warnings=list(warnings))
        start = time.perf_counter()
        completed = False
        try:
            result = executor(*args, **kwargs)
            completed = True
            return result
        finally:
            run = self.run
            self.run = previous
            self._finish(self._report(run, time.perf_counter() - start, completed, schedule))

    def _finish(self, report: RunReport) -> None:
        self.last_report = report
        for warning in report.warnings:
            LOG.warning("%s", warning)
        if self.on_report is not None:
            self.on_report(self, report)

    def _report(self, run: RunState, seconds: float, completed: bool, schedule) -> RunReport:
        sigmas = [float(s) for s in schedule] if schedule is not None else []
        steps = max(0, len(sigmas) - 1)
        active = steps_of(sigmas, run.active_sigmas)
        warnings = list(run.warnings)
        if completed and steps and not active:
            warnings.append(f"{self.label} was active in none of the {steps} steps: no step's noise level lies "
                            f"between start_percent {self.start_percent:g} and end_percent {self.end_percent:g}, "
                            f"or no block could be reduced.")
        if run.skipped_calls:
            # Never a silent no-op: another attention patch that runs before ours reshaped the
            # tokens (HyperTile tiles the queries, for example).
            warnings.append(f"{self.label} was skipped in {run.skipped_calls} block calls of this run: the tokens "
                            f"it received were not the block's grid: an attention patch applied before it reshaped "
                            f"them (HyperTile tiles the queries; ToMe in its q, k, v mode merges keys and values). "
                            f"Apply {self.label} before that patch (closer to the checkpoint loader).")
        levels = tuple(sorted(run.levels.values(), key=lambda lv: (lv.downsample, -lv.grid[0] * lv.grid[1])))
        return RunReport(seconds, run.plan_seconds, run.skipped_calls, completed, steps, active, levels,
                         tuple(warnings))

    def apply_model_wrapper(self, executor, *args, **kwargs):
        # A UNet call starts: state shared across its blocks must not leak into the next call
        # (the other CFG half, another area, the next step).
        if self.run is not None:
            self.run.call_plans.clear()
        return executor(*args, **kwargs)

    def attach(self, patcher, per_call_state: bool = False) -> None:
        """Register the wrappers; ``per_call_state``: the patch keeps state across the blocks of
        one UNet call (shared plans), which is then emptied at the start of every call."""
        patcher.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, self.outer_sample_wrapper)
        if per_call_state:
            patcher.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY, self.apply_model_wrapper)

    def current(self) -> RunState | None:
        """The run in progress, or None when the model is called outside a ComfyUI sampler
        (then the patch passes everything through, and says so once)."""
        if self.run is None and not self._warned_outside_sampler:
            self._warned_outside_sampler = True
            LOG.warning("%s: the model was called outside a ComfyUI sampler; this patch does "
                        "nothing there (it is active only inside sampling runs).", self.label)
        return self.run


class SessionPatch:
    """Base of a node's patch object: its settings and session, shared by every clone of the
    patched model (the host deep-copies model_options, and with them bound methods' owners)."""

    def __init__(self, settings, session: PatchSession):
        self.settings = settings
        self.session = session

    def __deepcopy__(self, memo):
        return self


def sessions_of(patcher) -> list[PatchSession]:
    """The TokenReduce sessions attached to a patched model (for benchmarks and reports)."""
    wrappers = patcher.wrappers.get(WrappersMP.OUTER_SAMPLE, {}).get(WRAPPER_KEY, [])
    return [w.__self__ for w in wrappers if isinstance(getattr(w, "__self__", None), PatchSession)]
