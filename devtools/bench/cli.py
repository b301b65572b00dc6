"""The command line of ``devtools/benchmark.py``: options, defaults that depend on the device,
and the files it writes."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import REPO, gpu_table
from .families import FAMILIES, parse_size


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--comfyui", type=Path, help="a ComfyUI folder to run in (default: the pinned host)")
    p.add_argument("--checkpoint", type=Path, help="benchmark this checkpoint instead of random weights")
    p.add_argument("--families", nargs="+", default=["SD15", "SDXL"], choices=list(FAMILIES),
                   help="random-weight model families (SD3: a tiny DiT, with --tiny only; Flux and Wan21 "
                        "without --tiny: the released layouts, Flux.1 [dev] 12B and Wan 2.1 1.3B, GPU only for Flux)")
    p.add_argument("--sizes", nargs="+", type=_size, help="px, square (1024) or width x height (832x480: Wan's "
                                                         "480p) (default 512 768 1024, plus 2048 on a GPU)")
    p.add_argument("--frames", nargs="+", type=int,
                   help="latent frames of the video families, one run per count (Wan: 9 for 33 video frames, "
                        "21 for 81; default 5, 17 video frames)")
    p.add_argument("--attention", nargs="+", default=["sub-quad", "sdpa"], choices=["sub-quad", "sdpa", "split", "sage"],
                   help="attention backends, each through ComfyUI's override hook (sage: SageAttention's kernel "
                        "as ComfyUI calls it, where the sageattention package imports; ToDo chains to it)")
    p.add_argument("--configs", nargs="*", help="only these configs (exact names; unpatched always runs)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before each measurement")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: the process's CPU seconds (all its threads) instead of wall-clock seconds, for the "
                        "timed passes and the Amdahl breakdown: steadier on a CPU shared with other jobs")
    p.add_argument("--threads", type=int, help="torch's CPU threads (with --clock cpu on a shared machine: 1, so "
                                               "CPU seconds are the work's own, not threads spinning)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"],
                   help="random-weight model precision (default float16 on a GPU, float32 on a CPU)")
    p.add_argument("--evals", type=int, help="model forwards per timed pass, at one sigma in one sampling run "
                                             "(default 1 on a CPU, 4 on a GPU: keeps the sampler's per-run "
                                             "setup out of the per-forward time)")
    p.add_argument("--compile", action="store_true",
                   help="also measure every config compiled with ComfyUI's set_torch_compile_wrapper (what its "
                        "TorchCompileModel node does), against compiled unpatched; warm-up passes (at least "
                        "one) include compiling")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend for --compile (default inductor, as TorchCompileModel; "
                        "eager: a fast check of the wiring)")
    p.add_argument("--sample-steps", type=int, default=20,
                   help="with --checkpoint: steps of the full sampling run per config for the image study")
    p.add_argument("--measure-cpu", action="store_true",
                   help="on a CPU, let reduce_when auto time each kind of call and decide, as it does on a GPU (by "
                        "default the CPU reduces everywhere): shows its decisions and what timing them costs")
    p.add_argument("--stacks", action="store_true",
                   help="instead of one forward per config: whole sampling runs of the speed stack, each attention "
                        "backend alone, with EasyCache, with ToDo defaults, with both (and compiled with --compile); "
                        "writes stacks.md and stacks.json")
    p.add_argument("--stack-steps", type=int, default=20, help="with --stacks: steps per sampling run (default 20)")
    p.add_argument("--tiny", action="store_true", help="tiny models (a smoke test of the benchmark itself)")
    p.add_argument("--quick", action="store_true", help="SD15 at 512 px, 2 repeats")
    p.add_argument("--out", type=Path, default=REPO / "out" / "benchmark")
    gpu_table.add_arguments(p)
    return p


def _size(text: str):
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def complete(p: argparse.ArgumentParser, args) -> None:
    """Fill the defaults that depend on the device and check what argparse cannot."""
    import torch

    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.quick:
        args.families, args.sizes, args.repeats = ["SD15"], [512], 2
    tiny_only = [f for f in args.families if FAMILIES[f].tiny_only]
    if tiny_only and not args.tiny and not args.checkpoint:
        p.error(f"{', '.join(tiny_only)}: only with --tiny")
    too_big = [f for f in args.families if FAMILIES[f].gpu_only_full_size]
    if too_big and not args.tiny and not args.checkpoint and not torch.cuda.is_available():
        p.error(f"{', '.join(too_big)} at full size needs a GPU (tens of GB of weights): add --tiny on a CPU")
    if args.frames and (min(args.frames) < 1 or not any(FAMILIES[f].frames > 1 for f in args.families)):
        p.error("--frames: counts of at least 1, for a video family (Wan21)")
    if not args.sizes:
        args.sizes = [512, 768, 1024] + ([2048] if torch.cuda.is_available() else [])
    if args.dtype is None:
        args.dtype = "float16" if torch.cuda.is_available() else "float32"
    if args.evals is None:
        args.evals = 4 if torch.cuda.is_available() else 1
    if args.evals < 1:
        p.error("--evals must be at least 1")
    if args.clock == "cpu" and torch.cuda.is_available():
        p.error("--clock cpu is for a CPU run: a GPU's work is not the process's CPU time")
    if args.threads is not None:
        if args.threads < 1:
            p.error("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    if args.stacks and (args.checkpoint or args.stack_steps < 2):
        p.error("--stacks: random-weight families (no --checkpoint), --stack-steps of at least 2")
    if args.measure_cpu and torch.cuda.is_available():
        p.error("--measure-cpu is for a CPU run: on a GPU reduce_when auto measures anyway")


def settings_line(args) -> str:
    line = (f"Median of {args.repeats} timed passes after {args.warmup} warm-up pass(es), "
            f"{args.evals} model forward(s) per pass; random-weight models in {args.dtype}.")
    if args.clock == "cpu":
        import torch

        line += f" Seconds are the process's CPU seconds (--clock cpu), {torch.get_num_threads()} torch thread(s)."
    if args.measure_cpu:
        line += " reduce_when auto times and decides on the CPU (--measure-cpu)."
    if args.compile:
        line += (f" Compiled twins: torch.compile backend {args.compile_backend}, at least one warm-up pass "
                 f"(compiling) each.")
    return line


def main(args) -> int:
    """Run the benchmark for parsed, completed ``args`` and write results.md, results.json and the plots."""
    from . import environment, plots, report
    from .run import run

    presets = (args.gpu_table, args.gpu_table_video, args.gpu_table_tome, args.gpu_table_peaks)
    if any(out is not None for out in presets):
        args.out = next(out for out in presets if out is not None)
        return gpu_table.main(args)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stacks:
        return _stacks_main(args)
    rows, skipped = run(args)
    machine, settings = environment.machine(), settings_line(args)
    report.write_json(args.out / "results.json", machine, settings, rows, skipped)
    markdown = report.to_markdown(rows, machine, settings, skipped)
    (args.out / "results.md").write_text(markdown + "\n")
    written = plots.plot(rows, args.out)
    print(markdown)
    print("\nwrote", args.out / "results.md", args.out / "results.json", *written, sep="\n  ")
    return 0


def _stacks_main(args) -> int:
    import json

    from . import environment, stacks
    from .run import run_stacks

    rows = run_stacks(args)
    machine = environment.machine()
    settings = (f"Whole sampling runs of {args.stack_steps} steps (euler, simple), median of {args.repeats} timed "
                f"runs after an untimed one and {args.warmup} warm-up run(s); random-weight models in {args.dtype}; "
                "EasyCache at its node's defaults, ToDo at its defaults"
                + (f"; compiled: torch.compile backend {args.compile_backend}" if args.compile else "") + ".")
    markdown = stacks.to_markdown(rows, machine, settings)
    (args.out / "stacks.md").write_text(markdown + "\n")
    (args.out / "stacks.json").write_text(json.dumps(stacks.as_json(rows, machine, settings), indent=1))
    print(markdown)
    print("\nwrote", args.out / "stacks.md", args.out / "stacks.json", sep="\n  ")
    return 0
