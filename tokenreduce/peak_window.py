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

How it runs: the far field, the tokens around the grid and the heavy keys are the same keys for
every grid query, and only their weights differ from tile to tile (a cell's tokens inside the
window are there exactly). So every grid query attends them once, each cell with its whole count,
in one call of torch's fused attention kernel with no per-tile mask, as plain ToDo's call runs;
each tile then attends its window's keys (gathered once, the tiles in the kernel's batch; every
tile has the same number of queries and keys: tiles and windows are clamped inside the grid, so a
last tile may overlap its neighbour, its overlapping queries computed twice and read once), and
takes away, by hand in float32, what the shared call counted that its window holds: each cell's
tokens inside it, a heavy key inside it, a heavy key's token out of its cell. The parts are one
softmax per query, merged by their log-sum-exps (``_corrected``). The kernels are private aten
ops, the only ones that return the log-sum-exp: on the CPU
``_scaled_dot_product_flash_attention_for_cpu`` (the counts as a one-row mask), on CUDA
``_scaled_dot_product_flash_attention`` in half precision where every cell has one size (the
count on the log-sum-exp) and the memory-efficient kernel elsewhere (the mask). Where neither
runs, the same softmax by hand in float32 with a per-tile bias (``_by_hand``, the reference the
fused path is tested against). Either way the grid's queries bypass the host's attention backend
(ComfyUI's sub-quadratic attention or SDPA); chunks of whole tiles of at most ``LOGITS`` logits
(``LOGITS_CUDA`` on CUDA) keep the memory bounded (no [N, N] tensor). The queries around the grid
(text) go to the host's backend, with the far field's log counts as its additive ``mask``. No
ragged shapes, no host syncs, a fixed split into chunks: reruns are bit for bit. Index tensors are
built once per layout (``window_plan``) and cached by the caller.

Cost, measured on one CPU thread (a shared machine; ``docs/benchmarks.md``): about 1.7-1.9x
plain nearest ToDo's time on a 64x64 grid (3 heads x 64 or 8 x 128; 1.4-1.6x without heavy
keys), about 4.6x on the 32x32 fixture (its calls are small). On an H200 (bf16, 24 heads x 128,
512 text tokens) a call takes 2.1 ms at Flux.1 1024 px against nearest's 0.22 (the per-tile mask
before: 2.25), 13.9 ms at SD1.5 2048 px against 4.8 (before: 50); a CUDA graph of it still takes
1.7 ms at 1024 px: the gathers, copies and float32 merges are GPU work, which a block-sparse
kernel of its own would not do.
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
# The grid's queries run in chunks of whole tiles of at most this many logits (all heads and
# batch rows together): float32, so 16 MiB of logits at a time, whatever the grid.
LOGITS = 2 ** 22
# On CUDA a chunk of tiles may hold more: 128 MiB of float32 logits (Flux.1 at 1 MP: one chunk).
LOGITS_CUDA = 2 ** 25
LOG2E = math.log2(math.e)
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
    (the 32x32 Flux fixture: 4 -> 29.7 %; 8 would give 35.5 %; at 64x64 8 -> 28 %)."""
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
    rows: torch.Tensor  # [T*Qt] the sequence position of each tile's queries, tile by tile
    window_rows: torch.Tensor  # [T, Kw] the sequence position of each tile's window keys
    overlap: torch.Tensor  # [T, C] the cells with tokens inside each tile's window, as rows of the shared keys
    taken: torch.Tensor  # [T, C] float32: log2 of how many (``MASKED`` where none: padding, the tiles' C differ)
    log_sizes: torch.Tensor  # [M] float32: the log of each cell's tokens
    seen: float  # the mean share of the grid's keys an image query sees (window and far field, no heavy keys)
    uniform: float  # the tokens of every cell where they are the same for all (else 0)

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
    # The cells each window overlaps, in cell order, padded to the most any tile has (stable sort:
    # the same plan every build)
    touched = int((inside > 0).sum(1).max())
    overlap = (inside > 0).int().sort(dim=1, descending=True, stable=True).indices[:, :touched]
    around = length - tokens  # the shared keys start with the tokens around the grid
    moved = [x.to(device) for x in (queries, back, windows, far, counts, sizes.float(), cell, low, high, coords,
                                      sampled, queries + start, windows.view(tiles, -1) + start, overlap + around,
                                      _log_counts(inside.gather(1, overlap).float()) * LOG2E, sizes.float().log())]
    return WindowPlan(start, tokens, length, grid, (at.tile, ah.tile, aw.tile), (at.window, ah.window, aw.window),
                      *moved, seen, float(sizes[0]) if bool((sizes == sizes[0]).all()) else 0.0)


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
    return counts.log().clamp_(min=MASKED)  # whole numbers: log 0 is -inf, clamped


def _around(x: torch.Tensor, plan: WindowPlan) -> torch.Tensor:
    """[B, H, A, D] the tokens before and after the grid."""
    end = plan.start + plan.tokens
    if end == x.shape[2]:
        return x.narrow(2, 0, plan.start)
    return torch.cat([x.narrow(2, 0, plan.start), x.narrow(2, end, x.shape[2] - end)], 2)


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(2, index)`` of a contiguous [B, H, L, D] as a 3-d gather: several times
    faster in torch's CPU kernels."""
    return x.flatten(0, 1).index_select(1, index).unflatten(0, x.shape[:2])


