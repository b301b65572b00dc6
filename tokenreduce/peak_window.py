"""ToDo's ``window`` method on DiTs (issue #50): each query keeps its attention's peak.

Trained DiT attention is peaked, on each query's neighbours (the Flux fixture: 98 % of image
queries have their top key within one grid step) or on a few keys many queries share (sinks).
Plain strided ToDo keeps one key in four and so loses both. Here every query still sees a
reduced key set, but one that keeps the peak:

(a) the tokens around the grid (text, references) as they are, for every query;
(b) its tile's window: the query tile plus ``halo`` tokens on each side, every key exact;
(c) the far field: the strided keys nearest ToDo keeps (each with its own rotary position), each
    standing for the tokens of its cell that lie outside the window, so its logit gets
    ``+log(count)`` (its cell's share of the softmax mass if its tokens were alike); a cell
    wholly inside the window is masked, as its tokens are already there exactly;
(d) the ``heavy`` keys with the most attention mass over a strided sample of queries, exact;
    each is taken out of its cell's count where it lies outside a tile's window, and masked
    for a tile whose window already holds it, so no token is counted twice.

Queries outside the grid (text) see (a), (c) with whole cells, and (d).

Block-sparse as one batched attention call: the tiles are folded into the batch, every tile has
the same number of queries and keys (tiles and windows are clamped inside the grid, so a last
tile may overlap its neighbour; the overlapping queries are computed twice and read once), and
the far field is the same key list for every tile: only its additive bias (the host backend's
``mask``) differs. No ragged shapes, no host syncs; index tensors are built once per layout
(``window_plan``) and cached by the caller. The bias keeps SDPA off its flash kernel (its
memory-efficient kernel takes the bias); an extra q/k channel would keep flash but breaks the
head size most kernels need, so the bias it is.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from .downsample import strided_positions

WINDOW = "window"  # ToDo's method value on DiTs
HALO = 2  # tokens of exact keys beyond the query tile on each side (the prototype: 2 gives LPIPS 0.027)
TIME_TILE, TIME_HALO = 2, 1  # video: two frames of queries per tile, seeing a frame before and after them
TILES = (16, 8, 4)  # query tile sides tried, largest first (see ``tile_side``)
VIDEO_TILE = 8  # the smallest tile side on video (see ``window_plan``)
# Each backend call gathers its tiles' keys (the far field once per tile): at most about this many
# times the call's own keys, so a large grid runs as a few calls instead of one huge copy.
GATHERED = 8
# The bias of a key a query must not see: finite, not -inf, since backends that softmax keys in
# chunks (ComfyUI's sub-quadratic attention, its CPU default) take a chunk's max, and a chunk of
# -inf alone gives NaN; e^-10000 is 0 in every dtype, and fp16 holds it.
MASKED = -1.0e4
HEAVY_KEYS = 16  # sink keys kept exact (the held-out UNet: 16 bring a layer's change from 25-77 % to 0.4-6 %)
SAMPLED_QUERIES = 64  # queries whose attention finds the heavy keys (32 did as well as all on the held-out UNet)


def tile_side(h: int, w: int, halo: int = HALO) -> int:
    """The side of the square query tiles on an ``h x w`` grid: the largest of ``TILES`` whose
    window ((side + 2 halo)^2 keys) is at most 1/16 of the grid's tokens (at factor 2 a quarter
    of the far field), the smallest where none is. Larger tiles share more of each key set; the
    window's keys are the cost over plain ToDo and the share of image keys each query sees
    (the 32x32 Flux fixture: 4 -> 29.7 %; 8 would give 35.5 %; at 64x64 8 -> 28 %). The far
    field is copied once per tile, so a tile of Qt queries adds about 1/Qt of a key read per
    key the query attends to: on a GPU (about 200 flops a byte) tiles of 64 or more queries keep
    that copy under the attention's own arithmetic."""
    for side in TILES:
        if (side + 2 * halo) ** 2 * 16 <= h * w:
            return side
    return TILES[-1]


