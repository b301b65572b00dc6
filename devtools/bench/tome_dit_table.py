"""ToMe on DiTs against ToDo, side by side in one run (``benchmark.py --tome-dit``): per model a
Pareto table of speed-up against relative error vs unpatched, of ToDo, ToMe (whole-block
merging) and both, with the Amdahl bound of whole-block merging.

    python3 devtools/benchmark.py --tome-dit [--families Flux Wan21] [--size 512] [--clock cpu]
    /path/to/venv/bin/python devtools/benchmark.py --tome-dit --comfyui /path/to/ComfyUI ...  # another tree

Each configuration is applied by its node at its defaults (the rows name what they change) to one of
the benchmark's tiny random DiTs (``families.py``: e.g. Flux.1 with 2 double and 4 single blocks,
Wan 2.1 with 6 blocks, 5 latent frames; ``--families`` takes any of them, a model ToMe does not
merge stops the run), and timed on one denoising step through ComfyUI's sampler (``step.py``: the
cond and uncond forwards at mid-schedule), the repeats of all configurations interleaved round by
round; the median counts. Relative error: L2 of the noise predictions against unpatched. The Pareto
column names the rows that are both faster and closer to unpatched than a row off the front.

ToMe's own work (planning, merging the tokens with their positions, modulation and mask, restoring,
drawing the tiles) is timed apart, in an extra pass of ToMe at its defaults: the time inside its
block replacements less the blocks' own, plus ``make_tiles``; the table gives it as a share of the
time ToMe saved. A summary row per model closes the run.

The bound of whole-block merging (ToMe): the merged blocks take a share ``s`` of the unpatched
forward (timed with forward hooks on those blocks); merged, a block costs in proportion to its
tokens, ``f = merged tokens / tokens`` of the sequence it runs on (its grid and the text it
carries), so the forward can at best speed up ``1 / (1 - s + s * f)``. The table says what share
of that bound each ToMe row reaches.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

from .configs import TODO_NODE, TOME_NODE, TODO, TOME
from .families import FAMILIES
from .step import OneStep

UNETS = ("SD15", "SDXL", "SD21")
CONFIGS = {  # name -> ((node kind, overrides of its defaults), ...), applied in order
    "ToDo (defaults)": ((TODO_NODE, {}),),
    "ToDo factor 3": ((TODO_NODE, {"factor": 3.0}),),
    "ToMe (defaults)": ((TOME_NODE, {}),),
    "ToMe ratio 0.25": ((TOME_NODE, {"ratio": 0.25}),),
    "ToMe ratio 0.75": ((TOME_NODE, {"ratio": 0.75}),),
    "ToMe + ToDo (defaults)": ((TOME_NODE, {}), (TODO_NODE, {})),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tome-dit", action="store_true", help="this table (the flag that selects it)")
    p.add_argument("--families", nargs="+", default=["Flux", "Wan21"], choices=[f for f in FAMILIES if f not in UNETS],
                   help="the benchmark's tiny DiTs (those ToMe does not merge stop the run)")
    p.add_argument("--size", type=int, default=512, help="px, square")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: the process's CPU seconds (all its threads): steadier on a busy machine")
    p.add_argument("--threads", type=int, help="torch's CPU threads (with --clock cpu on a shared machine: 1, so "
                   "CPU seconds are the work's own, not threads spinning)")
    p.add_argument("--comfyui", type=Path, help="a ComfyUI folder to run in, with this Python (its venv's; "
                   "default: the pinned host and its venv)")


def _apply(host, model, nodes) -> object:
    defaults = {TOME_NODE: TOME.defaults, TODO_NODE: TODO.defaults}
    for kind, overrides in nodes:
        model = host.appliers[kind](model, {**defaults[kind](), **overrides})
    return model


def _tome_patch(host, patched):
    return next(s.patch for s in host.sessions_of(patched) if type(s.patch).__name__ == "ToMeDiTPatch")


def _merged_share(model, step, patch, clock) -> float:
    """Share of the unpatched forward spent in the blocks ``patch`` merges (device-synchronised
    forward hooks), after one warm-up pass."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    diffusion_model = model.get_model_object("diffusion_model")
    paths = patch.family.blocks(diffusion_model)
    spent = [0.0]
    handles = []
    for index in patch.replace_keys():
        block = diffusion_model.get_submodule(paths[index])

        def pre(_m, _a):
            sync()
            spent[0] -= clock()

        def post(_m, _a, _o):
            sync()
            spent[0] += clock()
        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    try:
        step(model)
        spent[0] = 0.0
        start = clock()
        step(model)
        total = clock() - start
    finally:
        for handle in handles:
            handle.remove()
    return spent[0] / total


