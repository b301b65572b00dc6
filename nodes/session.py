"""The life of a patch inside ComfyUI's sampler: one run state per sampling run, one call
context per model call.

A patch node creates one ``PatchSession`` for the MODEL it returns; it is shared by every clone
of that MODEL (the host deep-copies ``model_options``, so the session opts out of copying) and
holds nothing between runs. An OUTER_SAMPLE wrapper opens a fresh ``RunState`` when sampling
starts and drops it in ``finally``, so an interrupted run leaves nothing behind and the next run
starts clean. An APPLY_MODEL wrapper, which runs outside the diffusion model (and so outside
what ComfyUI's ``TorchCompileModel`` compiles), gives each model call its context: whether the
step is inside the window, what the patch prepares per call, and room for its notes.
"""

from __future__ import annotations

import functools
import logging
import time

from comfy.patcher_extension import WrappersMP

from ..tokenreduce.change import measure_change
from ..tokenreduce.measure import copied_containers
from ..tokenreduce.run import CONTEXT_PREFIX, ModelCall, RunReport, RunState
from ..tokenreduce.window import SigmaWindow, late_level, levels_to_late, schedule_reach
from .host import attention_entry, compiled, compute_dtype, uncompiled, weights_fingerprint

LOG = logging.getLogger("tokenreduce")
WRAPPER_KEY = "tokenreduce"
# BaseModel.apply_model's named arguments; the rest of its keyword arguments are the model's inputs.
APPLY_MODEL_ARGS = ("x", "t", "c_concat", "c_crossattn", "control", "transformer_options")


def _arg(args: tuple, kwargs: dict, index: int, name: str):
    return args[index] if len(args) > index else kwargs.get(name)


# What ComfyUI puts into each call's transformer_options from the patcher (sampler_helpers): the
# wrappers and callbacks of every kind, the diffusion model's own (DIFFUSION_MODEL) among them.
HOST_HOOKS = ("wrappers", "callbacks")


def _rehearsal(base_model, args: tuple, kwargs: dict):
    """options -> this apply_model call run once more with ``options`` as its transformer_options,
    below every wrapper: through ``BaseModel._apply_model`` (below the APPLY_MODEL wrappers, no
    sampler wrapper of ours), uncompiled (``host.uncompiled``: also where the compile wrapper runs
    around ours), with no wrapper or callback left in the options (the diffusion model runs its
    DIFFUSION_MODEL wrappers from there: a cache such as ComfyUI's EasyCache keeps state in its
    wrapper, and may skip the call). The auto rule of whole-block ToMe captures a block's inputs
    there; no other pack's wrapper sees it.

    The call's inputs are taken now, before the call runs, and each rehearsal gets its own copies
    of their lists and dicts (``copied_containers``): the UNet pops its control residuals
    (ControlNet, T2I-Adapter) from the lists it is handed, so a rehearsal on the live ones would
    take residuals from the user's call (the auto rule rehearses before it), and one after it
    (measure_change's rerun) would run without the ControlNet. ``x`` and ``level``, where given,
    replace the latent and the noise level of every row (the quality budget's late input:
    ``late_blocks.py``)."""
    if len(args) > 5:
        args = (*args[:5], None, *args[6:])  # the options: given per rehearsal
    kwargs = {k: v for k, v in kwargs.items() if k != "transformer_options"}
    args, kwargs = copied_containers(args), copied_containers(kwargs)

    def rehearse(options: dict, x=None, level: float | None = None):
        options = {k: v for k, v in options.items() if k not in HOST_HOOKS}
        given, named = copied_containers(args), copied_containers(kwargs)
        if level is not None:  # the noise level as the call's own t has it: one per batch row
            t = given[1] if len(given) > 1 else named["t"]
            new = {0: x, 1: t.new_full(t.shape, level)}
            for index, name in ((0, "x"), (1, "t")):  # another input (the budget's late one)
                if len(given) > index:
                    given = (*given[:index], new[index], *given[index + 1:])
                else:
                    named[name] = new[index]
        with uncompiled(base_model):
            if len(given) > 5:
                return base_model._apply_model(*given[:5], options, *given[6:], **named)
            return base_model._apply_model(*given, **{**named, "transformer_options": options})
    return rehearse


def run_reach(model_sampling, schedule) -> float:
    """The share of sampling a run covers (``schedule_reach``), from its schedule's first sigma
    (one read per run, before any step; the schedule lives on the CPU)."""
    if schedule is None or getattr(schedule, "numel", lambda: 0)() < 2:
        return 1.0
    return schedule_reach(model_sampling.percent_to_sigma, float(schedule[0]))


