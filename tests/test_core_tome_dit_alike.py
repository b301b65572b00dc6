"""Host-free tests of ToMe on DiTs merging only what is alike (issue #50, point 3): the similarity
bound (``plan_block``'s ``bound``, ``alike``) with ``ratio`` the most that may merge, the restore
that gives a token no change of a group it was not alike to (a mix of the changes around it), and
the bound's plan kept static (the merged count fixed, no host sync). The DiT path plans with
``SIMILARITY_BOUND``, None today (measured on the trained Flux fixture: see its comment)."""

from __future__ import annotations

import math

import pytest
import torch

from tokenreduce.dit import BlockArgs, TokenLayout
import tokenreduce.tome_dit as tome_dit
from tokenreduce.tome_dit import (SIMILARITY_RAMP, alike, block_plan, make_tiles, merged_count, plan_block, plan_row,
                                  run_merged_block)

SIMILARITY_BOUND = 0.5  # the bound measured on the trained Flux fixture (tome_dit.SIMILARITY_BOUND's comment)

GRID = (1, 8, 8)
WIDTH = 64  # random tokens this wide are far from alike (cosine about 0 +- 0.13)


def _half_flat_half_textured(b: int = 1, seed: int = 0) -> torch.Tensor:
    """[B, 64, C] tokens of an 8 x 8 picture: its left half flat (one token, with a little noise
    far inside the bound), its right half textured (every token its own random direction)."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(b, 1, 1, WIDTH, generator=g)
    x = torch.randn(b, 8, 8, WIDTH, generator=g)
    x[:, :, :4] = flat + 0.01 * torch.randn(b, 8, 4, WIDTH, generator=g)
    return x.flatten(1, 2)


def _block(w: torch.Tensor):
    """A block that changes each token by a function of itself (so a token's own change is known exactly)."""
    def block(args):
        x = args["img"]
        return x + torch.tanh(x @ w)
    return block


def _flat_and_textured(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 64, ...] -> the left (flat) and right (textured) half's values."""
    v = values.view(values.shape[0], 8, 8, *values.shape[2:])
    return v[:, :, :4].flatten(1, 2), v[:, :, 4:].flatten(1, 2)


@pytest.mark.parametrize("seeded", [False, True])
def test_a_half_flat_half_textured_picture_merges_the_flat_half_and_leaves_the_textured_half(seeded):
    n = math.prod(GRID)
    tiles = make_tiles(GRID, (1, 2, 2), torch.Generator().manual_seed(5) if seeded else None, "cpu")
    r = merged_count(tiles, 0.5)  # 32 of the 48 sources may merge; 24 are in the flat half
    x = _half_flat_half_textured()
    plan = plan_block(x, tiles, r, bound=SIMILARITY_BOUND)
    assert plan.merged_tokens == n - r  # static: the merged count is ratio's
    # which grid positions merged into another (their weight > 0 and not their own row's owner)
    mask = torch.zeros(1, n)
    mask[:, tiles.tile_index[:, 1:].flatten()] = plan.mask.flatten(1)
    flat_merged, textured_merged = _flat_and_textured(mask)
    assert flat_merged.sum() == 24  # every source of the flat half merged, whole
    assert textured_merged.sum() == 0  # none of the textured half, though ratio allowed 8 more
    rows, weights, _ = plan.spread
    assert rows.shape == (1, r, 9) and torch.allclose(weights.sum(2), torch.ones(1, r, 1))

    # through the real merge, block and restore: the flat half takes its group's change (its tokens
    # are alike: each group's change is close to each token's own), the textured half its own change
    # (destinations and kept sources: no unlike token was averaged into them) or, for the 8 chosen
    # but unlike sources, a mix of the changes around them; never one other token's whole
    w = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(1)) / math.sqrt(WIDTH)
    block = _block(w)
    spec = BlockArgs("img", lambda layout: (n, 0))
    layout = TokenLayout(GRID, None, (n, 0))
    out = run_merged_block(spec, layout, plan, {"img": x}, block)
    full = block({"img": x})
    change, full_change = out - x, full - x
    flat_c, textured_c = _flat_and_textured(change)
    flat_full, textured_full = _flat_and_textured(full_change)
    assert torch.allclose(flat_c, flat_full, atol=0.05)
    own = (textured_c - textured_full).norm(dim=-1) < 1e-5
    assert int(own.sum()) == 32 - (r - 24)
    # the spread: the chosen textured sources' changes are the mixes their weights say
    chosen = torch.zeros(n, dtype=torch.bool)
    _, _, smooth_map = plan.spread
    chosen[smooth_map[0] >= plan.merged_tokens] = True
    _, textured_chosen = _flat_and_textured(chosen.view(1, n, 1).float())
    assert int(textured_chosen.sum()) == r - 24 and not bool(own[textured_chosen[..., 0] > 0].any())

    # today's ToMe (no bound) forces 8 textured sources into their tiles: they (and the destinations
    # they are averaged into) take a change that is not their own
    forced = plan_block(x, tiles, r)
    _, textured_forced = _flat_and_textured(run_merged_block(spec, layout, forced, {"img": x}, block) - x)
    wrong = (textured_forced - textured_full).norm(dim=-1) > 0.5 * textured_full.norm(dim=-1)
    assert int(wrong.sum()) >= r - 24


