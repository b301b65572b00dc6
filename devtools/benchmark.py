"""Side-by-side benchmark of token reduction in one process and one run.

    python3 devtools/benchmark.py                        # pinned ComfyUI, random weights, CPU or GPU
    python3 devtools/benchmark.py --quick                # a short subset
    /path/to/ComfyUI/venv/python devtools/benchmark.py --comfyui /path/to/ComfyUI [--checkpoint ckpt.safetensors]

For each model family, size and attention backend it runs one denoising step (one UNet call
per CFG half, batch 2 as with CFG) of every configuration through ComfyUI's own sampler path,
on the same spatially smooth input, and reports:

- seconds per UNet forward (median of repeats after warm-up runs; the repeats of all
  configurations interleaved round by round, so drift of the machine's speed hits all alike)
  and the speed-up against the unpatched model measured in the same run;
- peak memory (CUDA only), and the time spent planning merges (ToMe);
- quality: relative L2 error of the model output (noise prediction) against unpatched;
- the Amdahl bound: the share of the unpatched forward spent in the parts a configuration
  reduces (self-attention's projections and the attention itself, the MLP, per level), the
  speed-up that share allows if those parts cost nothing, and the speed-up it allows if each
  reduced part cost in proportion to the tokens it keeps (keys/values pooled 4x: the attention
  and the key/value projections at a quarter, the query and output projections unchanged);
  the measured speed-up as a fraction of that second bound is what the implementation's own
  overhead (planning, gathers, pooling) costs.

Writes ``results.md``, ``results.json`` and PNG plots to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "devtools"))

import host  # noqa: E402

PACK = "tokenreduce_pack"


ATTENTION_PARTS = ("q", "k", "v", "out", "core")  # self-attention: projections and the attention itself


@dataclass(frozen=True)
class Config:
    name: str
    method: str  # unpatched | builtin | tome | todo | combined (for plots)
    reduction: float  # fraction of self-attention tokens (queries or keys) removed at the first level
    apply: Callable  # (nodes, model) -> model
    # (level, first transformer level) -> {part: fraction of its cost left} for the parts this
    # config reduces at that level (parts: ATTENTION_PARTS of self-attention, "ff" the MLP).
    scales: Callable = lambda level, first: {}


def _tome_scales(ratio: float, queries_only: bool = False, mlp: bool = False, max_level=lambda first: first):
    """ToMe at the levels up to max_level: merged queries (and keys/values unless queries only)."""
    kept = 1 - ratio
    parts = ({"q": kept, "out": kept, "core": kept} if queries_only else
             {"q": kept, "k": kept, "v": kept, "out": kept, "core": kept * kept})
    if mlp:
        parts["ff"] = kept
    return lambda level, first: parts if level <= max_level(first) else {}


def _todo_scales(factor: float, factor_next: float = 1.0):
    """ToDo: keys/values (their projections and the attention over them) pooled by factor^2."""
    def scales(level, first):
        f = {first: factor, 2 * first: factor_next}.get(level, 1.0)
        return {"k": 1 / f ** 2, "v": 1 / f ** 2, "core": 1 / f ** 2} if f > 1 else {}
    return scales


def _stacked(*parts_of):
    def scales(level, first):
        out = {}
        for parts in parts_of:
            for part, scale in parts(level, first).items():
                out[part] = out.get(part, 1.0) * scale
        return out
    return scales


def _configs() -> list[Config]:
    tome = lambda **kw: (lambda n, m: n.tome.ToMePatchNode.execute(m, **{**n.TOME, **kw}).result[0])
    todo = lambda **kw: (lambda n, m: n.todo.ToDoPatchNode.execute(m, **{**n.TODO, **kw}).result[0])
    queries = lambda **kw: (lambda n, m: tome(mode=n.QUERIES, **kw)(n, m))
    builtin = lambda ratio: (lambda n, m: n.builtin.execute(m, ratio).result[0])
    # The built-in merges the queries of downsample-1 blocks only (none on SDXL).
    builtin_scales = lambda ratio: _tome_scales(ratio, queries_only=True, max_level=lambda first: 1)
    combined = lambda m_ratio, factor: (lambda n, m: todo(factor=factor)(n, queries(ratio=m_ratio)(n, m)))
    local = "3x3 cells"
    return [
        Config("unpatched", "unpatched", 0.0, lambda n, m: m),
        Config("built-in ToMe 0.3 (its default)", "builtin", 0.3, builtin(0.3), builtin_scales(0.3)),
        Config("built-in ToMe 0.5", "builtin", 0.5, builtin(0.5), builtin_scales(0.5)),
        Config("ToMe 0.3", "tome", 0.3, tome(ratio=0.3), _tome_scales(0.3)),
        Config("ToMe 0.5", "tome", 0.5, tome(ratio=0.5), _tome_scales(0.5)),
        Config("ToMe 0.7", "tome", 0.7, tome(ratio=0.7), _tome_scales(0.7)),
        Config("ToMe 0.5 3x3", "tome-3x3", 0.5, tome(ratio=0.5, matching=local), _tome_scales(0.5)),
        Config("ToMe 0.5 shared plans", "tome-shared", 0.5, tome(ratio=0.5, share_plans=True), _tome_scales(0.5)),
        Config("ToMe 0.3 queries only", "tome-queries", 0.3, queries(ratio=0.3), _tome_scales(0.3, True)),
        Config("ToMe 0.5 queries only", "tome-queries", 0.5, queries(ratio=0.5), _tome_scales(0.5, True)),
        Config("ToMe 0.3 queries only 3x3", "tome-queries-3x3", 0.3, queries(ratio=0.3, matching=local),
               _tome_scales(0.3, True)),
        Config("ToMe 0.5 queries only 3x3", "tome-queries-3x3", 0.5, queries(ratio=0.5, matching=local),
               _tome_scales(0.5, True)),
        Config("ToMe 0.5 queries only shared plans", "tome-queries-shared", 0.5, queries(ratio=0.5, share_plans=True),
               _tome_scales(0.5, True)),
        Config("ToMe 0.5 + MLP", "tome-mlp", 0.5, tome(ratio=0.5, merge_mlp=True), _tome_scales(0.5, mlp=True)),
        Config("ToMe 0.5 queries + MLP to downsample 4 3x3", "tome-mlp", 0.5,
               queries(ratio=0.5, merge_mlp=True, max_downsample="4", matching=local),
               _tome_scales(0.5, True, True, max_level=lambda first: 4)),
        Config("ToDo 1.5", "todo", 1 - 1 / 1.5 ** 2, todo(factor=1.5), _todo_scales(1.5)),
        Config("ToDo 2", "todo", 0.75, todo(factor=2.0), _todo_scales(2.0)),
        Config("ToDo 3", "todo", 1 - 1 / 9, todo(factor=3.0), _todo_scales(3.0)),
        Config("ToDo 4", "todo", 1 - 1 / 16, todo(factor=4.0), _todo_scales(4.0)),
        Config("ToDo 2 + next 2", "todo-next", 0.75, todo(factor=2.0, factor_next=2.0), _todo_scales(2.0, 2.0)),
        Config("ToDo 3 + next 2", "todo-next", 1 - 1 / 9, todo(factor=3.0, factor_next=2.0), _todo_scales(3.0, 2.0)),
        Config("ToDo 4 + next 2", "todo-next", 1 - 1 / 16, todo(factor=4.0, factor_next=2.0), _todo_scales(4.0, 2.0)),
        Config("ToMe 0.5 queries + ToDo 2", "combined", 0.75, combined(0.5, 2.0),
               _stacked(_tome_scales(0.5, True), _todo_scales(2.0))),
        Config("ToMe 0.5 queries + ToDo 4", "combined", 1 - 1 / 16, combined(0.5, 4.0),
               _stacked(_tome_scales(0.5, True), _todo_scales(4.0))),
    ]


@dataclass
class Row:
    family: str
    size: int
    attention: str
    config: str
    method: str
    reduction: float
    seconds: float
    speedup: float
    rel_error: float
    peak_mib: float | None
    plan_seconds: float | None
    share: float
    bound: float
    bound_at: float
    repeats: list = field(default_factory=list)
    breakdown: dict | None = None  # unpatched rows: share of the forward per part and level
    image_mse: float | None = None  # with --checkpoint: decoded image of a full sampling run vs unpatched
    image_psnr: float | None = None


def _setup_comfy(comfyui: Path):
    import torch

    sys.path.insert(0, str(comfyui))
    from comfy.cli_args import args

    args.cpu = not torch.cuda.is_available()
    import comfy.model_management  # noqa: F401

    if PACK not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACK, REPO / "__init__.py", submodule_search_locations=[str(REPO)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACK] = module
        spec.loader.exec_module(module)
    import importlib as il

    from comfy_extras.nodes_tomesd import TomePatchModel

    tome = il.import_module(f"{PACK}.nodes.tome_node")
    todo = il.import_module(f"{PACK}.nodes.todo_node")
    session = il.import_module(f"{PACK}.nodes.session")

    class Nodes:
        pass

    nodes = Nodes()
    nodes.tome, nodes.todo, nodes.session, nodes.builtin = tome, todo, session, TomePatchModel
    methods = il.import_module(f"{PACK}.tokenreduce.methods")
    nodes.QUERIES = methods.MODE_QUERIES
    nodes.TOME = {k: v for k, v in methods.TOME.defaults().items() if k not in ("share_plans", "matching")}
    nodes.TODO = methods.TODO.defaults()
    return nodes


def _attention_backends(names: list[str]) -> dict:
    import comfy.ldm.modules.attention as attention

    available = {"sub-quad": attention.attention_sub_quad, "sdpa": attention.attention_pytorch,
                 "split": attention.attention_split}
    return {name: available[name] for name in names}


def _with_attention(model, backend):
    """A clone whose every attention call goes to `backend`, through ComfyUI's own override hook."""
    clone = model.clone()
    clone.model_options["transformer_options"]["optimized_attention_override"] = (
        lambda func, *args, **kwargs: backend(*args, **kwargs))
    return clone


