"""One sampling pass of a Forge generation with TokenReduce: its patched UNet and its run.

Forge gives extensions no sampler wrappers; a script patches a clone of the pass's UNet
patcher just before the pass samples (``process_before_every_sampling``) and the clone lives
for that pass only (Forge resets the UNet before every pass). So each pass gets a fresh
``PassRun``: one ``RunState`` per method (as ComfyUI's sampler wrapper gives each run), and
Forge's one ``model_function_wrapper`` slot, chained to whatever held it, gives every model
call its context, as ComfyUI's APPLY_MODEL wrapper does. The attention patches are the shared
ones of ``tokenreduce/``; ``grid.supply_activations_shape`` runs first and gives them the
block's grid. ToDo's method window (and the budget's milder step to it) runs in an attn1 replace
patch on each block of the levels it reduces, since Forge has no attention override
(``todo_patch.BY_REPLACE``); where another extension holds a block's replace slot, it does not.

Refusals: Forge swallows exceptions raised in script hooks, so settings that cannot run are
refused by raising from the wrapper, at the pass's first model call, before anything is
computed (the API answers HTTP 500 with the message; the UI shows it in its error box).

Uses only the patcher methods Forge's ``UnetPatcher`` shares with ComfyUI's ``ModelPatcher``
(the in-process tests drive it with ComfyUI's), and imports no host.
"""

from __future__ import annotations

import time
from dataclasses import replace

from tokenreduce.change import measure_change
from tokenreduce.describe import header, todo_info, tome_dit_info, tome_info
from tokenreduce.fingerprint import fingerprint
from tokenreduce.layout import DIT, UNET, model_layout
from tokenreduce.measure import UNetLevels, copied_containers
from tokenreduce.methods import (MODE_FULL, MODE_PROPORTIONAL, todo_level_factors, todo_select, tome_dit_only,
                                 tome_select)
from tokenreduce.pays import Decisions, auto_rule
from tokenreduce.peak_window import WINDOW
from tokenreduce.preflight import todo_factors, tome_strides
from tokenreduce.run import CONTEXT_PREFIX, ModelCall, RunReport, RunState
from tokenreduce.target import resolve_target
from tokenreduce.todo_patch import BY_REPLACE, ToDoPatch
from tokenreduce.tome_patch import ToMePatch
from tokenreduce.window import SigmaWindow, late_level, levels_to_late, schedule_reach

from . import flux as forge_flux
from .grid import supply_activations_shape
from .settings import PREFIX, label

INSTALLED = "tokenreduce_forge"  # model_options key: what TokenReduce installed on a patcher
BUILTIN_TOME = "TomePatcher.patch."  # qualname prefix of Forge's built-in ToMe patches (backend/misc/tomesd.py)


class Refused(Exception):
    """TokenReduce refused this generation; the message says why and what to do."""

    def line(self) -> str:
        """The refusal as the console says it: one line, as the UI's error box shows it."""
        return f"[{PREFIX}] {type(self).__name__}: {' '.join(str(self).split())}"


class Installed:
    """What TokenReduce added to a patcher, so that a clone of it can take it out again."""

    def __init__(self, functions: list, object_keys: list, previous_wrapper, had_wrapper: bool,
                 replaced: list = ()):
        self.functions = functions  # (patch list name, function)
        self.object_keys = object_keys
        self.replaced = list(replaced)  # (replace name, key, function): ToDo's window (attn1), ToMe on Flux (dit)
        self.previous_wrapper = previous_wrapper
        self.had_wrapper = had_wrapper

    def __deepcopy__(self, memo):  # clone() deep-copies model_options; this record is shared
        return self


class MethodRun:
    """One method in one pass: its settings, what it patched and its run state."""

    def __init__(self, method: str, stage: str, settings, target, patch, window: SigmaWindow, warnings: list):
        self.method = method
        self.stage = stage
        self.label = label(stage, method)
        self.settings = settings
        self.target = target
        self.patch = patch
        self.header = header(method, target)
        if method == "ToMe" and target.layout.kind == DIT:  # Forge's Flux: whole blocks (flux.py)
            self.info = tome_dit_info(settings, target, patch)
        else:
            self.info = tome_info(settings, target) if method == "ToMe" else todo_info(settings, target)[0]
        always = settings.start_percent <= 0.0 and settings.end_percent >= 1.0
        self.run = RunState(window, always_active=always, warnings=list(warnings),
                            measure_change=settings.measure_change)


