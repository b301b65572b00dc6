"""The Image Compare node (issue #46, point 2) in the real ComfyUI, in-process: batches matched by
index (one image against N repeated), mismatches refused with what to change, PSNR and SSIM equal
to kornia's, LPIPS equal to the project's quality tools' where its weights are installed and said
to be missing (never fetched) where not, the heat map, and the report on the node."""

from __future__ import annotations

import importlib
import math
import re

import pytest
import torch

from conftest import PACK_MODULE


@pytest.fixture(scope="module")
def node(comfy):
    return importlib.import_module(f"{PACK_MODULE}.nodes.compare_node")


def images(count: int, h: int = 48, w: int = 40, seed: int = 0) -> torch.Tensor:
    """Smooth random RGB images in 0..1 (an IMAGE batch)."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(count, 3, h // 8 + 1, w // 8 + 1, generator=g)
    return torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear").permute(0, 2, 3, 1).contiguous()


def noisy(image: torch.Tensor, sigma: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (image + sigma * torch.randn(image.shape, generator=g)).clamp(0, 1)


def kornia_figures(a: torch.Tensor, b: torch.Tensor) -> tuple[list[float], list[float]]:
    import kornia.metrics

    a64, b64 = a.double(), b.double()
    psnr = [kornia.metrics.psnr(x, y, 1.0).item() for x, y in zip(a64, b64)]
    ssim = kornia.metrics.ssim(a64.permute(0, 3, 1, 2), b64.permute(0, 3, 1, 2), 11, max_val=1.0, eps=0.0,
                               padding="valid").mean(dim=(1, 2, 3)).tolist()
    return psnr, ssim


def run(node, a, b, **inputs):
    out = node.ImageCompareNode.execute(a, b, **inputs)
    difference, text = out.result
    return difference, text, out.ui


def test_a_batch_is_compared_image_by_image_with_kornias_psnr_and_ssim(node, monkeypatch, tmp_path):
    monkeypatch.setattr(node, "lpips_folders", lambda: [tmp_path])  # no weights: PSNR and SSIM only
    a = images(3, seed=1)
    b = torch.cat([noisy(a[:1], 0.02, seed=2), noisy(a[1:2], 0.1, seed=3), a[2:]])
    psnr, ssim = kornia_figures(a, b)
    assert node.psnr(a, b).tolist() == psnr and node.ssim(a, b).tolist() == ssim
    difference, text, ui = run(node, a, b)
    lines = text.splitlines()
    for i in range(2):
        assert lines[i] == f"image {i + 1}: PSNR {psnr[i]:.2f} dB · SSIM {ssim[i]:.4f}"
    assert lines[2] == "image 3: PSNR ∞ dB · SSIM 1.0000" and math.isinf(psnr[2])
    assert lines[3] == "mean of 3: PSNR ∞ dB · SSIM " + f"{sum(ssim) / 3:.4f}"
    assert lines[4].startswith("LPIPS: not installed") and "lpips-alexnet-a286e44ce15d.safetensors" in lines[4]
    assert psnr[0] > psnr[1] and ssim[0] > ssim[1]
    assert ui["tokenreduce"] == [{"lines": lines, "warnings": []}] and ui["text"] == [text]
    assert difference.shape == (3, 48, 40, 3) and difference.dtype == torch.float32
    assert 0 <= difference.min() and difference.max() <= 1
    assert torch.equal(difference[2], torch.zeros(48, 40, 3))  # identical: black everywhere
    assert difference[1].mean() > difference[0].mean() > 0


def test_the_heat_maps_gain_saturates_at_one_over_gain():
    from tokenreduce_pack.nodes.compare_node import HEAT, heat_map

    a = torch.zeros(1, 2, 2, 3)
    b = torch.tensor([0.0, 0.125, 0.25, 1.0]).view(1, 2, 2, 1).expand(1, 2, 2, 3)
    heat = heat_map(a, b, gain=4.0)[0]  # differences 0, 1/8 (half of 1/gain), 1/4 (= 1/gain), 1
    colour = lambda i: torch.tensor(HEAT[i])  # noqa: E731
    assert torch.equal(heat[0, 0], colour(0)) and torch.equal(heat[0, 1], colour(len(HEAT) // 2))
    assert torch.equal(heat[1, 0], colour(-1)) and torch.equal(heat[1, 1], colour(-1))


def test_one_image_is_compared_with_each_of_a_batch(node, monkeypatch, tmp_path):
    monkeypatch.setattr(node, "lpips_folders", lambda: [tmp_path])
    reference = images(1, seed=4)
    batch = torch.cat([noisy(reference, s, seed=5) for s in (0.01, 0.05)])
    for a, b, single in ((reference, batch, "image_a"), (batch, reference, "image_b")):
        difference, text, _ = run(node, a, b)
        psnr, _ = kornia_figures(a.expand(2, -1, -1, -1), b.expand(2, -1, -1, -1))
        assert difference.shape[0] == 2 and text.splitlines()[0].startswith(f"image 1: PSNR {psnr[0]:.2f} dB")
        assert f"{single}'s one image compared with each of the other's 2" in text


@pytest.mark.parametrize("a,b,needle", [
    ((2, 48, 40), (3, 48, 40), "image_a has 2 images and image_b 3"),
    ((1, 48, 40), (1, 40, 48), "image_a is 40x48 px and image_b 48x40 px: compare images of one size"),
])
def test_batches_that_do_not_pair_up_are_refused_saying_what_to_change(node, a, b, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        run(node, images(*a), images(*b))


def test_an_image_that_is_not_rgb_is_refused(node):
    with pytest.raises(ValueError, match=r"image_b is not an RGB IMAGE batch \[B, H, W, 3\]"):
        run(node, images(1), torch.zeros(1, 48, 40, 4))


def test_small_images_leave_out_what_needs_more_pixels(node):
    _, text, _ = run(node, images(1, 8, 8, seed=6), images(1, 8, 8, seed=7))
    assert "SSIM: needs images of at least 11x11 px" in text and "LPIPS: needs images of at least 31x31 px" in text
    assert "SSIM 0" not in text.splitlines()[0]


def test_lpips_is_the_quality_tools_where_its_weights_are_installed(node, monkeypatch, tmp_path):
    import shutil

    from quality import metrics  # devtools/quality: makes the weights (cached outside the clone)

    cached = metrics.cache_folder() / node.lpips_net.WEIGHTS_FILE
    if not cached.is_file():
        pytest.skip(f"no LPIPS weights at {cached}: python3 devtools/benchmark.py --quality fetches them")
    models = tmp_path / "models_lpips"  # as a user installs them: ComfyUI's models/lpips
    models.mkdir()
    shutil.copy(cached, models / node.lpips_net.WEIGHTS_FILE)
    monkeypatch.setattr(node, "lpips_folders", lambda: [tmp_path / "empty", models])
    a = images(2, 64, 64, seed=8)
    b = torch.cat([noisy(a[:1], 0.05, seed=9), images(1, 64, 64, seed=10)])
    expected = metrics.lpips(a, b).tolist()
    values, missing = node.lpips(a, b)
    assert missing is None and values.tolist() == expected
    _, text, _ = run(node, a, b)
    assert text.splitlines()[0].endswith(f"LPIPS {expected[0]:.4f}") and "not installed" not in text
    assert text.splitlines()[2].endswith(f"LPIPS {sum(expected) / 2:.4f}")
