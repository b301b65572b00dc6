"""ToDo on top of the speed stack users already run (issue #21), side by side in one run: another
attention kernel (the ``--attention`` backends, SageAttention's among them where the
``sageattention`` package imports), ComfyUI's own step cache (EasyCache at its node's defaults)
and ``torch.compile`` (``--compile``), each stack with and without ToDo at its defaults.

A step cache skips whole model calls, which one timed forward (the main benchmark) cannot show:
each pass here is a whole sampling run of ``--stack-steps`` steps (euler, simple schedule) from a
spatially smooth noise, and its time is reported per step. The wiring is the order docs/speed-stack.md
gives: the attention patch first (ToDo chains to it), ToDo, the step cache, compiling last."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from . import amdahl, compiled, environment, timing
from .configs import Config, todo
from .families import latent_shape, size_label
from .step import OneStep

TODO_DEFAULTS = Config("ToDo defaults", "todo", (todo(),))
CFG = {"Flux": 1.0}  # Flux.1 [dev] runs without CFG (its guidance is an input); the rest at 5


@dataclass(frozen=True)
class Stack:
    attention: str  # the attention backend (--attention)
    cache: bool  # EasyCache at its defaults
    todo: bool  # ToDo at its defaults
    compiled: bool = False

    @property
    def name(self) -> str:
        parts = [self.attention] + (["EasyCache"] if self.cache else []) + (["ToDo"] if self.todo else [])
        return (compiled.PREFIX if self.compiled else "") + " + ".join(parts)

    def without_todo(self) -> "Stack":
        return Stack(self.attention, self.cache, False, self.compiled)


def stacks(attentions: list[str], compile_too: bool) -> list[Stack]:
    """Every stack, the first attention backend without anything the reference."""
    eager = [Stack(a, cache, with_todo) for a in attentions for cache in (False, True) for with_todo in (False, True)]
    return eager + ([Stack(s.attention, s.cache, s.todo, True) for s in eager] if compile_too else [])


@dataclass(kw_only=True)
class StackRow:
    family: str  # with the frame count of a video: "Wan21 21f"
    size: int | str
    stack: str
    seconds_per_step: float  # median of the timed runs / steps
    vs_unpatched: float  # against the first backend without anything, same run
    vs_without_todo: float | None  # rows with ToDo: against the same stack without it
    rel_error: float  # final latent against the unpatched run's
    todo_bound: float | None  # rows with ToDo: the per-forward Amdahl bound of ToDo on this backend
    peak_mib: float | None
    repeats: list
    error: str | None = None  # a stack that could not run (e.g. did not compile): why


class SampledRun:
    """A whole sampling run: ``steps`` steps of euler on the simple schedule from smooth noise
    over an empty latent; returns the final latent. ``evals`` is the step count, so the timing
    harness reports seconds per step."""

    def __init__(self, model, size, conditioning: tuple, steps: int, *, downscale: int = 8, frames: int = 1,
                 cfg: float = 5.0):
        import random_models
        import torch

        self.torch = torch
        shape = latent_shape(model, 1, size, downscale, frames)
        video = dict(frames=shape[2]) if len(shape) == 5 else {}
        self.latent = torch.zeros(shape)
        self.noise = random_models.smooth_latent(1, shape[-2], shape[-1], seed=12, channels=shape[1], **video)
        self.positive, self.negative = conditioning
        self.evals = steps
        self.cfg = cfg

    def __call__(self, model):
        import comfy.sample

        with self.torch.inference_mode():  # as ComfyUI runs its nodes
            out = comfy.sample.sample(model, self.noise, self.evals, self.cfg, "euler", "simple", self.positive,
                                      self.negative, self.latent, seed=0, disable_pbar=True)
        if self.torch.cuda.is_available():
            self.torch.cuda.synchronize()
        return out.float().cpu()


def easycache(model):
    """ComfyUI's EasyCache node at its declared defaults (0.3.75 and 0.33 alike)."""
    from comfy_extras.nodes_easycache import EasyCacheNode

    defaults = {spec.id: spec.default for spec in EasyCacheNode.define_schema().inputs
                if getattr(spec, "default", None) is not None}
    return EasyCacheNode.execute(model, **defaults).result[0]


def build(stack: Stack, base, backends: dict, appliers: dict, compile_backend: str):
    model = environment.with_attention(base, backends[stack.attention])
    if stack.todo:
        model = TODO_DEFAULTS.apply(model, appliers)
    if stack.cache:
        model = easycache(model)
    return compiled.compiled(model, compile_backend) if stack.compiled else model