def _shared_keys(k: torch.Tensor, v: torch.Tensor, plan: WindowPlan, found) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, H, A + M (+ heavy), D] the keys and values every query sees: the tokens around the grid,
    the far field, the heavy keys."""
    grid_k, grid_v = k.narrow(2, plan.start, plan.tokens), v.narrow(2, plan.start, plan.tokens)
    far = plan.far + plan.start
    keys, values = [_around(k, plan), _take(k, far)], [_around(v, plan), _take(v, far)]
    if found is not None:
        take = found[:, None, :, None].expand(k.shape[0], k.shape[1], found.shape[1], k.shape[3])
        keys.append(grid_k.gather(2, take))
        values.append(grid_v.gather(2, take))
    return torch.cat(keys, 2), torch.cat(values, 2)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: WindowPlan,
                     attend: Callable, heavy: int = HEAVY_KEYS) -> torch.Tensor:
    """Attention of q, k, v ([B, H, L, D], L = ``plan.length``) with the key sets of the module
    docstring. The grid's queries are computed here (not by the host's backend; see the module
    docstring); ``attend(q, k, v, bias)`` is the backend for the queries around the grid:
    [B, H, A, D] each, ``bias`` an additive [B, 1, 1, K] mask in q's dtype; returns its
    [B, H, A, D]. Returns [B, H, L, D]."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # no copy where they are (tokens at dim 2)
    b, length = q.shape[0], q.shape[2]
    start, n = plan.start, plan.tokens
    heavy = min(heavy, n)
    found = heavy_keys(q, k, plan, heavy) if heavy else None  # [B, kh]
    shared_k, shared_v = _shared_keys(k, v, plan, found)  # [B, H, A + M + kh, D]
    a = shared_k.shape[2] - plan.kept - heavy
    held = None
    if heavy:
        where = plan.coords[found]  # [B, kh, 3]
        held = ((where[:, None] >= plan.low[None, :, None]) & (where[:, None] < plan.high[None, :, None])).all(-1)
    fused = _fused(q)
    if fused is not None:
        out = _corrected(fused, q, k, v, shared_k, shared_v, a, found, held, plan)  # [B, H, N, D], raster order
    else:
        out = _by_hand(q, k, v, shared_k, shared_v, a, _tile_bias(plan, found, held, b), plan)
    if length == n:
        return out
    # The queries around the grid: every key around it, the far field with whole cells (less a
    # heavy key's token, counted on its own), the heavy keys.
    if heavy:
        text_counts = plan.sizes.expand(b, -1).clone().scatter_add_(1, plan.cell[found],
                                                                    -torch.ones_like(found, dtype=torch.float))
        text_bias = torch.nn.functional.pad(_log_counts(text_counts), (a, heavy))
    else:
        text_bias = torch.nn.functional.pad(plan.log_sizes, (a, 0)).expand(b, -1)
    text = attend(_around(q, plan), shared_k, shared_v, text_bias.to(q.dtype)[:, None, None])
    end = start + n
    return torch.cat([text.narrow(2, 0, start), out, text.narrow(2, start, length - end)], 2)


def _tile_bias(plan: WindowPlan, found, held, b: int) -> torch.Tensor:
    """[B, T, M + kh] each tile's bias on the far field and the heavy keys (the softmax by hand):
    the log of the tokens each kept key stands for outside the tile's window, a heavy key's token
    taken out of its cell where it lies outside (the counts are whole numbers, so the sum is exact
    in any order), a heavy key inside the window masked."""
    if found is None:
        return _log_counts(plan.counts).expand(b, -1, -1)
    tiles, heavy = plan.tiles, found.shape[1]
    # clone, not contiguous(): at batch 1 the expanded plan is contiguous already, and the
    # scatter would write into the plan itself (every call's counts drifting)
    counts = plan.counts.expand(b, -1, -1).clone().scatter_add_(
        2, plan.cell[found][:, None, :].expand(b, tiles, heavy), -(~held).float())
    return torch.cat([_log_counts(counts), torch.zeros(held.shape, device=held.device).masked_fill_(held, MASKED)], 2)


