"""reduce_when auto's quality budget (``max_change``, issue #46) on the trained photo fixtures
(``benchmark.py --budgets OUT``): per fixture and reduction at its defaults (ToDo 2, ToMe 0.5),
the change the auto rule measures per kind of call (relative L2 of the unit's output: a UNet
level's first block, a DiT's attention call with ToDo, a DiT's block with ToMe), then for each
budget which kinds auto leaves alone and the LPIPS of the final images against unpatched; and the
same changes on random weights of the same architectures (where the budget must never bind: the
GPU benchmark's models).

    python3 devtools/benchmark.py --budgets out/budgets                       # ~10 min on 2 CPU cores
    python3 devtools/benchmark.py --budgets out/budgets --seeds 1 --steps 4   # a quick look

How: each node is applied with ``reduce_when auto`` and the budget, with a decisions store of its
own per caption (the benchmark host's, in memory), so the change is measured anew on each
caption's first model call (ToMe's and ToDo's DiT units on that call's own inputs) as a user's
first run measures it; on the CPU auto does not time, so the budget alone decides. Images are
sampled as the quality table samples them (text to image, euler / simple, the fixture's CFG), and
compared with ``quality/metrics.py``'s LPIPS.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

from .configs import Config, todo, tome
from .quality_table import UNPATCHED, _images, _random_fixture, parsed_with_host

TINY = 1e-6  # a budget every reduction exceeds: the run only measures (and reduces nothing)
REDUCTIONS = {"ToDo 2": todo, "ToMe 0.5": tome}  # at their defaults


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budgets", type=Path, required=True, metavar="OUT")
    p.add_argument("--fixtures", nargs="+", default=["sd15", "flux"])
    p.add_argument("--values", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3, 0.5],
                   help="the budgets (max_change) to compare; 0 (no budget) always comes first")
    p.add_argument("--reductions", nargs="+", default=list(REDUCTIONS), choices=list(REDUCTIONS))
    p.add_argument("--seeds", type=int, default=2, help="images per caption (one batch)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--comfyui", type=Path)


def _decisions(host, model) -> list:
    (session,) = host.sessions_of(model)
    return [(site, d) for site, d in session.last_report.decisions]


def _graded_notes(host, model) -> list[str]:
    """What the budget ran per block (ToDo on DiTs: the report's per-block line, from 'per block')."""
    (session,) = host.sessions_of(model)
    return [note.split(" · ", 2)[-1] for note in session.last_report.notes if ", per block, " in note]


def _changes(pf, host, fx, make, steps: int, seeds: int) -> dict:
    """{site: [change per caption]}: the auto rule's measurement with a budget nothing meets; a
    UNet's blocks one by one (issue #51: the store's per-block measurements, '..., block
    input.1.0, nearest'), other units as the report's decisions hold them."""
    out = {}
    for caption in pf.EVAL_CAPTIONS:
        model = Config("m", "m", (make(max_change=TINY),)).apply(fx.patcher, host.appliers)
        _images(pf, fx, model, caption, steps, "t2i", seeds)
        (session,) = host.sessions_of(model)
        logged = [(site, d) for site, d in session.patch.rule.decisions.log if ", block " in site] \
            if session.patch.rule is not None else []
        for site, decision in logged or _decisions(host, model):
            if decision.change is not None:  # a speed decision (ToDo on DiTs: the budget decides per block)
                out.setdefault(site, []).append(decision.change)
    return out


def run_fixture(host, name: str, args, log=print) -> dict:
    import photo_fixtures as pf
    from quality import metrics

    fx = pf.load(name)
    started = time.monotonic()
    unpatched = Config(UNPATCHED, UNPATCHED).apply(fx.patcher, host.appliers)
    refs = {c: _images(pf, fx, unpatched, c, args.steps, "t2i", args.seeds)[0] for c in pf.EVAL_CAPTIONS}
    rand = pf.Fixture(fx.spec, _random_fixture(pf, fx), fx.vae, fx.text, fx.codec)
    result = {"fixture": name, "px": fx.spec.native_px, "seeds": args.seeds, "steps": args.steps,
              "captions": list(pf.EVAL_CAPTIONS), "reductions": {}}
    for label, make in ((label, REDUCTIONS[label]) for label in args.reductions):
        changes = _changes(pf, host, fx, make, args.steps, args.seeds)
        random_changes = _changes(pf, host, rand, make, 4, 1)
        rows = []
        for budget in [0.0, *args.values]:
            lp, left, graded = [], {}, []
            for caption in pf.EVAL_CAPTIONS:
                model = Config("m", "m", (make(max_change=budget),)).apply(fx.patcher, host.appliers)
                images, _ = _images(pf, fx, model, caption, args.steps, "t2i", args.seeds)
                lp += metrics.lpips(images, refs[caption]).tolist()
                for site, decision in _decisions(host, model):
                    left.setdefault(site, []).append(not decision.reduce)
                graded += _graded_notes(host, model)
            rows.append({"budget": budget, "lpips": statistics.fmean(lp), "lpips_max": max(lp),
                         "left_alone": {site: sum(v) / len(v) for site, v in left.items()}, "per_block": graded})
            log(f"{name} {label} budget {budget:g}: LPIPS {rows[-1]['lpips']:.4f}, left alone "
                f"{rows[-1]['left_alone']} ({time.monotonic() - started:.0f} s)")
        result["reductions"][label] = {
            "change": {site: {"mean": statistics.fmean(v), "min": min(v), "max": max(v)} for site, v in changes.items()},
            "random_change": {site: statistics.fmean(v) for site, v in random_changes.items()},
            "budgets": rows}
    result["seconds"] = round(time.monotonic() - started)
    return result


def markdown(result: dict) -> str:
    lines = []
    for label, r in result["reductions"].items():
        lines += [f"\n{result['fixture']} fixture, {label}: change per kind of call (trained: mean, min-max over "
                  f"captions; random weights)\n", "| kind of call | trained | random weights |", "|---|---|---|"]
        for site, c in r["change"].items():
            rand = r["random_change"].get(site)
            lines.append(f"| {site} | {c['mean']:.3f} ({c['min']:.3f}-{c['max']:.3f}) | "
                         f"{rand:.4f} |" if rand is not None else f"| {site} | {c['mean']:.3f} | - |")
        lines += ["", "| max_change | LPIPS (max) | left alone (share of captions per kind) |", "|---|---|---|"]
        for row in r["budgets"]:
            left = ", ".join(f"{site}: {share:.2g}" for site, share in row["left_alone"].items() if share) or "none"
            graded = "; ".join(sorted(set(row.get("per_block", ()))))
            lines.append(f"| {row['budget']:g}{' (no budget)' if not row['budget'] else ''} | {row['lpips']:.4f} "
                         f"({row['lpips_max']:.4f}) | {left}{' · per block: ' + graded if graded else ''} |")
    return "\n".join(lines)


def each_fixture(host, args, out: Path, run: Callable, say: Callable) -> int:
    """``run(host, name, args)`` per fixture of ``args.fixtures``, each result said (``say``: its
    markdown) and all of them written to the JSON file ``out`` after each fixture (a long run
    keeps what it finished)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.fixtures:
        results.append(run(host, name, args))
        print(say(results[-1]), flush=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


def main(argv: list[str], comfyui: Path | None) -> int:
    args, host = parsed_with_host(__doc__, add_arguments, argv, comfyui)
    return each_fixture(host, args, args.budgets / "budgets.json", run_fixture, markdown)
