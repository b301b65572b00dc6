"""The trained photo fixtures through the diffusers adapter (``benchmark.py --diffusers-fixture OUT``):
issue #51 asks that a trained model through diffusers be reduced within the quality budget or left
alone with the report saying why. The fixtures' weights in diffusers' ``FluxTransformer2DModel``
and ``UNet2DConditionModel`` (``devtools/diffusers_fixture.py``: the same images as the ComfyUI
node's to 1.4e-6), each setting applied with ``tokenreduce.diffusers.apply_patch`` and a decisions store
of its own per caption (as the ComfyUI tables: each caption's first call measures; on the CPU auto
does not time, so the budget alone decides), images sampled as the ComfyUI quality table samples
them (euler, simple, the fixture's CFG, text to image), LPIPS against unpatched, and what each run's report
says it did.

    python3 devtools/benchmark.py --diffusers-fixture out/dfx                 # ~2 min on 2 CPU cores
    python3 devtools/benchmark.py --diffusers-fixture out/dfx --seeds 1       # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from . import REPO
from .quality_table import parsed_with_host

if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # the tokenreduce package of this checkout

# fixture -> label -> (method, settings, steps): the nodes' defaults (auto with the budget), the
# reductions always on, and (Flux) ToMe's plan reuse corrected from the whole blocks on a long schedule
SETTINGS = {
    "flux": {
        "ToDo 2 (defaults: auto, max_change 0.05)": ("ToDo", {}, 4),
        "ToDo 2, auto, max_change 0.1 (per block)": ("ToDo", {"max_change": 0.1}, 4),
        "ToDo 2, auto, max_change 0.2 (per block)": ("ToDo", {"max_change": 0.2}, 4),
        "ToDo 2 nearest, always": ("ToDo", {"reduce_when": "always"}, 4),
        "ToDo 2 window, always": ("ToDo", {"method": "window", "reduce_when": "always"}, 4),
        "ToMe 0.5 (defaults: auto, max_change 0.05)": ("ToMe", {}, 4),
        "ToMe 0.5, auto, max_change 0.2 (per block)": ("ToMe", {"max_change": 0.2}, 4),
        "ToMe 0.5, always": ("ToMe", {"reduce_when": "always"}, 4),
        "ToMe 0.5, always (20 steps)": ("ToMe", {"reduce_when": "always"}, 20),
        "ToMe 0.5, plans every 5, corrected, always (20 steps)": (
            "ToMe", {"reduce_when": "always", "share_plans": True, "plan_every": 5, "correct_from_whole": True}, 20),
    },
    "sd15": {
        "ToDo 2 (defaults: auto, max_change 0.05)": ("ToDo", {}, 4),
        "ToDo 2 nearest, always": ("ToDo", {"reduce_when": "always"}, 4),
        "ToMe 0.5 (defaults: auto, max_change 0.05)": ("ToMe", {}, 4),
        "ToMe 0.5, always": ("ToMe", {"reduce_when": "always"}, 4),
    },
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--diffusers-fixture", type=Path, required=True, metavar="OUT")
    p.add_argument("--fixtures", nargs="+", default=["flux", "sd15"], choices=sorted(SETTINGS))
    p.add_argument("--seeds", type=int, default=2, help="images per caption")
    p.add_argument("--comfyui", type=Path)


def _own_store(api, pays):
    """Each apply_patch gets an in-memory decisions store (nothing read from or written to the
    user's cache): every caption's first call measures, as a first run on a machine does."""
    api.decisions_at = lambda path: pays.Decisions(None)


def run(args, name: str, log=print) -> dict:
    import photo_fixtures as pf
    from quality import metrics

    import diffusers_fixture as dfx
    from tokenreduce import pays
    from tokenreduce.diffusers import api, apply_patch

    _own_store(api, pays)
    fx = pf.load(name)
    model = dfx.diffusers_model(fx)
    settings_of = SETTINGS[name]
    start = time.perf_counter()
    seeds = range(args.seeds)
    refs = {}
    for steps in sorted({steps for _, _, steps in settings_of.values()}):
        for caption in pf.EVAL_CAPTIONS:
            refs[steps, caption] = [dfx.sample(model, fx, caption, seed, steps) for seed in seeds]
    # the ComfyUI node's unpatched image of the same caption and seed: the diffusers model is the same model
    parity = max(float((refs[4, c][0] - pf.sample(fx, fx.patcher, c, 0, 4)).abs().max()) for c in pf.EVAL_CAPTIONS)
    rows = {}
    for label, (method, settings, steps) in settings_of.items():
        lp, said = [], []
        for caption in pf.EVAL_CAPTIONS:
            with apply_patch(model, method, **settings) as patch:
                for seed in seeds:
                    image = dfx.sample(model, fx, caption, seed, steps)
                    lp.append(float(metrics.lpips(image, refs[steps, caption][seeds.index(seed)])))
                    said.append(" | ".join(line for line in patch.report_lines()[1:] if line))
        rows[label] = {"method": method, "settings": settings, "steps": steps, "lpips": statistics.fmean(lp),
                       "lpips_max": max(lp), "images": len(lp), "reports": said}
        log(f"{name} {label}: LPIPS {rows[label]['lpips']:.4f} (max {rows[label]['lpips_max']:.4f}); "
            f"{rows[label]['reports'][0]}")
    return {"fixture": name, "captions": list(pf.EVAL_CAPTIONS), "seeds": args.seeds, "parity_max_abs": parity,
            "seconds": round(time.perf_counter() - start, 1), "rows": rows}


def _decisions(report: str) -> str:
    """A run's report as the table gives it: auto's decisions (with the times where it timed:
    they are the reason), or the reduction it ran."""
    parts = [p.strip() for p in report.split(" | ")]
    auto = [p.removeprefix("auto · ") for p in parts if p.startswith("auto · ")]
    auto = [p for p in auto if not p.startswith("measured ")]
    if not auto:
        return f"reduced: {parts[0]}" if parts else ""
    return "; ".join(auto)


def markdown(result: dict) -> str:
    lines = [f"| setting (diffusers, trained {result['fixture']} fixture) | steps | LPIPS (max) | "
             f"what the report says (first caption) |",
             "|---|---|---|---|"]
    for label, row in result["rows"].items():
        said = _decisions(row["reports"][0]).replace("|", "/")
        lines.append(f"| {label} | {row['steps']} | {row['lpips']:.4f} ({row['lpips_max']:.4f}) | {said} |")
    return "\n".join(lines)


def main(argv: list[str], comfyui: Path | None) -> int:
    args, _host = parsed_with_host(__doc__, add_arguments, argv, comfyui)
    out = args.diffusers_fixture / "diffusers_fixture.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.fixtures:
        results.append(run(args, name))
        print(f"\n{name}: unpatched through diffusers against ComfyUI's: max abs {results[-1]['parity_max_abs']:.2e} "
              f"({results[-1]['seconds']} s)\n")
        print(markdown(results[-1]), flush=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
    return 0
