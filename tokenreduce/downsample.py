"""Token downsampling of keys and values on the 2-D grid (ToDo, Smith et al. 2024).

Queries keep every token; keys and values are pooled on the block's token grid, so attention
costs ``N x N/f^2`` instead of ``N x N`` and there is nothing to unmerge. Pooling works on the
grid (never on the flattened sequence) with ceil rounding, so non-integer factors and odd,
non-square grids work; it is deterministic.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

METHODS = ("nearest", "average", "bilinear", "bicubic")


def downsampled_grid(h: int, w: int, factor: float) -> tuple[int, int]:
    """The grid keys/values are pooled to: each side divided by factor, rounded up."""
    return max(1, math.ceil(h / factor - 1e-9)), max(1, math.ceil(w / factor - 1e-9))


def downsample_tokens(x: torch.Tensor, h: int, w: int, factor: float, method: str) -> torch.Tensor:
    """[B, h*w, C] -> [B, h'*w', C] pooled on the grid by ``factor`` per side."""
    batch, tokens, channels = x.shape
    if tokens != h * w:
        raise ValueError(f"{tokens} tokens are not a {h}x{w} grid")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; one of {', '.join(METHODS)}")
    th, tw = downsampled_grid(h, w, factor)
    if (th, tw) == (h, w):
        return x
    grid = x.transpose(1, 2).reshape(batch, channels, h, w)
    step = round(factor)
    exact = abs(factor - step) < 1e-9 and h % step == 0 and w % step == 0
    if method == "nearest":
        # Integer factors that divide the grid: plain strided subsampling, a view.
        out = grid[:, :, ::step, ::step] if exact else F.interpolate(grid, size=(th, tw), mode="nearest")
    elif method == "average":
        out = F.avg_pool2d(grid, step) if exact else F.adaptive_avg_pool2d(grid, (th, tw))
    else:
        out = F.interpolate(grid, size=(th, tw), mode=method, align_corners=False, antialias=True)
    return out.flatten(2).transpose(1, 2)


def strided_positions(size: int, target: int, factor: float, device=None) -> torch.Tensor:
    """``target`` of ``size`` positions, every ``factor``-th from the first (``floor(i * factor)``):
    with an integer factor a plain stride, whether or not it divides the size; with a
    non-integer one the steps alternate (1.5: 0, 1, 3, 4, 6, ...). Spread over the whole size:
    ``target = ceil(size / factor)`` puts the last one within ``factor`` of the end."""
    kept = (torch.arange(target, dtype=torch.float64, device=device) * factor + 1e-9).floor().long()
    return kept.clamp_(max=size - 1)


def grid_keep_index(grid: tuple[int, int, int], target: tuple[int, int, int], factors: tuple[float, float, float],
                    device=None) -> torch.Tensor:
    """Token indices (frame-major raster order of ``grid`` = (t, h, w)) that strided downsampling
    of the grid to ``target`` by ``factors`` (per axis) keeps, in order."""
    (_, h, w) = grid
    frames, rows, cols = (strided_positions(n, m, f, device) for n, m, f in zip(grid, target, factors))
    return ((frames[:, None, None] * h + rows[None, :, None]) * w + cols[None, None, :]).reshape(-1)


def pool_grid_tokens(x: torch.Tensor, dim: int, grid: tuple[int, int, int], target: tuple[int, int, int]) -> torch.Tensor:
    """Average pooling of ``x``'s tokens along ``dim`` (``t*h*w`` of them, frame-major raster
    order) from ``grid`` to ``target`` (each side rounded up)."""
    x = x.movedim(dim, 1)
    batch, rest = x.shape[0], x.shape[2:]
    cube = x.reshape(batch, *grid, -1).permute(0, 4, 1, 2, 3)  # [B, C, t, h, w]
    pooled = F.adaptive_avg_pool3d(cube, target) if any(n % m for n, m in zip(grid, target)) else \
        F.avg_pool3d(cube, tuple(n // m for n, m in zip(grid, target)))
    return pooled.permute(0, 2, 3, 4, 1).reshape(batch, -1, *rest).movedim(1, dim)
