"""The trained Flux photo fixture through the diffusers adapter (``benchmark.py --diffusers-fixture OUT``):
issue #51 asks that a trained model through diffusers be reduced within the quality budget or left
alone with the report saying why. The fixture's weights in diffusers' ``FluxTransformer2DModel``
(``devtools/diffusers_fixture.py``: the same model calls as ComfyUI's to 6e-7, the same images
to 3e-7), each setting applied with ``tokenreduce.diffusers.apply_patch`` and a decisions store
of its own per caption (as the ComfyUI tables: each caption's first call measures; on the CPU auto
does not time, so the budget alone decides), images sampled as the ComfyUI quality table samples
them (euler, simple, CFG 1, text to image), LPIPS against unpatched, and what each run's report
says it did.

    python3 devtools/benchmark.py --diffusers-fixture out/dfx                 # ~6 min on 2 CPU cores
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

# label -> (method, settings, steps): the nodes' defaults (auto with the budget), the reductions
# without a budget, and ToMe's plan reuse corrected from the whole blocks on a long schedule
SETTINGS = {
    "ToDo 2 (defaults: auto, max_change 0.05)": ("ToDo", {}, 4),
    "ToDo 2 nearest, always": ("ToDo", {"reduce_when": "always"}, 4),
    "ToDo 2 window, always": ("ToDo", {"method": "window", "reduce_when": "always"}, 4),
    "ToMe 0.5 (defaults: auto, max_change 0.05)": ("ToMe", {}, 4),
    "ToMe 0.5, always": ("ToMe", {"reduce_when": "always"}, 4),
    "ToMe 0.5, always (20 steps)": ("ToMe", {"reduce_when": "always"}, 20),
    "ToMe 0.5, plans every 5, corrected, always (20 steps)": (
        "ToMe", {"reduce_when": "always", "share_plans": True, "plan_every": 5, "correct_from_whole": True}, 20),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--diffusers-fixture", type=Path, required=True, metavar="OUT")
    p.add_argument("--seeds", type=int, default=2, help="images per caption")
    p.add_argument("--comfyui", type=Path)


def _own_store(api, pays):
    """Each apply_patch gets an in-memory decisions store (nothing read from or written to the
    user's cache): every caption's first call measures, as a first run on a machine does."""
    api.decisions_at = lambda path: pays.Decisions(None)


def run(args, log=print) -> dict:
    import photo_fixtures as pf
    from quality import metrics

    import diffusers_fixture as dfx
    from tokenreduce import pays
    from tokenreduce.diffusers import api, apply_patch

    _own_store(api, pays)
    fx = pf.load("flux")
    model = dfx.flux_transformer(fx)
    start = time.perf_counter()
    seeds = range(args.seeds)
    refs = {}
    for steps in sorted({steps for _, _, steps in SETTINGS.values()}):
        for caption in pf.EVAL_CAPTIONS:
            refs[steps, caption] = [dfx.sample(model, fx, caption, seed, steps) for seed in seeds]
    # the ComfyUI node's unpatched image of the same caption and seed: the diffusers model is the same model
    parity = max(float((refs[4, c][0] - pf.sample(fx, fx.patcher, c, 0, 4)).abs().max()) for c in pf.EVAL_CAPTIONS)
    rows = {}
    for label, (method, settings, steps) in SETTINGS.items():
        lp, said = [], []
        for caption in pf.EVAL_CAPTIONS:
            with apply_patch(model, method, **settings) as patch:
                for seed in seeds:
                    image = dfx.sample(model, fx, caption, seed, steps)
                    lp.append(float(metrics.lpips(image, refs[steps, caption][seeds.index(seed)])))
                    said.append(" | ".join(line for line in patch.report_lines()[1:] if line))
        rows[label] = {"method": method, "settings": settings, "steps": steps, "lpips": statistics.fmean(lp),
                       "lpips_max": max(lp), "images": len(lp), "reports": said}
        log(f"{label}: LPIPS {rows[label]['lpips']:.4f} (max {rows[label]['lpips_max']:.4f}); "
            f"{rows[label]['reports'][0]}")
    return {"fixture": "flux", "captions": list(pf.EVAL_CAPTIONS), "seeds": args.seeds, "parity_max_abs": parity,
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
    lines = ["| setting (diffusers, trained Flux fixture) | steps | LPIPS (max) | what the report says (first caption) |",
             "|---|---|---|---|"]
    for label, row in result["rows"].items():
        said = _decisions(row["reports"][0]).replace("|", "/")
        lines.append(f"| {label} | {row['steps']} | {row['lpips']:.4f} ({row['lpips_max']:.4f}) | {said} |")
    return "\n".join(lines)


def main(argv: list[str], comfyui: Path | None) -> int:
    args, _host = parsed_with_host(__doc__, add_arguments, argv, comfyui)
    result = run(args)
    print(f"\nunpatched through diffusers against ComfyUI's: max abs {result['parity_max_abs']:.2e} "
          f"({result['seconds']} s)\n")
    print(markdown(result), flush=True)
    out = args.diffusers_fixture / "diffusers_fixture.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return 0