class WindowPlan(NamedTuple):
    """The index tensors of one grid call's windowed attention (``window_plan``)."""

    start: int  # where the grid's tokens start in the sequence
    tokens: int  # the grid's tokens N
    length: int  # the sequence's tokens L (queries and keys)
    grid: tuple[int, int, int]
    tile: tuple[int, int, int]  # query tile per axis (clamped to the grid)
    window: tuple[int, int, int]  # window per axis
    queries: torch.Tensor  # [T*Qt] the grid position of each tile's queries, tile by tile
    back: torch.Tensor  # [N] the row of each grid token's output among the [T*Qt] tile outputs
    windows: torch.Tensor  # [T*Kw] the grid position of each tile's window keys, tile by tile
    far: torch.Tensor  # [M] the grid positions nearest ToDo keeps (the far field's keys)
    counts: torch.Tensor  # [T, M] float32: the tokens of each kept key's cell outside each tile's window
    sizes: torch.Tensor  # [M] float32: the tokens of each cell
    cell: torch.Tensor  # [N] the cell (row of ``far``) of each grid token
    low: torch.Tensor  # [T, 3] each tile's window start per axis
    high: torch.Tensor  # [T, 3] its end (exclusive)
    coords: torch.Tensor  # [N, 3] the (t, h, w) of each grid token
    sampled: torch.Tensor  # [S] the queries whose attention finds the heavy keys (strided over the sequence)
    seen: float  # the mean share of the grid's keys an image query sees (window and far field, no heavy keys)

    @property
    def tiles(self) -> int:
        return self.counts.shape[0]

    @property
    def kept(self) -> int:
        return self.far.shape[0]


class _Axis(NamedTuple):
    tile: int
    window: int
    starts: torch.Tensor  # [n_tiles] first query of each tile
    window_starts: torch.Tensor  # [n_tiles]
    owner: torch.Tensor  # [n] the tile that computes each position's output
    offset: torch.Tensor  # [n] its place in that tile
    overlap: torch.Tensor  # [n_tiles, cells] positions of each cell inside each tile's window
    sizes: torch.Tensor  # [cells]
    cell: torch.Tensor  # [n] the cell of each position


