"""Host-free tests of ToMe's similarity bound (``min_similarity``, issue #50): ``ratio`` is the
most that merges and only tokens at least that alike to their target merge, in the three
matchings of UNets (tomesd's whole grid, nearby cells, tile) and on DiTs' tiles, frame by frame
too. A picture half flat and half textured merges its flat half and leaves the textured half."""

from __future__ import annotations

import pytest
import torch

from tokenreduce.bipartite import ALIKE_STEPS, alike_count, partition_grid, plan_merge
from tokenreduce.tome_dit import make_tiles, merge, plan_block, restore
from tokenreduce.tome_patch import TilePlan, draw_cells, plan_cells

H, W, C = 16, 16, 32


def half_flat(batch: int = 1, seed: int = 0) -> torch.Tensor:
    """[B, H*W, C]: the left half one vector (flat), the right half random tokens (textured)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, H, W, C, generator=g)
    x[:, :, : W // 2] = torch.randn(C, generator=g)
    return x.reshape(batch, H * W, C)


def flat_half(tokens: torch.Tensor) -> torch.Tensor:
    return tokens % W < W // 2


@pytest.mark.parametrize("reach", [None, 1], ids=["whole grid", "nearby cells"])
def test_a_half_flat_picture_merges_its_flat_half_and_leaves_the_textured_half(reach):
    x = half_flat(batch=2)
    r = H * W // 2  # ratio 0.5: more than the flat half's sources (3/8 of the tokens)
    partition = partition_grid(H, W, 2, 2, torch.Generator().manual_seed(1), x.device)
    unbounded = plan_merge(x, W, H, 2, 2, partition, r, reach)
    assert unbounded.r == r and not flat_half(unbounded.moved).all()  # tomesd merges textured tokens too
    plan = plan_merge(x, W, H, 2, 2, partition, r, reach, bound=0.9)
    flat_sources = H * (W // 2) * 3 // 4
    assert plan.r == flat_sources  # every flat source (a multiple of r / 8 here), nothing else
    assert flat_half(plan.moved).all()
    out = plan.unmerge(plan.merge(x))
    textured = ~flat_half(torch.arange(H * W))
    assert torch.equal(out[:, textured], x[:, textured])  # the textured half stays as it was
    assert torch.allclose(out, x, atol=1e-6)  # the flat half merged only what was alike: unchanged too


def test_tile_matching_merges_the_flat_half_alone():
    x = half_flat(batch=2)
    r = H * W // 2
    cells = draw_cells(H, W, 2, 2, torch.Generator().manual_seed(1), x.device, True)
    plan = plan_cells(x, W, H, 2, 2, cells, r, None, bound=0.9)
    assert isinstance(plan, TilePlan) and plan.plan.r == H * (W // 2) * 3 // 4
    sources = cells.tile_index[:, 1:].flatten()
    merged = sources[plan.plan.mask[0, ..., 0].flatten().bool()]
    assert flat_half(merged).all()
    out = plan.unmerge(plan.merge(x))
    textured = ~flat_half(torch.arange(H * W))
    assert torch.equal(out[:, textured], x[:, textured])
    assert plan_cells(x, W, H, 2, 2, cells, r, None).plan.r == r  # unbounded: ratio's count


def test_dit_tiles_frame_by_frame_merge_the_flat_half_of_every_frame():
    frames = 3
    x = torch.cat([half_flat(seed=s).view(1, 1, H * W, C) for s in range(frames)], 1).flatten(1, 2)
    tiles = make_tiles((frames, H, W), (1, 2, 2), torch.Generator().manual_seed(2), x.device)
    r = frames * H * W // 2
    plan = plan_block(x, tiles, r, frames, bound=0.9)
    assert plan.r == frames * H * (W // 2) * 3 // 4
    grid_positions = torch.arange(frames * H * W)
    textured = ~flat_half(grid_positions % (H * W))
    out = restore(plan, merge(plan, x))
    assert torch.equal(out[:, textured], x[:, textured])
    assert torch.allclose(out, x, atol=1e-6)


def test_the_count_is_the_fewest_alike_of_the_batch_rounded_down_to_an_eighth_of_r():
    similarity = torch.tensor([[0.95] * 70 + [0.1] * 58, [0.95] * 100 + [0.1] * 28])
    r = 96  # steps of 12
    assert alike_count(similarity, r, 0.9) == 60  # the first row's 70 alike, rounded down
    assert alike_count(similarity, r, None) == r and alike_count(similarity, r, 0.0) == r
    assert alike_count(similarity, 40, 0.9) == 40  # more alike than ratio allows: ratio's count
    assert alike_count(similarity, r, 0.99) == 0
    counts = {alike_count(torch.rand(2, 128, generator=torch.Generator().manual_seed(i)), r, 0.5) for i in range(50)}
    assert counts <= {r * k // ALIKE_STEPS for k in range(ALIKE_STEPS + 1)}  # at most nine shapes


def test_nothing_alike_is_the_identity_plan():
    x = torch.randn(1, H * W, C, generator=torch.Generator().manual_seed(3))
    partition = partition_grid(H, W, 2, 2, None, x.device)
    assert plan_merge(x, W, H, 2, 2, partition, H * W // 2, None, bound=0.999).is_identity
    cells = draw_cells(H, W, 2, 2, None, x.device, True)
    assert plan_cells(x, W, H, 2, 2, cells, H * W // 2, None, bound=0.999).is_identity
