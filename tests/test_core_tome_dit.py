"""Host-free tests of ToMe on DiTs (``tokenreduce/tome_dit.py``): the tile plan, merge and
restore on their own (exactness, counts, no scatter), and the block wrapper called the way the
host's block-replace seam calls it, with a stand-in block that records what it is given."""

from __future__ import annotations

import math

import pytest
import torch

from tokenreduce.dit import TokenLayout
from tokenreduce.tome_dit import (BlockArgs, frame_shortfall, make_tiles, merge, merged_args, merged_count, plan_block,
                                  restore, restored, take)

GRIDS = [(1, 6, 8), (1, 7, 5), (3, 4, 6), (2, 5, 7)]


def _tokens(grid, b=2, c=8, seed=0):
    return torch.randn(b, math.prod(grid), c, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("strides", [(1, 2, 2), (2, 2, 2), (1, 3, 2)])
@pytest.mark.parametrize("seeded", [False, True])
def test_ratio_zero_restores_exactly(grid, strides, seeded):
    generator = torch.Generator().manual_seed(3) if seeded else None
    tiles = make_tiles(grid, strides, generator, "cpu")
    x = _tokens(grid)
    plan = plan_block(x, tiles, 0)
    merged = merge(plan, x)
    assert merged.shape[1] == x.shape[1]
    assert torch.equal(restore(plan, merged), x)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_counts_and_identity_block(grid, ratio):
    tiles = make_tiles(grid, (1, 2, 2), torch.Generator().manual_seed(1), "cpu")
    x = _tokens(grid)
    r = merged_count(tiles, ratio)
    assert r == min(int(math.prod(grid) * ratio), tiles.sources)
    plan = plan_block(x, tiles, r)
    merged = merge(plan, x)
    assert merged.shape == (x.shape[0], math.prod(grid) - r, x.shape[2]) == (2, plan.merged_tokens, 8)
    # a block that changes nothing gives every token back exactly (the change is restored, not the state)
    spec = BlockArgs("img", lambda layout: (math.prod(grid), 0))
    layout = TokenLayout(grid, None, (math.prod(grid), 0))
    assert torch.equal(restored(spec, layout, plan, x, merged, merged.clone()), x)
    # each token reads back its merged row: a merged group shares one change, others their own
    change = torch.randn_like(merged)
    out = restored(spec, layout, plan, x, merged, merged + change)
    assert torch.allclose(out - x, restore(plan, change), atol=1e-5)
    assert len(torch.unique(plan.restore_map[0])) == merged.shape[1]


def test_merge_averages_each_tile_and_keeps_positions():
    grid = (1, 4, 4)
    tiles = make_tiles(grid, (1, 2, 2), None, "cpu")
    x = _tokens(grid, b=1)
    r = tiles.sources  # every source merges: one token per tile, the mean of its tile
    plan = plan_block(x, tiles, r)
    merged = merge(plan, x)
    means = x[0].view(2, 2, 2, 2, -1).permute(0, 2, 1, 3, 4).reshape(4, 4, -1).mean(1)
    assert torch.allclose(merged[0], means, atol=1e-6)
    assert plan.positions[0].tolist() == [0, 2, 8, 10]  # top-left destinations


def test_similar_sources_merge_first():
    grid = (1, 2, 4)
    x = torch.randn(1, 8, 4)
    x[0, 1] = x[0, 0] * 3  # the same direction as its tile's destination: cosine 1
    tiles = make_tiles(grid, (1, 2, 2), None, "cpu")
    plan = plan_block(x, tiles, 1)
    assert plan.restore_map[0, 1] == plan.restore_map[0, 0]


def test_rotary_positions_mask_and_modulation_follow_the_tokens():
    grid, text = (1, 4, 6), 5
    n = math.prod(grid)
    length = text + n + 3  # [text, grid, 3 reference tokens]
    layout = TokenLayout(grid, (length, text), None)
    spec = BlockArgs("img", lambda lay: (lay.joint[0], lay.joint[1]), pe="pe", pe_dim=2,
                     in_pe=lambda lay: lay.joint, mask="mask", modulation="vec")
    x = torch.arange(length, dtype=torch.float32).view(1, length, 1).expand(2, length, 4).clone()
    x[:, text:text + n] += torch.randn(2, n, 4)
    pe = torch.arange(length, dtype=torch.float32).view(1, 1, length, 1)
    mask = torch.arange(length * length, dtype=torch.float32).view(1, length, length)
    vec = torch.arange(length, dtype=torch.float32).view(1, length, 1).expand(2, length, 3)
    tiles = make_tiles(grid, (1, 2, 2), torch.Generator().manual_seed(0), "cpu")
    plan = plan_block(x[:, text:text + n], tiles, 10)
    new, merged_x = merged_args(spec, layout, plan, {"img": x, "pe": pe, "mask": mask, "vec": vec})
    m = length - 10
    assert new["img"].shape == (2, m, 4)
    assert torch.equal(new["img"][:, :text], x[:, :text]) and torch.equal(new["img"][:, -3:], x[:, -3:])
    positions = new["pe"][:, 0, :, 0]
    assert positions.shape == (2, m)
    assert positions[:, :text].tolist() == [list(range(text))] * 2
    assert positions[:, -3:].tolist() == [list(range(text + n, length))] * 2
    assert torch.equal(positions[:, text:text + n - 10], plan.positions.float() + text)
    assert torch.equal(new["vec"][..., 0], positions)
    assert torch.equal(new["mask"], positions[:, :, None] * length + positions[:, None, :])


def test_one_table_for_the_batch_is_merged_for_a_plan_of_one_row():
    """BlockArgs.pe_shared (CogVideoX: a (cos, sin) pair [N, D] the block broadcasts over the
    batch): both tables of the pair are handed on merged without a batch dimension, for a plan of
    one row (``run_merged_block`` runs such a block once per row: tests/test_core_tome_dit_plan.py);
    a plan of several rows has no one table: left alone."""
    grid = (2, 4, 6)
    n = math.prod(grid)
    layout = TokenLayout(grid, (n + 5, 5), None)
    spec = BlockArgs("img", lambda lay: (n, 0), pe="pe", pe_dim=1, in_pe=lambda lay: (n, 0), pe_batch=False,
                     pe_items=2, pe_shared=True)
    x = _tokens(grid, b=1)
    tiles = make_tiles(grid, (1, 2, 2), torch.Generator().manual_seed(0), "cpu")
    plan = plan_block(x, tiles, 20)
    cos = torch.arange(n, dtype=torch.float32)[:, None].expand(n, 4)
    flag = object()
    new, merged_grid = merged_args(spec, layout, plan, {"img": x, "pe": (cos, -cos, flag)})
    assert torch.equal(merged_grid, merge(plan, x)) and merged_grid.shape == (1, n - 20, 8)
    merged_cos, merged_sin, kept_flag = new["pe"]
    assert kept_flag is flag and merged_cos.shape == (n - 20, 4) and torch.equal(merged_sin, -merged_cos)
    assert torch.equal(merged_cos[:, 0], plan.positions[0].float())
    assert torch.equal(restored(spec, layout, plan, x, merged_grid, new["img"].clone()), x)
    rows = _tokens(grid, b=3)
    per_sample = plan_block(rows, tiles, 20)  # a plan of its own per sample: no one table fits; left alone
    assert merged_args(spec, layout, per_sample, {"img": rows, "pe": (cos, -cos)}) is None
    assert merged_args(spec, layout, per_sample, {"img": rows, "pe": None}) is not None  # no table (CogVideoX 2B)


def test_a_stream_of_a_pair_merges_and_host_held_modulations_follow_per_frame():
    """A tokens argument that is a pair of streams (LTX-2's img = (video, audio)): only its item
    ``tokens_item`` merges, the other passes through and comes back as the block leaves it; a
    modulation the host holds in an object (``modulation_rows``: a row per frame) reaches each merged
    token as its frame's row, a further one (``modulation_also``) too, one per sample stays as it is."""

    class Held:  # a stand-in for the host's CompressedTimestep
        def __init__(self, data):
            self.data = data

    grid, guides = (3, 2, 4), 8  # [video grid, a guide frame's tokens]
    n = math.prod(grid)
    length = n + guides
    layout = TokenLayout(grid, None, (length, 0))
    spec = BlockArgs("img", lambda lay: lay.image, pe="pe", in_pe=lambda lay: lay.image, modulation="t",
                     modulation_runs=True, tokens_item=0, modulation_also=("t2", "t3"), modulation_rows=lambda h: h.data)
    video, audio = torch.randn(2, length, 4), torch.randn(2, 5, 4)
    frames = torch.arange(4.0).view(1, 4, 1).expand(2, 4, 3)  # a row per frame, the guide's the last
    per_sample = Held(torch.ones(2, 1, 3))
    tiles = make_tiles(grid, (1, 2, 2), None, "cpu")
    plan = plan_block(video[:, :n], tiles, 8)
    new, merged_grid = merged_args(spec, layout, plan, {"img": (video, audio), "pe": torch.arange(float(length)).view(1, length, 1),
                                                        "t": Held(frames), "t2": Held(frames), "t3": per_sample})
    assert isinstance(new["img"], tuple) and new["img"][1] is audio
    merged_x = new["img"][0]  # the merged grid, then the guide's tokens as they are
    assert torch.equal(merged_x[:, :n - 8], merged_grid)
    assert merged_x.shape == (2, length - 8, 4) and torch.equal(merged_x[:, -guides:], video[:, -guides:])
    positions = new["pe"][..., 0].long()  # the grid position each merged token stands for
    for name in ("t", "t2"):
        assert torch.equal(new[name][..., 0], (positions // 8).float())  # its frame's row (8 tokens a frame)
    assert new["t3"] is per_sample
    out = restored(spec, layout, plan, video, merged_x, merged_x + 1)
    assert torch.allclose(out, video + 1)  # a block adding 1 to every token: each token its own + 1


def test_take_broadcasts_a_batch_of_one():
    x = torch.arange(6.0).view(1, 6, 1)
    index = torch.tensor([[0, 5], [2, 3]])
    assert take(x, 1, index)[..., 0].tolist() == [[0.0, 5.0], [2.0, 3.0]]


def test_no_scatter_in_plan_merge_restore(monkeypatch):
    """Merge and restore are gathers and dense sums: no scatter (slow, non-deterministic on GPUs)."""
    def refuse(*args, **kwargs):
        raise AssertionError("scatter used")

    for name in ("scatter", "scatter_add", "scatter_reduce", "index_add", "index_put"):
        monkeypatch.setattr(torch, name, refuse, raising=False)
        monkeypatch.setattr(torch.Tensor, name, refuse, raising=False)
        monkeypatch.setattr(torch.Tensor, name + "_", refuse, raising=False)
    grid = (3, 6, 6)  # frames 1-2 in stride_t 2 tiles (the first in none)
    tiles_before = make_tiles  # tiles are drawn before the model call (outside the hot path)
    monkeypatch.undo()
    tiles = tiles_before(grid, (2, 2, 2), torch.Generator().manual_seed(0), "cpu")
    frame_tiles = tiles_before(grid, (1, 2, 2), torch.Generator().manual_seed(0), "cpu")  # grouped by frame
    for name in ("scatter", "scatter_add", "scatter_reduce", "index_add", "index_put"):
        monkeypatch.setattr(torch, name, refuse, raising=False)
        monkeypatch.setattr(torch.Tensor, name, refuse, raising=False)
        monkeypatch.setattr(torch.Tensor, name + "_", refuse, raising=False)
    x = _tokens(grid)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        plan = plan_block(x, tiles, 30)
        out = restore(plan, merge(plan, x))
        by_frame = plan_block(x, frame_tiles, 18, frames=3)
        out_by_frame = restore(by_frame, merge(by_frame, x))
    assert out.shape == out_by_frame.shape == x.shape
    assert not [e.name for e in profile.events() if "scatter" in e.name or "index_put" in e.name]


def test_seeded_tiles_are_reproducible_and_leave_the_global_rng():
    state = torch.get_rng_state()
    a = make_tiles((3, 4, 6), (1, 2, 2), torch.Generator().manual_seed(7), "cpu")
    b = make_tiles((3, 4, 6), (1, 2, 2), torch.Generator().manual_seed(7), "cpu")
    c = make_tiles((3, 4, 6), (1, 2, 2), torch.Generator().manual_seed(8), "cpu")
    assert torch.equal(get_state := torch.get_rng_state(), state), get_state
    assert torch.equal(a.tile_index, b.tile_index) and not torch.equal(a.tile_index, c.tile_index)
    assert sorted(a.tile_index.flatten().tolist() + a.extra_index.tolist()) == list(range(72))


@pytest.mark.parametrize("frames", [3, 4, 5])
def test_temporal_tiles_span_stride_t_frames_and_leave_the_first_whole(frames):
    """stride_t 2: every full tile holds 2x2 tokens of each of two consecutive latent frames, never
    the first frame (a causal video VAE's lone first frame; in image to video the clean one, with a
    timestep of its own), whatever the frame count; the tiles are counted from the last frame back,
    so of 4 frames the second stays whole too. The count merged is the ratio's while the full
    tiles' sources allow it, then every source; seeded draws rerun exactly."""
    grid = (frames, 4, 6)
    n, per_frame = math.prod(grid), 4 * 6
    whole = 1 if frames % 2 else 2  # frames no tile reaches
    tiles = make_tiles(grid, (2, 2, 2), torch.Generator().manual_seed(5), "cpu")
    assert tiles.tile_index.shape == ((frames - whole) // 2 * 2 * 3, 8)
    for tile in tiles.tile_index.tolist():
        assert sorted({p // per_frame for p in tile}) in [[f, f + 1] for f in range(whole, frames, 2)]
    assert tiles.extra_index.tolist() == list(range(per_frame * whole))
    assert tiles.sources == (n - per_frame * whole) * 7 // 8
    for ratio in (0.5, 0.875):
        assert merged_count(tiles, ratio) == min(int(n * ratio), tiles.sources)
    assert merged_count(make_tiles(grid, (2, 2, 2), None, "cpu"), 0.875) == tiles.sources
    x = _tokens(grid)
    r = merged_count(tiles, 0.5)
    plan = plan_block(x, tiles, r)
    assert merge(plan, x).shape[1] == n - r
    # a merged group (tokens reading the same merged row) spans two frames somewhere
    groups = {}
    for position, row in enumerate(plan.restore_map[0].tolist()):
        groups.setdefault(row, set()).add(position // per_frame)
    assert any(len(f) == 2 for f in groups.values())
    again = make_tiles(grid, (2, 2, 2), torch.Generator().manual_seed(5), "cpu")
    assert torch.equal(again.tile_index, tiles.tile_index)
    assert torch.equal(plan_block(x, again, r).restore_map, plan.restore_map)
    assert not torch.equal(make_tiles(grid, (2, 2, 2), torch.Generator().manual_seed(6), "cpu").tile_index,
                           tiles.tile_index)


@pytest.mark.parametrize("grid", [(3, 4, 6), (2, 5, 7)])
def test_frame_grouped_plan_merges_the_same_count_per_frame_in_frame_order(grid):
    """DiTMerge.frame_grouped (Wan HuMo, whose audio cross-attention splits a block's tokens into
    equal groups, one per frame): each frame merges r / frames of its own sources, the merged
    tokens frame by frame, each frame's as a plan of that frame alone would make them."""
    t, h, w = grid
    tiles = make_tiles(grid, (1, 2, 2), None, "cpu")
    x = _tokens(grid)
    r = merged_count(tiles, 0.45, frames=t)
    assert r % t == 0 and 0 < r <= merged_count(tiles, 0.45)
    plan = plan_block(x, tiles, r, frames=t)
    merged = merge(plan, x)
    per_frame = plan.merged_tokens // t
    assert merged.shape[1] == plan.merged_tokens == per_frame * t
    frame_of = torch.arange(t).repeat_interleave(per_frame)
    assert torch.equal(plan.positions // (h * w), frame_of.expand(2, -1))  # frame order, equal counts
    assert torch.equal(frame_of[plan.restore_map], (torch.arange(t * h * w) // (h * w)).expand(2, -1))  # own frame
    spec = BlockArgs("img", lambda layout: (math.prod(grid), 0))
    layout = TokenLayout(grid, None, (math.prod(grid), 0))
    assert torch.equal(restored(spec, layout, plan, x, merged, merged.clone()), x)
    one = make_tiles((1, h, w), (1, 2, 2), None, "cpu")
    for f in range(t):  # each frame as its own one-frame plan merges it
        frame = x[:, f * h * w:(f + 1) * h * w]
        alone = plan_block(frame, one, r // t)
        assert torch.equal(merged[:, f * per_frame:(f + 1) * per_frame], merge(alone, frame))
        assert torch.equal(plan.positions[:, f * per_frame:(f + 1) * per_frame], alone.positions + f * h * w)
