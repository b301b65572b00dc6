"""What one sampling run with a patched model accumulates, and what it reports.

A host opens a ``RunState`` when sampling starts and drops it when the run ends (also when it
is interrupted). For every model call it asks the run for a *call context*: a plain dict that
travels with the call in the host's options, so the attention patches find there everything
that is decided per run or per call (whether the call is inside the step window, merge
partitions drawn beforehand) and note there what they did. The patches read no tensor values
and keep no Python state of their own: a compiled model sees the same code and the same kinds
of values at every step, and nothing of a run outlives it.

Model calls of one run may come from several threads at once (ComfyUI's multi-GPU split runs
each device's work unit in a worker thread): the run keeps no per-call value in shared
attributes, and folds what the calls noted under a lock.

Call context keys (every patch may add its own):
- ``active``: reduce in this call (the step is inside the window);
- ``notes``: written by the patches during the call: ``notes[grid] = (level, stages)`` the
  first time a grid is reduced (``notes[(grid, part)] = (level, stages, grid)`` for a part of its
  blocks reduced otherwise, whose stages join the grid's), ``notes["skipped"]`` the number of
  block calls left alone because their tokens were not the block's grid; read back by
  ``close_call``;
- ``calls``: set to 0 by a patch the model's attention must call (the DiT override, which counts
  its calls there): still 0 at the end, the model ran without reaching it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from .describe import RunCalls, run_warnings
from .fingerprint import module_fingerprint
from .pays import CPU, MEASURED, AutoRule, Decision, Work, synchronizer
from .window import SigmaWindow, steps_of

LOG = logging.getLogger("tokenreduce")
SKIPPED = "skipped"
CONTEXT_PREFIX = "tokenreduce."  # every call context's key in the host's options starts so
MEASURING = "tokenreduce:measuring"  # in the options of a call the auto rule times: patches without a context pass
# The host's attention override slot in the per-call options (ComfyUI's name; Forge has none).
OVERRIDE = "optimized_attention_override"
LEFT_ALONE = "left alone"  # run.cache: (LEFT_ALONE, a patch's call key) -> (sites left alone, all of them)
# In the options a block merged by ToMe on a DiT hands on (a copy of the model call's): that block's
# merge (``tome_dit.BlockPlan``), so an attention patch inside it (ToDo) knows the merged grid.
MERGED_GRID = "tokenreduce:merged grid"
KEPT_PLANS = "kept plans"  # run.cache: (KEPT_PLANS, plan_key(call)) -> (step, the plans of the call that planned)


def call_context(active: bool, timer=None, **extra) -> dict:
    """A call context (see above): for a model call of a run, or one the auto rule times."""
    return {"active": active, "notes": {}, "timer": timer, **extra}


def call_reduced(context: dict) -> bool:
    """Whether a patch noted a reduction in this call (after the call: what ``close_call`` folds)."""
    return any(key != SKIPPED for key in context["notes"])


class ModelCall(NamedTuple):
    """What the host knows of a model call before it runs it."""

    x: torch.Tensor  # the latent the model is called on ([B, C, H, W], or [B, C, T, H, W] for video)
    context: torch.Tensor | None  # the text tokens (cross-attention / joint context)
    kwargs: dict  # the model's other inputs (reference latents, pooled text, ...)
    options: dict  # the host's per-call options (ComfyUI: transformer_options)
    sigmas: torch.Tensor  # the noise level, as a tensor (not read unless needed)
    dtype: torch.dtype | None = None  # the dtype the model computes in (None: the latent's)
    attention: Callable | None = None  # the host's attention entry (the auto rule times DiT calls through it)
    model: torch.nn.Module | None = None  # the diffusion model this call runs (another device's copy under multi-GPU)
    compiled: bool = False  # the host runs the model compiled (torch.compile): its own kinds of call
    # (options, x=None, level=None) -> runs this model call once more, uncompiled and outside the host's
    # wrappers, with the options given (the auto rule captures a DiT block's inputs there to time it) and,
    # where a level is given, on the latent x at that noise level in every row (the budget's late input);
    # returns the model's prediction of the clean latent. None: the host has none
    rehearse: Callable | None = None
    # (path, module) -> the fingerprint of the weights ``module`` (at ``path`` under the diffusion
    # model) computes with, as the host applies them (LoRA and other weight patches included; see
    # ``fingerprint.py``): the quality budget keeps a change per model. None: the live module's own.
    fingerprint: Callable[[str, torch.nn.Module], str] | None = None


def weights_of(call: ModelCall, path: str, module: torch.nn.Module) -> str:
    """The fingerprint of the weights the unit ``module`` (at ``path`` under the call's diffusion
    model) runs with in ``call``: the host's reading where it gives one, else the module's own
    parameters. Read where the auto rule decides a kind (once per run), never in a block call."""
    if call.fingerprint is not None:
        return call.fingerprint(path, module)
    return module_fingerprint(module)


def plan_key(call: ModelCall) -> tuple:
    """Which model calls of a run may share a merge plan across steps (ToMe's plan_every): the same
    latent (batch included) on the same model copy and device, the same text shape, and the same
    rows: cond and uncond (``cond_or_uncond``, batched or apart), the conditionings' ids and the
    context window where the host says them (ComfyUI, Forge)."""
    options = call.options
    window = options.get("context_window")
    return (call.x.device, tuple(call.x.shape), tuple(call.context.shape) if call.context is not None else (),
            tuple(options.get("cond_or_uncond") or ()), tuple(options.get("uuids") or ()),
            tuple(getattr(window, "index_list", ())) if window is not None else None, call.model)


@dataclass(frozen=True)
class LevelTokens:
    """What a patch did to the tokens of one grid (first block call that reduced there)."""

    downsample: int
    grid: tuple[int, int]
    tokens: dict  # stage ("q", "k/v", "cross q", "mlp") -> (tokens before, tokens after)


class SiteDecision(NamedTuple):
    """What the auto rule decided for one level or kind of DiT call in a run."""

    site: str  # "downsample 1 (96×96)", "21 frames × 52×30 grid, image attention (32760 keys)"
    decision: Decision


class PredictionChange(NamedTuple):
    """``measure_change``: how much the reduction changed one model call's output (``change.py``)."""

    change: float  # ||reduced - unreduced|| / ||unreduced||
    step: int | None  # the 1-based step of that call (None: the schedule did not say)


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
    decisions: tuple[SiteDecision, ...] = ()  # reduce_when auto, in the order first met
    measure_seconds: float = 0.0  # what measuring for the auto rule cost in this run
    notes: tuple[str, ...] = ()  # what the patch did about its surroundings (not warnings: it works)
    windows: tuple[tuple[int, ...], ...] = ()  # ComfyUI context windows seen, as their frame indices, in order
    decisions_file: str = ""  # where the auto rule keeps its decisions ("": this process only)
    prediction_change: PredictionChange | None = None  # measure_change's readout (None: not asked or not made)


@dataclass
class RunState:
    """Everything one sampling run accumulates; discarded when the run ends."""

    window: SigmaWindow
    always_active: bool = False  # the window spans the whole run: no noise level needs reading
    profile: bool = False
    warnings: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    plan_seconds: float = 0.0
    skipped_calls: int = 0
    dit_calls: bool = False  # the calls went through a DiT's attention override (for the report's wording)
    unreached_calls: int = 0  # model calls in which the attention never reached the patch's override
    levels: dict = field(default_factory=dict)  # grid -> LevelTokens
    # The noise-level tensor of every call that reduced tokens; read once, at the end.
    reduced_sigmas: list = field(default_factory=list)
    cache: dict = field(default_factory=dict)  # per-run values patches compute once (partitions, ...)
    decisions: dict = field(default_factory=dict)  # (site, device) -> Decision of the auto rule, first met first
    decisions_file: str = ""  # where the auto rule keeps its decisions ("": in memory only)
    windows: dict = field(default_factory=dict)  # context windows seen: frames of the window -> model calls
    measure_change: bool = False  # measure the prediction change at the first reduced call (change.py)
    # The share of sampling the run covers (window.schedule_reach: about denoise), where the host can
    # tell; the quality budget weighs a measured change by it (pays.weighed_change). 1: from pure noise.
    reach: float = 1.0
    # The noise level at window.LATE of the run's schedule, where the budget reads DiT blocks'
    # changes (late_blocks.py); None: the host cannot tell, or the run has too few steps.
    late_sigma: float | None = None
    # The noise levels of the run's steps up to that one (window.levels_to_late): where an input some
    # steps earlier is read (ToMe's correct_from_whole: its plan's step). (): not known.
    late_levels: tuple = ()
    # (relative change, the call's sigmas) as tensors, read when the report is made; None: not yet
    _change: tuple | None = None
    _change_claimed: bool = False  # a call took the readout (once per run, whichever thread)
    _last_sigma: tuple | None = None  # (sigmas tensor, its value): one device read per call
    _steps: dict = field(default_factory=dict)  # noise level -> step (0-based, in the order first met)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def sigma(self, sigmas: torch.Tensor) -> float:
        """The noise level of a model call, read from the device once per call."""
        last = self._last_sigma  # one tuple, replaced whole: safe when calls come from several threads
        if last is not None and last[0] is sigmas:
            return last[1]
        value = float(sigmas.max())
        self._last_sigma = (sigmas, value)
        return value

    def step(self, sigmas: torch.Tensor) -> int:
        """The step of a model call: its noise level's place among the distinct levels of the run,
        in the order first met (cond and uncond, context windows and devices share a step)."""
        value = self.sigma(sigmas)
        with self._lock:
            return self._steps.setdefault(value, len(self._steps))

    def kept_plans(self, key, step: int, every: int) -> dict | None:
        """Plan reuse across steps (ToMe's plan_every): the plans ``keep_plans`` kept for calls like
        this one (``key``) at a step fewer than ``every`` steps before ``step`` (a dict, by what
        each plan is for), or None: plan anew."""
        kept = self.cache.get((KEPT_PLANS, key))
        return kept[1] if kept is not None and 0 <= step - kept[0] < every else None

    def keep_plans(self, key, step: int, plans: dict) -> None:
        """Keep ``plans`` (a dict the patches fill with their plans during the call that plans) for
        the calls like it of the next steps; nothing of it outlives the run."""
        self.cache[(KEPT_PLANS, key)] = (step, plans)

    def open_call(self, sigmas: torch.Tensor, options: dict | None = None, aside: bool = False) -> dict:
        """The context of one model call at noise level ``sigmas`` with the host's ``options``.
        ``aside``: the patch already knows it leaves this call whole alone (``CallPatch.steps_aside``):
        the context is inactive and the noise level is not read (no device sync)."""
        window = (options or {}).get("context_window")  # ComfyUI's context windows: one model call per window
        if window is not None:
            frames = tuple(getattr(window, "index_list", ()))
            with self._lock:
                self.windows[frames] = self.windows.get(frames, 0) + 1
        active = not aside and (self.always_active or self.window.contains(self.sigma(sigmas)))
        return call_context(active, self if self.profile else None)

    def close_call(self, context: dict, sigmas: torch.Tensor) -> None:
        """Fold what the patches noted during the call into the run."""
        with self._lock:
            self._fold(context, sigmas)

    def _fold(self, context: dict, sigmas: torch.Tensor) -> None:
        notes = context["notes"]
        self.skipped_calls += notes.get(SKIPPED, 0)
        self.dit_calls = self.dit_calls or "calls" in context
        if context.get("calls") == 0:
            self.unreached_calls += 1
        reduced = False
        for grid, noted in notes.items():
            if grid == SKIPPED:
                continue
            reduced = True
            grid = noted[2] if len(noted) > 2 else grid
            if grid not in self.levels:
                self.levels[grid] = LevelTokens(noted[0], grid, noted[1])
            elif any(stage not in self.levels[grid].tokens for stage in noted[1]):  # another part's stages
                level = self.levels[grid]
                self.levels[grid] = LevelTokens(level.downsample, grid, {**level.tokens, **{
                    stage: counts for stage, counts in noted[1].items() if stage not in level.tokens}})
        if reduced:
            self.reduced_sigmas.append(sigmas)

    def claims_change(self, context: dict) -> bool:
        """Whether the call of ``context``, just returned, is the one whose prediction change this run
        measures: asked for, the first call that reduced (once per run, whatever threads call)."""
        if not self.measure_change or self._change_claimed or not context["active"] or not call_reduced(context):
            return False
        with self._lock:
            claimed, self._change_claimed = self._change_claimed, True
        return not claimed

    def keep_change(self, change: torch.Tensor, sigmas: torch.Tensor) -> None:
        """The measured relative change and the noise level it was measured at, kept as tensors."""
        self._change = (change, sigmas)

    def warn_once(self, message: str) -> None:
        """A warning for the run's report, said once however many calls (and threads) meet it."""
        with self._lock:
            if message not in self.warnings:
                self.warnings.append(message)

    def note_once(self, message: str) -> None:
        """A note for the run's report (something the patch handled), said once."""
        with self._lock:
            if message not in self.notes:
                self.notes.append(message)

    def decided(self, site: str, device: torch.device, decision: Decision, where: str) -> None:
        """What the auto rule decided for ``site`` on ``device`` (kept in the file ``where``, or "")."""
        with self._lock:
            self.decisions.setdefault((site, str(device)), decision)
            self.decisions_file = where

    def timed(self, device: torch.device, work):
        """Run work() and add its duration (device-synchronised) to plan_seconds: benchmarks only."""
        sync = synchronizer(device)  # any accelerator (ROCm, XPU, MPS), as the auto rule times
        sync()
        start = time.perf_counter()
        result = work()
        sync()
        self.plan_seconds += time.perf_counter() - start
        return result

    def generator(self, device: torch.device, seed: int) -> torch.Generator:
        """A private generator seeded with ``seed``; never the global torch RNG. A new one per
        draw: calls on other threads (several devices, or two work units on one) share none."""
        # On CUDA draw on the device (no host round trip); elsewhere on the CPU.
        return torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(seed)

    def report(self, label: str, start_percent: float, end_percent: float, seconds: float, completed: bool,
               schedule) -> RunReport:
        sigmas = [float(s) for s in schedule] if schedule is not None else []
        steps = max(0, len(sigmas) - 1)
        active = steps_of(sigmas, set(_noise_levels(self.reduced_sigmas)))
        decided = _site_decisions(self.decisions)
        calls = RunCalls(self.unreached_calls, bool(self.reduced_sigmas), self.skipped_calls, self.dit_calls)
        warnings = list(self.warnings) + run_warnings(label, calls, decided, steps, active, start_percent,
                                                      end_percent, completed)
        levels = tuple(sorted(self.levels.values(), key=lambda lv: (lv.downsample, -lv.grid[0] * lv.grid[1])))
        return RunReport(seconds, self.plan_seconds, self.skipped_calls, completed, steps, active, levels,
                         tuple(warnings), decisions=decided,
                         measure_seconds=sum(d.seconds for d in self.decisions.values() if d.source == MEASURED),
                         notes=tuple(self.notes), windows=tuple(sorted(self.windows)), decisions_file=self.decisions_file,
                         prediction_change=self._prediction_change(sigmas))

    def _prediction_change(self, schedule: list[float]) -> PredictionChange | None:
        """measure_change's readout, read from the device now (once per run), with its step."""
        if self._change is None:
            return None
        change, sigmas = self._change
        step = steps_of(schedule, _noise_levels([sigmas])) if schedule else ()
        return PredictionChange(float(change), step[0] if step else None)


def _noise_levels(sigmas: list) -> list[float]:
    """The noise level of each call that reduced: one transfer per device for the whole run, not
    one per call (under ComfyUI's multi-GPU split the calls' sigmas live on several devices)."""
    maxima: dict = {}
    for s in sigmas:
        maxima.setdefault(s.device, []).append(s.max())
    return [value for group in maxima.values() for value in torch.stack(group).float().cpu().tolist()]


def _site_decisions(decisions: dict) -> tuple[SiteDecision, ...]:
    """(site, device) -> Decision, as the report lists them: one line per site where every device
    decided alike, one per device where they differ (two GPU models in one multi-GPU run)."""
    sites: dict = {}
    for (site, device), decision in decisions.items():
        sites.setdefault(site, []).append((device, decision))
    listed = []
    for site, per_device in sites.items():
        if len({decision.reduce for _, decision in per_device}) == 1:
            listed.append(SiteDecision(site, per_device[0][1]))
        else:
            listed += [SiteDecision(f"{site} on {device}", decision) for device, decision in per_device]
    return tuple(listed)


def note_reduced(context: dict, grid: tuple[int, int], level: int, stages, part: str | None = None) -> None:
    """Called by a patch that reduced a block of this grid; ``stages()`` gives the stage ->
    (before, after) counts, asked once per grid (and ``part``: blocks reduced otherwise, e.g.
    ToDo in blocks ToMe merged, whose stages join the grid's) and call."""
    notes = context["notes"]
    key = grid if part is None else (grid, part)
    if key not in notes:
        notes[key] = (level, stages()) if part is None else (level, stages(), grid)


def note_skipped(context: dict) -> None:
    """Called by a patch that had to leave a block alone (its tokens were not the grid)."""
    notes = context["notes"]
    notes[SKIPPED] = notes.get(SKIPPED, 0) + 1


class CallPatch:
    """Base of a node's patch object: one per node output, shared by every clone of the
    patched model (ComfyUI's clone() deep-copies model options), finding its call context
    under ``context_key`` in the options the host passes to each patch call."""

    def __init__(self, context_key: str, label: str, rule: AutoRule | None = None):
        self.context_key = context_key
        self.label = label
        self.rule = rule  # reduce_when auto: reduce only where it pays on the device (pays.py); None: always
        self._warned_outside_sampler = False

    def __deepcopy__(self, memo):
        return self

    def prepare_call(self, context: dict, run: RunState, call: ModelCall) -> None:
        """Called by the host before each model call, outside any compiled region, with what
        is known then; puts into ``context`` what the patch decides per call."""

    def end_run(self, run: RunState) -> None:
        """Called by the host when a sampling run ends, before its report: nothing of the run
        may outlive it."""

    def call_key(self, call: ModelCall):
        """What of a model call decides which of its sites the auto rule leaves alone (the kinds of
        its sites), cheap to build; None: the patch decides per call (``left_alone`` keeps nothing)."""
        return None

    def steps_aside(self, run: RunState, call: ModelCall) -> bool:
        """Whether the auto rule already left every site of calls like ``call`` alone in this run: the
        host then opens the call's context inactive (``RunState.open_call(..., aside=True)``: no noise
        level read) and the patch passes everything through. A cached lookup; False until the first
        such call was prepared (``left_alone``)."""
        if self.rule is None:
            return False
        cached = run.cache.get((LEFT_ALONE, self.call_key(call)))
        return cached is not None and cached[1]

    def left_alone(self, context: dict, run: RunState, call: ModelCall, sites,
                   pays_at: Callable[[object], bool]) -> frozenset:
        """The sites (levels, kinds of call) of ``sites`` the auto rule leaves alone in this call:
        ``pays_at(site)`` asked the first time the run meets a call with this ``call_key``, then a
        cached lookup (no kind is built again). Where it leaves every site alone the call's context
        is switched off, from the first such call on (a compiled model sees one kind of call)."""
        if self.rule is None:
            return frozenset()
        key = (LEFT_ALONE, self.call_key(call))
        cached = run.cache.get(key) if key[1] is not None else None
        if cached is None:
            sites = tuple(sites)
            left = frozenset(site for site in sites if not pays_at(site))
            cached = (left, bool(left) and len(left) == len(sites))
            if key[1] is not None:
                run.cache[key] = cached
        if cached[1]:
            context["active"] = False
        return cached[0]

    def pays(self, run: RunState, device: torch.device, kind: tuple,
             describe: Callable[[], tuple[str, Callable[[], Work]]], model: Callable[[], str] | None = None) -> bool:
        """Whether to reduce this kind of call in this run: always without an auto rule, else the
        rule's decision (``decision``)."""
        decision = self.decision(run, device, kind, describe, model)
        return decision is None or decision.reduce

    def decision(self, run: RunState, device: torch.device, kind: tuple,
                 describe: Callable[[], tuple[str, Callable[[], Work]]], model: Callable[[], str] | None = None,
                 time_cpu: bool = False, budgeted: bool = True) -> Decision | None:
        """The auto rule's decision for this kind of call in this run (None: no rule, reduce), the
        same for the whole run and said in its report. ``describe()`` gives the site's name and the
        builder of the work that times it; asked only the first time the run meets the kind (the
        rest of the run's calls pay a lookup). ``model()``: the fingerprint of the weights the
        measured unit runs with (``weights_of``), under which the quality budget's change is kept;
        read then too, and only where a budget applies. ``time_cpu``: timed on a CPU too (a
        reduction that can be slower than none there; see ``pays.Decisions.decide``). ``budgeted``
        False: speed alone (the budget decides per block: ``pays.grade_blocks``)."""
        if self.rule is None:
            return None
        key = ("auto", device, kind, budgeted)
        decision = run.cache.get(key)
        if decision is None:
            site, work = describe()
            decision = run.cache[key] = self.rule.decide(device, kind, work, site, model=model, time_cpu=time_cpu,
                                                         reach=run.reach, budgeted=budgeted)
            if decision.source != CPU:
                run.decided(site, device, decision, self.rule.decisions.where)
        return decision

    def call_context(self, options: dict) -> dict | None:
        """This call's context, or None when the model is called outside a sampling run (then
        the patch passes everything through, and says so once) or while the auto rule of another
        TokenReduce node times a block."""
        context = options.get(self.context_key)
        if context is None and not self._warned_outside_sampler and not options.get(MEASURING):
            self._warned_outside_sampler = True
            LOG.warning("%s: the model was called outside a sampling run; this patch does nothing there "
                        "(it is active only inside sampling runs).", self.label)
        return context