MEMORY_ONLY = Decisions(None)  # the auto rule's decisions where the caller keeps no file (tests)


class PassRun:
    """A pass's patched methods, the warnings about what does nothing, and its model calls."""

    def __init__(self, stage: str, dtype=None, attention=None):
        self.stage = stage
        self.dtype = dtype  # the UNet's computation dtype, and the attention function: for the auto rule
        self.attention = attention
        self.methods: list[MethodRun] = []
        self.warnings: list[str] = []  # settings that do nothing for this model (said, not refused)
        self.refusal: str | None = None
        self.schedule: list[float] | None = None  # the pass's sigmas, when the host can tell
        self.calls = 0
        self._sigmas: list = []  # each call's noise level (read at the end, where no schedule is known)
        self._started: float | None = None
        self._ended: float | None = None
        self.finished = False

    def use_schedule(self, schedule: list[float] | None, unet) -> None:
        """The pass's sigmas (``hooks.schedule_of``), known before its first step: the report's
        steps, and the share of sampling the pass covers (a hires pass or img2img: about its
        denoising strength), which the quality budget weighs a measured change by."""
        self.schedule = schedule
        if schedule:
            reach = schedule_reach(_percent_to_sigma(unet), schedule[0])
            for method in self.methods:
                method.run.reach = reach
                method.run.late_sigma = late_level(schedule)  # where the budget reads a DiT block (late_blocks.py)
                method.run.late_levels = levels_to_late(schedule)  # and its plan's step, corrected (tome_dit_blocks.py)

    def wrapper(self, previous):
        """The ``model_function_wrapper`` of this pass, calling ``previous`` (another
        extension's) inside."""

        def tokenreduce_model_call(apply_model, args):
            if self.refusal is not None:
                refused = Refused(self.refusal)
                print(refused.line(), flush=True)  # said once, here; the web server's traceback is not (console.py)
                raise refused
            c = args["c"]
            options = c["transformer_options"]  # a fresh dict per model call
            sigmas = options["sigmas"]
            call = ModelCall(args["input"], c.get("c_crossattn"),
                             {k: v for k, v in c.items() if k not in ("c_crossattn", "transformer_options")},
                             options, sigmas, self.dtype, self.attention, rehearse=_rehearsal(apply_model, args),
                             fingerprint=weights_fingerprint)
            contexts = []
            for method in self.methods:
                context = method.run.open_call(sigmas, options, aside=method.patch.steps_aside(method.run, call))
                method.patch.prepare_call(context, method.run, call)
                options[method.patch.context_key] = context
                contexts.append(context)
            if self._started is None:
                self._started = time.perf_counter()
            try:
                output = previous(apply_model, args) if previous is not None else \
                    apply_model(args["input"], args["timestep"], **c)
                for method, context in zip(self.methods, contexts):  # measure_change: once per run, unreduced
                    measure_change(method.run, context, call, output, method.patch.context_key, method.label)
                return output
            finally:
                for method, context in zip(self.methods, contexts):
                    method.run.close_call(context, sigmas)
                self.calls += 1
                self._sigmas.append(sigmas)
                self._ended = time.perf_counter()

        return tokenreduce_model_call

    def finish(self, completed: bool) -> list[tuple[MethodRun, RunReport]]:
        """End the pass: every method's report. Nothing of the run outlives it."""
        self.finished = True
        schedule = self.schedule
        if schedule is None and self._sigmas:  # the noise levels the calls saw, as the steps
            schedule = sorted({float(s.max()) for s in self._sigmas}, reverse=True) + [0.0]
        seconds = (self._ended - self._started) if self._started is not None else 0.0
        reports = []
        for method in self.methods:
            method.patch.end_run(method.run)
            report = method.run.report(method.label, method.settings.start_percent, method.settings.end_percent,
                                       seconds, completed, schedule)
            if self.calls == 0 and method.patch._warned_outside_sampler:
                report = replace(report, warnings=report.warnings + (
                    f"{method.label} did nothing: its attention patches ran without their per-call state, because "
                    f"another extension replaced Forge's model_function_wrapper (one slot) after {PREFIX} set it "
                    f"instead of calling it.",))
            reports.append((method, report))
        self._sigmas = []
        return reports