class OneStep:
    """Runs one CFG denoising step through ComfyUI's sampler (so wrappers and per-run state work
    as in real sampling) and returns the model's raw noise predictions for the cond and uncond
    halves of the batch (before CFG, which would amplify differences by the cfg scale).

    With ``evals`` > 1 the step evaluates the model that many times at the same sigma inside one
    sampling run: on a GPU a forward takes tens of milliseconds, and the sampler's per-run setup
    (model loading checks, conditioning) would otherwise be timed as if it were part of every
    step. Each evaluation plans its merges afresh (plans never outlive a UNet call)."""

    def __init__(self, family: str, size: int, batch_images: int, sigma_percent: float, tiny: bool,
                 conditioning: tuple | None = None, evals: int = 1):
        import comfy.samplers
        import random_models
        import torch

        self.torch = torch
        latent = size // 8
        self.latent = random_models.smooth_latent(batch_images, latent, latent, seed=11)
        self.noise = random_models.smooth_latent(batch_images, latent, latent, seed=12)
        if conditioning is None:
            conditioning = (random_models.conditioning(family, tiny, seed=1), random_models.conditioning(family, tiny, seed=2))
        self.positive, self.negative = conditioning
        self.sigma_percent = sigma_percent
        self.evals = evals
        self.sampler = comfy.samplers.KSAMPLER(self._evaluate)
        self._raw = None

    def _evaluate(self, model, x, sigmas, extra_args=None, callback=None, disable=None):
        sigma = sigmas[0] * x.new_ones([x.shape[0]])
        for _ in range(self.evals):
            denoised = model(x, sigma, **(extra_args or {}))
        return denoised

    def _record(self, args):
        sigma = args["sigma"].reshape(-1, 1, 1, 1)
        x = args["input"]
        self._raw = self.torch.cat([(x - args["cond_denoised"]) / sigma, (x - args["uncond_denoised"]) / sigma])
        return args["denoised"]

    def __call__(self, model):
        import comfy.sample

        recording = model.clone()
        recording.set_model_sampler_post_cfg_function(self._record)
        sigma = model.get_model_object("model_sampling").percent_to_sigma(self.sigma_percent)
        sigmas = self.torch.tensor([sigma, 0.0])
        with self.torch.inference_mode():  # as ComfyUI runs its nodes
            comfy.sample.sample_custom(recording, self.noise, 5.0, self.sampler, sigmas, self.positive,
                                       self.negative, self.latent, disable_pbar=True, seed=0)
        if self.torch.cuda.is_available():
            self.torch.cuda.synchronize()
        return self._raw.float().cpu()