def _corrected(fused, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shared_k: torch.Tensor,
               shared_v: torch.Tensor, a: int, found, held, plan: WindowPlan) -> torch.Tensor:
    """The grid's queries through the device's fused kernel, without a per-tile mask: every grid
    query attends the shared keys once, each cell with its whole count (``_shared_parts``: the
    kernel runs as plain ToDo's call does); then each tile adds its window's keys, exact, and takes
    away what the shared call counted that its window holds: each cell's tokens inside the window,
    the token a heavy key takes out of its cell (outside), a heavy key inside the window. These few
    keys a tile (window, overlapped cells, twice the heavy keys) run by hand in float32 and merge
    with the kernel's output by its log-sum-exp: the one softmax of the module docstring, exactly
    (what is taken away is part of what the shared call counted, and each cell's kept key, a token
    of its cell, is in the window where its cell is wholly; so the sum stays of the order of the
    window's own mass and rounding stays at the kernel's). Returns [B, H, N, D] in raster order."""
    b, heads, _, dim = q.shape
    tiles = plan.tiles
    per_tile = plan.rows.shape[0] // tiles
    heavy = 0 if found is None else found.shape[1]
    # Gathered token-major ([B, tokens, H, D]), a chunk's tiles are the kernel's batch as a view:
    # the kernels read [B, H, Q, D] views of that layout (their own), so no copy per tile. q, k, v
    # are copied token-major once, so each gather reads whole rows (several times faster in torch's
    # CPU kernels; on an H200 the windows' gathers at 2048 px 1.3x faster than from a strided view).
    qt, kt, vt = (x.transpose(1, 2).contiguous().flatten(2) for x in (q, k, v))  # [B, L, H*D]
    tiled_q = qt.index_select(1, plan.rows).unflatten(2, (heads, dim))  # [B, T*Qt, H, D], tile by tile
    tile_q = tiled_q.transpose(1, 2)
    flash = _flash(q)
    parts = _shared_parts(fused, flash, tile_q, shared_k, shared_v, a, heavy, plan)  # [(out, lse)]
    kw, touched = plan.window_rows.shape[1], plan.overlap.shape[1]
    taken = plan.taken.expand(b, -1, -1)  # [B, T, C]: log2 of each overlapped cell's tokens inside the window
    if heavy:
        # per heavy key: its cell's kept key, taken once where the key lies outside the window (the
        # key is counted on its own), and the key itself, taken where it lies inside (it is exact there)
        keys = torch.arange(a + plan.kept, a + plan.kept + heavy, device=found.device)
        pairs = torch.cat([plan.cell[found] + a, keys.expand(b, -1)], 1)[:, None, :, None]
        extra_k, extra_v = (x.gather(2, pairs.expand(b, heads, 2 * heavy, dim)) for x in (shared_k, shared_v))
        taken = torch.cat([taken, held * (MASKED * LOG2E), ~held * (MASKED * LOG2E)], 2)  # [B, T, C + 2kh]
    bound = LOGITS_CUDA if q.device.type == "cuda" else LOGITS
    chunk = max(1, bound // (b * heads * per_tile * (touched + 2 * heavy + kw)))  # tiles per chunk
    out = q.new_empty(b, heads, tiles, per_tile, dim)
    for first in range(0, tiles, chunk):
        count = min(chunk, tiles - first)
        rows = slice(first * per_tile, (first + count) * per_tile)
        part = tiled_q[:, rows]  # [B, c*Qt, H, D]
        # the window's keys, exact: the kernel again, the chunk's tiles in its batch
        index = plan.window_rows[first:first + count].reshape(-1)
        window_kv = (_by_tile(x.index_select(1, index).unflatten(2, (heads, dim)), b * count) for x in (kt, vt))
        near = (flash or fused)(_by_tile(part, b * count), *window_kv)[:2]
        # every part [B, H, c, Qt, D] and its log-sum-exp [B, H, c, Qt]: views
        shared = [(o[:, :, rows].unflatten(2, (count, per_tile)), lse[:, :, rows].unflatten(2, (count, per_tile)))
                  for o, lse in parts]
        shared.append(tuple(x.unflatten(0, (b, count)).transpose(1, 2) for x in near))
        peak = shared[0][1]
        for _, lse in shared[1:]:
            peak = torch.maximum(peak, lse)
        peak = peak[..., None]  # [B, H, c, Qt, 1], natural log
        # taken away, by hand in float32, base 2 (few keys; their logits must match the kernel's, so
        # no reduced-precision product): each overlapped cell's kept key with the tokens its tile's
        # window holds, the heavy keys' pairs
        cells = plan.overlap[first:first + count].reshape(-1)
        neg_k, neg_v = (_take(x, cells).unflatten(2, (count, touched)) for x in (shared_k, shared_v))
        if heavy:
            neg_k = torch.cat([neg_k, extra_k[:, :, None].expand(b, heads, count, 2 * heavy, dim)], 3)
            neg_v = torch.cat([neg_v, extra_v[:, :, None].expand(b, heads, count, 2 * heavy, dim)], 3)
        # the scale on the logits, as the kernels put it (on q it rounds differently)
        quer = part.unflatten(1, (count, per_tile)).permute(0, 3, 1, 2, 4)  # [B, H, c, Qt, D]
        logits = quer.to(torch.float32, memory_format=torch.contiguous_format) @ neg_k.float().transpose(3, 4)
        logits = logits.mul_(dim ** -0.5 * LOG2E).add_(taken[:, None, first:first + count, None])  # [B, H, c, Qt, K]
        weights = logits.sub_(peak * LOG2E).exp2_()
        total = weights.sum(-1, keepdim=True).neg_()
        result = (weights @ neg_v.float()).neg_()  # [B, H, c, Qt, D]
        for o, lse in shared:
            weight = (lse[..., None] - peak).exp_()
            total += weight
            result.addcmul_(o, weight)
        out[:, :, first:first + count] = result.div_(total)
    return _take(out.flatten(2, 3), plan.back)


def _by_tile(x: torch.Tensor, batch: int) -> torch.Tensor:
    """[B*c, H, per tile, D] of a chunk's token-major [B, c*per tile, H, D]: its tiles in the
    kernel's batch (a view where the chunk is contiguous: batch 1, or every tile at once)."""
    return x.reshape(batch, -1, *x.shape[2:]).transpose(1, 2)


def _shared_parts(fused, flash, q: torch.Tensor, shared_k: torch.Tensor, shared_v: torch.Tensor, a: int, heavy: int,
                  plan: WindowPlan) -> list:
    """Every grid query (q: [B, H, Q, D]) over the shared keys, each cell's kept key with the log
    of its cell's tokens: [(out, lse)], parts of one softmax. On CUDA in half precision with one
    cell size, torch's flash kernel (no mask: the cells' common log count goes on their
    log-sum-exp; the keys around the grid and the heavy keys a second call), as plain ToDo runs;
    elsewhere ``fused`` with the counts as a one-row mask."""
    if flash is not None and plan.uniform:
        parts = [flash(q, shared_k.narrow(2, a, plan.kept), shared_v.narrow(2, a, plan.kept))]
        parts[0] = parts[0][0], parts[0][1] + math.log(plan.uniform)
        if a + heavy:
            rest = [torch.cat([x.narrow(2, 0, a), x.narrow(2, a + plan.kept, heavy)], 2) for x in (shared_k, shared_v)]
            parts.append(flash(q, *rest))
        return parts
    bias = torch.nn.functional.pad(plan.log_sizes, (a, heavy)).to(q.dtype)
    return [fused(q, shared_k, shared_v, attn_mask=bias[None, None, None])[:2]]


def _by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shared_k: torch.Tensor,
             shared_v: torch.Tensor, a: int, bias: torch.Tensor, plan: WindowPlan) -> torch.Tensor:
    """The grid's queries (q, k, v: [B, H, L, D], contiguous) over their tile's window keys and the
    ``shared`` keys (the first ``a`` unbiased, the rest with their tile's row of ``bias``
    [B, T, M + kh]): one softmax per query over both, by hand (where no fused kernel returns its
    log-sum-exp; the reference the fused path is tested against). The shared keys are read once
    for all tiles (one dense product per chunk of queries, tiles in order), the window keys per
    tile; logits and their softmax in float32; chunks of whole tiles, at most ``LOGITS``
    logits each (a fixed split: the same every call). Returns [B, H, N, D] in raster order."""
    b, heads, _, dim = q.shape
    tiles = plan.tiles
    per_tile = plan.rows.shape[0] // tiles
    windows = plan.window_rows
    kw = windows.shape[1]
    dtype = q.dtype
    # Logits in base 2: exp2 is as exact and, in torch's CPU kernels, several times faster than exp
    # (which also slows tenfold on logits far below the peak, the masked ones). The scale goes on
    # the logits, as torch's SDPA puts it (on q it rounds differently).
    scale = dim ** -0.5 * LOG2E
    tile_q = _take(q, plan.rows)  # [B, H, T*Qt, D], tile by tile
    shared_kt = shared_k.transpose(2, 3).contiguous()  # small; the product reads it faster so
    keys = shared_k.shape[2]
    chunk = max(1, LOGITS // (b * heads * per_tile * (keys + kw)))  # tiles per chunk
    out = torch.empty_like(tile_q)
    for first in range(0, tiles, chunk):
        count = min(chunk, tiles - first)
        rows = slice(first * per_tile, (first + count) * per_tile)
        part = tile_q[:, :, rows]
        index = windows[first:first + count].reshape(-1)
        window_k = _take(k, index).unflatten(2, (count, kw))  # [B, H, c, Kw, D]
        window_v = _take(v, index).unflatten(2, (count, kw))
        far = (part @ shared_kt).float().mul_(scale)  # [B, H, c*Qt, S]: float() is a no-op in float32
        tiled = far.view(b, heads, count, per_tile, keys)
        tiled[..., a:] += bias[:, None, first:first + count, None] * LOG2E
        near = (part.view(b, heads, count, per_tile, dim) @ window_k.transpose(3, 4)).float().mul_(scale)
        peak = torch.maximum(tiled.amax(-1, keepdim=True), near.amax(-1, keepdim=True))
        tiled.sub_(peak).exp2_()
        near.sub_(peak).exp2_()
        total = tiled.sum(-1, keepdim=True) + near.sum(-1, keepdim=True)
        result = (far.to(dtype) @ shared_v).float().view(b, heads, count, per_tile, dim)
        result += (near.to(dtype) @ window_v).float()
        out[:, :, rows] = (result / total).flatten(2, 3)
    return _take(out, plan.back)


def _fused(q: torch.Tensor):
    """torch's fused attention kernel of q's device that also returns each query's log-sum-exp and
    takes an additive mask, ``fused(q, k, v, attn_mask=None) -> (out, lse, ...)``: on the CPU its
    flash kernel, on CUDA its memory-efficient kernel. Both are private aten ops: ``None`` where
    this torch lacks them, or on another device (the softmax by hand)."""
    if q.device.type == "cpu":
        return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if q.device.type == "cuda" and _efficient_kernel_takes(q):
        op = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)
        return None if op is None else _with_lse(op)
    return None


