"""Host-free tests of which frames ToMe on DiTs keeps whole (``tokenreduce/tome_dit.py``'s
``make_tiles``, ``frame_shortfall``): the first latent frame never shares a tile of stride_t frames
with later frames (in image to video the clean one, with a timestep of its own), conditioning
frames stay whole, the shortfall warning says why and advises only what merges as asked; and the
tiles are made on the device (no host round trip) and are those of the earlier implementation for
the same seed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tokenreduce.tome_dit import frame_shortfall, make_tiles, merge, merged_count, plan_block, rotated, tile_structure


def _tokens(grid, b=2, c=8, seed=0):
    return torch.randn(b, math.prod(grid), c, generator=torch.Generator().manual_seed(seed))


def test_frame_shortfall_says_which_frames_stay_whole_and_only_advice_that_merges_as_asked():
    """The warning's text: where frames stay whole (the first with stride_t above 1, conditioning
    frames, the frames before the first whole tile of stride_t frames counted from the last, or all
    tiles spanning fewer frames than stride_t) and so fewer tokens merge than the ratio asks. Its
    advice names only frame counts and stride_t values that merge as asked (none where none does),
    and always the ratio that merges what the call can; none at stride_t 1 without conditioning
    frames (even on a grid whose odd edges cap the ratio) or where the ratio asks no more than can
    merge."""
    def said(grid, strides, ratio, whole_frames=0):
        tiles = make_tiles(grid, strides, None, "cpu", whole_frames)
        return frame_shortfall("Wan", grid, strides, ratio, merged_count(tiles, ratio), whole_frames)

    text = said((5, 4, 6), (2, 2, 2), 0.875)  # 105 asked, 84 merge: frames 1-4 in tiles, at the cap
    assert text.startswith("ratio 0.875 asks 105 of the 120 grid tokens of this Wan call (5 frames × 6×4) to merge, "
                           "but 84 merge: with stride_t 2 its first latent frame is kept whole")
    assert text.endswith("Set ratio 0.70 or lower, which merges what this call can.")  # no frame count would do
    even = said((4, 4, 6), (2, 2, 2), 0.5)  # 48 asked; frames 2-3 in tiles: 42 merge
    assert "so the next frame stays whole too" in even
    assert "that is 1 more than a multiple of 2 (3 or 5), or set stride_t 1 or 3; or set ratio 0.43" in even
    assert "the next 2 frames stay whole too" in said((6, 4, 6), (3, 2, 2), 0.9)  # one stride_t 3 tile: frames 3-5
    short = said((2, 4, 6), (4, 2, 2), 0.7)  # frame 1 alone after the first: tiles of one frame
    assert "stride_t 4 is more than the 1 latent frame after it, so each tile spans only 1" in short
    assert "1 more than a multiple of 4 (5), or set stride_t 1; or set ratio 0.37" in short
    wan = said((21, 4, 6), (3, 2, 2), 0.875)  # Wan's 81 frames at stride_t 3: 6 tiles of frames 3-20
    assert "the next 2 frames stay whole too" in wan and "1 more than a multiple of 3 (22), or set stride_t 4 or 5" in wan
    clean = said((3, 4, 6), (1, 2, 2), 0.75, whole_frames=1)  # image to video: the clean first frame whole
    assert "its first latent frame is conditioning (the clean image it starts from" in clean
    assert said((1, 5, 5), (1, 2, 2), 0.75) is None  # stride_t 1: the edges cap it, not frames
    assert said((5, 4, 6), (2, 2, 2), 0.5) is None  # 60 asked, 84 can merge


@pytest.mark.parametrize("grid, strides", [((16, 2, 4), (2, 2, 2)), ((21, 2, 4), (3, 2, 2)), ((4, 2, 4), (2, 2, 2))])
@pytest.mark.parametrize("whole_frames", [0, 1])
def test_the_first_frame_never_shares_a_tile_with_later_frames(grid, strides, whole_frames):
    """LTX-Video at 121 frames (16 latent frames) with stride_t 2, Wan at 81 (21) with stride_t 3,
    and a frame count that is a multiple of stride_t: the first latent frame (the clean one of image
    to video, with its own timestep) is in no tile, so it merges with no other frame, nor does any
    token merge into it; conditioning frames (``whole_frames``) stay whole at stride_t 1 too."""
    t, h, w = grid
    per_frame = h * w
    for st in (strides[0], 1):
        tiles = make_tiles(grid, (st, *strides[1:]), torch.Generator().manual_seed(2), "cpu", whole_frames)
        frame_of_tiles = tiles.tile_index // per_frame
        if st > 1 or whole_frames:
            assert (frame_of_tiles > 0).all() and set(range(per_frame)) <= set(tiles.extra_index.tolist())
        else:  # stride_t 1 without conditioning frames: frame 0 tiled on its own
            assert (frame_of_tiles == frame_of_tiles[:, :1]).all() and (frame_of_tiles == 0).any()
        x = _tokens(grid)
        plan = plan_block(x, tiles, merged_count(tiles, 0.5))
        if st > 1 or whole_frames:  # frame 0's tokens read their own rows, which no other token reads
            rows = plan.restore_map[:, :per_frame]
            assert all(len(set(r.tolist())) == per_frame for r in rows)
            assert not (plan.restore_map[:, per_frame:, None] == rows[:, None]).any()
            merged = merge(plan, x)
            assert torch.equal(merged.gather(1, rows.unsqueeze(-1).expand(-1, -1, x.shape[2])), x[:, :per_frame])


def test_tiles_are_the_same_as_before_for_the_same_seed():
    """The tiles (made on the device from index arithmetic, the draw a rotation on the device) are
    those of the earlier implementation (host-side indexing) for the same seed and grid, wherever
    the point-2 change (the first frame out of every tile of stride_t frames) does not move them."""
    expected = json.loads((Path(__file__).parent / "data" / "tome_dit_tiles_before.json").read_text())
    for grid, strides, seed, tile_index, extra_index, inverse in expected:
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        tiles = make_tiles(tuple(grid), tuple(strides), generator, "cpu")
        assert tiles.tile_index.tolist() == tile_index and tiles.extra_index.tolist() == extra_index
        assert tiles.inverse.tolist() == inverse


def test_making_tiles_reads_nothing_back_from_the_device(monkeypatch):
    """Tile structure and draws are tensor work on the device: no boolean indexing (a device sync
    on CUDA), no copy to or from the host, no ``.item()``/``.tolist()``."""
    def refuse(*args, **kwargs):
        raise AssertionError("a host round trip")

    for name in ("item", "tolist", "nonzero", "cpu", "numpy", "masked_select"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    real_getitem = torch.Tensor.__getitem__

    def no_boolean_index(self, index):
        items = index if isinstance(index, tuple) else (index,)
        if any(torch.is_tensor(i) and i.dtype == torch.bool for i in items):
            raise AssertionError("a boolean index")
        return real_getitem(self, index)
    monkeypatch.setattr(torch.Tensor, "__getitem__", no_boolean_index)
    for grid, strides, whole in (((3, 4, 6), (1, 2, 2), 0), ((5, 5, 7), (2, 2, 2), 0), ((4, 4, 6), (1, 2, 2), 1)):
        structure = tile_structure(grid, strides, "cpu", whole)
        tiles = rotated(structure, torch.Generator().manual_seed(1))
        assert tiles.tile_index.shape == structure.tile_index.shape
    monkeypatch.undo()
    assert sorted(tiles.tile_index.flatten().tolist() + tiles.extra_index.tolist()) == list(range(4 * 4 * 6))
    assert torch.equal(torch.cat([tiles.extra_index, tiles.tile_index.flatten()])[tiles.inverse], torch.arange(96))
