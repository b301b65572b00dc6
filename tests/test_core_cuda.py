"""Host-free checks that the core gives on a CUDA device what it gives on the CPU.

Skipped where no CUDA device is present (CI has none); run on a lent GPU with
``python3 -m pytest tests/test_core_cuda.py``.
"""

import pytest
import torch

from tokenreduce import DOWNSAMPLE_METHODS, downsample_tokens, plan_bipartite_merge

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


def smooth_tokens(batch, h, w, channels, seed):
    """Spatially smooth tokens (as a UNet's are), float64 so both devices rank alike."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(batch, channels, (h + 3) // 4, (w + 3) // 4, generator=g, dtype=torch.float64)
    grid = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
    grid = grid + 0.05 * torch.randn(grid.shape, generator=g, dtype=torch.float64)
    return grid.flatten(2).transpose(1, 2).contiguous()


@pytest.mark.parametrize("method", DOWNSAMPLE_METHODS)
@pytest.mark.parametrize("h,w,factor", [(64, 64, 2), (65, 97, 3), (48, 64, 1.5)])
def test_downsampling_matches_the_cpu(method, h, w, factor):
    x = smooth_tokens(2, h, w, 8, seed=1).float()
    on_cpu = downsample_tokens(x, h, w, factor, method)
    on_gpu = downsample_tokens(x.to(CUDA), h, w, factor, method)
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=1e-5, atol=1e-5)


def merges(plan):
    """The plan in token space, independent of the order it keeps its lists in (the CPU's
    argsort is not stable, CUDA's is): the dst tokens, and which src token joins which dst."""
    src_of, dst_of = plan.src_of[0, :, 0].cpu(), plan.dst_of[0, :, 0].cpu()
    merged, into = plan.merged[..., 0].cpu(), plan.merged_into[..., 0].cpu()
    pairs = [sorted(zip(src_of[m].tolist(), dst_of[i].tolist())) for m, i in zip(merged, into)]
    return sorted(dst_of.tolist()), pairs


@pytest.mark.parametrize("reach", [None, 1, 2])
def test_plans_and_merges_match_the_cpu(reach):
    h, w = 32, 48
    # Independent random tokens: similarities far apart, so both devices rank them alike.
    x = torch.randn(2, h * w, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    r = (h * w * 3) // 4 // 2
    plan_cpu = plan_bipartite_merge(x, w, h, 2, 2, r, None, reach)
    plan_gpu = plan_bipartite_merge(x.to(CUDA), w, h, 2, 2, r, None, reach)
    assert plan_gpu.src_of.device.type == "cuda"
    assert merges(plan_gpu) == merges(plan_cpu)
    round_trip_cpu = plan_cpu.unmerge(plan_cpu.merge(x))
    torch.testing.assert_close(plan_gpu.unmerge(plan_gpu.merge(x.to(CUDA))).cpu(), round_trip_cpu)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_merging_is_bit_identical_from_run_to_run(dtype):
    # Identical runs must give identical images: no atomics decide the order of a sum.
    h, w = 64, 64
    x = smooth_tokens(2, h, w, 320, seed=4).to(CUDA, dtype)
    plan = plan_bipartite_merge(x, w, h, 2, 2, 2048)  # whole grid: many src share a dst
    first = plan.merge(x)
    assert first.dtype == dtype and first.shape == (2, h * w - 2048, 320)
    for _ in range(20):
        assert torch.equal(plan.merge(x), first)
    restored = plan.unmerge(first)
    assert torch.isfinite(restored).all()


def test_the_merge_mean_matches_the_cpu_in_half_precision():
    h, w = 64, 64
    x = torch.randn(2, h * w, 32, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    plan_cpu = plan_bipartite_merge(x, w, h, 2, 2, 2048)
    plan_gpu = plan_bipartite_merge(x.to(CUDA), w, h, 2, 2, 2048)
    assert merges(plan_gpu) == merges(plan_cpu)
    on_gpu = plan_gpu.unmerge(plan_gpu.merge(x.to(CUDA, torch.float16))).double().cpu()
    torch.testing.assert_close(on_gpu, plan_cpu.unmerge(plan_cpu.merge(x)), rtol=5e-3, atol=5e-3)