def _tome_own_seconds(model, step, patch, clock) -> float:
    """Seconds per step ToMe spends on its own work, timed in an extra pass of the patched
    ``model``: in each of its block replacements, everything but the block itself (planning,
    merging the tokens and their positions, modulation and mask, restoring), and drawing the
    tiles before each model call (``make_tiles``); device-synchronised."""
    import sys
    import torch

    tome_dit = sys.modules[type(patch).__module__]  # the pack's core, as the host imported it
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    own = [0.0]

    def timing(function, sign=1):  # its time added to own (sign -1: taken back out)
        def run(*args, **kwargs):
            sync()
            own[0] -= sign * clock()
            try:
                return function(*args, **kwargs)
            finally:
                sync()
                own[0] += sign * clock()
        return run

    def ours(replacement):  # the block it runs (the host's, as it hands it) taken back out
        return timing(lambda args, extra: replacement(args, {**extra, "original_block": timing(extra["original_block"], -1)}))

    timed = model.clone()  # its options a copy: the model's own are left as they were
    replace = timed.model_options["transformer_options"]["patches_replace"]["dit"]
    for key in patch.replace_keys().values():
        replace[key] = ours(replace[key])
    make_tiles = tome_dit.make_tiles
    tome_dit.make_tiles = timing(make_tiles)
    try:
        step(timed)
        own[0] = 0.0
        step(timed)
    finally:
        tome_dit.make_tiles = make_tiles
    return own[0]


def _pareto(points: dict) -> dict:
    """{name: the rows that dominate it (both at least as fast and at least as close to unpatched,
    one of them strictly), the fastest first}: the front is the names with none."""
    return {name: sorted((other for other, (s, e) in points.items()
                          if s >= speed and e <= error and (s, e) != (speed, error)), key=lambda o: -points[o][0])
            for name, (speed, error) in points.items()}


def _where(config: str, dominated: dict) -> str:
    """The Pareto cell: yes, or the rows that dominate it (the fastest first)."""
    if not dominated[config]:
        return "yes"
    return f"no: {', '.join(dominated[config])} faster and closer"


DEFAULT, TODO3, BOTH = "ToMe (defaults)", "ToDo factor 3", "ToMe + ToDo (defaults)"


