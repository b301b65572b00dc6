"""Bipartite soft matching on a 2-D token grid (ToMe for SD, Bolya & Hoffman 2023).

The grid is tiled into ``sy x sx`` cells; one token per cell becomes a *destination* (dst),
every other token a *source* (src). Each src picks its most similar dst (cosine similarity
of the metric), and the ``r`` src tokens with the highest similarity are averaged into their
dst. ``unmerge`` copies each dst's result back to the src tokens merged into it, restoring
the full sequence in its original order.

For the same metric, sizes, ``r`` and generator state this computes the same partition and
the same merges as ``tomesd.merge.bipartite_soft_matching_random2d`` (tomesd 0.1.3, our test
oracle); the plan is an object instead of a pair of closures so that a host can keep it
between the merge and the unmerge, reuse it, and report on it.

``reach`` restricts each src to the dst of the cells within ``reach`` cells of its own (a
``(2 reach + 1)^2`` neighbourhood) instead of every dst of the grid. The similarity then costs
``N x (2 reach + 1)^2`` instead of ``N^2 / 4`` (tomesd's full src x dst matrix, which grows with
the square of the tokens like the attention it saves), and merges stay local: a src only ever
takes the output of a nearby token. The partition and the choice of the ``r`` best pairs are
unchanged; with a reach that covers the grid the plan is tomesd's.

Planning is split in two: the *partition* (which token of each cell is the dst) depends only on
the grid, the strides and the generator, so a host can draw it before a model call, outside a
compiled region; the *plan* then depends on the tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def stride_ratio_cap(stride_x: int, stride_y: int, stride_t: int = 1) -> float:
    """The largest ratio a ``stride_x x stride_y`` dst grid can reach: every src merged (on
    video DiTs, tiles of ``stride_t`` frames)."""
    return 1.0 - 1.0 / (stride_t * stride_x * stride_y)


# A merge bounded by similarity merges a count rounded down to an eighth of ``r``: however the
# picture varies, a grid meets at most nine token counts (nine shapes for a compiled model).
ALIKE_STEPS = 8


def alike_count(similarity: torch.Tensor, r: int, bound: float | None) -> int:
    """How many of the ``r`` most similar sources merge where a source merges only if its cosine
    ``similarity`` to its target ([..., sources]) is at least ``bound`` (None or 0: no bound,
    ``r``): the fewest alike sources of any row (one count for the batch, each row merging its
    own most similar, all of them alike), rounded down to a multiple of ``ceil(r / ALIKE_STEPS)``.
    Reads one number from the device: a sync, which the unbounded merge never needs."""
    if not bound or r <= 0:
        return r
    step = -(-r // ALIKE_STEPS)
    alike = int((similarity >= bound).sum(dim=-1).min())
    return min(r, alike // step * step)


def _gather(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    # MPS mis-gathers along a trailing dimension of size 1 (tomesd#4); add a dimension there.
    if x.device.type == "mps" and x.shape[-1] == 1:
        return torch.gather(x.unsqueeze(-1), dim - 1 if dim < 0 else dim, index.unsqueeze(-1)).squeeze(-1)
    return torch.gather(x, dim, index)


class Partition(NamedTuple):
    """Which tokens are dst and which src, for one grid."""

    src_of: torch.Tensor  # [1, N - num_dst, 1]: token index of each src, raster order
    dst_of: torch.Tensor  # [1, num_dst, 1]: token index of each dst, raster order

    @property
    def num_dst(self) -> int:
        return self.dst_of.shape[1]


def partition_grid(h: int, w: int, sx: int, sy: int, generator: torch.Generator | None,
                   device: torch.device) -> Partition | None:
    """One dst per whole ``sy x sx`` cell: drawn with ``generator``, or the top-left token with
    None. None where the grid is smaller than one cell (nothing can merge)."""
    if h < sy or w < sx:
        return None
    hsy, wsx = h // sy, w // sx
    if generator is None:
        choice = torch.zeros(hsy, wsx, 1, device=device, dtype=torch.int64)
    else:
        # Drawn on the generator's device so the stream is the same wherever the model runs.
        choice = torch.randint(sy * sx, size=(hsy, wsx, 1), device=generator.device,
                               generator=generator).to(device)
    marks = torch.zeros(hsy, wsx, sy * sx, device=device, dtype=torch.int64)
    marks.scatter_(dim=2, index=choice, src=torch.full_like(choice, -1))
    marks = marks.view(hsy, wsx, sy, sx).transpose(1, 2).reshape(hsy * sy, wsx * sx)
    if hsy * sy < h or wsx * sx < w:
        # Rows/columns beyond the last whole cell hold no dst: they are all src.
        full = torch.zeros(h, w, device=device, dtype=torch.int64)
        full[: hsy * sy, : wsx * sx] = marks
        marks = full
    # dst are marked -1 and src 0, so sorting lists dst first, then src. The same (default,
    # not necessarily stable) sort as tomesd keeps the token order identical to the oracle's.
    order = marks.reshape(1, -1, 1).argsort(dim=1)
    num_dst = hsy * wsx
    return Partition(src_of=order[:, num_dst:, :], dst_of=order[:, :num_dst, :])


class MergePlan(NamedTuple):
    """Which tokens merge into which, for one block call; complete when built. Applies to any
    [B, N, C] tensor of the batch and token count it was planned on.

    Besides the matching itself (positions in the src and dst lists, as tomesd keeps them) the
    plan holds token indices for its two operations, so that merging is two gathers and one
    scatter, and unmerging one gather, however often the plan is used (every stage of a block,
    every block of a level with shared plans)."""

    batch: int
    tokens: int
    r: int
    partition: Partition | None = None
    unmerged: torch.Tensor | None = None  # [B, N - num_dst - r, 1]: positions in src kept
    merged: torch.Tensor | None = None  # [B, r, 1]: positions in src merged away
    merged_into: torch.Tensor | None = None  # [B, r, 1]: the dst each of those joins
    order: torch.Tensor | None = None  # [B, N - r, 1]: the token each merged position starts from
    moved: torch.Tensor | None = None  # [B, r, 1]: the tokens merged away
    inverse: torch.Tensor | None = None  # [B, N, 1]: the merged position each token reads back

    @property
    def is_identity(self) -> bool:
        return self.r <= 0

    @property
    def merged_tokens(self) -> int:
        """Token count after merging."""
        return self.tokens - max(self.r, 0)

    @property
    def src_of(self) -> torch.Tensor:
        return self.partition.src_of

    @property
    def dst_of(self) -> torch.Tensor:
        return self.partition.dst_of

    @classmethod
    def identity(cls, batch: int, tokens: int) -> "MergePlan":
        return cls(batch=batch, tokens=tokens, r=0)

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """[B, N, C] -> [B, N - r, C]: unmerged src tokens, then dst tokens (each the mean of
        itself and the src merged into it)."""
        if self.is_identity:
            return x
        b, _, c = x.shape
        out = _gather(x, 1, self.order.expand(b, self.tokens - self.r, c))
        moved = _gather(x, 1, self.moved.expand(b, self.r, c))
        n_kept = self.unmerged.shape[1]
        if x.is_cuda:
            out[:, n_kept:] = _deterministic_mean_into(out[:, n_kept:], self.merged_into[..., 0], moved)
        else:
            out[:, n_kept:].scatter_reduce_(-2, self.merged_into.expand(b, self.r, c), moved, reduce="mean")
        return out

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        """[B, N - r, C] -> [B, N, C]: every merged src receives its dst's value."""
        if self.is_identity:
            return x
        b, _, c = x.shape
        return _gather(x, 1, self.inverse.expand(b, self.tokens, c))

    def log_sizes(self) -> torch.Tensor | None:
        """[B, N - r] float32: the log of the tokens each merged token stands for (None: nothing merged)."""
        return None if self.is_identity else log_sizes(self.inverse[..., 0], self.merged_tokens)


