"""Host-free tests of key/value downsampling on the grid."""

import pytest
import torch

from tokenreduce import DOWNSAMPLE_METHODS, downsample_tokens, downsampled_grid


def grid_tokens(batch, h, w, channels=6, seed=0):
    return torch.randn(batch, h * w, channels, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", DOWNSAMPLE_METHODS)
@pytest.mark.parametrize("h,w,factor", [(64, 64, 2), (65, 97, 2), (33, 49, 3), (64, 48, 1.5), (17, 25, 2.5), (8, 8, 4)])
def test_shapes_follow_the_ceil_grid(method, h, w, factor):
    x = grid_tokens(2, h, w)
    th, tw = downsampled_grid(h, w, factor)
    out = downsample_tokens(x, h, w, factor, method)
    assert out.shape == (2, th * tw, 6)
    assert torch.isfinite(out).all()


def test_nearest_with_an_integer_factor_is_strided_subsampling():
    h, w = 8, 6
    x = grid_tokens(1, h, w)
    out = downsample_tokens(x, h, w, 2, "nearest")
    expected = x.reshape(1, h, w, 6)[:, ::2, ::2].reshape(1, -1, 6)
    assert torch.equal(out, expected)


def test_average_is_the_mean_of_each_cell():
    x = torch.arange(16.0).reshape(1, 16, 1)  # a 4x4 grid, one channel
    out = downsample_tokens(x, 4, 4, 2, "average")
    assert out.flatten().tolist() == [2.5, 4.5, 10.5, 12.5]


def test_constant_tokens_stay_constant():
    x = torch.ones(1, 65 * 97, 3) * torch.tensor([1.0, -2.0, 0.5])
    for method in DOWNSAMPLE_METHODS:
        out = downsample_tokens(x, 65, 97, 2.5, method)
        torch.testing.assert_close(out, torch.ones_like(out) * torch.tensor([1.0, -2.0, 0.5]))


def test_deterministic_and_factor_one_is_identity():
    x = grid_tokens(2, 9, 7)
    assert downsample_tokens(x, 9, 7, 1.0, "bilinear") is x
    assert torch.equal(downsample_tokens(x, 9, 7, 2, "bicubic"), downsample_tokens(x, 9, 7, 2, "bicubic"))


def test_a_sequence_that_is_not_the_grid_is_refused():
    with pytest.raises(ValueError, match="grid"):
        downsample_tokens(grid_tokens(1, 4, 4), 3, 5, 2, "nearest")
    with pytest.raises(ValueError, match="method"):
        downsample_tokens(grid_tokens(1, 4, 4), 4, 4, 2, "max")