@dataclass(frozen=True)
class Amdahl:
    share: float  # of the unpatched forward spent in the parts the config reduces
    bound: float  # the speed-up if those parts cost nothing: 1 / (1 - share)
    bound_at: float  # the speed-up if each reduced part cost in proportion to its remaining tokens


def _part_times(model, step: OneStep, warmup: int) -> tuple[dict, float]:
    """Seconds of the unpatched forward per (part, level): self-attention split into its
    projections and the attention itself (what is left of the module), and the MLP; and the
    whole forward. Measured with device-synchronised forward hooks in one pass."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    layout = importlib.import_module(f"{PACK}.tokenreduce.layout").unet_layout(model.get_model_object("diffusion_model"))
    spent: dict = {}
    handles = []

    def timed(module, key):
        def pre(_m, _a):
            sync()
            spent.setdefault(key, []).append(-time.perf_counter())

        def post(_m, _a, _o):
            sync()
            spent[key][-1] += time.perf_counter()

        handles.extend([module.register_forward_pre_hook(pre), module.register_forward_hook(post)])

    for site in layout.sites:
        block = model.get_model_object(site.path)
        timed(block.attn1, ("attn1", site.level))
        for part, name in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("out", "to_out")):
            timed(getattr(block.attn1, name), (part, site.level))
        timed(block.ff, ("ff", site.level))
    try:
        for _ in range(warmup):
            step(model)
        spent.clear()
        start = time.perf_counter()
        step(model)
        total = (time.perf_counter() - start) / step.evals
    finally:
        for handle in handles:
            handle.remove()
    times = {key: sum(values) / step.evals for key, values in spent.items()}
    for level in layout.levels:
        projections = sum(times.get((part, level), 0.0) for part in ("q", "k", "v", "out"))
        times[("core", level)] = max(0.0, times.pop(("attn1", level)) - projections)
    return {"times": times, "first": layout.levels[0]}, total


def _amdahl(parts: dict, total: float, config: Config) -> Amdahl:
    reduced = saved = 0.0
    for (part, level), seconds in parts["times"].items():
        scale = config.scales(level, parts["first"]).get(part)
        if scale is not None and scale < 1:
            reduced += seconds
            saved += seconds * (1 - scale)
    return Amdahl(reduced / total, 1 / max(1e-9, 1 - reduced / total), total / max(1e-9, total - saved))


def _breakdown(parts: dict, total: float) -> dict:
    """Share of the forward per level: self-attention (split into the attention itself and
    its projections) and the MLP, finest level first."""
    names = {"core": "self-attention", "proj": "its projections", "ff": "MLP"}
    shares = {}
    for level in sorted({level for _, level in parts["times"]}):
        t = {part: parts["times"].get((part, level), 0.0) for part in ("q", "k", "v", "out", "core", "ff")}
        t["proj"] = t["q"] + t["k"] + t["v"] + t["out"]
        for part in ("core", "proj", "ff"):
            shares[f"{names[part]} at downsample {level}"] = t[part] / total
    return shares


class PeakMemory:
    """Peak memory of a measured pass: the CUDA allocator's peak on a GPU; on a CPU the peak
    resident set of this process above what it held before (Linux: VmHWM, reset through
    /proc/self/clear_refs), so the model's weights are not counted."""

    def __init__(self):
        import torch

        self.torch = torch
        self.cuda = torch.cuda.is_available()
        self.baseline = 0

    @staticmethod
    def _status_kib(field: str) -> int | None:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        except OSError:
            return None
        return None

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass
        self.baseline = self._status_kib("VmRSS") or 0

    def peak_mib(self) -> float | None:
        if self.cuda:
            return self.torch.cuda.max_memory_allocated() / 2**20
        peak = self._status_kib("VmHWM")
        return None if peak is None else max(0, peak - self.baseline) / 1024


