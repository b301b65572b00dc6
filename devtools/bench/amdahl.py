"""Where the unpatched forward's time goes, and the speed-up a configuration's reduction
allows (Amdahl's law). UNets only: each transformer block's self-attention (its projections
and the attention itself) and MLP are timed with forward hooks; models without a UNet layout
(DiTs) get no breakdown and no bounds."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .configs import Config


@dataclass(frozen=True)
class Parts:
    times: dict  # (part, level) -> seconds per forward; parts as in configs.PARTS
    levels: tuple[int, ...]  # the UNet's transformer levels, finest first
    total: float  # seconds of the whole hooked forward


@dataclass(frozen=True)
class Amdahl:
    share: float  # of the unpatched forward spent in the parts the config reduces
    bound: float  # the speed-up if those parts cost nothing: 1 / (1 - share)
    bound_at: float  # the speed-up if each reduced part cost in proportion to its remaining tokens


def part_times(model, step, warmup: int, layout) -> Parts | None:
    """Seconds of the unpatched forward per (part, level): self-attention split into its
    projections and the attention itself (what is left of the module), and the MLP; and the
    whole forward. Measured with device-synchronised forward hooks in one pass after
    ``warmup`` passes. None without a UNet ``layout``."""
    if layout is None:
        return None
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
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
    return Parts(times, layout.levels, total)


def amdahl(parts: Parts | None, config: Config) -> Amdahl | None:
    if parts is None:
        return None
    scales = config.scales(parts.levels)
    reduced = saved = 0.0
    for (part, level), seconds in parts.times.items():
        scale = scales.get(level, {}).get(part)
        if scale is not None and scale < 1:
            reduced += seconds
            saved += seconds * (1 - scale)
    total = parts.total
    return Amdahl(reduced / total, 1 / max(1e-9, 1 - reduced / total), total / max(1e-9, total - saved))


def breakdown(parts: Parts | None) -> dict | None:
    """Share of the forward per level: self-attention (split into the attention itself and
    its projections) and the MLP, finest level first."""
    if parts is None:
        return None
    names = {"core": "self-attention", "proj": "its projections", "ff": "MLP"}
    shares = {}
    for level in sorted({level for _, level in parts.times}):
        t = {part: parts.times.get((part, level), 0.0) for part in ("q", "k", "v", "out", "core", "ff")}
        t["proj"] = t["q"] + t["k"] + t["v"] + t["out"]
        for part in ("core", "proj", "ff"):
            shares[f"{names[part]} at downsample {level}"] = t[part] / parts.total
    return shares