class PatchSession:
    """Shared by the patch of one node output and its sampler wrappers."""

    def __init__(self, label: str, start_percent: float, end_percent: float, preflight=None):
        self.label = label
        self.context_key = f"{CONTEXT_PREFIX}{label}"  # where each call's context travels in transformer_options
        # Checks the settings against the latent size before the first step: raises with a
        # message for the user, or returns warnings for the run's report; None: nothing
        # depends on the size.
        self.preflight = preflight
        self.start_percent = start_percent
        self.end_percent = end_percent
        self.patch = None  # the node's CallPatch, given each call's context
        self.run: RunState | None = None
        # Reports: the graph node to tell (None outside a prompt), what the node patched, and
        # a callable given (session, report) when a run ends (sends it to the browser).
        self.node_id: str | None = None
        self.header = label
        self.on_report = None
        self.profile = False  # set by benchmarks: time merge planning (synchronises the device)
        self.measure_change = False  # the node's measure_change: one unreduced call per run (change.py)
        self.last_report: RunReport | None = None

    def __deepcopy__(self, memo):
        # ModelPatcher.clone() deep-copies model_options; the clone must share this session.
        return self

    def window_for(self, model_sampling) -> SigmaWindow:
        return SigmaWindow(model_sampling.percent_to_sigma(self.start_percent),
                           model_sampling.percent_to_sigma(self.end_percent))

    def outer_sample_wrapper(self, executor, *args, **kwargs):
        # CFGGuider.outer_sample(noise, latent_image, sampler, sigmas, ...)
        noise = _arg(args, kwargs, 0, "noise")
        schedule = _arg(args, kwargs, 3, "sigmas")
        warnings = []
        if self.preflight is not None and getattr(noise, "ndim", 0) >= 4:
            try:
                warnings = self.preflight(tuple(noise.shape))  # before any step: nothing half-applied
            except ValueError as refused:
                self._finish(RunReport(0.0, 0.0, 0, completed=False, warnings=(str(refused),), refused=True))
                raise
        guider = executor.class_obj
        model_sampling = guider.model_patcher.get_model_object("model_sampling")
        window = self.window_for(model_sampling)
        # The whole of sampling: no call's noise level needs reading to know it is inside.
        always = self.start_percent <= 0.0 and self.end_percent >= 1.0
        previous, self.run = self.run, RunState(window, always_active=always, profile=self.profile,
                                                warnings=list(warnings), measure_change=self.measure_change,
                                                reach=run_reach(model_sampling, schedule),
                                                late_sigma=late_level(schedule),
                                                late_levels=levels_to_late(schedule))
        start = time.perf_counter()
        completed = False
        try:
            result = executor(*args, **kwargs)
            completed = True
            return result
        finally:
            run = self.run
            self.run = previous
            self._end(run, completed, time.perf_counter() - start, schedule)

    def _end(self, run: RunState, completed: bool, seconds: float, schedule) -> None:
        """End the run and report it. Called in ``finally``: an error here must not replace the
        sampler's result or its interrupt, so it is logged and said in the report instead."""
        try:
            if self.patch is not None:
                self.patch.end_run(run)
            report = run.report(self.label, self.start_percent, self.end_percent, seconds, completed, schedule)
        except Exception as problem:  # noqa: BLE001 - the run's own outcome matters more than its report
            LOG.exception("%s: could not make the run's report", self.label)
            report = RunReport(seconds, 0.0, 0, completed, warnings=(
                f"{self.label}: could not make this run's report ({type(problem).__name__}: {problem}); the run "
                f"itself was not affected. Please report this.",))
        try:
            self._finish(report)
        except Exception:  # noqa: BLE001
            LOG.exception("%s: could not send the run's report", self.label)

    def apply_model_wrapper(self, executor, *args, **kwargs):
        # BaseModel.apply_model(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)
        run = self.run
        options = _arg(args, kwargs, 5, "transformer_options")
        if run is None or options is None or self.patch is None:
            return executor(*args, **kwargs)
        sigmas = options["sigmas"]
        inputs = {k: v for k, v in kwargs.items() if k not in APPLY_MODEL_ARGS}
        base_model = executor.class_obj  # the BaseModel this call runs (a device's own copy under multi-GPU)
        call = ModelCall(_arg(args, kwargs, 0, "x"), _arg(args, kwargs, 3, "c_crossattn"), inputs, options, sigmas,
                         compute_dtype(base_model), attention_entry(), getattr(base_model, "diffusion_model", None),
                         compiled(options), _rehearsal(base_model, args, kwargs),
                         functools.partial(weights_fingerprint, base_model))
        # Where auto already left every site of such calls alone: no noise level read, nothing prepared.
        context = run.open_call(sigmas, options, aside=self.patch.steps_aside(run, call))
        self.patch.prepare_call(context, run, call)
        options[self.context_key] = context  # a fresh dict per model call (ComfyUI copies it)
        try:
            output = executor(*args, **kwargs)
            # measure_change: at the run's first reduced call only, the same call again unreduced
            # (below every wrapper); the output returned is the reduced one, untouched.
            measure_change(run, context, call, output, self.context_key, self.label)
            return output
        finally:
            run.close_call(context, sigmas)

    def _finish(self, report: RunReport) -> None:
        self.last_report = report
        for warning in report.warnings:
            LOG.warning("%s", warning)
        if self.on_report is not None:
            self.on_report(self, report)

    def attach(self, patcher, patch) -> None:
        """Register the wrappers on ``patcher`` and give ``patch`` its call contexts."""
        self.patch = patch
        patcher.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, self.outer_sample_wrapper)
        patcher.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY, self.apply_model_wrapper)


def sessions_of(patcher) -> list[PatchSession]:
    """The TokenReduce sessions attached to a patched model (for benchmarks and reports)."""
    wrappers = patcher.wrappers.get(WrappersMP.OUTER_SAMPLE, {}).get(WRAPPER_KEY, [])
    return [w.__self__ for w in wrappers if isinstance(getattr(w, "__self__", None), PatchSession)]
