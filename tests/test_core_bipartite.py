"""Host-free tests of the bipartite matching: the tomesd oracle, merge/unmerge, edge sizes."""

import pytest
import torch
from tomesd.merge import bipartite_soft_matching_random2d as tomesd_matching

from tokenreduce import plan_bipartite_merge, stride_ratio_cap

CASES = [  # h, w, sx, sy, batch, ratio
    (8, 8, 2, 2, 2, 0.5),
    (64, 64, 2, 2, 2, 0.5),
    (9, 13, 2, 2, 1, 0.6),  # not divisible by the stride: the remainder is all src
    (65, 97, 2, 2, 2, 0.5),  # a 520x776 px image at the finest SD level
    (7, 5, 3, 2, 3, 0.5),
    (16, 16, 4, 4, 1, 0.9),
    (12, 10, 2, 1, 2, 0.3),
]


def _metric(batch, h, w, channels=24, seed=0):
    return torch.randn(batch, h * w, channels, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("h,w,sx,sy,batch,ratio", CASES)
@pytest.mark.parametrize("use_rand", [True, False])
def test_same_merges_as_tomesd(h, w, sx, sy, batch, ratio, use_rand):
    x = _metric(batch, h, w)
    r = int(h * w * ratio)
    ref_merge, ref_unmerge = tomesd_matching(x, w, h, sx, sy, r, no_rand=not use_rand,
                                             generator=torch.Generator().manual_seed(7))
    plan = plan_bipartite_merge(x, w, h, sx, sy, r, torch.Generator().manual_seed(7) if use_rand else None)
    values = _metric(batch, h, w, channels=5, seed=1)
    assert torch.equal(plan.merge(values), ref_merge(values))
    merged = plan.merge(values)
    assert torch.equal(plan.unmerge(merged), ref_unmerge(merged))


@pytest.mark.parametrize("h,w,sx,sy,batch,ratio", CASES)
def test_unmerge_restores_order_and_shape(h, w, sx, sy, batch, ratio):
    x = _metric(batch, h, w)
    plan = plan_bipartite_merge(x, w, h, sx, sy, int(h * w * ratio), torch.Generator().manual_seed(3))
    merged = plan.merge(x)
    assert merged.shape == (batch, plan.merged_tokens, x.shape[-1])
    restored = plan.unmerge(merged)
    assert restored.shape == x.shape
    # Tokens that were not merged come back bit-exact, in their original positions.
    unchanged = (restored == x).all(dim=-1)
    assert unchanged.sum(dim=1).tolist() == [h * w - plan.r * 1 - _touched_dst(plan, b) for b in range(batch)]


def _touched_dst(plan, b):
    """dst tokens that received a merge are averages, so they differ from the input."""
    return int(torch.unique(plan.merged_into[b]).numel())


def test_merge_of_identical_tokens_is_lossless():
    # Constant features: any merge averages equal values, so unmerge restores them exactly.
    x = torch.ones(2, 64, 8) * torch.arange(8.0)
    plan = plan_bipartite_merge(x, 8, 8, 2, 2, 40, torch.Generator().manual_seed(0))
    assert torch.equal(plan.unmerge(plan.merge(x)), x)


def test_ratio_zero_is_exact_no_op():
    x = _metric(2, 8, 8)
    plan = plan_bipartite_merge(x, 8, 8, 2, 2, 0, torch.Generator().manual_seed(0))
    assert plan.is_identity
    assert plan.merge(x) is x and plan.unmerge(x) is x


def test_grid_smaller_than_a_cell_is_identity():
    x = _metric(1, 1, 9)
    assert plan_bipartite_merge(x, 9, 1, 2, 2, 4).is_identity


def test_r_is_capped_at_the_src_count():
    x = _metric(1, 8, 8)
    plan = plan_bipartite_merge(x, 8, 8, 2, 2, 1000)
    assert plan.r == 48 and plan.merged_tokens == 16


def test_stride_ratio_cap():
    assert stride_ratio_cap(2, 2) == 0.75
    assert stride_ratio_cap(1, 2) == 0.5
    assert stride_ratio_cap(1, 1) == 0.0


def test_wrong_token_count_is_an_error():
    with pytest.raises(ValueError, match="grid"):
        plan_bipartite_merge(_metric(1, 8, 8), 7, 8, 2, 2, 10)


def test_generator_seed_decides_the_partition():
    x = _metric(1, 16, 16)
    a = plan_bipartite_merge(x, 16, 16, 2, 2, 128, torch.Generator().manual_seed(1))
    b = plan_bipartite_merge(x, 16, 16, 2, 2, 128, torch.Generator().manual_seed(1))
    c = plan_bipartite_merge(x, 16, 16, 2, 2, 128, torch.Generator().manual_seed(2))
    assert torch.equal(a.dst_of, b.dst_of)
    assert not torch.equal(a.dst_of, c.dst_of)


# --- matching within nearby cells (reach) ---------------------------------------------------

@pytest.mark.parametrize("h,w,sx,sy,batch,ratio", CASES)
@pytest.mark.parametrize("use_rand", [True, False])
def test_a_reach_that_covers_the_grid_plans_what_tomesd_plans(h, w, sx, sy, batch, ratio, use_rand):
    # float64: the nearby path normalises in another order, so in float32 near-ties could rank
    # differently; in float64 the products agree and so must every merge.
    x = _metric(batch, h, w).double()
    values = _metric(batch, h, w, channels=5, seed=1).double()
    r = int(h * w * ratio)
    ref_merge, ref_unmerge = tomesd_matching(x, w, h, sx, sy, r, no_rand=not use_rand,
                                             generator=torch.Generator().manual_seed(7))
    reach = max(h // sy, w // sx)
    plan = plan_bipartite_merge(x, w, h, sx, sy, r, torch.Generator().manual_seed(7) if use_rand else None, reach)
    merged = plan.merge(values)
    assert torch.equal(merged, ref_merge(values))
    assert torch.equal(plan.unmerge(merged), ref_unmerge(merged))


def _cell(token, w, sx, sy, h):
    y, x = divmod(int(token), w)
    return min(y // sy, h // sy - 1), min(x // sx, w // sx - 1)


@pytest.mark.parametrize("h,w,sx,sy", [(16, 16, 2, 2), (9, 13, 2, 2), (12, 10, 3, 2)])
@pytest.mark.parametrize("reach", [1, 2])
def test_nearby_matching_merges_only_into_dst_within_reach(h, w, sx, sy, reach):
    x = _metric(2, h, w)
    plan = plan_bipartite_merge(x, w, h, sx, sy, int(h * w * 0.5), torch.Generator().manual_seed(4), reach)
    assert plan.r == int(h * w * 0.5)
    for b in range(2):
        for pos, dst in zip(plan.merged[b, :, 0], plan.merged_into[b, :, 0]):
            (sy_, sx_), (dy_, dx_) = (_cell(plan.src_of[0, pos, 0], w, sx, sy, h),
                                      _cell(plan.dst_of[0, dst, 0], w, sx, sy, h))
            assert abs(sy_ - dy_) <= reach and abs(sx_ - dx_) <= reach


def test_nearby_matching_picks_the_most_similar_nearby_dst():
    """Against a brute-force search: every merged src joins the dst of highest cosine similarity
    among the cells within reach, and the merged src are the most similar ones."""
    h, w, reach = 10, 12, 1
    x = _metric(1, h, w).double()
    plan = plan_bipartite_merge(x, w, h, 2, 2, 40, torch.Generator().manual_seed(5), reach)
    unit = x[0] / x[0].norm(dim=-1, keepdim=True)
    dst_tokens = plan.dst_of[0, :, 0]
    best = []
    for pos in range(plan.src_of.shape[1]):
        token = plan.src_of[0, pos, 0]
        cy, cx = _cell(token, w, 2, 2, h)
        nearby = [i for i, d in enumerate(dst_tokens)
                  if max(abs(_cell(d, w, 2, 2, h)[0] - cy), abs(_cell(d, w, 2, 2, h)[1] - cx)) <= reach]
        scores = unit[dst_tokens[nearby]] @ unit[token]
        best.append((float(scores.max()), nearby[int(scores.argmax())]))
    ranked = sorted(range(len(best)), key=lambda i: -best[i][0])
    assert sorted(plan.merged[0, :, 0].tolist()) == sorted(ranked[:40])
    for pos, dst in zip(plan.merged[0, :, 0].tolist(), plan.merged_into[0, :, 0].tolist()):
        assert dst == best[pos][1]


def test_a_reach_below_one_cell_is_an_error():
    with pytest.raises(ValueError, match="reach"):
        plan_bipartite_merge(_metric(1, 8, 8), 8, 8, 2, 2, 10, reach=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_fixed_order_mean_used_on_cuda_equals_scatter_reduce(dtype):
    # On CUDA merge() averages through index_put_ (a fixed order) instead of scatter_reduce
    # (atomics); both must mean the same thing. Checked here on the CPU, on CUDA in test_core_cuda.
    from tokenreduce.bipartite import _deterministic_mean_into

    g = torch.Generator().manual_seed(5)
    dst = torch.randn(3, 20, 7, generator=g, dtype=dtype)
    moved = torch.randn(3, 50, 7, generator=g, dtype=dtype)
    into = torch.randint(0, 12, (3, 50), generator=g)  # several src per dst, some dst none
    expected = dst.scatter_reduce(-2, into[..., None].expand(3, 50, 7), moved, reduce="mean")
    got = _deterministic_mean_into(dst.clone(), into, moved)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_a_large_similarity_is_computed_in_blocks_with_the_same_plan(monkeypatch):
    """Past SIMILARITY_BLOCK numbers the src x dst matrix is never held whole: same plan."""
    import tokenreduce.bipartite as bipartite

    x = _metric(2, 24, 20)
    whole = plan_bipartite_merge(x, 20, 24, 2, 2, 200, torch.Generator().manual_seed(5))
    monkeypatch.setattr(bipartite, "SIMILARITY_BLOCK", 1000)  # a few src rows per block
    blocked = plan_bipartite_merge(x, 20, 24, 2, 2, 200, torch.Generator().manual_seed(5))
    for a, b in zip((whole.unmerged, whole.merged, whole.merged_into), (blocked.unmerged, blocked.merged,
                                                                       blocked.merged_into)):
        assert torch.equal(a, b)


# --- matching "tile (fast)": the DiT path's tile plan behind the UNet patches --------------

TILE_CASES = [(8, 8, 2, 2, 2, 0.5), (9, 13, 2, 2, 1, 0.6), (7, 5, 3, 2, 3, 0.5), (6, 8, 1, 2, 2, 0.4),
              (16, 16, 4, 4, 1, 0.9), (64, 64, 2, 2, 2, 0.5)]


def _naive_tile_restore(x, values, h, w, sx, sy, r, seed):
    """Reference for "tile (fast)", token by token: one target per whole sy x sx cell (the
    first token of the cell in raster order, or the one at a drawn offset), every other token
    of a whole cell compared (cosine) with its own cell's target only, the r most similar
    (ties: the earlier cell, then the earlier token) averaged into their target; each token
    reads back its target's average."""
    batch = x.shape[0]
    cells = [[(cy * sy + dy) * w + cx * sx + dx for dy in range(sy) for dx in range(sx)]
             for cy in range(h // sy) for cx in range(w // sx)]
    if seed is not None:
        offsets = torch.randint(0, sy * sx, (len(cells), 1), generator=torch.Generator().manual_seed(seed))
        cells = [cell[o:] + cell[:o] for cell, o in zip(cells, offsets[:, 0].tolist())]
    out = values.clone()
    for b in range(batch):
        pairs = []  # (similarity, target, source), in cell then token order
        for cell in cells:
            target = x[b, cell[0]]
            for source in cell[1:]:
                cos = float(torch.dot(x[b, source], target) / (x[b, source].norm() * target.norm()))
                pairs.append((cos, cell[0], source))
        chosen = sorted(range(len(pairs)), key=lambda i: -pairs[i][0])[:r]
        groups = {}
        for i in chosen:
            groups.setdefault(pairs[i][1], []).append(pairs[i][2])
        for target, sources in groups.items():
            mean = values[b, [target, *sources]].mean(0)
            out[b, [target, *sources]] = mean
    return out


@pytest.mark.parametrize("h,w,sx,sy,batch,ratio", TILE_CASES)
@pytest.mark.parametrize("seed", [None, 7])
def test_tile_plan_equals_a_naive_reference(h, w, sx, sy, batch, ratio, seed):
    from tokenreduce.tome_patch import TilePlan, draw_cells, plan_cells

    x = _metric(batch, h, w)
    values = _metric(batch, h, w, channels=5, seed=1)
    r = int(h * w * ratio)
    cells = draw_cells(h, w, sx, sy, None if seed is None else torch.Generator().manual_seed(seed), "cpu", True)
    plan = plan_cells(x, w, h, sx, sy, cells, r, None)
    assert isinstance(plan, TilePlan)
    r = min(r, (h // sy) * (w // sx) * (sx * sy - 1))
    merged = plan.merge(values)
    assert merged.shape == (batch, h * w - r, 5) and plan.merged_tokens == h * w - r and plan.tokens == h * w
    assert torch.allclose(plan.unmerge(merged), _naive_tile_restore(x, values, h, w, sx, sy, r, seed), atol=1e-5)


def test_tile_plan_uses_no_scatter_and_reruns_bit_for_bit():
    from tokenreduce.tome_patch import draw_cells, plan_cells

    state = torch.get_rng_state()
    h, w = 24, 32
    cells = draw_cells(h, w, 2, 2, torch.Generator().manual_seed(3), "cpu", True)  # drawn before the model call
    again = draw_cells(h, w, 2, 2, torch.Generator().manual_seed(3), "cpu", True)
    assert torch.equal(cells.tile_index, again.tile_index)
    x = _metric(2, h, w)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        plan = plan_cells(x, w, h, 2, 2, cells, h * w // 2, None)
        out = plan.unmerge(plan.merge(x))
    names = {e.name for e in profile.events()}
    assert not [n for n in names if "scatter" in n or "index_put" in n or "index_add" in n]
    repeat = plan_cells(x, w, h, 2, 2, again, h * w // 2, None)
    assert torch.equal(repeat.unmerge(repeat.merge(x)), out)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG untouched


def test_tile_plan_of_a_grid_smaller_than_a_cell_is_the_identity():
    from tokenreduce.tome_patch import draw_cells, plan_cells

    x = _metric(1, 1, 5)
    plan = plan_cells(x, 5, 1, 2, 2, draw_cells(1, 5, 2, 2, None, "cpu", True), 2, None)
    assert plan.is_identity and torch.equal(plan.unmerge(plan.merge(x)), x)