def weights_fingerprint(path: str, module) -> str:
    """The fingerprint of the weights ``module`` (a UNet block) computes with in Forge, for the
    quality budget's per-model change (``tokenreduce/fingerprint.py``): Forge's LoRA loader patches
    weights in place (the module holds base + LoRA, read as it is), except online LoRAs (GGUF and
    bitsandbytes weights, or "online" set), kept on the layer as ``forge_online_loras`` and applied
    in each forward: those patches, sampled with their strengths, are added per layer."""
    parts = list(module.named_parameters())
    for name, layer in module.named_modules():
        online = getattr(layer, "forge_online_loras", None)
        if online:
            parts.append((f"{name} online LoRAs", online))
    return fingerprint(parts)


def _rehearsal(apply_model, args: dict):
    """options -> this model call run once more with ``options`` as its transformer_options, by the
    model's own apply_model (below Forge's model_function_wrapper: no other extension's wrapper).
    The call's conditioning is taken now, before the call runs, and each rehearsal gets its own
    copies of its lists and dicts (``copied_containers``): Forge's UNet pops its control residuals
    (ControlNet, T2I-Adapter) from the lists it is handed, so a rehearsal on the live ones would
    take them from the user's call, and measure_change's rerun after it would run without them."""
    conditioning = copied_containers({k: v for k, v in args["c"].items() if k != "transformer_options"})

    def rehearse(options: dict, x=None, level: float | None = None):
        t = args["timestep"]
        return apply_model(args["input"] if level is None else x, t if level is None else t.new_full(t.shape, level),
                           **{**copied_containers(conditioning), "transformer_options": options})
    return rehearse


def _percent_to_sigma(unet):
    """The model's percent -> sigma (as ComfyUI's ``model_sampling.percent_to_sigma``)."""
    predictor = getattr(unet.model, "predictor", None)  # Forge: the KModel's predictor
    if predictor is None:  # ComfyUI's ModelPatcher (the in-process tests of this adapter)
        predictor = unet.get_model_object("model_sampling")
    return predictor.percent_to_sigma


def not_a_unet(family: str) -> str:
    return (f"{PREFIX} cannot patch this {family} model: it has no UNet transformer blocks. In Forge, {PREFIX} "
            f"works on UNet models (SD1.x, SD2.x, SDXL) and ToMe or ToDo on Forge's Flux.1; both on other DiT models "
            f"(Chroma, SD3, ...) are in the ComfyUI nodes only. Turn {PREFIX} off for this model.")


def has_ours(unet) -> bool:
    return INSTALLED in unet.model_options


def _patches(unet) -> dict:
    return unet.model_options.setdefault("transformer_options", {}).setdefault("patches", {})


def strip_ours(clone) -> None:
    """Take out what TokenReduce installed on the patcher this clone was made from (Forge hands
    the hires pass's discarded first hook call the first pass's patched UNet)."""
    installed = clone.model_options.pop(INSTALLED, None)
    if installed is None:
        return
    patches = _patches(clone)
    for name, function in installed.functions:
        if name in patches:
            patches[name] = [f for f in patches[name] if f != function]
    if installed.had_wrapper:
        clone.model_options["model_function_wrapper"] = installed.previous_wrapper
    else:
        clone.model_options.pop("model_function_wrapper", None)
    for key in installed.object_keys:
        clone.object_patches.pop(key, None)
    for name, key, function in installed.replaced:
        replace = _patches_replace(clone, name)
        if replace.get(key) == function:
            del replace[key]


