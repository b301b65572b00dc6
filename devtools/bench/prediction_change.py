"""What ``measure_change``'s readout means on a trained model (``benchmark.py --prediction-change
OUT``, issue #46): per photo fixture and setting of the quality table (docs/quality.md), the
prediction change the node reports at the first reduced step beside the LPIPS of the final image
against unpatched, image by image, and the quality table's own LPIPS for the same setting.

    python3 devtools/benchmark.py --prediction-change out/change                # ~10 min on 2 CPU cores
    python3 devtools/benchmark.py --prediction-change out/change --seeds 1 --fixtures sd15   # a quick look

How: each setting is applied by its nodes (in-process, as ComfyUI executes them) with
``reduce_when`` always, as in the quality table, and ``measure_change`` on (on the last node of a
stack: the readout is the change of every TokenReduce node on the model together). Each image is
its own run (batch 1: one readout per image), text to image, euler / simple at ``--steps``, the
fixture's CFG; the readout is read from the node's report (``RunReport.prediction_change``), the
LPIPS from ``quality/metrics.py`` against the same seed unpatched. ``quality_lpips`` is the quality
table's mean LPIPS of the same setting in the same cell (text to image at 20 steps, 16 seeds x 4
captions; ``docs/results/quality_fixtures.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from . import REPO
from .configs import Config, Node
from .quality_table import ALWAYS, UNPATCHED, _images, configs

QUALITY = REPO / "docs" / "results" / "quality_fixtures.json"
MEASURE = {"measure_change": True}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prediction-change", type=Path, required=True, metavar="OUT")
    p.add_argument("--fixtures", nargs="+", default=["sd15", "flux"])
    p.add_argument("--seeds", type=int, default=2, help="images per caption (each its own run)")
    p.add_argument("--steps", type=int, default=20, help="the schedule (euler, simple)")
    p.add_argument("--configs", nargs="+", help="a subset by name")
    p.add_argument("--comfyui", type=Path)


def measuring(config: Config) -> Config:
    """The setting with measure_change on its last node (our nodes only: the built-in has no readout)."""
    *first, last = config.nodes
    return Config(config.name, config.method, (*first, Node(last.kind, (*last.changes, *MEASURE.items()))))


def readout(host, model) -> tuple[float, int | None]:
    """The last run's prediction change and its step, from the report of the model's last node."""
    change = host.sessions_of(model)[-1].last_report.prediction_change
    return change.change, change.step


def quality_lpips(fixture: str, steps: int) -> dict[str, float]:
    """{setting: the quality table's mean LPIPS in its text-to-image cell at ``steps`` steps}."""
    if not QUALITY.exists():
        return {}
    for result in json.loads(QUALITY.read_text()):
        if result["fixture"] == fixture:
            return {name: row["by_cell"].get(f"t2i|{steps}") for name, row in result["rows"].items()}
    return {}


def run_fixture(host, name: str, args, log=print) -> dict:
    import photo_fixtures as pf
    from quality import metrics

    fx = pf.load(name)
    chosen = [c for c in configs(name)[1:] if c.nodes[-1].kind in ("tome", "todo")
              and "shared plans" not in c.name and "tile" not in c.name and (not args.configs or c.name in args.configs)]
    patched = {c.name: measuring(c).apply(fx.patcher, host.appliers) for c in chosen}
    table = quality_lpips(name, args.steps)
    runs = {c.name: [] for c in chosen}
    started = time.monotonic()
    for caption in pf.EVAL_CAPTIONS:
        for seed in range(args.seeds):
            reference, _ = _seeded(pf, fx, fx.patcher, caption, args.steps, seed)
            for config in chosen:
                image, _ = _seeded(pf, fx, patched[config.name], caption, args.steps, seed)
                change, step = readout(host, patched[config.name])
                runs[config.name].append({"caption": caption, "seed": seed, "change": change, "step": step,
                                          "lpips": float(metrics.lpips(image, reference)[0])})
        log(f"{name}: {caption!r} done ({time.monotonic() - started:.0f} s)")
    rows = {}
    for config in chosen:
        r = runs[config.name]
        rows[config.name] = {
            "change": statistics.fmean(x["change"] for x in r), "change_min": min(x["change"] for x in r),
            "change_max": max(x["change"] for x in r), "step": r[0]["step"],
            "lpips": statistics.fmean(x["lpips"] for x in r), "quality_lpips": table.get(config.name),
            "images": len(r), "runs": r,
        }
    return {"fixture": name, "px": fx.spec.native_px, "steps": args.steps, "seeds": args.seeds,
            "captions": list(pf.EVAL_CAPTIONS), "rows": rows, "seconds": round(time.monotonic() - started)}


def _seeded(pf, fx, patcher, caption: str, steps: int, seed: int) -> tuple:
    """One text-to-image run of batch 1 from ``seed``'s noise (the quality table's sampling)."""
    import comfy.sample
    import torch

    size = fx.latent_size()
    latent = torch.zeros(1, fx.spec.latent_channels, size, size)
    noise = comfy.sample.prepare_noise(latent, seed)
    with torch.no_grad():
        out = comfy.sample.sample(patcher, noise, steps, pf.CFG[fx.spec.name], "euler", "simple",
                                  fx.conditioning(caption, 1), fx.conditioning(pf.EMPTY, 1), latent,
                                  seed=seed, disable_pbar=True)
        return fx.vae.decode(out), out


def markdown(result: dict) -> str:
    lines = ["| setting | prediction change at step 1: mean (min-max) | LPIPS of the final image: these runs | "
             "LPIPS: quality table |", "|---|---|---|---|"]
    for name, r in result["rows"].items():
        table = f"{r['quality_lpips']:.4f}" if r["quality_lpips"] is not None else "-"
        lines.append(f"| {name} | {100 * r['change']:.1f} % ({100 * r['change_min']:.1f}-{100 * r['change_max']:.1f} %)"
                     f" | {r['lpips']:.4f} | {table} |")
    return "\n".join(lines)


def main(argv: list[str], comfyui: Path | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    from . import environment

    host = environment.load(args.comfyui or comfyui)
    sys.path.insert(0, str(REPO / "devtools"))
    out = args.prediction_change
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.fixtures:
        result = run_fixture(host, name, args)
        results.append(result)
        print(f"\n{name} fixture ({result['px']} px, text to image, {args.steps} steps, {len(result['captions'])} "
              f"captions x {args.seeds} seeds, each its own run; {result['seconds']} s):\n")
        print(markdown(result), flush=True)
        (out / "prediction_change.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0