def _bound(host, base, backend, size, loaded, warmup: int) -> float | None:
    """ToDo's per-forward Amdahl bound on this backend (the cache skips forwards; ToDo shortens
    those that run)."""
    step = OneStep(base, size, loaded.conditioning, downscale=loaded.downscale, frames=loaded.frames)
    timed = environment.with_attention(base, backend)
    layout = host.model_layout(timed.get_model_object("diffusion_model"),
                               type(getattr(timed.model, "model_config", None)).__name__)
    bounds = amdahl.amdahl(amdahl.part_times(timed, step, warmup, layout, host.unet_kind), TODO_DEFAULTS)
    return bounds.bound_at if bounds else None


def one_setting(args, host, loaded, size, backends: dict, progress) -> list[StackRow]:
    """Every stack of one model at one size, timed side by side."""
    run = SampledRun(loaded.model, size, loaded.conditioning, args.stack_steps, downscale=loaded.downscale,
                     frames=loaded.frames, cfg=CFG.get(loaded.label.split()[0], 5.0))
    chosen = stacks(list(backends), args.compile)
    models, errors = {}, {}
    if args.compile:
        compiled.make_room(sum(s.compiled for s in chosen))
    for stack in chosen:
        models[stack.name] = build(stack, loaded.model, backends, host.appliers, args.compile_backend)
    where = f"{loaded.label} {size_label(size)} px stacks"
    runnable = {}
    # A first, untimed run of each: it compiles, lets reduce_when auto time its calls, and finds a
    # stack that cannot run (one that does not compile, say), which is said, not fatal.
    for stack in chosen:
        try:
            run(models[stack.name])
            runnable[stack.name] = models[stack.name]
        except Exception as error:  # noqa: BLE001 - reported in the table
            if stack == chosen[0]:
                raise  # the reference itself: nothing to compare with
            errors[stack.name] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]}"
        progress(f"{where}: {stack.name}")
    warmup = dict.fromkeys(runnable, args.warmup)
    measured = timing.measure(run, runnable, repeats=args.repeats, warmup=warmup, progress=lambda name: progress(
        f"{where}: {name}"), compiled=frozenset(s.name for s in chosen if s.compiled and s.name in runnable))
    bounds = {a: _bound(host, loaded.model, b, size, loaded, args.warmup) for a, b in backends.items()}
    reference = measured[chosen[0].name]
    rows = []
    for stack in chosen:
        if stack.name in errors:
            rows.append(StackRow(family=loaded.label, size=size, stack=stack.name, seconds_per_step=float("nan"),
                                 vs_unpatched=float("nan"), vs_without_todo=None, rel_error=float("nan"),
                                 todo_bound=None, peak_mib=None, repeats=[], error=errors[stack.name]))
            continue
        entry = measured[stack.name]
        seconds = statistics.median(entry.times)
        plain = measured.get(stack.without_todo().name) if stack.todo else None
        rows.append(StackRow(
            family=loaded.label, size=size, stack=stack.name, seconds_per_step=seconds,
            vs_unpatched=statistics.median(reference.times) / seconds,
            vs_without_todo=statistics.median(plain.times) / seconds if plain else None,
            rel_error=float((entry.out - reference.out).norm() / reference.out.norm()),
            todo_bound=bounds[stack.attention] if stack.todo else None, peak_mib=entry.peak_mib,
            repeats=entry.times))
    if args.compile:
        import torch._dynamo

        torch._dynamo.reset()
    return rows


def to_markdown(rows: list[StackRow], machine: str, settings: str) -> str:
    lines = [f"Machine: {machine}", "", settings, ""]
    for key in dict.fromkeys((r.family, r.size) for r in rows):
        group = [r for r in rows if (r.family, r.size) == key]
        lines += [f"### {key[0]}, {size_label(key[1])} px, stacks", "",
                  "| stack | s / step | vs unpatched | ToDo: vs the stack without it | ToDo's Amdahl bound "
                  "(per forward) | rel. error vs unpatched | peak MiB |", "|---|---|---|---|---|---|---|"]
        for r in group:
            if r.error:
                lines.append(f"| {r.stack} | did not run: {r.error} | | | | | |")
                continue
            lines.append(f"| {r.stack} | {r.seconds_per_step:.4g} | {r.vs_unpatched:.2f}x | "
                         + (f"{r.vs_without_todo:.2f}x" if r.vs_without_todo else "-") + " | "
                         + (f"{r.todo_bound:.2f}x" if r.todo_bound else "-") + f" | {r.rel_error:.4f} | "
                         + (f"{r.peak_mib:.0f}" if r.peak_mib is not None else "-") + " |")
        lines.append("")
    return "\n".join(lines)


def as_json(rows: list[StackRow], machine: str, settings: str) -> dict:
    return {"machine": machine, "settings": settings, "rows": [asdict(r) for r in rows]}