def _axis(n: int, tile: int, halo: int, target: int, factor: float) -> _Axis:
    tile = min(tile, n)
    window = min(tile + 2 * halo, n)
    count = math.ceil(n / tile)
    starts = (torch.arange(count) * tile).clamp_(max=n - tile)  # the last tile clamped inside: equal sizes
    window_starts = (starts - halo).clamp_(min=0, max=n - window)
    x = torch.arange(n)
    owner = (x // tile).clamp_(max=count - 1)
    offset = x - starts[owner]
    cell_starts = strided_positions(n, target, factor)  # the kept positions: each its cell's first
    cell_ends = torch.cat([cell_starts[1:], torch.tensor([n])])
    overlap = (torch.minimum(cell_ends[None], (window_starts + window)[:, None])
               - torch.maximum(cell_starts[None], window_starts[:, None])).clamp_(min=0)
    cell = torch.searchsorted(cell_starts, x, right=True) - 1
    return _Axis(tile, window, starts, window_starts, owner, offset, overlap, cell_ends - cell_starts, cell)


def _outer(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Raster positions ((a * h + b) * w + c) of every combination, [len a, len b, len c] flattened."""
    return ((a[:, None, None] * h + b[None, :, None]) * w + c[None, None, :]).reshape(-1)


def _blocks(starts: tuple, size: tuple, h: int, w: int) -> torch.Tensor:
    """[tiles_t, tiles_h, tiles_w, st, sh, sw] raster positions of the blocks of ``size`` starting at ``starts``."""
    (t0, h0, w0), (st, sh, sw) = starts, size
    t = t0[:, None] + torch.arange(st)
    y = h0[:, None] + torch.arange(sh)
    x = w0[:, None] + torch.arange(sw)
    return ((t[:, None, None, :, None, None] * h + y[None, :, None, None, :, None]) * w
            + x[None, None, :, None, None, :])


def window_plan(length: int, start: int, grid: tuple[int, int, int], target: tuple[int, int, int],
                factors: tuple[float, float, float], device, tile: tuple[int, int, int] | None = None,
                halo: tuple[int, int, int] | None = None, samples: int = SAMPLED_QUERIES) -> WindowPlan:
    """The plan of a grid call of ``length`` tokens whose ``grid`` (t, h, w; frame-major raster)
    starts at ``start``, its far field strided to ``target`` by ``factors`` per axis (the kept
    positions of nearest ToDo). ``tile`` / ``halo`` per axis: by default ``tile_side`` squares,
    ``HALO``, and on video two frames with a frame on each side and sides of at least
    ``VIDEO_TILE`` (a video's many tiles would otherwise copy its large far field too often).
    Built on the CPU, moved once."""
    t, h, w = grid
    if tile is None:
        side = tile_side(h, w) if t == 1 else max(VIDEO_TILE, tile_side(h, w))
        tile = (TIME_TILE, side, side)
    if halo is None:
        halo = (TIME_HALO if t > 1 else 0, HALO, HALO)
    axes = [_axis(n, a, e, m, f) for n, a, e, m, f in zip(grid, tile, halo, target, factors)]
    at, ah, aw = axes
    tiles = at.starts.numel() * ah.starts.numel() * aw.starts.numel()
    queries = _blocks((at.starts, ah.starts, aw.starts), (at.tile, ah.tile, aw.tile), h, w).reshape(-1)
    windows = _blocks((at.window_starts, ah.window_starts, aw.window_starts),
                      (at.window, ah.window, aw.window), h, w).reshape(-1)
    per_tile = at.tile * ah.tile * aw.tile
    owner = _outer(at.owner, ah.owner, aw.owner, ah.starts.numel(), aw.starts.numel())
    offset = _outer(at.offset, ah.offset, aw.offset, ah.tile, aw.tile)
    back = owner * per_tile + offset
    kept = tuple(a.sizes.numel() for a in axes)
    far = _outer(*(strided_positions(n, m, f) for n, m, f in zip(grid, kept, factors)), h, w)
    sizes = (at.sizes[:, None, None] * ah.sizes[None, :, None] * aw.sizes[None, None, :]).reshape(-1)
    inside = (at.overlap[:, None, None, :, None, None] * ah.overlap[None, :, None, None, :, None]
              * aw.overlap[None, None, :, None, None, :]).reshape(tiles, -1)
    counts = (sizes[None] - inside).float()
    cell = _outer(at.cell, ah.cell, aw.cell, kept[1], kept[2])
    starts = torch.stack(torch.meshgrid(at.window_starts, ah.window_starts, aw.window_starts, indexing="ij"),
                         -1).reshape(tiles, 3)
    low, high = starts, starts + torch.tensor([at.window, ah.window, aw.window])
    coords = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"),
                         -1).reshape(-1, 3)
    sampled = torch.arange(min(samples, length)) * length // max(1, min(samples, length))
    tokens = t * h * w
    window_keys = at.window * ah.window * aw.window
    seen = (window_keys + (counts > 0).sum(1).float().mean().item()) / tokens  # built once, off the hot path
    moved = [x.to(device) for x in (queries, back, windows, far, counts, sizes.float(), cell, low, high, coords,
                                      sampled)]
    return WindowPlan(start, tokens, length, grid, (at.tile, ah.tile, aw.tile), (at.window, ah.window, aw.window),
                      *moved, seen)


def heavy_keys(q: torch.Tensor, k: torch.Tensor, plan: WindowPlan, count: int) -> torch.Tensor:
    """[B, count] the grid positions of the keys with the most attention mass (summed over the
    heads and a strided sample of queries, each query's softmax over every key of the call),
    found on the device: no host sync; deterministic (topk of a fixed computation)."""
    sample = q.index_select(2, plan.sampled)
    logits = (sample @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5  # [B, H, S, L]
    mass = logits.softmax(-1).narrow(-1, plan.start, plan.tokens).sum((1, 2))  # [B, N]
    return mass.topk(min(count, plan.tokens), dim=-1).indices


def _log_counts(counts: torch.Tensor) -> torch.Tensor:
    """The far field's bias: log of the tokens a key stands for; ``MASKED`` where it stands for
    none (its cell wholly inside the window, or its one token a heavy key)."""
    return torch.where(counts > 0, counts.clamp(min=1).log(), MASKED)


def _around(x: torch.Tensor, plan: WindowPlan) -> torch.Tensor:
    """[B, H, A, D] the tokens before and after the grid."""
    end = plan.start + plan.tokens
    if end == x.shape[2]:
        return x.narrow(2, 0, plan.start)
    return torch.cat([x.narrow(2, 0, plan.start), x.narrow(2, end, x.shape[2] - end)], 2)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: WindowPlan,
                     attend: Callable, heavy: int = HEAVY_KEYS) -> torch.Tensor:
    """Attention of q, k, v ([B, H, L, D], L = ``plan.length``) with the key sets of the module
    docstring; ``attend(q, k, v, bias)`` is the backend: [B', H, Lq, D] each, ``bias`` an additive
    [B', 1, 1, K] mask in q's dtype; returns its [B', H, Lq, D]. Returns [B, H, L, D]."""
    b, heads, length, dim = q.shape
    start, n, tiles = plan.start, plan.tokens, plan.tiles
    dtype, device = q.dtype, q.device
    grid_k, grid_v = k.narrow(2, start, n), v.narrow(2, start, n)
    around_k, around_v = _around(k, plan), _around(v, plan)
    a = around_k.shape[2]
    far_k, far_v = grid_k.index_select(2, plan.far), grid_v.index_select(2, plan.far)
    heavy = min(heavy, n)
    if heavy:
        found = heavy_keys(q, k, plan, heavy)  # [B, kh]
        take = found[:, None, :, None].expand(b, heads, heavy, dim)
        heavy_k, heavy_v = grid_k.gather(2, take), grid_v.gather(2, take)
        cells = plan.cell[found]  # [B, kh]
        where = plan.coords[found]  # [B, kh, 3]
        held = ((where[:, None] >= plan.low[None, :, None]) & (where[:, None] < plan.high[None, :, None])).all(-1)
        # Each heavy key outside a tile's window leaves its cell's count there; the counts are
        # whole numbers, so the sum is exact in any order.
        counts = plan.counts.expand(b, -1, -1).contiguous().scatter_add_(
            2, cells[:, None, :].expand(b, tiles, heavy), -(~held).float())
        far_bias = _log_counts(counts)
        heavy_bias = torch.zeros(held.shape, device=device).masked_fill_(held, MASKED)
        text_counts = plan.sizes.expand(b, -1).contiguous().scatter_add_(
            1, cells, torch.full(cells.shape, -1.0, device=device))
    else:
        heavy_k = heavy_v = None
        far_bias = _log_counts(plan.counts).expand(b, -1, -1)
        heavy_bias = torch.zeros(b, tiles, 0, device=device)
        text_counts = plan.sizes.expand(b, -1)
    per_tile = plan.queries.shape[0] // tiles
    windows = plan.windows.view(tiles, -1)
    kw = windows.shape[1]
    tile_q = q.narrow(2, start, n).index_select(2, plan.queries).unflatten(2, (tiles, per_tile)).transpose(1, 2)
    bias = torch.cat([torch.zeros(b, tiles, a + kw, device=device), far_bias, heavy_bias], 2).to(dtype)
    keys = a + kw + plan.kept + heavy
    chunk = max(1, GATHERED * length // keys)  # tiles per backend call: a fixed split, the same every call

    def tile_keys(x, around, far, extra, first, count):
        window = x.index_select(2, windows[first:first + count].reshape(-1)).unflatten(2, (count, kw)).transpose(1, 2)
        parts = [around.unsqueeze(1).expand(b, count, heads, a, dim), window,
                 far.unsqueeze(1).expand(b, count, heads, far.shape[2], dim)]
        if extra is not None:
            parts.append(extra.unsqueeze(1).expand(b, count, heads, extra.shape[2], dim))
        return torch.cat(parts, 3).flatten(0, 1)  # [B*count, H, K, D]

    outs = []
    for first in range(0, tiles, chunk):
        count = min(chunk, tiles - first)
        out = attend(tile_q[:, first:first + count].flatten(0, 1),
                     tile_keys(grid_k, around_k, far_k, heavy_k, first, count),
                     tile_keys(grid_v, around_v, far_v, heavy_v, first, count),
                     bias[:, first:first + count].flatten(0, 1)[:, None, None])
        outs.append(out.unflatten(0, (b, count)))
    out = (outs[0] if len(outs) == 1 else torch.cat(outs, 1)).transpose(1, 2).flatten(2, 3)
    out = out.index_select(2, plan.back)  # [B, H, N, D]
    if length == n:
        return out
    # The queries around the grid: every key around it, the far field with whole cells, the heavy keys.
    keys = [around_k, far_k] + ([heavy_k] if heavy else [])
    values = [around_v, far_v] + ([heavy_v] if heavy else [])
    text_bias = torch.cat([torch.zeros(b, a, device=device), _log_counts(text_counts), torch.zeros(b, heavy, device=device)], 1)
    text = attend(_around(q, plan), torch.cat(keys, 2), torch.cat(values, 2), text_bias.to(dtype)[:, None, None])
    end = start + n
    return torch.cat([text.narrow(2, 0, start), out, text.narrow(2, start, length - end)], 2)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """torch's attention as ``window_attention``'s backend (tests, hosts without one of their own)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def _to_heads(x: torch.Tensor, dim: int, heads: int) -> torch.Tensor:
    """[B, H, N, D] of a tensor as a host's attention call hands it: [B, H, N, D] (tokens at
    ``dim`` 2), [B, N, H*D] or [B, N, H, D] (SD3's values)."""
    if dim == 2:
        return x
    if x.ndim == 3:
        x = x.unflatten(2, (heads, -1))
    return x.transpose(1, 2)


def window_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, dim: int, plan: WindowPlan,
                attend: Callable, heavy: int = HEAVY_KEYS, heads_out: bool = False) -> torch.Tensor:
    """``window_attention`` of a grid call as an attention override sees it: tokens at ``dim``
    (1: [B, N, H*D]; 2: [B, H, N, D]); the output [B, N, H*D], or [B, H, N, D] with
    ``heads_out`` (ComfyUI's ``skip_output_reshape``)."""
    out = window_attention(_to_heads(q, dim, heads), _to_heads(k, dim, heads), _to_heads(v, dim, heads),
                           plan, attend, heavy)
    return out if heads_out else out.transpose(1, 2).flatten(2)