@dataclass
class Measured:
    times: list = field(default_factory=list)  # seconds per timed pass
    out: object = None  # the model output of the last pass
    peak_mib: float | None = None  # the highest peak of its passes
    plan_seconds: float | None = None  # ToMe: merge planning in one profiled pass


def _measure(step: OneStep, models: dict, repeats: int, warmup: int, progress) -> dict[str, Measured]:
    """Time every configuration's passes interleaved: warm-ups first, then round by round one
    pass of each (the order rotated every round). A machine whose speed drifts during a run
    (turbo, neighbours on a shared host) then shifts every configuration alike, not the ones
    measured last. ``progress(name)`` is called after each pass."""
    names = list(models)
    for name in names:
        for _ in range(warmup):
            step(models[name])
            progress(name)
    measured = {name: Measured() for name in names}
    memory = PeakMemory()
    for round_ in range(repeats):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            memory.reset()
            start = time.perf_counter()
            out = step(models[name])
            entry = measured[name]
            entry.times.append((time.perf_counter() - start) / step.evals)
            entry.out = out
            peak = memory.peak_mib()
            if peak is not None:
                entry.peak_mib = max(entry.peak_mib or 0.0, peak)
            progress(name)
    sessions_of = importlib.import_module(f"{PACK}.nodes.session").sessions_of
    for name, model in models.items():
        sessions = [s for s in sessions_of(model) if s.label == "TokenReduceToMe"]
        if sessions:  # one more pass, timing the merge planning (device-synchronised)
            for s in sessions:
                s.profile = True
            step(model)
            measured[name].plan_seconds = sum(s.last_report.plan_seconds for s in sessions) / step.evals
            for s in sessions:
                s.profile = False
    return measured


