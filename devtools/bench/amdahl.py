"""Where the unpatched forward's time goes, and the speed-up a configuration's reduction
allows (Amdahl's law). UNets: each transformer block's self-attention (its projections and the
attention itself) and MLP are timed with forward hooks. DiTs: each attention call over the
token grid is timed through the host's attention override, per block (what ToDo reduces there:
the keys of those calls; their projections run before the call and are not reduced). Models
the pack has no layout for get no breakdown and no bounds."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .configs import TODO_NODE, Config
from .timing import now


@dataclass(frozen=True)
class Parts:
    times: dict  # (part, level) -> seconds per forward; parts as in configs.PARTS
    levels: tuple[int, ...]  # the UNet's transformer levels, finest first; a DiT's blocks, in order
    total: float  # seconds of the whole hooked forward
    video: bool | None = None  # None: a UNet; a DiT: whether its grid has a time axis
    # a DiT: the grid's share of the keys of its image-only calls (the rest, reference and motion
    # tokens after the grid as Wan S2V's, ToDo keeps whole)
    grid_keys: float = 1.0


@dataclass(frozen=True)
class Amdahl:
    share: float  # of the unpatched forward spent in the parts the config reduces
    bound: float  # the speed-up if those parts cost nothing: 1 / (1 - share)
    bound_at: float  # the speed-up if each reduced part cost in proportion to its remaining tokens


def _sync():
    import torch

    return torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def _timed_pass(model, step, warmup: int, spent: dict) -> float:
    """Seconds per forward of one pass after ``warmup`` passes, with ``spent`` (what the hooks
    record) holding that pass alone."""
    for _ in range(warmup):
        step(model)
    spent.clear()
    start = now()
    step(model)
    return (now() - start) / step.evals


def part_times(model, step, warmup: int, layout, unet_kind: str) -> Parts | None:
    """Seconds of the unpatched forward per (part, level): self-attention split into its
    projections and the attention itself (what is left of the module), and the MLP; and the
    whole forward. Measured with device-synchronised forward hooks in one pass after
    ``warmup`` passes. DiTs: see ``_dit_part_times``. None without a ``layout``."""
    if layout is None:
        return None
    if layout.kind != unet_kind:
        return _dit_part_times(model, step, warmup, layout)
    sync = _sync()
    spent: dict = {}
    handles = []

    def timed(module, key):
        def pre(_m, _a):
            sync()
            spent.setdefault(key, []).append(-now())

        def post(_m, _a, _o):
            sync()
            spent[key][-1] += now()

        handles.extend([module.register_forward_pre_hook(pre), module.register_forward_hook(post)])

    for site in layout.sites:
        block = model.get_model_object(site.path)
        timed(block.attn1, ("attn1", site.level))
        for part, name in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("out", "to_out")):
            timed(getattr(block.attn1, name), (part, site.level))
        timed(block.ff, ("ff", site.level))
    try:
        total = _timed_pass(model, step, warmup, spent)
    finally:
        for handle in handles:
            handle.remove()
    times = {key: sum(values) / step.evals for key, values in spent.items()}
    for level in layout.levels:
        projections = sum(times.get((part, level), 0.0) for part in ("q", "k", "v", "out"))
        times[("core", level)] = max(0.0, times.pop(("attn1", level)) - projections)
    return Parts(times, layout.levels, total)


def _dit_part_times(model, step, warmup: int, layout) -> Parts:
    """Seconds per block of a DiT's attention calls over its token grid (the family's call
    plan says which calls those are, in the order the model makes them), timed around the
    attention function through ComfyUI's ``optimized_attention_override`` on a clone, chained
    to the override already there (the benchmark's backend choice); a model-function wrapper
    restarts the call count at every model call and, for a family that plans each call from its
    inputs (LTX-2: audio present or not), takes that call's plan."""
    sync = _sync()
    spent: dict = {}
    calls = [0]
    plan = [layout.plan]
    grid_keys = [1.0]
    timed = model.clone()
    options = timed.model_options.setdefault("transformer_options", {})
    previous = options.get("optimized_attention_override")

    def override(func, *args, **kwargs):
        index = calls[0]
        calls[0] = index + 1
        slot = plan[0][index] if index < len(plan[0]) else None
        sync()
        start = now()
        out = previous(func, *args, **kwargs) if previous is not None else func(*args, **kwargs)
        sync()
        if slot is not None and slot.block >= 0 and slot.kind in ("joint", "image"):
            key = ("core", slot.block)
            spent[key] = spent.get(key, 0.0) + now() - start
        return out

    def restart(apply_model, args):
        calls[0] = 0
        c = args["c"]
        diffusion_model = model.get_model_object("diffusion_model")
        inputs = {k: v for k, v in c.items() if k not in ("c_concat", "c_crossattn", "control", "transformer_options")}
        if layout.family.call_plan is not None:  # the model call's inputs, as the node's wrapper gives them
            plan[0] = layout.family.call_plan(diffusion_model, args["input"],
                                              c.get("c_crossattn"), inputs, c.get("transformer_options") or {})
            plan[0] = () if isinstance(plan[0], str) else plan[0]
        tokens = layout.family.tokens(diffusion_model, layout.family.patch(diffusion_model), args["input"],
                                      c.get("c_crossattn"), inputs)
        if tokens is not None and not isinstance(tokens, str) and tokens.image is not None:
            grid_keys[0] = math.prod(tokens.grid) / tokens.image[0]
        return apply_model(args["input"], args["timestep"], **c)

    options["optimized_attention_override"] = override
    timed.set_model_unet_function_wrapper(restart)
    total = _timed_pass(timed, step, warmup, spent)
    blocks = tuple(site.key[1] for site in layout.sites)
    return Parts({key: seconds / step.evals for key, seconds in spent.items()}, blocks, total, layout.family.video,
                 grid_keys[0])


def _dit_scales(config: Config, parts: Parts) -> dict[int, dict[str, float]]:
    """{block: {"core": fraction left}}: ToDo keeps 1/factor^2 of the grid's keys (and
    1/temporal_factor of the frames on video) in the blocks its skips leave; the attention
    costs in proportion to its keys (the text keys of joint calls, a few percent at most, counted
    as reduced too; the tokens image-only calls have after the grid, kept whole). Nothing else of ours acts on a DiT (ToMe refuses it, the built-in finds nothing)."""
    out: dict[int, dict[str, float]] = {}
    for node in config.nodes:
        if node.kind != TODO_NODE:
            continue
        s = node.settings
        blocks = parts.levels
        chosen = blocks[s["skip_first_blocks"]: max(s["skip_first_blocks"], len(blocks) - s["skip_last_blocks"])]
        kept = 1 / (s["factor"] ** 2 * (s["temporal_factor"] if parts.video else 1.0))
        scale = 1 - parts.grid_keys * (1 - kept)
        for block in chosen:
            out.setdefault(block, {})["core"] = out.get(block, {}).get("core", 1.0) * scale
    return out


def amdahl(parts: Parts | None, config: Config) -> Amdahl | None:
    if parts is None:
        return None
    scales = _dit_scales(config, parts) if parts.video is not None else config.scales(parts.levels)
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
    if parts.video is not None:  # a DiT: only its attention over the grid is timed
        return {"attention over the token grid (all blocks)": sum(parts.times.values()) / parts.total}
    names = {"core": "self-attention", "proj": "its projections", "ff": "MLP"}
    shares = {}
    for level in sorted({level for _, level in parts.times}):
        t = {part: parts.times.get((part, level), 0.0) for part in ("q", "k", "v", "out", "core", "ff")}
        t["proj"] = t["q"] + t["k"] + t["v"] + t["out"]
        for part in ("core", "proj", "ff"):
            shares[f"{names[part]} at downsample {level}"] = t[part] / parts.total
    return shares
