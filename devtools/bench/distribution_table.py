"""Whether a setting makes worse images or only other ones (``benchmark.py --distribution OUT``,
issue #50): a distribution measure beside the same-seed distance, on the trained photo fixtures.

    python3 devtools/benchmark.py --distribution out/distribution                 # both fixtures, 4 steps
    python3 devtools/benchmark.py --distribution out/distribution --fixtures flux --seeds 16 --steps 20 \
        --candidates --configs "ToMe 0.5" "ToMe 0.5 plans every 5 corrected"    # a candidate, 20 steps

A same-seed distance (the quality table's LPIPS) says how far each image moved from the one made
without the reduction, not whether it got worse: ToMe for SD chose its random merge targets by
FID, although they move each image further. So here, per fixture and setting, a *set* of images
(text to image, the four eval captions x ``--seeds`` images each, noise seed 0, as the quality
table draws it) is held against a *reference set* made without any reduction from other noise
(the same captions and count, noise seed 1), by KID (``quality.metrics.kid``: the unbiased kernel
distance of AlexNet features; 0 in expectation for one distribution). The unpatched row is the
floor: the model's own images of seed 0 against those of seed 1. A setting whose KID stays within
the spread of the floor makes images of the model's own kind, however far each one moved; one well
above it makes a kind of its own (blocky detail, a mosaic).

Each setting is applied by its node with ``reduce_when`` always, as in the quality table. Columns:
KID x 10^3 against the reference set, its spread (the standard deviation over 50 random halves of
both sets; the full sets' estimate moves about 1/sqrt(2) of that), and the same images' mean
same-seed LPIPS against unpatched (how far each moved).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from .budget_table import each_fixture
from .quality_table import CANDIDATES, UNPATCHED, _images, configs, parsed_with_host

REFERENCE_SEED, SET_SEED = 1, 0
# Beside the quality table's settings: ToMe's fixed merge targets, since random ones were chosen by
# a distribution measure (FID) although they move each image further from the unpatched one.
EXTRA = tuple(c for c in CANDIDATES if c.name == "ToMe 0.5 fixed targets")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--distribution", type=Path, required=True, metavar="OUT")
    p.add_argument("--fixtures", nargs="+", default=["sd15", "flux"])
    p.add_argument("--seeds", type=int, default=32, help="images per caption in each set (one batch)")
    p.add_argument("--steps", type=int, default=4, help="the schedule (euler, simple)")
    p.add_argument("--configs", nargs="+", help="a subset by name (unpatched always)")
    p.add_argument("--candidates", action="store_true", help="the quality table's candidates for other defaults instead")
    p.add_argument("--comfyui", type=Path)


def _set(pf, fx, patcher, steps: int, seeds: int, noise_seed: int) -> tuple:
    """(images [captions x seeds, H, W, 3], their features) of one setting: text to image."""
    import torch

    from quality import metrics

    images = torch.cat([_images(pf, fx, patcher, caption, steps, "t2i", seeds, noise_seed=noise_seed)[0]
                        for caption in pf.EVAL_CAPTIONS])
    return images, metrics.features(images)


def run_fixture(host, name: str, args, log=print) -> dict:
    import photo_fixtures as pf
    from quality import metrics

    fx = pf.load(name)
    settings = configs(name, True) if args.candidates else configs(name) + EXTRA
    chosen = [c for c in settings if not args.configs or c.name == UNPATCHED or c.name in args.configs]
    started = time.monotonic()
    _, reference = _set(pf, fx, fx.patcher, args.steps, args.seeds, REFERENCE_SEED)
    rows, unpatched_images = {}, None
    for config in chosen:
        images, found = _set(pf, fx, config.apply(fx.patcher, host.appliers), args.steps, args.seeds, SET_SEED)
        if config.name == UNPATCHED:
            unpatched_images = images
        rows[config.name] = {
            "kid": metrics.kid(found, reference), "kid_spread": metrics.kid_spread(found, reference),
            "lpips": statistics.fmean(metrics.lpips(images, unpatched_images).tolist()), "images": images.shape[0]}
        log(f"{name}: {config.name}: KID x 10^3 {rows[config.name]['kid'] * 1e3:.3f} "
            f"({time.monotonic() - started:.0f} s)")
    return {"fixture": name, "px": fx.spec.native_px, "seeds": args.seeds, "steps": args.steps,
            "captions": list(pf.EVAL_CAPTIONS), "rows": rows, "seconds": round(time.monotonic() - started)}


def markdown(result: dict) -> str:
    rows = result["rows"]
    floor = rows[UNPATCHED]
    lines = ["| setting | KID x 10^3 (spread) | above the floor, in spreads | same-seed LPIPS |", "|---|---|---|---|"]
    for name, row in rows.items():
        above = "-" if name == UNPATCHED else f"{(row['kid'] - floor['kid']) / floor['kid_spread']:.1f}"
        lines.append(f"| {name} | {row['kid'] * 1e3:.3f} ({row['kid_spread'] * 1e3:.3f}) | {above} | {row['lpips']:.4f} |")
    return "\n".join(lines)


def said(result: dict) -> str:
    return (f"\n{result['fixture']} fixture ({result['px']} px; {len(result['captions'])} captions x {result['seeds']} "
            f"images a set, text to image, {result['steps']} steps; {result['seconds']} s):\n\n{markdown(result)}")


def main(argv: list[str], comfyui: Path | None) -> int:
    args, host = parsed_with_host(__doc__, add_arguments, argv, comfyui)
    return each_fixture(host, args, args.distribution / "distribution.json", run_fixture, said)