STUDY_PROMPT = "a lighthouse on a rocky cliff at sunset, dramatic sky, highly detailed photograph"
STUDY_NEGATIVE = "blurry, low quality, watermark"


def _encode(clip, text: str):
    return clip.encode_from_tokens_scheduled(clip.tokenize(text))


def image_study(nodes, model, vae, configs, size: int, steps: int, conditioning, out: Path, label: str) -> dict:
    """Full sampling (euler, normal schedule, the same seed) per config with a real checkpoint:
    MSE and PSNR of the decoded image against the unpatched one, and a grid image with the
    baseline on the left and reductions rising to the right."""
    import comfy.sample
    import numpy as np
    import torch
    from PIL import Image

    positive, negative = conditioning
    noise = torch.randn(1, 4, size // 8, size // 8, generator=torch.Generator().manual_seed(42))
    images = {}
    for config in sorted(configs, key=lambda c: (c.method != "unpatched", c.reduction)):
        patched = config.apply(nodes, model)
        with torch.inference_mode():
            latent = comfy.sample.sample(patched, noise, steps, 7.0, "euler", "normal", positive, negative,
                                         torch.zeros_like(noise), disable_pbar=True, seed=42)
            pixels = vae.decode(latent)[0].clamp(0, 1).float().cpu().numpy()
        images[config.name] = pixels
    reference = images["unpatched"]
    scores = {}
    for name, pixels in images.items():
        mse = float(((pixels - reference) ** 2).mean())
        scores[name] = (mse, float("inf") if mse == 0 else 10 * np.log10(1.0 / mse))
    tiles = [(np.asarray(p) * 255).round().astype("uint8") for p in images.values()]
    Image.fromarray(np.concatenate(tiles, axis=1)).save(out / f"grid_{label}.png")
    (out / f"grid_{label}.txt").write_text("left to right: " + ", ".join(images) + "\n")
    return scores


def _machine() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def run(args) -> list[Row]:
    import random_models
    import torch
    from tqdm import tqdm

    nodes = _setup_comfy(Path(args.comfyui))
    known = {c.name for c in _configs()}
    unknown = set(args.configs or []) - known
    if unknown:
        raise SystemExit(f"unknown configs {sorted(unknown)}; known: {sorted(known)}")
    configs = [c for c in _configs() if not args.configs or c.name == "unpatched" or c.name in args.configs]
    backends = _attention_backends(args.attention)
    dtype = getattr(torch, args.dtype)
    total = ((1 if args.checkpoint else len(args.families)) * len(args.sizes) * len(backends) * len(configs)
             * (args.warmup + args.repeats))
    rows: list[Row] = []
    with tqdm(total=total, desc="benchmark", unit="pass") as bar:
        for family in (["checkpoint"] if args.checkpoint else args.families):
            conditioning = vae = None
            if args.checkpoint:
                import comfy.sd

                model, clip, vae = comfy.sd.load_checkpoint_guess_config(str(args.checkpoint))[:3]
                family = type(model.model.model_config).__name__
                conditioning = (_encode(clip, STUDY_PROMPT), _encode(clip, STUDY_NEGATIVE))
            else:
                model = random_models.make_model(family, tiny=args.tiny, seed=0, dtype=dtype)
            for size in args.sizes:
                step = OneStep(family, size, 1, 0.5, args.tiny, conditioning, args.evals)
                scores = {}
                if vae is not None:
                    bar.set_postfix_str(f"{family} {size}px: image study ({args.sample_steps} steps per config)")
                    scores = image_study(nodes, model, vae, configs, size, args.sample_steps, conditioning, args.out,
                                         f"{family.lower()}_{size}")
                for attention, backend in backends.items():
                    base = _with_attention(model, backend)
                    parts, hooked_total = _part_times(base, step, args.warmup)
                    patched = {config.name: config.apply(nodes, base) for config in configs}
                    measured = _measure(step, patched, args.repeats, args.warmup, lambda name: (
                        bar.set_postfix_str(f"{family} {size}px {attention}: {name}"), bar.update()))
                    reference, base_seconds = measured["unpatched"].out, statistics.median(measured["unpatched"].times)
                    for config in configs:
                        result = measured[config.name]
                        seconds = statistics.median(result.times)
                        error = float((result.out - reference).norm() / reference.norm())
                        amdahl = _amdahl(parts, hooked_total, config)
                        mse, psnr = scores.get(config.name, (None, None))
                        rows.append(Row(family, size, attention, config.name, config.method, config.reduction,
                                        seconds, base_seconds / seconds, error, result.peak_mib, result.plan_seconds,
                                        amdahl.share, amdahl.bound, amdahl.bound_at, result.times,
                                        _breakdown(parts, hooked_total) if config.name == "unpatched" else None,
                                        mse, psnr))
            del model
            import comfy.model_management as mm

            mm.unload_all_models()
            mm.soft_empty_cache()
    return rows


def to_markdown(rows: list[Row], machine: str, settings: str = "") -> str:
    lines = [f"Machine: {machine}", ""] + ([settings, ""] if settings else [])
    groups = {}
    for row in rows:
        groups.setdefault((row.family, row.size, row.attention), []).append(row)
    for (family, size, attention), group in groups.items():
        base = group[0]
        images = base.image_mse is not None
        lines += [f"### {family}, {size}x{size} px, batch 2 (CFG), {attention} attention",
                  "", f"Unpatched: {base.seconds * 1000:.0f} ms per UNet forward. Where it goes (hooks): "
                      + ", ".join(f"{name} {share:.0%}" for name, share in (base.breakdown or {}).items()) + ".", "",
                  "| config | s/forward | speed-up | rel. error | plan time | peak MiB | reduced share | bound if free "
                  "| bound at its reduction | of that bound |" + (" image MSE | PSNR dB |" if images else ""),
                  "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if images else "")]
        for r in group:
            plan = f"{r.plan_seconds * 1000:.0f} ms" if r.plan_seconds is not None else "-"
            peak = f"{r.peak_mib:.0f}" if r.peak_mib is not None else "-"
            amdahl = (f"{r.share:.0%} | {r.bound:.2f}x | {r.bound_at:.2f}x | {r.speedup / r.bound_at:.0%}"
                      if r.method != "unpatched" else "- | - | - | -")
            lines.append(f"| {r.config} | {r.seconds:.3f} | {r.speedup:.2f}x | {r.rel_error:.4f} | {plan} | {peak} | "
                         f"{amdahl} |" + (f" {r.image_mse:.2e} | {r.image_psnr:.1f} |" if images else ""))
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[Row], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {}
    for row in rows:
        groups.setdefault((row.family, row.size, row.attention), []).append(row)
    written = []
    for (family, size, attention), group in groups.items():
        fig, axes = plt.subplots(1, 3, figsize=(17, 5))
        methods = sorted({r.method for r in group if r.method != "unpatched"})
        for method in methods:
            pts = sorted((r.reduction, r.speedup, r.rel_error) for r in group if r.method == method)
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=method)
            axes[1].plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=method)
            axes[2].scatter([p[2] for p in pts], [p[1] for p in pts], label=method)
        axes[0].set(xlabel="tokens removed at the first level (ratio, or 1 - 1/factor^2)", ylabel="speed-up",
                    title="speed-up vs ratio")
        axes[1].set(xlabel="tokens removed at the first level", ylabel="relative error", title="error vs ratio")
        axes[2].set(xlabel="relative error vs unpatched", ylabel="speed-up", title="speed-up vs error")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"{family} {size}x{size} px, batch 2, {attention} attention")
        fig.tight_layout()
        path = out / f"{family.lower()}_{size}_{attention}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--comfyui", type=Path, help="a ComfyUI folder to run in (default: the pinned host)")
    parser.add_argument("--checkpoint", type=Path, help="benchmark this checkpoint instead of random weights")
    parser.add_argument("--families", nargs="+", default=["SD15", "SDXL"], choices=["SD15", "SD21", "SDXL"])
    parser.add_argument("--sizes", nargs="+", type=int, help="px (default 512 768 1024, plus 2048 on a GPU)")
    parser.add_argument("--attention", nargs="+", default=["sub-quad", "sdpa"], choices=["sub-quad", "sdpa", "split"])
    parser.add_argument("--configs", nargs="*", help="only these configs (exact names; unpatched always runs)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before each measurement")
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"],
                        help="random-weight UNet precision (default float16 on a GPU, float32 on a CPU)")
    parser.add_argument("--evals", type=int, help="UNet forwards per timed pass, at one sigma in one sampling run "
                                                  "(default 1 on a CPU, 4 on a GPU: keeps the sampler's per-run "
                                                  "setup out of the per-forward time)")
    parser.add_argument("--sample-steps", type=int, default=20,
                        help="with --checkpoint: steps of the full sampling run per config for the image study")
    parser.add_argument("--tiny", action="store_true", help="tiny models (a smoke test of the benchmark itself)")
    parser.add_argument("--quick", action="store_true", help="SD15 at 512 px, 2 repeats")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "benchmark")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    if args.comfyui is None:
        args.comfyui = host.run_inside_host(__file__).comfyui
    import torch

    if args.quick:
        args.families, args.sizes, args.repeats = ["SD15"], [512], 2
    if not args.sizes:
        args.sizes = [512, 768, 1024] + ([2048] if torch.cuda.is_available() else [])
    if args.dtype is None:
        args.dtype = "float16" if torch.cuda.is_available() else "float32"
    if args.evals is None:
        args.evals = 4 if torch.cuda.is_available() else 1
    if args.evals < 1:
        parser.error("--evals must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run(args)
    machine = _machine()
    settings = (f"Median of {args.repeats} timed passes after {args.warmup} warm-up pass(es), "
                f"{args.evals} UNet forward(s) per pass; random-weight UNet in {args.dtype}.")
    (args.out / "results.json").write_text(json.dumps(
        {"machine": machine, "settings": settings, "rows": [asdict(r) for r in rows]}, indent=1))
    markdown = to_markdown(rows, machine, settings)
    (args.out / "results.md").write_text(markdown + "\n")
    plots = plot(rows, args.out)
    print(markdown)
    print("\nwrote", args.out / "results.md", *plots, sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
