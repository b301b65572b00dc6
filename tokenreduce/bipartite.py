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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def stride_ratio_cap(stride_x: int, stride_y: int) -> float:
    """The largest ratio a ``stride_x x stride_y`` dst grid can reach: every src merged."""
    return 1.0 - 1.0 / (stride_x * stride_y)


def _gather(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    # MPS mis-gathers along a trailing dimension of size 1 (tomesd#4); add a dimension there.
    if x.device.type == "mps" and x.shape[-1] == 1:
        return torch.gather(x.unsqueeze(-1), dim - 1 if dim < 0 else dim, index.unsqueeze(-1)).squeeze(-1)
    return torch.gather(x, dim, index)


def _partition(h: int, w: int, sx: int, sy: int, generator: torch.Generator | None,
               device: torch.device) -> tuple[torch.Tensor, int]:
    """Token indices ordered dst first, then src, each in raster order; and the dst count."""
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
    return order, hsy * wsx


@dataclass(eq=False)
class MergePlan:
    """Which tokens merge into which, for one block call. Applies to any [B, N, C] tensor of
    the batch and token count it was planned on."""

    batch: int
    tokens: int
    r: int
    num_dst: int
    src_of: torch.Tensor | None = None  # [1, N - num_dst, 1]: token index of each src
    dst_of: torch.Tensor | None = None  # [1, num_dst, 1]: token index of each dst
    unmerged: torch.Tensor | None = None  # [B, N - num_dst - r, 1]: positions in src kept
    merged: torch.Tensor | None = None  # [B, r, 1]: positions in src merged away
    merged_into: torch.Tensor | None = None  # [B, r, 1]: the dst each of those joins

    @property
    def is_identity(self) -> bool:
        return self.r <= 0

    @property
    def merged_tokens(self) -> int:
        """Token count after merging."""
        return self.tokens - max(self.r, 0)

    @classmethod
    def identity(cls, batch: int, tokens: int) -> "MergePlan":
        return cls(batch=batch, tokens=tokens, r=0, num_dst=0)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, c = x.shape
        src = _gather(x, 1, self.src_of.expand(b, n - self.num_dst, c))
        dst = _gather(x, 1, self.dst_of.expand(b, self.num_dst, c))
        return src, dst

    def merge(self, x: torch.Tensor, mode: str = "mean") -> torch.Tensor:
        """[B, N, C] -> [B, N - r, C]: unmerged src tokens, then dst tokens."""
        if self.is_identity:
            return x
        src, dst = self._split(x)
        b, n_src, c = src.shape
        kept = _gather(src, -2, self.unmerged.expand(b, n_src - self.r, c))
        moved = _gather(src, -2, self.merged.expand(b, self.r, c))
        if mode == "mean" and x.is_cuda:
            dst = _deterministic_mean_into(dst, self.merged_into[..., 0], moved)
        else:
            dst = dst.scatter_reduce(-2, self.merged_into.expand(b, self.r, c), moved, reduce=mode)
        return torch.cat([kept, dst], dim=1)

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        """[B, N - r, C] -> [B, N, C]: every merged src receives its dst's value."""
        if self.is_identity:
            return x
        n_kept = self.unmerged.shape[1]
        kept, dst = x[..., :n_kept, :], x[..., n_kept:, :]
        b, c = x.shape[0], x.shape[-1]
        moved = _gather(dst, -2, self.merged_into.expand(b, self.r, c))
        src_of = self.src_of.expand(b, self.src_of.shape[1], 1)
        out = torch.zeros(b, self.tokens, c, device=x.device, dtype=x.dtype)
        out.scatter_(-2, self.dst_of.expand(b, self.num_dst, c), dst)
        out.scatter_(-2, _gather(src_of, 1, self.unmerged).expand(b, n_kept, c), kept)
        out.scatter_(-2, _gather(src_of, 1, self.merged).expand(b, self.r, c), moved)
        return out


def _best_nearby_dst(metric: torch.Tensor, h: int, w: int, sx: int, sy: int, src_of: torch.Tensor,
                     dst_of: torch.Tensor, reach: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each src's highest cosine similarity to the dst of the cells within ``reach`` cells of its
    own, and that dst's position in the dst list (both [B, n_src], in src-list order).

    Computed cell by cell: the ``sy*sx`` tokens of a cell against its neighbourhood's
    ``(2 reach + 1)^2`` dst vectors, one small matrix product per cell. Neighbours past the
    grid's edge repeat the edge cell (harmless for a maximum). Rows/columns beyond the last
    whole cell hold only src, which belong to the last cell. Only the dst are normalised before
    the products (a src's norm does not change which dst is its best): the src are divided by
    their norm once their best products are known, which saves a pass over all tokens."""
    batch, tokens, channels = metric.shape
    hsy, wsx = h // sy, w // sx
    cells, side = hsy * wsx, 2 * reach + 1
    device = metric.device
    # The dst of each cell, and each cell's neighbourhood as positions in the dst list.
    dst_tokens = dst_of.view(-1)
    dst_cell = (dst_tokens // w // sy) * wsx + (dst_tokens % w) // sx
    cell_dst = torch.empty(cells, dtype=torch.int64, device=device)
    cell_dst[dst_cell] = torch.arange(dst_tokens.numel(), device=device)
    offsets = torch.arange(-reach, reach + 1, device=device)
    ny = (torch.arange(hsy, device=device)[:, None, None, None] + offsets[None, None, :, None]).clamp(0, hsy - 1)
    nx = (torch.arange(wsx, device=device)[None, :, None, None] + offsets[None, None, None, :]).clamp(0, wsx - 1)
    candidates = cell_dst[(ny * wsx + nx).view(cells, side * side)]  # [cells, K]
    norms = metric.norm(dim=-1)
    dst_unit = metric.index_select(1, dst_tokens) / norms.index_select(1, dst_tokens)[..., None]
    # [B * cells, K, C]: every cell's neighbourhood of dst vectors, channels innermost.
    nearby = dst_unit.index_select(1, candidates.view(-1)).view(batch * cells, -1, channels)

    grid = metric.view(batch, h, w, channels)
    whole = grid[:, : hsy * sy, : wsx * sx].reshape(batch, hsy, sy, wsx, sx, channels)
    whole = whole.permute(0, 1, 3, 2, 4, 5).reshape(batch * cells, sy * sx, channels)
    best, which = torch.bmm(whole, nearby.transpose(1, 2)).max(dim=-1)  # [B*cells, sy*sx]
    best_dst = candidates.repeat(batch, 1).gather(-1, which)

    # Back to token order on the full grid, then the remainder rows/columns.
    def to_grid(values: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((batch, h, w), fill, dtype=values.dtype, device=device)
        out[:, : hsy * sy, : wsx * sx] = values.view(batch, hsy, wsx, sy, sx).permute(0, 1, 3, 2, 4).reshape(
            batch, hsy * sy, wsx * sx)
        return out

    best_tok, dst_tok = to_grid(best, 0.0), to_grid(best_dst, 0)
    if hsy * sy < h or wsx * sx < w:
        rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        outside = (rows >= hsy * sy) | (cols >= wsx * sx)
        ry, rx = rows[outside], cols[outside]
        cell = (ry // sy).clamp(max=hsy - 1) * wsx + (rx // sx).clamp(max=wsx - 1)
        per_cell = nearby.view(batch, cells, -1, channels)[:, cell]  # [B, nR, K, C]
        scores = torch.einsum("brc,brkc->brk", grid[:, ry, rx], per_cell)
        r_best, r_which = scores.max(dim=-1)
        best_tok[:, ry, rx] = r_best
        dst_tok[:, ry, rx] = candidates[cell].expand(batch, -1, -1).gather(-1, r_which[..., None]).squeeze(-1)
    src_tokens = src_of.view(-1)
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


def plan_bipartite_merge(metric: torch.Tensor, w: int, h: int, sx: int, sy: int, r: int,
                         generator: torch.Generator | None = None, reach: int | None = None) -> MergePlan:
    """Plan merging ``r`` tokens of ``metric`` ([B, N, C], N = h * w in raster order).

    ``generator`` draws the dst position in each cell; ``None`` takes the top-left token of
    every cell. ``reach``: match each src only with the dst of cells at most this many cells
    away (``None``: every dst, as tomesd). ``r`` is capped at the number of src tokens. Grids
    smaller than one cell (``h < sy`` or ``w < sx``) have no dst and give the identity plan.
    """
    if reach is not None and reach < 1:
        raise ValueError(f"reach must be at least 1 cell, got {reach}")
    batch, tokens, _ = metric.shape
    if tokens != h * w:
        raise ValueError(f"metric has {tokens} tokens, the grid {h}x{w} has {h * w}")
    if r <= 0 or h < sy or w < sx:
        return MergePlan.identity(batch, tokens)
    with torch.no_grad():
        order, num_dst = _partition(h, w, sx, sy, generator, metric.device)
        src_of, dst_of = order[:, num_dst:, :], order[:, :num_dst, :]
        plan = MergePlan(batch=batch, tokens=tokens, r=min(r, tokens - num_dst),
                         num_dst=num_dst, src_of=src_of, dst_of=dst_of)
        if reach is None:
            unit = metric / metric.norm(dim=-1, keepdim=True)
            a, b = plan._split(unit)
            best, best_dst = (a @ b.transpose(-1, -2)).max(dim=-1)
        else:
            best, best_dst = _best_nearby_dst(metric, h, w, sx, sy, src_of, dst_of, reach)
        by_similarity = best.argsort(dim=-1, descending=True)[..., None]
        plan.unmerged = by_similarity[..., plan.r:, :]
        plan.merged = by_similarity[..., : plan.r, :]
        plan.merged_into = _gather(best_dst[..., None], -2, plan.merged)
    return plan
