"""Where token reduction pays for itself, and where it does not (the ``auto`` rule).

Measured side by side on an NVIDIA H100 (PyTorch SDPA, float16; docs/benchmarks.md): a level
whose grid holds fewer than about 128x128 tokens is not worth reducing there. A forward at those
sizes is bound by launching kernels, not by the tokens: SD1.5 at 768 px (96x96 at its first
level) and SDXL at 1024 px (64x64 at its first attention level) ran 0.67x to 1.01x with every
method, while 128x128 grids and up gained (SDXL 2048 px 1.13x, SD1.5 1536 px 1.54x, Flux at 2048 px
1.32x with a plain reference; Flux at 1024 px, 64x64, 1.02x). A CPU gains at every size we measured
(SD1.5 512 px, 64x64: 1.18x), so the rule keeps reducing there. Other devices are not measured and
are treated as CPUs.
"""

from __future__ import annotations

import torch

CUDA_MIN_GRID_TOKENS = 128 * 128


def min_grid_tokens(device: torch.device) -> int:
    """The smallest grid (in tokens) the auto rule reduces on this device."""
    return CUDA_MIN_GRID_TOKENS if device.type == "cuda" else 0


def too_small(tokens: int, device: torch.device) -> bool:
    return tokens < min_grid_tokens(device)


def skipped_message(label: str, what: str, tokens: int, device: torch.device) -> str:
    return (f"{label}: reduce_when auto left {what} ({tokens} tokens) unreduced: on a {device.type.upper()} device "
            f"reduction pays from {min_grid_tokens(device)} tokens per grid (measured on an H100; below that the "
            f"GPU waits on kernel launches, not on tokens). Set reduce_when to always to reduce it anyway.")
