"""The benchmark loop: for each model family, size and attention backend, every configuration
(and with ``--compile`` its compiled twin) measured side by side, turned into result rows."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path

from . import amdahl, compiled, environment, stacks, study, timing
from .configs import UNPATCHED, Config, select
from .families import FAMILIES, size_label
from .report import Row
from .step import OneStep


@dataclass
class Loaded:
    """A model to benchmark and what the harness needs to feed it."""

    label: str  # the family's name in the results
    model: object
    conditioning: tuple
    vae: object = None  # a checkpoint's VAE: the image study
    downscale: int = 8
    frames: int = 1
    audio: bool = False  # an audio latent beside the video (LTX-2)


def _load(args, family: str, dtype) -> Loaded:
    if args.checkpoint:
        import comfy.sd

        model, clip, vae = comfy.sd.load_checkpoint_guess_config(str(args.checkpoint))[:3]
        return Loaded(type(model.model.model_config).__name__, model, study.conditioning(clip), vae)
    spec = FAMILIES[family]
    return Loaded(family, spec.build(args.tiny, 0, dtype), spec.step_conditioning(args.tiny),
                  downscale=spec.downscale, frames=spec.frames, audio=spec.audio)


def _frame_counts(args, loaded: Loaded) -> list[Loaded]:
    """The model once per ``--frames`` count for a video family (labelled ``Wan21 21f``: 21
    latent frames), else as loaded."""
    if loaded.frames == 1 or not args.frames:
        return [loaded]
    return [dataclasses.replace(loaded, label=f"{loaded.label} {frames}f", frames=frames) for frames in args.frames]


def _patched(configs: list[Config], model, appliers) -> tuple[dict, dict]:
    """{name: patched model} of the configurations the model takes, {name: reason} of those
    a node refuses for this model (a DiT, say)."""
    patched, refused = {}, {}
    for config in configs:
        try:
            patched[config.name] = config.apply(model, appliers)
        except ValueError as reason:
            refused[config.name] = str(reason)
    return patched, refused


def _error(out, reference) -> float:
    return float((out - reference).norm() / reference.norm())


def _rows(where: dict, configs: list[Config], measured: dict, parts, scores: dict, backend: str | None,
          auto: dict) -> list[Row]:
    """Eager rows, and with a compile ``backend`` the compiled ones (against compiled unpatched)."""
    rows = []
    reference = measured[UNPATCHED.name]
    base_seconds = statistics.median(reference.times)
    for config in configs:
        entry = measured[config.name]
        seconds = statistics.median(entry.times)
        bounds = amdahl.amdahl(parts, config)
        mse, psnr = scores.get(config.name, (None, None))
        rows.append(Row(**where, config=config.name, method=config.method, reduction=config.reduction,
                        seconds=seconds, speedup=base_seconds / seconds, rel_error=_error(entry.out, reference.out),
                        peak_mib=entry.peak_mib, plan_seconds=entry.plan_seconds,
                        share=bounds and bounds.share, bound=bounds and bounds.bound,
                        bound_at=bounds and bounds.bound_at, repeats=entry.times,
                        breakdown=amdahl.breakdown(parts) if config is UNPATCHED else None,
                        image_mse=mse, image_psnr=psnr, attention_mib=entry.attention_mib,
                        first_seconds=entry.first_seconds, **auto.get(config.name, {})))
    if backend is None:
        return rows
    compiled_reference = measured[compiled.name_of(UNPATCHED.name)]
    compiled_base = statistics.median(compiled_reference.times)
    for config in configs:
        eager, entry = measured[config.name], measured[compiled.name_of(config.name)]
        seconds = statistics.median(entry.times)
        rows.append(Row(**where, config=compiled.name_of(config.name), method=config.method,
                        reduction=config.reduction, seconds=seconds, speedup=compiled_base / seconds,
                        rel_error=_error(entry.out, compiled_reference.out), peak_mib=entry.peak_mib,
                        repeats=entry.times, compiled=backend, vs_eager=statistics.median(eager.times) / seconds,
                        vs_eager_error=_error(entry.out, eager.out), first_seconds=entry.first_seconds,
                        compiles_in_timed_passes=entry.compiles_in_timed_passes))
    return rows


def _one_setting(args, host, configs, loaded: Loaded, step, size: int | str, attention: str, backend, scores: dict,
                 progress) -> tuple[list[Row], dict]:
    base = environment.with_attention(loaded.model, backend)
    config = getattr(base.model, "model_config", None)  # the host's name for the model type, as the nodes read it
    layout = host.model_layout(base.get_model_object("diffusion_model"), type(config).__name__)
    parts = amdahl.part_times(base, step, args.warmup, layout, host.unet_kind)
    eager, refused = _patched(configs, base, host.appliers)
    applied = [c for c in configs if c.name in eager]
    models, warmup = dict(eager), dict.fromkeys(eager, args.warmup)
    if host.auto_measures:  # reduce_when auto times its calls in the first pass: a warm-up pass, not a timed one
        warmup = dict.fromkeys(eager, max(1, args.warmup))
    if args.compile:
        compiled.make_room(len(eager))
        for name, model in eager.items():
            models[compiled.name_of(name)] = compiled.compiled(model, args.compile_backend)
            warmup[compiled.name_of(name)] = max(1, args.warmup)  # the warm-up compiles
    where_label = f"{loaded.label} {size_label(size)} px"
    measured = timing.measure(step, models, repeats=args.repeats, warmup=warmup, compiled=frozenset(models) - set(eager),
                              progress=lambda name: progress(f"{where_label} {attention}: {name}"))
    # Before the profiling pass: its attention hook is another override, so another kind of call to the rule.
    auto = {name: _auto_fields(environment.auto_log(model, host.sessions_of)) for name, model in eager.items()}
    for name, model in eager.items():
        timing.profile(step, model, measured[name], host.sessions_of, attention)
    where = dict(family=loaded.label, size=size, attention=attention)
    rows = _rows(where, applied, measured, parts, scores, args.compile_backend if args.compile else None, auto)
    if args.compile:
        import torch._dynamo

        torch._dynamo.reset()
    return rows, refused


def _auto_fields(log: list) -> dict:
    """What reduce_when auto measured for one configuration (nothing where it measured nothing)."""
    if not log:
        return {}
    return {"auto": [{"site": site, "reduce": d.reduce, "full_ms": d.full_ms, "reduced_ms": d.reduced_ms,
                      "change": d.change} for site, d in log],
            "auto_seconds": sum(d.seconds for _, d in log)}


def passes_per_setting(args, configs: int) -> int:
    """Timed and warm-up passes of one (family, size, attention), for the progress bar."""
    eager = configs * (args.warmup + args.repeats)
    return eager + (configs * (max(1, args.warmup) + args.repeats) if args.compile else 0)


def run(args) -> tuple[list[Row], list[dict]]:
    """The rows of every measured setting, and the configurations a family refused
    (``{"family", "config", "reason"}``)."""
    import torch
    from tqdm import tqdm

    host = environment.load(Path(args.comfyui), measure_cpu=args.measure_cpu)
    timing.use_clock(args.clock)
    configs = select(args.configs)
    backends = environment.attention_backends(args.attention)
    dtype = getattr(torch, args.dtype)
    families = ["checkpoint"] if args.checkpoint else args.families
    videos = sum(FAMILIES[f].frames > 1 for f in families if f in FAMILIES)
    counts = len(families) + videos * (len(args.frames or [1]) - 1)
    total = counts * len(args.sizes) * len(backends) * passes_per_setting(args, len(configs))
    rows: list[Row] = []
    skipped: dict[tuple, dict] = {}
    with tqdm(total=total, desc="benchmark", unit="pass") as bar:
        progress = _progress(bar)
        for family in families:
            for loaded in _frame_counts(args, _load(args, family, dtype)):
                rows += _one_model(args, host, configs, backends, loaded, skipped, bar, progress)
            import comfy.model_management as mm

            mm.unload_all_models()
            mm.soft_empty_cache()
    return rows, list(skipped.values())


def _one_model(args, host, configs, backends, loaded: Loaded, skipped: dict, bar, progress) -> list[Row]:
    """Every size and attention backend of one model (one frame count of a video family)."""
    rows: list[Row] = []
    for size in args.sizes:
        step = OneStep(loaded.model, size, loaded.conditioning, evals=args.evals, downscale=loaded.downscale,
                       frames=loaded.frames, audio=loaded.audio)
        scores = {}
        if loaded.vae is not None:
            bar.set_postfix_str(f"{loaded.label} {size_label(size)} px: image study "
                                f"({args.sample_steps} steps per config)")
            patched, _ = _patched(configs, loaded.model, host.appliers)
            scores = study.image_study(patched, {c.name: c.reduction for c in configs}, loaded.vae, size,
                                       args.sample_steps, loaded.conditioning, args.out,
                                       f"{loaded.label.lower()}_{size}")
        for attention, backend in backends.items():
            measured, refused = _one_setting(args, host, configs, loaded, step, size, attention, backend,
                                             scores, progress)
            rows += measured
            for name, reason in refused.items():
                skipped[(loaded.label, name)] = {"family": loaded.label, "config": name, "reason": reason}
    return rows


def run_stacks(args) -> list:
    """--stacks: every stack (see bench/stacks.py) of every family, frame count and size."""
    import torch
    from tqdm import tqdm

    host = environment.load(Path(args.comfyui), measure_cpu=args.measure_cpu)
    backends = environment.attention_backends(args.attention)
    dtype = getattr(torch, args.dtype)
    rows = []
    with tqdm(desc="stacks", unit="run") as bar:
        progress = _progress(bar)
        for family in args.families:
            for loaded in _frame_counts(args, _load(args, family, dtype)):
                for size in args.sizes:
                    rows += stacks.one_setting(args, host, loaded, size, backends, progress)
            import comfy.model_management as mm

            mm.unload_all_models()
            mm.soft_empty_cache()
    return rows


def _progress(bar):
    """A pass done: the bar advances and names it."""
    def progress(text: str) -> None:
        bar.set_postfix_str(text)
        bar.update()
    return progress
