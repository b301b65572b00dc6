"""Which quality-budget unit says which block the picture forgives (``benchmark.py --unit-blocks OUT``,
issue #51): ToDo on the Flux photo fixture one block at a time, per block and method (nearest, the
window) the units a budget could read beside the final images' LPIPS against unpatched.

    python3 devtools/benchmark.py --unit-blocks out/unit          # ~6 min on 2 CPU cores

How: each block b alone is reduced by the ToDo node (``skip_first_blocks`` b, ``skip_last_blocks``
the rest; in-process, as ComfyUI executes it), text to image for the four eval captions, ``--seeds``
seeds each, euler / simple at ``--steps``. The units, each read from the node's report:

- *output*: the budget's unit (the block's output, residual included, on its own input), read with
  ``max_change`` 1e-9 at the first reduced call of a run that starts reducing at ``start_percent``
  0, and at each of ``--late`` (a later step: where the picture forms);
- *update*: the change of the block's update ``block(x) - x`` instead (the unit's two sides with the
  block's input taken out), at the first call;
- *prediction*: ``measure_change``'s prediction change at the first reduced step;
- *rehearsed*: the output unit read on a late input made before sampling starts, as a budget
  deciding at the first call could make it: the unpatched model's one-step prediction noised
  again (with the run's own noise) to the schedule's step at ``--late``'s last value, one model
  call there (``rehearsed``);
- *LPIPS*: the final images with the block reduced at every step (``reduce_when`` always).

Spearman's rank correlation of each unit with LPIPS over the blocks (per method, and over both
methods' rows) says how well it would rank per-block decisions. Then the SD photo fixture per
setting (its nodes reduce one level): the output unit at the first call and at ``--late``, and
LPIPS, for a threshold that must serve both models. Results in ``OUT/unit_blocks.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import time
from pathlib import Path

from . import PACK

METHODS = ("nearest", "window")
TINY = 1e-9  # max_change: every kind over it, so each decision says its change


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--unit-blocks", type=Path, required=True, metavar="OUT")
    p.add_argument("--seeds", type=int, default=1, help="images per caption (each its own run)")
    p.add_argument("--steps", type=int, default=4, help="the schedule (euler, simple)")
    p.add_argument("--late", type=float, nargs="+", default=[0.5, 0.75],
                   help="start_percent values at which the output unit is also read")
    p.add_argument("--comfyui", type=Path)


@contextlib.contextmanager
def update_unit():
    """The budget's two sides return the block's update (its output less its input) while inside."""
    import torch

    todo_dit = importlib.import_module(f"{PACK}.tokenreduce.todo_dit")
    original = todo_dit.on_copies

    def on_update(block, args, extra):
        def run():
            out = block({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}, extra)
            return {k: out[k] - args[k] for k in out}
        return run

    todo_dit.on_copies = on_update
    try:
        yield
    finally:
        todo_dit.on_copies = original


@contextlib.contextmanager
def per_kind_unit():
    """ToDo on DiTs reads its budget's unit per kind, at the call (the first reduced block on its
    own input), as before per-block decisions (issue #51; still their fallback): the unit this
    study compares with the others, whose own late per-block reading came out of it."""
    todo_dit_blocks = importlib.import_module(f"{PACK}.tokenreduce.todo_dit_blocks")
    original = todo_dit_blocks.BlockBudget._graded
    todo_dit_blocks.BlockBudget._graded = lambda *_args, **_kwargs: None
    try:
        yield
    finally:
        todo_dit_blocks.BlockBudget._graded = original


def own_change(host, model) -> float:
    """The change of the method's own decision in the model's last run (not the window measured in
    nearest's place)."""
    decisions = host.sessions_of(model)[-1].last_report.decisions
    return next(d.change for site, d in decisions if "instead" not in site)


def one_step_prediction(pf, fx, caption: str, seed: int):
    """The unpatched model's denoised prediction of one euler step from ``seed``'s noise."""
    from .prediction_change import _seeded

    return _seeded(pf, fx, fx.patcher, caption, 1, seed)[1]


def rehearsed(pf, fx, patcher, caption: str, steps: int, seed: int, prediction, late: float) -> None:
    """One model call at the step of ``steps`` nearest ``late``, on ``prediction`` noised to that
    step's level with ``seed``'s noise (KSampler Advanced's start and last step)."""
    import comfy.sample
    import torch

    start = min(steps - 1, round(late * steps))
    noise = comfy.sample.prepare_noise(torch.zeros_like(prediction), seed)
    with torch.no_grad():
        comfy.sample.sample(patcher, noise, steps, pf.CFG[fx.spec.name], "euler", "simple",
                            fx.conditioning(caption, 1), fx.conditioning(pf.EMPTY, 1), prediction, seed=seed,
                            disable_pbar=True, start_step=start, last_step=start + 1, force_full_denoise=True)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties take their mean rank; 0 where either side is constant)."""
    def ranks(values):
        return [statistics.fmean(r for r, w in enumerate(sorted(values)) if w == v) for v in values]
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    norm = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / norm if norm else 0.0


def run_fixture(host, args, log=print) -> dict:
    import photo_fixtures as pf
    from quality import metrics

    from .prediction_change import _seeded

    todo = importlib.import_module(f"{PACK}.tokenreduce.methods").TODO.defaults()
    fx = pf.load("flux")
    blocks = len(fx.patcher.model.diffusion_model.double_blocks) + len(fx.patcher.model.diffusion_model.single_blocks)
    names = [f"double {i}" for i in range(len(fx.patcher.model.diffusion_model.double_blocks))] + \
            [f"single {i}" for i in range(len(fx.patcher.model.diffusion_model.single_blocks))]
    started = time.monotonic()

    def node(block: int, method: str, **changes):
        settings = {**todo, "method": method, "skip_first_blocks": block, "skip_last_blocks": blocks - 1 - block,
                    **changes}
        return host.appliers["todo"](fx.patcher, settings)

    predictions = {(caption, seed): one_step_prediction(pf, fx, caption, seed)
                   for caption in pf.EVAL_CAPTIONS for seed in range(args.seeds)}
    rows = []
    for block in range(blocks):
        for method in METHODS:
            cells = {"output": [], "update": [], "prediction": [], "lpips": [],
                     **{f"output at {late:g}": [] for late in args.late}, "rehearsed": []}
            for caption in pf.EVAL_CAPTIONS:
                for seed in range(args.seeds):
                    reference, _ = _seeded(pf, fx, fx.patcher, caption, args.steps, seed)
                    model = node(block, method, max_change=TINY)
                    rehearsed(pf, fx, model, caption, args.steps, seed, predictions[caption, seed], args.late[-1])
                    cells["rehearsed"].append(own_change(host, model))
                    for start, key in ((0.0, "output"), *((late, f"output at {late:g}") for late in args.late)):
                        model = node(block, method, max_change=TINY, start_percent=start)
                        _seeded(pf, fx, model, caption, args.steps, seed)
                        cells[key].append(own_change(host, model))
                    with update_unit():
                        model = node(block, method, max_change=TINY)
                        _seeded(pf, fx, model, caption, args.steps, seed)
                    cells["update"].append(own_change(host, model))
                    model = node(block, method, reduce_when="always", measure_change=True)
                    image, _ = _seeded(pf, fx, model, caption, args.steps, seed)
                    cells["prediction"].append(host.sessions_of(model)[-1].last_report.prediction_change.change)
                    cells["lpips"].append(float(metrics.lpips(image, reference)[0]))
            rows.append({"block": names[block], "method": method,
                         **{k: statistics.fmean(v) for k, v in cells.items()}})
            log(f"flux: {names[block]}, {method} done ({time.monotonic() - started:.0f} s)")
    units = [k for k in rows[0] if k not in ("block", "method", "lpips")]
    correlation = {unit: {**{method: spearman([r[unit] for r in rows if r["method"] == method],
                                              [r["lpips"] for r in rows if r["method"] == method])
                             for method in METHODS},
                          "both": spearman([r[unit] for r in rows], [r["lpips"] for r in rows])}
                   for unit in units}
    return {"fixture": "flux", "steps": args.steps, "seeds": args.seeds, "captions": list(pf.EVAL_CAPTIONS),
            "late": args.late, "rows": rows, "spearman": correlation, "seconds": round(time.monotonic() - started)}


SD_SETTINGS = (("ToDo 2", "todo", {}), ("ToDo 2 window", "todo", {"method": "window"}), ("ToMe 0.5", "tome", {}))


def run_sd(host, args, log=print) -> dict:
    """The SD fixture beside it, per setting (its nodes' defaults reduce one level): the output unit at
    the first call and at ``--late``, and LPIPS; the same threshold must serve both fixtures."""
    import photo_fixtures as pf
    from quality import metrics

    from .prediction_change import _seeded

    methods = importlib.import_module(f"{PACK}.tokenreduce.methods")
    defaults = {"todo": methods.TODO.defaults(), "tome": methods.TOME.defaults()}
    fx = pf.load("sd15")
    started = time.monotonic()
    predictions = {(caption, seed): one_step_prediction(pf, fx, caption, seed)
                   for caption in pf.EVAL_CAPTIONS for seed in range(args.seeds)}
    rows = []
    for name, node, changes in SD_SETTINGS:
        def model(**more):
            return host.appliers[node](fx.patcher, {**defaults[node], **changes, **more})

        cells = {"output": [], **{f"output at {late:g}": [] for late in args.late}, "rehearsed": [], "lpips": []}
        for caption in pf.EVAL_CAPTIONS:
            for seed in range(args.seeds):
                measured = model(max_change=TINY)
                rehearsed(pf, fx, measured, caption, args.steps, seed, predictions[caption, seed], args.late[-1])
                cells["rehearsed"].append(own_change(host, measured))
                for start, key in ((0.0, "output"), *((late, f"output at {late:g}") for late in args.late)):
                    measured = model(max_change=TINY, start_percent=start)
                    _seeded(pf, fx, measured, caption, args.steps, seed)
                    cells[key].append(own_change(host, measured))
                reference, _ = _seeded(pf, fx, fx.patcher, caption, args.steps, seed)
                image, _ = _seeded(pf, fx, model(reduce_when="always"), caption, args.steps, seed)
                cells["lpips"].append(float(metrics.lpips(image, reference)[0]))
        rows.append({"setting": name, **{k: statistics.fmean(v) for k, v in cells.items()}})
        log(f"sd15: {name} done ({time.monotonic() - started:.0f} s)")
    return {"fixture": "sd15", "rows": rows, "seconds": round(time.monotonic() - started)}


def sd_markdown(result: dict) -> str:
    units = [k for k in result["rows"][0] if k not in ("setting", "lpips")]
    lines = [f"| SD fixture setting | {' | '.join(units)} | LPIPS |", "|---" * (len(units) + 2) + "|"]
    for r in result["rows"]:
        lines.append(f"| {r['setting']} | {' | '.join(f'{r[u]:.3f}' for u in units)} | {r['lpips']:.3f} |")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    units = list(result["spearman"])
    lines = [f"| block | method | {' | '.join(units)} | LPIPS |", "|---" * (len(units) + 3) + "|"]
    for r in result["rows"]:
        lines.append(f"| {r['block']} | {r['method']} | {' | '.join(f'{r[u]:.3f}' for u in units)} | {r['lpips']:.3f} |")
    lines += ["", "| Spearman with LPIPS | " + " | ".join(units) + " |", "|---" * (len(units) + 1) + "|"]
    for over in (*METHODS, "both"):
        lines.append(f"| {over} | " + " | ".join(f"{result['spearman'][u][over]:.2f}" for u in units) + " |")
    return "\n".join(lines)


def main(argv: list[str], comfyui: Path | None) -> int:
    from .quality_table import parsed_with_host

    args, host = parsed_with_host(__doc__, add_arguments, argv, comfyui)
    out = args.unit_blocks
    out.mkdir(parents=True, exist_ok=True)
    with per_kind_unit():
        result = run_fixture(host, args)
    print(f"\nflux fixture (text to image, {args.steps} steps, {len(result['captions'])} captions x {args.seeds} "
          f"seeds, each block alone; {result['seconds']} s):\n")
    print(markdown(result), flush=True)
    sd = run_sd(host, args)
    print(f"\nsd15 fixture (the same runs, per setting; {sd['seconds']} s):\n")
    print(sd_markdown(sd), flush=True)
    (out / "unit_blocks.json").write_text(json.dumps([result, sd], indent=1) + "\n")
    return 0