def _patches_replace(unet, name: str = "attn1") -> dict:
    """The patcher's ``name`` replace patches by key: attn1's by block (``("input", 1, 0)``; or
    without the transformer index, for every index of the block), dit's by block (``("double_block", 1)``)."""
    return unet.model_options.get("transformer_options", {}).get("patches_replace", {}).get(name, {})


def _replaced_by_others(clone, sites) -> list:
    """The sites whose self-attention another extension replaces (an attn1 replace patch): ToDo's
    window cannot run there, since Forge calls one replacement per block."""
    replace = _patches_replace(clone)
    return [site for site in sites if site.key in replace or site.key[:2] in replace]


def strip_builtin_tome(clone) -> bool:
    """Take Forge's built-in ToMe out of this clone; whether it was there."""
    patches = _patches(clone)
    found = False
    for name in ("attn1_patch", "attn1_output_patch"):
        kept = [f for f in patches.get(name, []) if not str(getattr(f, "__qualname__", "")).startswith(BUILTIN_TOME)]
        found |= len(kept) != len(patches.get(name, []))
        if name in patches:
            patches[name] = kept
    return found


def _target(layout, family: str, method: str, settings):
    if method == "ToDo":
        return resolve_target(layout, family, "ToDo", "level", settings.level, todo_select(settings))
    return resolve_target(layout, family, "ToMe", "max_downsample", settings.max_downsample,
                          tome_select)


def install(unet, family: str, stage: str, methods: dict, latent_shape: tuple, refusal: str | None = None,
            decisions: Decisions | None = None, attention=None):
    """A clone of ``unet`` (a Forge UnetPatcher) patched for one pass with ``methods``
    ({method: settings}, in patch order) for a latent of ``latent_shape``, and the pass's run.
    ``refusal``: refuse the pass with this message. ``decisions``: where the auto rule keeps
    what it measured (None: in memory); ``attention``: Forge's attention function (names the
    backend in what the rule keeps). Returns ``(unet, run)``; ``unet`` is the input itself where
    there is nothing to do."""
    run = PassRun(stage, getattr(unet.model, "computation_dtype", None), attention)
    if not methods and refusal is None and not has_ours(unet):
        return unet, run
    clone = unet.clone()
    strip_ours(clone)
    previous = clone.model_options.get("model_function_wrapper")
    had_wrapper = "model_function_wrapper" in clone.model_options
    run.refusal = refusal
    if refusal is None and methods:
        diffusion_model = clone.get_model_object("diffusion_model")
        layout = forge_flux.layout_of(diffusion_model) or model_layout(diffusion_model, family)
        run.refusal = _patch(clone, run, layout, family, stage, methods, tuple(latent_shape),
                             decisions if decisions is not None else MEMORY_ONLY)
    if run.refusal is None and not run.methods:
        return clone, run  # only warnings (settings that do nothing here): nothing to call
    functions, object_keys, replaced = [], [], []
    if run.refusal is None:
        functions, object_keys, replaced = _register(clone, run)
    clone.set_model_unet_function_wrapper(run.wrapper(previous))
    clone.model_options[INSTALLED] = Installed(functions, object_keys, previous, had_wrapper, replaced)
    return clone, run