def _flash(q: torch.Tensor):
    """CUDA's flash kernel with its log-sum-exp, ``flash(q, k, v) -> (out, lse)`` (no mask), where
    it runs these queries: half precision, a head width of a multiple of 8 up to 256, compute
    capability 8 on. ``None`` elsewhere (the CPU's kernel takes the mask as fast)."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    if q.shape[-1] % 8 or q.shape[-1] > 256 or torch.cuda.get_device_capability(q.device)[0] < 8:
        return None
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
    if op is None:
        return None

    def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        out, lse = op(q, k, v)[:2]  # [B, H, Q, D] views of any layout with the head width contiguous, as SDPA's
        return out, lse[..., :q.shape[2]]

    return flash


def _efficient_kernel_takes(q: torch.Tensor) -> bool:
    """Whether CUDA's memory-efficient kernel runs these queries: a head width of a multiple of 8
    (its alignment), and bfloat16 only from compute capability 8 (Ampere) on. Elsewhere the softmax
    by hand, which runs anything."""
    return q.shape[-1] % 8 == 0 and (q.dtype != torch.bfloat16 or torch.cuda.get_device_capability(q.device)[0] >= 8)


MASK_ALIGN = 16  # CUDA's memory-efficient kernel reads the mask's rows at a stride of a multiple of 16


def _with_lse(op: Callable) -> Callable:
    """``op`` (aten's ``_scaled_dot_product_efficient_attention``: a mask of every dimension's size,
    its log-sum-exp padded to a multiple of 32 queries) as ``fused``: the mask copied into rows of
    an aligned stride and expanded, the log-sum-exp cut to the queries."""

    def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None):
        if attn_mask is not None and attn_mask.shape[-1] % MASK_ALIGN:
            keys = attn_mask.shape[-1]
            aligned = attn_mask.new_zeros(*attn_mask.shape[:-1], -(-keys // MASK_ALIGN) * MASK_ALIGN)
            attn_mask = aligned[..., :keys].copy_(attn_mask)
        if attn_mask is not None:  # the kernel takes a mask of every dimension's size (a view: no copy)
            attn_mask = attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        out, lse = op(q, k, v, attn_mask, True)[:2]
        return out, lse[..., :q.shape[2]]

    return fused


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
