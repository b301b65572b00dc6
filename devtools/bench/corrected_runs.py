"""ToMe's ``correct_from_whole`` (issue #50) in whole sampling runs: its speed beside the same plan
reuse without it and unpatched, side by side in one run, on the trained Flux fixture at its own
512 px (1024 image tokens) and at 1024 px (4096).

    python3 devtools/benchmark.py --corrected-speed OUT                  # 20 steps, 512 and 1024 px
    python3 devtools/benchmark.py --corrected-speed OUT --sizes 512 --steps 20 --repeats 3

Why whole runs: the correction costs once per plan (the step that plans runs every merged block
whole as well as merged), so one timed forward cannot show it; a run of ``--steps`` steps (euler,
simple schedule, CFG as the quality table samples) can. Each configuration's runs are interleaved
round by round after a warm-up (``timing.measure``), on one torch thread by default (a steadier
figure on a shared CPU), and its final latent is compared with the unpatched run's (relative L2;
the pictures' LPIPS is the quality table's, ``--quality --candidates``).

The estimate beside a corrected row (its Amdahl-style bound): the plain plan-reusing row's time
plus, once every ``plan_every`` steps, one unpatched step (the merged blocks run whole once more;
they are most of a step), ``1 / (1 / S + 1 / plan_every)`` with ``S`` the plain row's speed-up.
Where the merged blocks are a smaller part of a step the run passes it; the copies of each
block's inputs, the difference and its addition are what it leaves out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from .configs import ALWAYS, Config, tome
from .timing import measure, use_clock

CONFIGS = (
    Config("unpatched", "unpatched"),
    Config("ToMe 0.5 plans every 5", "tome", (tome(share_plans=True, plan_every=5, **ALWAYS),)),
    Config("ToMe 0.5 plans every 5 corrected", "tome",
           (tome(share_plans=True, plan_every=5, correct_from_whole=True, **ALWAYS),)),
    Config("ToMe 0.5 plans every 10", "tome", (tome(share_plans=True, plan_every=10, **ALWAYS),)),
    Config("ToMe 0.5 plans every 10 corrected", "tome",
           (tome(share_plans=True, plan_every=10, correct_from_whole=True, **ALWAYS),)),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corrected-speed", dest="out", type=Path, required=True, metavar="OUT")
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 1024], help="image sizes (px)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each configuration")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--comfyui", type=Path)


class FixtureRun:
    """One text-to-image sampling run of the Flux fixture at ``px``: the first eval caption, CFG as
    the quality table samples, a fixed noise; returns the final latent."""

    def __init__(self, pf, fx, px: int, steps: int):
        import comfy.sample
        import torch

        self.torch, self.sample, self.pf, self.fx = torch, comfy.sample.sample, pf, fx
        size = fx.latent_size(px)
        self.latent = torch.zeros(1, fx.spec.latent_channels, size, size)
        self.noise = comfy.sample.prepare_noise(self.latent, 0)
        caption = pf.EVAL_CAPTIONS[0]
        self.positive, self.negative = fx.conditioning(caption), fx.conditioning(pf.EMPTY)
        self.evals = steps

    def __call__(self, model):
        with self.torch.inference_mode():
            return self.sample(model, self.noise, self.evals, self.pf.CFG[self.fx.spec.name], "euler", "simple",
                               self.positive, self.negative, self.latent, seed=0, disable_pbar=True)


def _rel(a, b) -> float:
    import torch

    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-12))


def run_size(host, pf, fx, px: int, args) -> list[dict]:
    models = {c.name: c.apply(fx.patcher, host.appliers) for c in CONFIGS}
    step = FixtureRun(pf, fx, px, args.steps)
    measured = measure(step, models, repeats=args.repeats, warmup={name: 1 for name in models},
                       progress=lambda name: None)
    base = measured["unpatched"]
    base_seconds = statistics.median(base.times)
    rows = []
    for config in CONFIGS:
        m = measured[config.name]
        seconds = statistics.median(m.times)
        row = {"px": px, "tokens": (fx.latent_size(px) // 2) ** 2, "config": config.name, "steps": args.steps,
               "seconds_per_step": seconds, "speedup": base_seconds / seconds, "rel_error": _rel(m.out, base.out),
               "repeats": m.times}
        if config.name.endswith(" corrected"):
            plain = measured[config.name.removesuffix(" corrected")]
            plain_speedup = base_seconds / statistics.median(plain.times)
            every = next(node.settings["plan_every"] for node in config.nodes)
            row["estimate"] = 1 / (1 / plain_speedup + 1 / every)
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| size (image tokens) | configuration | s / step | speed-up | estimate (plain + a step per plan) | "
             "rel. L2 latent |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        bound = f"{r['estimate']:.2f}x" if "estimate" in r else "-"
        lines.append(f"| {r['px']} px ({r['tokens']}) | {r['config']} | {r['seconds_per_step']:.3f} | "
                     f"{r['speedup']:.2f}x | {bound} | {r['rel_error']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str], comfyui: Path | None) -> int:
    from .quality_table import parsed_with_host

    args, host = parsed_with_host(__doc__, add_arguments, argv, comfyui)
    import photo_fixtures as pf
    import torch

    torch.set_num_threads(args.threads)
    use_clock("wall")
    fx = pf.load("flux")
    started, rows = time.monotonic(), []
    for px in args.sizes:
        rows += run_size(host, pf, fx, px, args)
        print(f"{px} px done ({time.monotonic() - started:.0f} s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "corrected_speed.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"\nFlux fixture, {args.steps} steps, {args.repeats} timed runs each, {args.threads} torch thread(s):\n")
    print(markdown(rows))
    return 0