def log_sizes(restore_map: torch.Tensor, merged: int) -> torch.Tensor:
    """[B, merged] float32: the log of how many tokens read each merged row back (``restore_map``
    [B, N]: the merged row of each token). Proportional attention adds it to a merged key's logits
    (ToMe, Bolya et al. 2023), so that a key standing for k alike tokens gets their k shares of the
    softmax: the attention the unmerged keys would give where a group's tokens are alike. Sums of
    ones: exact, deterministic on every device."""
    b = restore_map.shape[0]
    ones = torch.ones(restore_map.shape, dtype=torch.float32, device=restore_map.device)
    counts = torch.zeros(b, merged, dtype=torch.float32, device=restore_map.device)
    return counts.scatter_add_(1, restore_map, ones).log()


def _split(x: torch.Tensor, partition: Partition) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, N, C] -> its src tokens and its dst tokens."""
    b, n, c = x.shape
    num_dst = partition.num_dst
    src = _gather(x, 1, partition.src_of.expand(b, n - num_dst, c))
    dst = _gather(x, 1, partition.dst_of.expand(b, num_dst, c))
    return src, dst


# The whole-grid similarity is a src x dst matrix per image: 3N^2/16 numbers, 1.6 GB in float16
# for one 2048 px SD1.5 image at its first level, more than the attention it saves. Past this
# many numbers it is computed in blocks of src rows and only each row's best is kept.
SIMILARITY_BLOCK = 1 << 24


def _best_dst(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each src's (rows of ``a``) highest similarity to a dst (rows of ``b``) and which dst."""
    batch, n_src, _ = a.shape
    rows = max(1, SIMILARITY_BLOCK // (batch * b.shape[1]))
    if rows >= n_src:
        return (a @ b.transpose(-1, -2)).max(dim=-1)
    parts = [(a[:, i:i + rows] @ b.transpose(-1, -2)).max(dim=-1) for i in range(0, n_src, rows)]
    return torch.cat([p.values for p in parts], dim=1), torch.cat([p.indices for p in parts], dim=1)


def _nearby_dst(h: int, w: int, sx: int, sy: int, dst_of: torch.Tensor, reach: int) -> torch.Tensor:
    """[cells, (2 reach + 1)^2]: for each whole cell, the positions in the dst list of the dst
    of the cells within ``reach`` cells of it. Neighbours past the grid's edge repeat the edge
    cell (harmless for a maximum)."""
    hsy, wsx = h // sy, w // sx
    device = dst_of.device
    dst_tokens = dst_of.view(-1)
    dst_cell = (dst_tokens // w // sy) * wsx + (dst_tokens % w) // sx
    cell_dst = torch.empty(hsy * wsx, dtype=torch.int64, device=device)
    cell_dst[dst_cell] = torch.arange(dst_tokens.numel(), device=device)
    offsets = torch.arange(-reach, reach + 1, device=device)
    ny = (torch.arange(hsy, device=device)[:, None, None, None] + offsets[None, None, :, None]).clamp(0, hsy - 1)
    nx = (torch.arange(wsx, device=device)[None, :, None, None] + offsets[None, None, None, :]).clamp(0, wsx - 1)
    return cell_dst[(ny * wsx + nx).view(hsy * wsx, (2 * reach + 1) ** 2)]


def _best_in_whole_cells(metric: torch.Tensor, h: int, w: int, sx: int, sy: int, nearby: torch.Tensor,
                         candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For every token of a whole cell: its best product with the nearby dst vectors and that
    dst's position in the dst list, both [B, h, w] in token order (zero outside whole cells).
    One small matrix product per cell: its ``sy*sx`` tokens against its neighbourhood."""
    batch, _, channels = metric.shape
    hsy, wsx = h // sy, w // sx
    cells = hsy * wsx
    whole = metric.view(batch, h, w, channels)[:, : hsy * sy, : wsx * sx].reshape(batch, hsy, sy, wsx, sx, channels)
    whole = whole.permute(0, 1, 3, 2, 4, 5).reshape(batch * cells, sy * sx, channels)
    best, which = torch.bmm(whole, nearby.transpose(1, 2)).max(dim=-1)  # [B*cells, sy*sx]
    best_dst = candidates.repeat(batch, 1).gather(-1, which)

    def to_grid(values: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((batch, h, w), fill, dtype=values.dtype, device=metric.device)
        out[:, : hsy * sy, : wsx * sx] = values.view(batch, hsy, wsx, sy, sx).permute(0, 1, 3, 2, 4).reshape(
            batch, hsy * sy, wsx * sx)
        return out

    return to_grid(best, 0.0), to_grid(best_dst, 0)


def _best_in_remainder(metric: torch.Tensor, h: int, w: int, sx: int, sy: int, nearby: torch.Tensor,
                       candidates: torch.Tensor, best_tok: torch.Tensor, dst_tok: torch.Tensor) -> None:
    """The same for the rows/columns beyond the last whole cell (all src, belonging to the last
    cell), written into ``best_tok`` and ``dst_tok``."""
    batch, _, channels = metric.shape
    hsy, wsx = h // sy, w // sx
    device = metric.device
    rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    outside = (rows >= hsy * sy) | (cols >= wsx * sx)
    ry, rx = rows[outside], cols[outside]
    cell = (ry // sy).clamp(max=hsy - 1) * wsx + (rx // sx).clamp(max=wsx - 1)
    per_cell = nearby.view(batch, hsy * wsx, -1, channels)[:, cell]  # [B, nR, K, C]
    scores = torch.einsum("brc,brkc->brk", metric.view(batch, h, w, channels)[:, ry, rx], per_cell)
    r_best, r_which = scores.max(dim=-1)
    best_tok[:, ry, rx] = r_best
    dst_tok[:, ry, rx] = candidates[cell].expand(batch, -1, -1).gather(-1, r_which[..., None]).squeeze(-1)


def _best_nearby_dst(metric: torch.Tensor, h: int, w: int, sx: int, sy: int, partition: Partition,
                     reach: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each src's highest cosine similarity to the dst of the cells within ``reach`` cells of its
    own, and that dst's position in the dst list (both [B, n_src], in src-list order).

    Only the dst are normalised before the products (a src's norm does not change which dst is
    its best): the src are divided by their norm once their best products are known, which
    saves a pass over all tokens."""
    batch, tokens, channels = metric.shape
    candidates = _nearby_dst(h, w, sx, sy, partition.dst_of, reach)  # [cells, K]
    norms = metric.norm(dim=-1)
    dst_tokens = partition.dst_of.view(-1)
    dst_unit = metric.index_select(1, dst_tokens) / norms.index_select(1, dst_tokens)[..., None]
    # [B * cells, K, C]: every cell's neighbourhood of dst vectors, channels innermost.
    nearby = dst_unit.index_select(1, candidates.view(-1)).view(batch * candidates.shape[0], -1, channels)
    best_tok, dst_tok = _best_in_whole_cells(metric, h, w, sx, sy, nearby, candidates)
    if (h // sy) * sy < h or (w // sx) * sx < w:
        _best_in_remainder(metric, h, w, sx, sy, nearby, candidates, best_tok, dst_tok)
    src_tokens = partition.src_of.view(-1)
    best_cos = best_tok.view(batch, tokens)[:, src_tokens] / norms[:, src_tokens]
    return best_cos, dst_tok.view(batch, tokens)[:, src_tokens]


def _deterministic_mean_into(dst: torch.Tensor, into: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
    """``dst.scatter_reduce(-2, into, moved, "mean")`` (each dst averaged with the src merged
    into it), in a fixed order on CUDA. There scatter_reduce adds with atomics, so the sum, and
    with it the image, changes from run to run; index_put_ with accumulate sorts the indices
    and adds each dst's tokens in one order. Sums in float32: a dst in a flat region can take
    in hundreds of tokens, which can overflow float16."""
    b, r, c = moved.shape
    rows = torch.arange(b, device=dst.device)[:, None].expand(b, r)
    total = dst.to(torch.float32, copy=True).index_put_((rows, into), moved.float(), accumulate=True)
    count = torch.ones(dst.shape[:2], device=dst.device, dtype=torch.float32)
    count.index_put_((rows, into), torch.ones(b, r, device=dst.device), accumulate=True)
    return (total / count[..., None]).to(dst.dtype)


def plan_merge(metric: torch.Tensor, w: int, h: int, sx: int, sy: int, partition: Partition | None, r: int,
               reach: int | None = None, bound: float | None = None) -> MergePlan:
    """Plan merging ``r`` tokens of ``metric`` ([B, N, C], N = h * w in raster order) with a
    partition of its grid (None: the grid holds no whole cell, nothing merges). ``reach``:
    match each src only with the dst of cells at most this many cells away (None: every dst,
    as tomesd). ``r`` is capped at the number of src tokens. ``bound``: merge only src at least
    this alike (cosine) to their dst, ``r`` the most (``alike_count``; None: tomesd's ``r``)."""
    if reach is not None and reach < 1:
        raise ValueError(f"reach must be at least 1 cell, got {reach}")
    batch, tokens, _ = metric.shape
    if tokens != h * w:
        raise ValueError(f"metric has {tokens} tokens, the grid {h}x{w} has {h * w}")
    if r <= 0 or partition is None:
        return MergePlan.identity(batch, tokens)
    with torch.no_grad():
        r = min(r, tokens - partition.num_dst)
        if reach is None:
            a, b = _split(metric / metric.norm(dim=-1, keepdim=True), partition)
            best, best_dst = _best_dst(a, b)
        else:
            best, best_dst = _best_nearby_dst(metric, h, w, sx, sy, partition, reach)
        r = alike_count(best, r, bound)
        if r <= 0:
            return MergePlan.identity(batch, tokens)
        by_similarity = best.argsort(dim=-1, descending=True)[..., None]
        return _complete_plan(batch, tokens, r, partition, unmerged=by_similarity[..., r:, :],
                              merged=by_similarity[..., :r, :],
                              merged_into=_gather(best_dst[..., None], -2, by_similarity[..., :r, :]))


def _complete_plan(batch: int, tokens: int, r: int, partition: Partition, unmerged: torch.Tensor,
                   merged: torch.Tensor, merged_into: torch.Tensor) -> MergePlan:
    """The plan with the token indices of its merge and unmerge."""
    src_of = partition.src_of.expand(batch, -1, 1)
    kept = _gather(src_of, 1, unmerged)
    moved = _gather(src_of, 1, merged)
    order = torch.cat([kept, partition.dst_of.expand(batch, -1, 1)], dim=1)
    inverse = torch.empty(batch, tokens, 1, dtype=torch.int64, device=order.device)
    inverse.scatter_(1, order, torch.arange(tokens - r, device=order.device).view(1, -1, 1).expand(batch, -1, 1))
    inverse.scatter_(1, moved, merged_into + kept.shape[1])
    return MergePlan(batch=batch, tokens=tokens, r=r, partition=partition, unmerged=unmerged, merged=merged,
                     merged_into=merged_into, order=order, moved=moved, inverse=inverse)


def plan_bipartite_merge(metric: torch.Tensor, w: int, h: int, sx: int, sy: int, r: int,
                         generator: torch.Generator | None = None, reach: int | None = None) -> MergePlan:
    """Partition the grid and plan the merge in one step (tomesd's
    ``bipartite_soft_matching_random2d``): ``generator`` draws the dst position in each cell,
    ``None`` takes the top-left token of every cell. Grids smaller than one cell (``h < sy``
    or ``w < sx``) give the identity plan."""
    if reach is not None and reach < 1:
        raise ValueError(f"reach must be at least 1 cell, got {reach}")
    batch, tokens, _ = metric.shape
    if tokens != h * w:
        raise ValueError(f"metric has {tokens} tokens, the grid {h}x{w} has {h * w}")
    if r <= 0:
        return MergePlan.identity(batch, tokens)
    return plan_merge(metric, w, h, sx, sy, partition_grid(h, w, sx, sy, generator, metric.device), r, reach)