def run_family(host, name: str, args, clock) -> tuple[str, dict]:
    """The family's table, and its row of the summary."""
    import torch

    spec = FAMILIES[name]
    base = spec.build(True, 0, torch.float32)
    step = OneStep(base, args.size, spec.step_conditioning(True), downscale=spec.downscale, frames=spec.frames,
                   audio=spec.audio)
    models = {"unpatched": base, **{config: _apply(host, base, nodes) for config, nodes in CONFIGS.items()}}
    if not any(type(s.patch).__name__ == "ToMeDiTPatch" for s in host.sessions_of(models[DEFAULT])):
        raise SystemExit(f"{name}: ToMe does not merge this model's blocks")
    outputs = {config: step(model) for config, model in models.items()}  # also the warm-up
    times = {config: [] for config in models}
    for _ in range(args.repeats):
        for config, model in models.items():
            start = clock()
            step(model)
            times[config].append(clock() - start)
    seconds = {config: statistics.median(t) for config, t in times.items()}
    reference = outputs["unpatched"]
    error = {config: float((out - reference).norm() / reference.norm()) for config, out in outputs.items()}
    speed = {config: seconds["unpatched"] / seconds[config] for config in models}
    patch = _tome_patch(host, models[DEFAULT])
    share = _merged_share(base, step, patch, clock)
    own = _tome_own_seconds(models[DEFAULT], step, patch, clock)
    saved = seconds["unpatched"] - seconds[DEFAULT]
    dominated = _pareto({config: (speed[config], error[config]) for config in models})
    frames = f", {spec.frames} latent frames" if spec.frames > 1 else ""
    lines = [f"### {name} (tiny), {args.size} px{frames}",
             "", f"Merged blocks' share of the unpatched forward: {share:.0%}.",
             f"Bound of whole-block merging: 1 / (1 - s + s * f), s = {share:.2f}, f = merged tokens / tokens "
             f"(blocks merged cost in proportion to their tokens; their attention, quadratic, costs less: a row "
             f"may pass it); with the merged blocks free: {1 / (1 - share):.2f}x.", "",
             "| config | s / step | speed-up | rel. error | bound (whole blocks) | of bound | Pareto |",
             "|---|---|---|---|---|---|---|"]
    bounds = {}
    for config in models:
        if "ToMe" in config and "ToDo" not in config:
            report = next(s.last_report for s in host.sessions_of(models[config]) if type(s.patch).__name__ == "ToMeDiTPatch")
            before, after = next(iter(report.levels[0].tokens.values()))
            bounds[config] = 1 / (1 - share + share * after / before)
            bound = f"{bounds[config]:.2f}x | {speed[config] / bounds[config]:.0%}"
        else:
            bound = "- | -"
        lines.append(f"| {config} | {seconds[config]:.3f} | {speed[config]:.2f}x | {error[config]:.4f} | {bound} | "
                     f"{_where(config, dominated)} |")
    plan_share = f"{own / saved:.0%} of the time it saved" if saved > 0 else "it saved no time"
    lines += ["", f"ToMe's own work at its defaults (planning, merging, restoring, drawing tiles; timed apart in an "
              f"extra pass): {own:.3f} s / step, {own / seconds[DEFAULT]:.0%} of its step, {plan_share}.",
              f"ToMe (defaults) against ToDo factor 3: {speed[DEFAULT] / speed[TODO3]:.2f}x its speed-up at "
              f"{error[DEFAULT] / max(error[TODO3], 1e-12):.1f}x its error; on the Pareto front: "
              f"{_where(DEFAULT, dominated)}."]
    summary = {"family": name, "size": f"{args.size} px{frames}", "share": share, "bound": bounds[DEFAULT],
               "speed": speed[DEFAULT], "of bound": speed[DEFAULT] / bounds[DEFAULT], "error": error[DEFAULT],
               "todo3 error": error[TODO3], "todo3 speed": speed[TODO3], "both": (speed[BOTH], error[BOTH]),
               "plan": own / saved if saved > 0 else None, "pareto": _where(DEFAULT, dominated)}
    return "\n".join(lines), summary


SUMMARY_HEADER = ("| family | size | merged share s | bound | ToMe defaults | of bound | rel. error | ToDo factor 3 "
                  "| ToMe + ToDo | ToMe's own work / time saved | ToMe defaults on the Pareto front |\n"
                  "|---|---|---|---|---|---|---|---|---|---|---|")


def summary_row(row: dict) -> str:
    plan = "-" if row["plan"] is None else f"{row['plan']:.0%}"
    return (f"| {row['family']} | {row['size']} | {row['share']:.0%} | {row['bound']:.2f}x | {row['speed']:.2f}x | "
            f"{row['of bound']:.0%} | {row['error']:.4f} | {row['todo3 speed']:.2f}x, {row['todo3 error']:.4f} | "
            f"{row['both'][0]:.2f}x, {row['both'][1]:.4f} | {plan} | {row['pareto']} |")


def main(argv: list[str], comfyui: Path | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    from . import environment

    host = environment.load(args.comfyui or comfyui)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    import comfy.ldm.modules.attention as attention
    import torch

    print(f"{'CPU ' if args.clock == 'cpu' else ''}seconds per denoising step (cond + uncond), median of "
          f"{args.repeats}, configurations interleaved; relative L2 error of the noise predictions vs unpatched; "
          f"attention: {attention.optimized_attention.__name__}, {torch.get_num_threads()} torch threads.\n")
    rows = []
    for name in args.families:
        table, row = run_family(host, name, args, clock)
        rows.append(row)
        print(table, flush=True)
        print()
    print("Summary (ToMe at its defaults; ToDo factor 3 and ToMe + ToDo: speed-up, rel. error):\n")
    print("\n".join([SUMMARY_HEADER, *map(summary_row, rows)]), flush=True)
    return 0