def test_alike_ramps_from_the_bound_and_none_is_no_bound():
    s = torch.tensor([-1.0, 0.0, SIMILARITY_BOUND, SIMILARITY_BOUND + SIMILARITY_RAMP / 2,
                      SIMILARITY_BOUND + SIMILARITY_RAMP, 1.0])
    assert torch.allclose(alike(s, SIMILARITY_BOUND), torch.tensor([0, 0, 0, 0.5, 1, 1.0]), atol=1e-6)
    assert alike(s, None) is None
    tiles = make_tiles(GRID, (1, 2, 2), None, "cpu")
    assert plan_block(_half_flat_half_textured(), tiles, 8).spread is None


def test_the_bound_is_per_row_static_and_a_rerun_is_bit_for_bit():
    """Each row is planned alone (rows of a batch or alone give the same plan), the plan's shapes
    do not depend on how much is alike, and a rerun gives the same output bit for bit."""
    n = math.prod(GRID)
    tiles = make_tiles(GRID, (1, 2, 2), torch.Generator().manual_seed(2), "cpu")
    r = merged_count(tiles, 0.5)
    x = torch.cat([_half_flat_half_textured(seed=0), torch.randn(1, n, WIDTH), _half_flat_half_textured(seed=3)])
    plans = {}
    tome_dit.SIMILARITY_BOUND, today = SIMILARITY_BOUND, tome_dit.SIMILARITY_BOUND
    try:  # the DiT path's plan with the bound set
        plan = block_plan(plans, x, (n, 0), TokenLayout(GRID, None, (n, 0)), tiles, r)
    finally:
        tome_dit.SIMILARITY_BOUND = today
    assert block_plan({}, x, (n, 0), TokenLayout(GRID, None, (n, 0)), tiles, r).spread is None  # off by default
    assert plan.spread is not None and plan.spread[2].shape == (3, n)
    for i in range(3):
        alone = plan_block(x[i:i + 1], tiles, r, bound=SIMILARITY_BOUND)
        row = plan_row(plan, i)
        assert all(torch.equal(a, b) for a, b in zip(alone.spread, row.spread)) and torch.equal(alone.mask, row.mask)
        assert torch.equal(alone.restore_map, row.restore_map)
    assert plan.mask[1].sum() == 0  # random tokens: nothing alike, nothing merged
    spec = BlockArgs("img", lambda layout: (n, 0))
    layout = TokenLayout(GRID, None, (n, 0))
    block = _block(torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(1)) / 4)
    first = run_merged_block(spec, layout, plan_block(x, tiles, r, bound=SIMILARITY_BOUND), {"img": x}, block)
    again = run_merged_block(spec, layout, plan_block(x, tiles, r, bound=SIMILARITY_BOUND), {"img": x}, block)
    assert torch.equal(first, again)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_plans_the_same_merge_and_restores_in_its_dtype(dtype):
    n = math.prod(GRID)
    tiles = make_tiles(GRID, (1, 2, 2), None, "cpu")
    r = merged_count(tiles, 0.5)
    x = _half_flat_half_textured()
    plan32 = plan_block(x, tiles, r, bound=SIMILARITY_BOUND)
    plan = plan_block(x.to(dtype), tiles, r, bound=SIMILARITY_BOUND)
    assert torch.equal((plan.mask > 0.5), (plan32.mask > 0.5))
    spec = BlockArgs("img", lambda layout: (n, 0))
    out = run_merged_block(spec, TokenLayout(GRID, None, (n, 0)), plan, {"img": x.to(dtype)},
                           lambda a: a["img"] * 1.5)
    assert out.dtype == dtype and torch.isfinite(out).all()
