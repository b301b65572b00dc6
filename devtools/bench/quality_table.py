"""What each setting does to the images of a trained model (``benchmark.py --quality OUT``, issue #44):
per photo fixture (``devtools/photo_fixtures.py``: a Flux.1 and an SD1.5 model trained here on
photographs), same-seed LPIPS, SSIM and PSNR of the final decoded images against unpatched, next to
the speed-up, with the Pareto front drawn by LPIPS.

    python3 devtools/benchmark.py --quality out/quality                    # the full table (CPU: ~1 h)
    python3 devtools/benchmark.py --quality out/quality --seeds 2 --steps 4 --modes t2i   # a quick look

How: each configuration is applied by its node (in-process, as ComfyUI executes it) to the fixture,
with ``reduce_when`` set to always (the table measures what a reduction does to the image; where
auto leaves a call alone at full size the image does not change at all, and the speed column says
so). Images are sampled as KSampler samples them (``comfy.sample.sample``, euler / simple) and
decoded by the fixture's VAE (ComfyUI's VAE class): text to image for each of the four eval
captions, and image to image (denoise 0.6) from each caption's own photo, ``--seeds`` images per
caption as one batch (the noise of seed ``s`` for the whole batch, as KSampler draws it), at each
schedule of ``--steps``. Unpatched and patched share every seed, so the metrics compare the same
image with and without the reduction.

Columns: LPIPS (AlexNet, v0.1; lower is closer), SSIM and PSNR (dB) of the decoded images against
unpatched, mean over every image of the cell; the relative L2 of the final latents; the same
configuration's relative L2 on random weights of the same architecture (the old proxy, kept to show
how far it misleads: 4-step text to image, ``--random-seeds`` images per caption); the speed-up
of the same configuration at full size on a GPU, read from the committed GPU table
(``docs/results/gpu-h100-2026-11-27/tome.jsonl``: SD1.5 and Flux.1 at 1024 px on an H100, with
``reduce_when auto``, whose decision is named); and the Pareto front by LPIPS against that speed-up
(unpatched at 1x and 0). Speed-ups of the tiny fixtures on a CPU are not GPU figures and are not
shown. Also written: one picture per fixture (``grid_<fixture>.png``: unpatched | ToDo | ToMe |
ToMe + ToDo (| the built-in ToMe on the UNet), the first caption and seed, text to image over image
to image, LPIPS and the speed-up under each).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import REPO
from .configs import BUILTIN_NODE, MATCH_TILE, MODE_PROPORTIONAL, Config, builtin, todo, tome

ALWAYS = {"reduce_when": "always"}
GPU_TABLE = REPO / "docs" / "results" / "gpu-h100-2026-11-27" / "tome.jsonl"
GPU_ROW = {"flux": "flux-1024-tome", "sd15": "sd15-1024-tome"}
UNPATCHED = "unpatched"
# The configurations, by the names the GPU table gives the same settings (there with reduce_when auto).
COMMON = (
    Config(UNPATCHED, "unpatched"),
    Config("ToDo 2", "todo", (todo(**ALWAYS),)),  # ToDo's defaults
    Config("ToDo 2 window", "todo-window", (todo(method="window", **ALWAYS),)),  # issue #50 (UNets: ComfyUI's)
    Config("ToDo 3", "todo", (todo(factor=3.0, **ALWAYS),)),
    Config("ToMe 0.5", "tome", (tome(**ALWAYS),)),  # ToMe's defaults
)
ONLY = {
    # On DiTs either order stacks the same; on UNets ToDo goes first (docs/nodes.md: after ToMe's
    # q, k, v mode it would find its keys merged and leave them).
    "flux": (Config("ToMe 0.5 + ToDo 2", "combined", (tome(**ALWAYS), todo(**ALWAYS))),
             Config("ToMe 0.5 shared plans every 4", "tome-shared",
                    (tome(share_plans=True, plan_every=4, **ALWAYS),))),
    "sd15": (Config("ToMe 0.5 + ToDo 2", "combined", (todo(**ALWAYS), tome(**ALWAYS))),
             Config("ToMe 0.5 tile", "tome-tile", (tome(matching=MATCH_TILE, **ALWAYS),)),
             Config("built-in ToMe 0.3 (its default)", "builtin", (builtin(),))),
}
# Candidates for other defaults (``--candidates``: a quick look, e.g. 4 steps, text to image): which
# steps to reduce (start_percent / end_percent, in noise level: 0 is the first step), how much, how
# ToMe picks its merge targets, and which blocks ToDo leaves whole.
CANDIDATES = (
    Config("ToDo 2", "todo", (todo(**ALWAYS),)),
    Config("ToDo 2 late (start 0.4)", "todo", (todo(start_percent=0.4, **ALWAYS),)),
    Config("ToDo 2 early (end 0.6)", "todo", (todo(end_percent=0.6, **ALWAYS),)),
    Config("ToDo 1.5", "todo", (todo(factor=1.5, **ALWAYS),)),
    Config("ToDo 2 skip 2 + 2 blocks", "todo", (todo(skip_first_blocks=2, skip_last_blocks=2, **ALWAYS),)),
    Config("ToMe 0.5", "tome", (tome(**ALWAYS),)),
    Config("ToMe 0.3", "tome", (tome(ratio=0.3, **ALWAYS),)),
    Config("ToMe 0.5 late (start 0.5)", "tome", (tome(start_percent=0.5, **ALWAYS),)),
    Config("ToMe 0.5 fixed targets", "tome", (tome(use_rand=False, **ALWAYS),)),
    Config("ToMe 0.5 tile", "tome-tile", (tome(matching=MATCH_TILE, **ALWAYS),)),
    # proportional attention (issue #50): UNets only (mode does not apply to DiTs)
    Config("ToMe 0.5 proportional", "tome", (tome(mode=MODE_PROPORTIONAL, **ALWAYS),)),
    Config("ToMe 0.75 proportional", "tome", (tome(ratio=0.75, mode=MODE_PROPORTIONAL, **ALWAYS),)),
    # min_similarity (issue #50): ratio the most that merges, only tokens at least this alike
    Config("ToMe 0.1", "tome", (tome(ratio=0.1, **ALWAYS),)),  # about alike 0.9's count on the Flux fixture
    Config("ToMe 0.5 alike 0.95", "tome", (tome(min_similarity=0.95, **ALWAYS),)),
    Config("ToMe 0.5 alike 0.9", "tome", (tome(min_similarity=0.9, **ALWAYS),)),
    Config("ToMe 0.5 alike 0.8", "tome", (tome(min_similarity=0.8, **ALWAYS),)),
    Config("ToMe 0.75 alike 0.9", "tome", (tome(ratio=0.75, min_similarity=0.9, **ALWAYS),)),
    # correct_from_whole (issue #50): DiTs; the step that plans runs each merged block whole too
    Config("ToMe 0.5 plans every 5", "tome", (tome(share_plans=True, plan_every=5, **ALWAYS),)),
    Config("ToMe 0.5 plans every 5 corrected", "tome",
           (tome(share_plans=True, plan_every=5, correct_from_whole=True, **ALWAYS),)),
    Config("ToMe 0.5 plans every 2 corrected", "tome",
           (tome(share_plans=True, plan_every=2, correct_from_whole=True, **ALWAYS),)),
)
GRID = ("unpatched", "ToDo 2", "ToDo 2 window", "ToMe 0.5", "ToMe 0.5 + ToDo 2", "built-in ToMe 0.3 (its default)")
GRID_LABELS = {"unpatched": "unpatched", "ToDo 2": "ToDo", "ToDo 2 window": "ToDo window", "ToMe 0.5": "ToMe",
               "ToMe 0.5 + ToDo 2": "ToMe + ToDo", "built-in ToMe 0.3 (its default)": "built-in ToMe"}
I2I_DENOISE = 0.6


def configs(fixture: str, candidates: bool = False) -> tuple[Config, ...]:
    return COMMON[:1] + CANDIDATES if candidates else COMMON + ONLY[fixture]


@dataclass
class Cell:
    lpips: list
    ssim: list
    psnr: list
    rel: list


def gpu_speedups(fixture: str) -> dict[str, tuple[float, str]]:
    """{variant: (speed-up, auto's decision)} of the fixture's full-size GPU row."""
    out = {}
    if not GPU_TABLE.exists():
        return out
    for line in GPU_TABLE.read_text().splitlines():
        row = json.loads(line)
        if row.get("row") == GPU_ROW[fixture] and row.get("speedup"):
            out[row["variant"]] = (row["speedup"], row.get("decision") or "")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quality", type=Path, required=True, metavar="OUT")
    p.add_argument("--fixtures", nargs="+", default=["sd15", "flux"])
    p.add_argument("--seeds", type=int, default=16, help="images per caption (one batch)")
    p.add_argument("--long-seeds", type=int, help="images per caption at schedules of more than 4 steps "
                   "(default: --seeds; fewer keeps a large fixture's CPU time in bounds)")
    p.add_argument("--steps", type=int, nargs="+", default=[20, 4], help="the schedules (euler, simple)")
    p.add_argument("--modes", nargs="+", default=["t2i", "i2i"], choices=["t2i", "i2i"])
    p.add_argument("--random-seeds", type=int, default=4, help="images per caption on random weights")
    p.add_argument("--configs", nargs="+", help="a subset by name (unpatched always)")
    p.add_argument("--candidates", action="store_true", help="the candidates for other defaults instead")
    p.add_argument("--comfyui", type=Path)


def _images(pf, fx, patcher, caption: str, steps: int, mode: str, seeds: int,
            denoise: float = I2I_DENOISE, noise_seed: int = 0) -> tuple:
    """(decoded images [seeds, H, W, 3], final latents) of one caption, schedule and mode
    (``denoise``: image to image's), the batch's noise drawn as KSampler draws it for ``noise_seed``."""
    import comfy.sample
    import torch

    size = fx.latent_size()
    if mode == "t2i":
        latent = torch.zeros(seeds, fx.spec.latent_channels, size, size)
        denoise = 1.0
    else:
        photo = next(p for p in pf.PHOTOS if p.caption == caption)
        image = pf.square(pf.load_photo(photo.name), fx.spec.native_px).movedim(0, -1)[None]
        latent = fx.vae.encode(image).repeat(seeds, 1, 1, 1)
    noise = comfy.sample.prepare_noise(latent, noise_seed)
    with torch.no_grad():
        out = comfy.sample.sample(patcher, noise, steps, pf.CFG[fx.spec.name], "euler", "simple",
                                  fx.conditioning(caption, seeds), fx.conditioning(pf.EMPTY, seeds), latent,
                                  denoise=denoise, seed=noise_seed, disable_pbar=True)
        return fx.vae.decode(out), out


def _rel(a, b) -> list:
    import torch

    return [float(torch.linalg.vector_norm(x - y) / torch.linalg.vector_norm(y).clamp_min(1e-12)) for x, y in zip(a, b)]


def _random_fixture(pf, fx, seed: int = 0):
    """The fixture's architecture with random weights (as the benchmark's random models are filled).
    Built anew rather than deep-copied: ComfyUI 0.33's model config answers every missing
    attribute (``__deepcopy__`` too) with None."""
    import comfy.model_management
    import comfy.model_patcher
    from random_models import build_random

    model = build_random(lambda: pf.build(fx.spec)[0], seed)
    return comfy.model_patcher.ModelPatcher(model, load_device=comfy.model_management.get_torch_device(),
                                            offload_device=comfy.model_management.unet_offload_device())


def run_fixture(host, name: str, args, log=print) -> dict:
    import torch

    import photo_fixtures as pf
    from quality import metrics

    fx = pf.load(name)
    chosen = [c for c in configs(name, args.candidates) if not args.configs or c.name == UNPATCHED or c.name in args.configs]
    patched = {c.name: c.apply(fx.patcher, host.appliers) for c in chosen}
    cells = {c.name: Cell([], [], [], []) for c in chosen}
    per_cell = {}
    grid = {}
    merges = {}  # config -> (merged, ratio's count) of each plan min_similarity bounded
    started = time.monotonic()
    for steps in args.steps:
        seeds = args.long_seeds if args.long_seeds and steps > 4 else args.seeds
        for mode in args.modes:
            for caption in pf.EVAL_CAPTIONS:
                ref_img, ref_lat = _images(pf, fx, patched[UNPATCHED], caption, steps, mode, seeds)
                pictured = steps == max(args.steps) and caption == pf.EVAL_CAPTIONS[0]
                if pictured:
                    grid.setdefault(mode, {})[UNPATCHED] = ref_img[0]
                for config in chosen[1:]:
                    with _bounded_merges(merges.setdefault(config.name, [])):
                        img, lat = _images(pf, fx, patched[config.name], caption, steps, mode, seeds)
                    values = (metrics.lpips(img, ref_img).tolist(), metrics.ssim(img, ref_img).tolist(),
                              metrics.psnr(img, ref_img).clamp(max=99.0).tolist(), _rel(lat, ref_lat))
                    for target, v in zip((cells[config.name].lpips, cells[config.name].ssim,
                                          cells[config.name].psnr, cells[config.name].rel), values):
                        target.extend(v)
                    per_cell.setdefault(f"{config.name}|{mode}|{steps}", []).extend(values[0])
                    if pictured:
                        grid.setdefault(mode, {})[config.name] = (img[0], values[0][0])
            log(f"{name}: {mode}, {steps} steps done ({time.monotonic() - started:.0f} s)")
    random_rel = _random_rows(pf, fx, host, chosen, args)
    speed = gpu_speedups(name)
    rows = {}
    for config in chosen[1:]:
        c = cells[config.name]
        gpu = speed.get(config.name)
        rows[config.name] = {
            "lpips": statistics.fmean(c.lpips), "lpips_sd": statistics.pstdev(c.lpips),
            "ssim": statistics.fmean(c.ssim), "psnr": statistics.fmean(c.psnr), "rel": statistics.fmean(c.rel),
            "random_rel": random_rel.get(config.name), "images": len(c.lpips),
            "gpu_speedup": gpu[0] if gpu else None, "gpu_decision": gpu[1] if gpu else None,
            "by_cell": {k.split("|", 1)[1]: statistics.fmean(v) for k, v in per_cell.items()
                        if k.startswith(config.name + "|")},
            # min_similarity: the share of ratio's count its plans merged (None: unbounded, all of it)
            "merged_of_ratio": (sum(m for m, _ in merges[config.name]) / sum(r for _, r in merges[config.name])
                                if merges.get(config.name) else None),
        }
    front = _front({k: (v["gpu_speedup"], v["lpips"]) for k, v in rows.items() if v["gpu_speedup"]})
    for k, v in rows.items():
        v["front"] = front.get(k)
    args.quality.mkdir(parents=True, exist_ok=True)
    _save_grid(grid, rows, args.quality / f"grid_{name}.png")
    return {"fixture": name, "px": fx.spec.native_px, "seeds": args.seeds, "long_seeds": args.long_seeds or args.seeds,
            "steps": args.steps,
            "modes": args.modes, "captions": list(pf.EVAL_CAPTIONS), "rows": rows,
            "seconds": round(time.monotonic() - started)}


@contextlib.contextmanager
def _bounded_merges(records: list):
    """Record (merged, ratio's count) of every plan ToMe's min_similarity bounds while sampling
    (``alike_count``, where the planners of UNets and DiTs call it)."""
    import importlib

    from . import PACK

    modules = [importlib.import_module(f"{PACK}.tokenreduce.{name}") for name in ("bipartite", "tome_dit")]
    original = modules[0].alike_count

    def counting(similarity, r, bound):
        merged = original(similarity, r, bound)
        if bound and r > 0:
            records.append((merged, r))
        return merged

    for module in modules:
        module.alike_count = counting
    try:
        yield
    finally:
        for module in modules:
            module.alike_count = original


def _random_rows(pf, fx, host, chosen, args) -> dict:
    """{config: mean relative L2 of the final latents} on random weights (4-step text to image)."""
    import statistics as st

    base = _random_fixture(pf, fx)
    rand = pf.Fixture(fx.spec, base, fx.vae, fx.text, fx.codec)
    patched = {c.name: c.apply(base, host.appliers) for c in chosen}
    out = {}
    for caption in pf.EVAL_CAPTIONS:
        _, ref = _images(pf, rand, patched[UNPATCHED], caption, 4, "t2i", args.random_seeds)
        for config in chosen[1:]:
            _, lat = _images(pf, rand, patched[config.name], caption, 4, "t2i", args.random_seeds)
            out.setdefault(config.name, []).extend(_rel(lat, ref))
    return {k: st.fmean(v) for k, v in out.items()}


def _front(points: dict) -> dict:
    """{name: True, or the names both at least as fast and at least as close by LPIPS}; unpatched
    (1x, 0) counts."""
    points = {**points, UNPATCHED: (1.0, 0.0)}
    out = {}
    for name, (speed, lp) in points.items():
        better = [o for o, (s, e) in points.items() if o != name and s >= speed and e <= lp and (s, e) != (speed, lp)]
        out[name] = True if not better else better
    return out


def _save_grid(grid: dict, rows: dict, path: Path) -> None:
    import torch
    from PIL import Image, ImageDraw

    names = [n for n in GRID if n in grid.get("t2i", grid.get("i2i", {}))]
    tile = 256
    label_h = 34
    modes = [m for m in ("t2i", "i2i") if m in grid]
    canvas = Image.new("RGB", (tile * len(names), (tile + label_h) * len(modes)), "white")
    draw = ImageDraw.Draw(canvas)
    for r, mode in enumerate(modes):
        for c, name in enumerate(names):
            entry = grid[mode][name]
            image = entry if name == UNPATCHED else entry[0]
            pic = Image.fromarray((image.clamp(0, 1) * 255).to(torch.uint8).numpy())
            canvas.paste(pic.resize((tile, tile), Image.LANCZOS), (c * tile, r * (tile + label_h)))
            row = rows.get(name)
            text = GRID_LABELS[name] + (" (text to image)" if mode == "t2i" and name == UNPATCHED else
                                        " (image to image)" if name == UNPATCHED else "")
            if row:
                speed = f"{row['gpu_speedup']:.2f}x H100" if row["gpu_speedup"] else "-"
                text += f"\n{speed} · LPIPS {entry[1]:.3f}"
            draw.multiline_text((c * tile + 4, r * (tile + label_h) + tile + 2), text, fill="black", spacing=1)
    canvas.save(path)


def markdown(result: dict) -> str:
    lines = [f"| setting | LPIPS (sd) | SSIM | PSNR dB | rel. L2 latent | random weights: rel. L2 | "
             f"H100 1 MP speed-up (auto) | on the LPIPS front |", "|---|---|---|---|---|---|---|---|"]
    for name, r in result["rows"].items():
        front = r["front"]
        cell = "yes" if front is True else (f"no: {', '.join(front)}" if front else "-")
        speed = f"{r['gpu_speedup']:.3f}x ({_short(r['gpu_decision'])})" if r["gpu_speedup"] else "-"
        rand = f"{r['random_rel']:.4f}" if r["random_rel"] is not None else "-"
        merged = r.get("merged_of_ratio")
        if merged is not None:  # min_similarity: how much of ratio's count merged
            name = f"{name} (merged {merged:.0%} of ratio's count)"
        lines.append(f"| {name} | {r['lpips']:.4f} ({r['lpips_sd']:.4f}) | {r['ssim']:.4f} | {r['psnr']:.2f} | "
                     f"{r['rel']:.4f} | {rand} | {speed} | {cell} |")
    return "\n".join(lines)


def _short(decision: str) -> str:
    if not decision:
        return "-"
    reduced, alone = decision.count("reduced"), decision.count("left alone")
    return "reduced" if not alone else ("left alone" if not reduced else f"{reduced} reduced, {alone} left alone")


def parsed_with_host(doc: str, add: Callable, argv: list[str], comfyui: Path | None) -> tuple:
    """(arguments, the benchmark host) of a photo-fixture table: ``add`` declares its options."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add(p)
    args = p.parse_args(argv)
    from . import environment

    host = environment.load(args.comfyui or comfyui)
    sys.path.insert(0, str(REPO / "devtools"))  # photo_fixtures, quality.metrics
    return args, host


def main(argv: list[str], comfyui: Path | None) -> int:
    args, host = parsed_with_host(__doc__, add_arguments, argv, comfyui)
    results = []
    for name in args.fixtures:
        result = run_fixture(host, name, args)
        results.append(result)
        print(f"\n{name} fixture ({result['px']} px; {result['rows'][next(iter(result['rows']))]['images']} images "
              f"a setting: {len(result['captions'])} captions x {args.seeds} seeds ({result['long_seeds']} at more "
              f"than 4 steps) x {args.modes} x {args.steps} steps; {result['seconds']} s):\n")
        print(markdown(result), flush=True)
        (args.quality / "quality.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0
