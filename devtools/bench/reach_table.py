"""The quality budget across denoise (``benchmark.py --budget-reach OUT``, issue #51): does the
budget's unit, weighed by the share of sampling a run covers (``pays.weighed_change``), track
the picture from text to image down to a light image-to-image pass or hires fix?

    python3 devtools/benchmark.py --budget-reach out/reach                  # ~25 min on 2 CPU cores
    python3 devtools/benchmark.py --budget-reach out/reach --fixtures sd15 --denoise 1 0.3

Per photo fixture, reduction at its defaults and denoise (1: text to image from zeros; below 1:
image to image from each caption's own photo, as KSampler runs it, euler / simple): the change the
auto rule measures per kind of call on that run's first model call (``max_change`` 1e-6: nothing
reduces; the kind changing most is shown), the run's reach as the pack computes it from the
schedule (``window.schedule_reach``), the change weighed as the budget weighs it
(``pays.weighed_change``), the LPIPS of the final images with the reduction always applied, and
whether the default budget's verdict on the weighed change (left alone above 0.05) agrees with
"visible" (LPIPS above 0.05); beside it, whether weighing by the square root of the reach or by
the reach itself would agree. The verdict is the budget's alone: on a CPU the auto rule also
times ToDo's window, which on these small grids can leave it alone for speed.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from pathlib import Path

from . import PACK
from .budget_table import TINY, _decisions, each_fixture
from .configs import Config, todo, tome
from .quality_table import UNPATCHED, parsed_with_host
from .quality_table import _images as quality_images
from .unit_blocks import per_kind_unit

VISIBLE = 0.05  # LPIPS above this is a change one sees side by side (the line)
DEFAULT_BUDGET = 0.05  # max_change's default
REDUCTIONS = {
    "sd15": {"ToDo 2": {}, "ToMe 0.5": {}},
    "flux": {"ToDo 2 window": {"method": "window"}, "ToDo 2": {}, "ToMe 0.5": {}},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget-reach", type=Path, required=True, metavar="OUT")
    p.add_argument("--fixtures", nargs="+", default=["sd15", "flux"])
    p.add_argument("--denoise", type=float, nargs="+", default=[1.0, 0.6, 0.3, 0.15])
    p.add_argument("--seeds", type=int, default=2, help="images per caption (one batch)")
    p.add_argument("--steps", type=int, nargs="+", default=[8, 4], help="the schedules (euler, simple)")
    p.add_argument("--comfyui", type=Path)


def _images(pf, fx, patcher, caption: str, steps: int, denoise: float, seeds: int):
    """Decoded images of one caption: text to image at denoise 1, else from the caption's photo."""
    mode = "t2i" if denoise >= 1.0 else "i2i"
    return quality_images(pf, fx, patcher, caption, steps, mode, seeds, denoise)[0]


def run_fixture(host, name: str, args, log=print) -> dict:
    import photo_fixtures as pf
    from quality import metrics

    weighed_change = importlib.import_module(f"{PACK}.tokenreduce.pays").weighed_change  # as the budget weighs
    fx = pf.load(name)
    started = time.monotonic()
    unpatched = Config(UNPATCHED, UNPATCHED).apply(fx.patcher, host.appliers)
    rows = []
    for steps, denoise in ((steps, denoise) for steps in args.steps for denoise in args.denoise):
        refs = {c: _images(pf, fx, unpatched, c, steps, denoise, args.seeds) for c in pf.EVAL_CAPTIONS}
        for label, changes in REDUCTIONS[name].items():
            make = tome if label.startswith("ToMe") else todo
            units, reach, always = {}, [], []
            for caption in pf.EVAL_CAPTIONS:
                measuring = Config("m", "m", (make(max_change=TINY, **changes),)).apply(fx.patcher, host.appliers)
                _images(pf, fx, measuring, caption, steps, denoise, 1)
                for site, decision in _decisions(host, measuring):
                    if decision.change is not None:
                        units.setdefault(site, []).append(decision.change)
                        reach.append(decision.reach)
                on = Config("a", "a", (make(reduce_when="always", **changes),)).apply(fx.patcher, host.appliers)
                always += metrics.lpips(_images(pf, fx, on, caption, steps, denoise, args.seeds),
                                        refs[caption]).tolist()
            unit = max(statistics.fmean(v) for v in units.values()) if units else None  # the kind changing most
            r = statistics.fmean(reach) if reach else 1.0
            row = {"reduction": label, "denoise": denoise, "steps": steps, "reach": r, "unit": unit,
                   "weighed": weighed_change(unit, r) if unit is not None else None,
                   "lpips_always": statistics.fmean(always), "lpips_always_max": max(always)}
            row["visible"] = row["lpips_always"] > VISIBLE
            for suffix, power in (("", None), ("_sqrt", 0.5), ("_reach", 1.0)):  # the pack's, and two others
                weighed = row["weighed"] if power is None or unit is None else unit * r ** power
                row["left_alone" + suffix] = weighed is not None and weighed > DEFAULT_BUDGET
                row["agrees" + suffix] = row["left_alone" + suffix] == row["visible"]
            rows.append(row)
            log(f"{name} {label} {steps} steps, denoise {denoise:g}: reach {r:.3f}, unit {unit}, LPIPS always "
                f"{row['lpips_always']:.4f} ({time.monotonic() - started:.0f} s)")
    return {"fixture": name, "px": fx.spec.native_px, "seeds": args.seeds, "steps": args.steps,
            "captions": list(pf.EVAL_CAPTIONS), "rows": rows, "seconds": round(time.monotonic() - started)}


def markdown(result: dict) -> str:
    lines = [f"\n{result['fixture']} fixture ({result['px']} px, {len(result['captions'])} captions x "
             f"{result['seeds']} seeds)\n",
             "| reduction | steps | denoise | reach | unit (kind changing most) | weighed | LPIPS (max) | "
             "at max_change 0.05 | agrees with LPIPS 0.05 | x sqrt(reach) would | x reach would |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    yes = {True: "yes", False: "**no**"}
    for row in result["rows"]:
        unit = row["unit"]
        cells = f"{unit:.3f} | {row['weighed']:.3f}" if unit is not None else "- | -"
        verdict = "left alone" if row["left_alone"] else "reduced"
        lines.append(f"| {row['reduction']} | {row['steps']} | {row['denoise']:g} | {row['reach']:.2f} | {cells} | "
                     f"{row['lpips_always']:.4f} ({row['lpips_always_max']:.4f}) | {verdict} | "
                     f"{yes[row['agrees']]} | {yes[row['agrees_sqrt']]} | {yes[row['agrees_reach']]} |")
    return "\n".join(lines)


def main(argv: list[str], comfyui: Path | None) -> int:
    args, host = parsed_with_host(__doc__, add_arguments, argv, comfyui)
    with per_kind_unit():  # the unit this table weighed: ToDo on DiTs per kind, at the run's first call
        return each_fixture(host, args, args.budget_reach / "reach.json", run_fixture, markdown)
