"""ToMe's proportional attention (mode "q, k, v + proportional attention", issue #50): a merged key
carries the log of the tokens it stands for, so where a merged group's tokens are alike the
merged attention is the unmerged one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenreduce.bipartite import log_sizes, partition_grid, plan_merge
from tokenreduce.tome_dit import make_tiles, plan_block
from tokenreduce.tome_patch import TilePlan


def _cells_alike(h: int, w: int, c: int, seed: int = 0) -> torch.Tensor:
    """[1, h*w, c] tokens equal within each 2x2 cell: whatever merges, merges identical tokens."""
    cells = torch.randn(1, c, h // 2, w // 2, generator=torch.Generator().manual_seed(seed))
    return F.interpolate(cells, scale_factor=2, mode="nearest").flatten(2).transpose(1, 2)


def _attention(q, k, v, bias=None):
    mask = None if bias is None else bias[:, None, None, :]
    return F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], attn_mask=mask)[:, 0]


def _plans(x: torch.Tensor, h: int, w: int, r: int):
    generator = torch.Generator().manual_seed(3)
    partition = partition_grid(h, w, 2, 2, generator, x.device)
    yield plan_merge(x, w, h, 2, 2, partition, r)
    yield TilePlan(plan_block(x, make_tiles((1, h, w), (1, 2, 2), torch.Generator().manual_seed(3), x.device), r))


def test_merged_keys_of_alike_tokens_with_their_log_sizes_give_full_attention():
    h = w = 8
    x = _cells_alike(h, w, 16)
    q = torch.randn(1, h * w, 16, generator=torch.Generator().manual_seed(1))
    full = _attention(q, x, x)
    for plan in _plans(x, h, w, r=32):
        merged = plan.merge(x)
        sizes = plan.log_sizes()
        assert sizes.shape == (1, h * w - 32)
        assert torch.allclose(sizes.exp().sum(-1), torch.tensor([float(h * w)]))  # every token counted once
        assert torch.allclose(_attention(q, merged, merged, sizes), full, atol=1e-5)
        assert not torch.allclose(_attention(q, merged, merged), full, atol=1e-3)  # tomesd's: the mass is off


def test_sizes_count_the_tokens_each_merged_row_restores():
    restore_map = torch.tensor([[0, 0, 1, 2, 2, 2], [0, 1, 1, 1, 2, 2]])
    assert torch.equal(log_sizes(restore_map, 3).exp().round(), torch.tensor([[2., 1., 3.], [1., 3., 2.]]))


def test_nothing_merged_has_no_sizes():
    x = _cells_alike(4, 4, 8)
    plan = plan_merge(x, 4, 4, 2, 2, partition_grid(4, 4, 2, 2, None, x.device), 0)
    assert plan.log_sizes() is None
