"""ToDo's window on a GPU: its fused kernel path against the softmax by hand (issue #50).

    python3 devtools/bench/window_check.py      # on a lent GPU, from the repository root

Per dtype (float32, bfloat16) and grid (Flux.1 1024 px and 2 MP at 24 heads x 128 with 512 text
tokens, the Flux fixture's 32x32, SD1.5's 64x64 level at 8 x 40, a 33x33 grid of unequal cells):
the largest difference between ``window_call`` through the device's fused kernels and the same
call with the softmax by hand, and whether a rerun is bit for bit. Host-free: torch and the core only.
Output of 2026-11-29 (an H200): ``docs/results/gpu-h200-2026-11-29/window-check.txt`` (the per-tile
mask), ``docs/results/gpu-h200-2026-11-29-corrected/window-check.txt`` (the shared call corrected per tile).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tokenreduce import peak_window as pw  # noqa: E402

# side, heads, dim, text; 33: cells of unequal size (the kernel with a mask row, not the flash split)
GRIDS = ((64, 24, 128, 512), (32, 3, 64, 64), (64, 8, 40, 0), (90, 24, 128, 512), (33, 3, 64, 64))


def by_hand(call):
    """``call()`` with the fused kernel off: the softmax by hand."""
    fused = pw._fused
    pw._fused = lambda q: None
    try:
        return call()
    finally:
        pw._fused = fused


def main() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for side, heads, dim, text in GRIDS:
            length = text + side * side
            generator = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(1, heads, length, dim, device="cuda", generator=generator).to(dtype)
                       for _ in range(3))
            target = -(-side // 2)
            plan = pw.window_plan(length, text, (1, side, side), (1, target, target), (1, 2, 2), "cuda")

            def call():
                return pw.window_call(q, k, v, heads, 2, plan, pw.sdpa, 16, True)

            kernel, hand, again = call(), by_hand(call), call()
            print(dtype, side, heads, dim, text, "max|kernel - by hand|",
                  (kernel.float() - hand.float()).abs().max().item(), "rerun bit for bit", torch.equal(kernel, again),
                  flush=True)


if __name__ == "__main__":
    main()