def _patch(clone, run: PassRun, layout, family: str, stage: str, methods: dict, latent_shape: tuple,
           decisions: Decisions) -> str | None:
    """Decide each method's sites and patch (registered by ``_register``); a refusal or None."""
    if layout is not None and layout.family is forge_flux.FAMILY:  # Forge's own Flux.1: flux.py
        refusal, chosen = forge_flux.choose(clone, run, layout, family, stage, methods, latent_shape, decisions,
                                            _percent_to_sigma(clone))
        run.methods += [MethodRun(c.method, stage, *c[1:]) for c in chosen]
        return refusal
    if layout is None or layout.kind != UNET or not layout.sites:
        return not_a_unet(family)
    percent_to_sigma = _percent_to_sigma(clone)
    for method, settings in methods.items():
        target = _target(layout, family, method, settings)
        if target.refused:
            return not_a_unet(family)
        if target.sites is None:
            run.warnings.append(f"{label(stage, method)}: {target.message}")
            continue
        who = label(stage, method)
        context_key = f"{CONTEXT_PREFIX}forge.{stage}.{method}"
        unet_levels = UNetLevels(clone.get_model_object("diffusion_model"), target.sites, family)
        rule = auto_rule(settings.reduce_when, decisions, per_process=True,  # a new pass each generation
                         max_change=settings.max_change)
        if method == "ToDo":
            named = todo_level_factors(target.level, settings)
            check = todo_factors(who, [nf for nf in named if nf[1] in target.levels])
            warnings = [f"{who}: {warning}" for warning in todo_info(settings, target)[1]]
            window = BY_REPLACE
            if taken := _replaced_by_others(clone, target.sites):
                blocks = ", ".join(str(site.key) for site in taken)
                if settings.method == WINDOW:
                    return (f"{who}: method window cannot run here: another extension replaces the self-attention "
                            f"of blocks {blocks} (an attn1 replace patch; Forge calls one per block). Use method "
                            f"nearest, or turn that extension off.")
                window = None
                warnings.append(f"{who}: the quality budget's milder step (method window) is off: another extension "
                                f"replaces the self-attention of blocks {blocks}.")
            patch = ToDoPatch({level: factor for _, level, factor in named}, settings.method, context_key, who,
                              unet_levels, rule, window=window, attention=run.attention)
        else:
            if settings.mode == MODE_PROPORTIONAL:  # its sizes go in through an attention override
                return (f"{who}: mode '{MODE_PROPORTIONAL}' adds each merged key's log size to the attention's "
                        f"logits through an attention override, which Forge has no counterpart of yet; use mode "
                        f"'{MODE_FULL}' here.")
            check = tome_strides(who, target.levels, settings.stride_x, settings.stride_y)
            patch = ToMePatch(settings, target, context_key, who, unet_levels, rule)
            # correct_from_whole (the API's dict form) corrects whole-block merging on DiTs: said to do nothing
            warnings = [f"{who}: {warning}" for warning in tome_dit_only(settings, family)]
        try:
            warnings = warnings + check(latent_shape)  # before any step: refused, or what it misses
        except ValueError as refused:
            return str(refused)
        window = SigmaWindow(percent_to_sigma(settings.start_percent), percent_to_sigma(settings.end_percent))
        run.methods.append(MethodRun(method, stage, settings, target, patch, window, warnings))
    return None


def _register(clone, run: PassRun) -> tuple[list, list, list]:
    if any(method.target.layout.kind == DIT for method in run.methods):
        return forge_flux.register(clone, run)
    functions, object_keys, replaced = [], [], []

    def add(name: str, function) -> None:
        clone.set_model_patch(function, name)
        functions.append((name, function))

    add("attn1_patch", supply_activations_shape)
    for method in run.methods:
        patch, settings = method.patch, method.settings
        add("attn1_patch", patch.attn1)
        if method.method != "ToMe":
            if patch.may_window:  # the blocks of the levels it reduces hand it q, k, v (todo_patch.py)
                for site in method.target.sites:
                    if site.level in patch.factors:
                        clone.set_model_attn1_replace(patch.attn1_replace, *site.key)
                        replaced.append(("attn1", site.key, patch.attn1_replace))
            continue
        if settings.merge_attn:
            add("attn1_output_patch", patch.unmerge_output)
        if settings.merge_crossattn:
            add("attn2_patch", patch.attn2)
            add("attn2_output_patch", patch.unmerge_output)
        if settings.merge_mlp:
            # Forge keeps object patches on the shared module after the run (until another clone
            # of the model loads); the replacement forward finds no plan outside this pass's calls.
            for site in method.target.sites:
                key = f"{site.path}.ff.forward"
                clone.add_object_patch(key, patch.mlp_forward(site.key, clone.get_model_object(f"{site.path}.ff")))
                object_keys.append(key)
    return functions, object_keys, replaced


def refusing(unet, stage: str, message: str):
    """A clone of ``unet`` that refuses the pass with ``message`` at its first model call."""
    return install(unet, "", stage, {}, (), refusal=message)
