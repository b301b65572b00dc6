"""ToDo's ``method`` window against plain strided ToDo, one grid attention call on this machine
(``benchmark.py --window-speed``, issue #50; host-free: torch and the core only).

    python3 devtools/benchmark.py --window-speed [--threads 1] [--repeats 10] [--device cpu]
    python3 devtools/benchmark.py --window-speed --device cuda --dtype bfloat16 --full-size  # a lent GPU

Per case: random q, k, v [1, heads, text + grid, dim]; full attention (SDPA over every key), ToDo
at factor 2 ``nearest`` (SDPA over the text and the strided keys), plain SDPA over as many keys
as the window's set (the issue's yardstick: the same key count), and ``peak_window.window_call``
with its 16 heavy keys and without them. Median of interleaved repeats after a warm-up, so drift
of the machine's speed hits every variant alike; each beside ToDo nearest's time. The window's
own speed is what this shows, not a model's: a block also runs projections and an MLP.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from . import REPO

if str(REPO) not in sys.path:  # the core, host-free: torch is all it needs
    sys.path.insert(0, str(REPO))
from tokenreduce.downsample import grid_keep_index  # noqa: E402
from tokenreduce.peak_window import HEAVY_KEYS, sdpa, window_call, window_plan  # noqa: E402

# (name, grid side, heads, head dim, text tokens, repeats at --repeats 10)
CASES = (
    ("the Flux fixture", 32, 3, 64, 64, 30),
    ("a Flux.1 1024 px grid, the fixture's width", 64, 3, 64, 64, 10),
    ("a Flux.1 1024 px grid, 8 heads x 128", 64, 8, 128, 256, 3),
    ("SD1.5 512 px, level 1's self-attention (a UNet: no text)", 64, 8, 40, 0, 3),
)
# Full size, for a GPU (--device cuda): Flux.1's 24 heads x 128 and 512 text tokens at 1 MP and 2 MP
# (2048 px: 4 MP of pixels, a 128x128 grid), SD1.5's level 1 at 2048 px.
GPU_CASES = (
    ("Flux.1 1024 px: 24 heads x 128, 512 text", 64, 24, 128, 512, 30),
    ("Flux.1 1448 px (2 MP): 24 heads x 128, 512 text", 90, 24, 128, 512, 20),
    ("Flux.1 2048 px: 24 heads x 128, 512 text", 128, 24, 128, 512, 10),
    ("SD1.5 2048 px, level 1's self-attention (a UNet: no text)", 256, 8, 40, 0, 5),
)


def _medians(work: dict, repeats: int, sync) -> dict:
    for run in work.values():
        run()
    times = {name: [] for name in work}
    for _ in range(repeats):
        for name, run in work.items():
            sync()
            start = time.perf_counter()
            run()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def case(side: int, heads: int, dim: int, text: int, repeats: int, device: torch.device,
         dtype: torch.dtype = torch.float32) -> dict:
    tokens = side * side
    length = text + tokens
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, dim, generator=generator).to(device, dtype) for _ in range(3))
    grid, target, factors = (1, side, side), (1, math.ceil(side / 2), math.ceil(side / 2)), (1, 2, 2)
    plan = window_plan(length, text, grid, target, factors, device)
    keep = torch.cat([torch.arange(text), grid_keep_index(grid, target, factors) + text]).to(device)
    per_query = text + plan.windows.numel() // plan.tiles + plan.kept + HEAVY_KEYS
    same = torch.arange(per_query, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ms = _medians({
        "full": lambda: sdpa(q, k, v, None),
        "ToDo 2 nearest": lambda: sdpa(q, k.index_select(2, keep), v.index_select(2, keep), None),
        "SDPA, the window's key count": lambda: sdpa(q, k.index_select(2, same), v.index_select(2, same), None),
        "window + 16 heavy": lambda: window_call(q, k, v, heads, 2, plan, sdpa, HEAVY_KEYS, True),
        "window, no heavy": lambda: window_call(q, k, v, heads, 2, plan, sdpa, 0, True),
    }, repeats, sync)
    return {"grid": f"{side}x{side}", "heads": heads, "dim": dim, "text": text, "tile": plan.tile[1:],
            "window": plan.window[1:], "image keys seen": round(plan.seen, 4), "keys per query": per_query,
            "keys per query, nearest": len(keep), "ms": {name: round(t, 2) for name, t in ms.items()}}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window-speed", action="store_true", required=True)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: a quiet, comparable figure)")
    p.add_argument("--repeats", type=int, default=10, help="scales each case's repeats (10: as listed in CASES)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--full-size", action="store_true", help="the full-size cases (GPU_CASES) instead of CASES")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{args.threads} thread(s)"
    print(f"torch {torch.__version__}, {device} ({where}), {args.dtype}")
    for name, side, heads, dim, text, repeats in GPU_CASES if args.full_size else CASES:
        row = case(side, heads, dim, text, max(3, repeats * args.repeats // 10), device, dtype)
        nearest = row["ms"]["ToDo 2 nearest"]
        print(f"\n{name}: {row['grid']}, {heads} heads x {dim}, {text} text tokens; tile {row['tile']}, window "
              f"{row['window']}; image keys seen {row['image keys seen']:.1%}; keys per query "
              f"{row['keys per query']} (nearest {row['keys per query, nearest']})")
        for label, ms in row["ms"].items():
            print(f"  {label:30s} {ms:9.2f} ms  {ms / nearest:5.2f}x ToDo 2 nearest's time")
