"""ToMe on DiTs against ToDo, side by side in one run (``benchmark.py --tome-dit``): per model a
Pareto table of speed-up against relative error vs unpatched, of ToDo, ToMe (whole-block
merging) and both, with the Amdahl bound of whole-block merging.

    python3 devtools/benchmark.py --tome-dit [--families Flux Wan21] [--size 512] [--clock cpu]

Each configuration is applied by its node at its defaults (the rows name what they change) to the
benchmark's tiny random models (``families.py``: Flux.1 with 2 double and 4 single blocks, Wan 2.1
with 6 blocks, 17 frames), and timed on one denoising step through ComfyUI's sampler (``step.py``:
the cond and uncond forwards at mid-schedule), the repeats of all configurations interleaved round
by round; the median counts. Relative error: L2 of the noise predictions against unpatched.

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
    p.add_argument("--families", nargs="+", default=["Flux", "Wan21"], choices=["Flux", "Wan21"])
    p.add_argument("--size", type=int, default=512, help="px, square")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: the process's CPU seconds (all its threads): steadier on a busy machine")
    p.add_argument("--threads", type=int, help="torch's CPU threads (with --clock cpu on a shared machine: 1, so "
                   "CPU seconds are the work's own, not threads spinning)")
    p.add_argument("--comfyui", type=Path, help="a ComfyUI folder to run in (default: the pinned host)")


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


def _pareto(points: dict) -> set:
    """Names on the front: no other row is both faster and closer to unpatched."""
    return {name for name, (speed, error) in points.items()
            if not any(s >= speed and e <= error and (s, e) != (speed, error) for s, e in points.values())}


def run_family(host, name: str, args, clock) -> str:
    import torch

    spec = FAMILIES[name]
    base = spec.build(True, 0, torch.float32)
    step = OneStep(base, args.size, (spec.conditioning(True, 1), spec.conditioning(True, 2)),
                   downscale=spec.downscale, frames=spec.frames)
    models = {"unpatched": base, **{config: _apply(host, base, nodes) for config, nodes in CONFIGS.items()}}
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
    share = _merged_share(base, step, _tome_patch(host, models["ToMe (defaults)"]), clock)
    front = _pareto({config: (speed[config], error[config]) for config in models})
    lines = [f"### {name} (tiny), {args.size} px" + (f", {4 * spec.frames - 3} frames" if spec.frames > 1 else ""),
             "", f"Merged blocks' share of the unpatched forward: {share:.0%}.",
             f"Bound of whole-block merging: 1 / (1 - s + s * f), s = {share:.2f}, f = merged tokens / tokens "
             f"(blocks merged cost in proportion to their tokens; their attention, quadratic, costs less: a row "
             f"may pass it); with the merged blocks free: {1 / (1 - share):.2f}x.", "",
             "| config | s / step | speed-up | rel. error | bound (whole blocks) | of bound | Pareto |",
             "|---|---|---|---|---|---|---|"]
    for config in models:
        if "ToMe" in config and "ToDo" not in config:
            report = next(s.last_report for s in host.sessions_of(models[config]) if type(s.patch).__name__ == "ToMeDiTPatch")
            before, after = next(iter(report.levels[0].tokens.values()))
            limit = 1 / (1 - share + share * after / before)
            bound = f"{limit:.2f}x | {speed[config] / limit:.0%}"
        else:
            bound = "- | -"
        lines.append(f"| {config} | {seconds[config]:.3f} | {speed[config]:.2f}x | {error[config]:.4f} | {bound} | "
                     f"{'yes' if config in front else ''} |")
    return "\n".join(lines)


def main(argv: list[str], comfyui: Path) -> int:
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
    for name in args.families:
        print(run_family(host, name, args, clock), flush=True)
        print()
    return 0
