"""The Image Compare node (issue #46, point 2) in the real ComfyUI, in-process: batches matched by
index (one image against N repeated), mismatches refused with what to change, PSNR equal to
kornia's and SSIM to kornia's in float64 within 1e-4, LPIPS equal to the project's quality tools'
where its weights are installed and said to be missing (never fetched by the node) where not, the
heat map, and the report on the node. Issue #51: the mean's PSNR is that of the mean squared error
(one identical pair leaves it finite), every metric runs one frame at a time (its peak memory does
not grow with the frames), and install.py's LPIPS weights land where the node finds them."""

from __future__ import annotations

import importlib
import math
import re
import shutil
import sys
from pathlib import Path

import numpy as np
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


def mean_psnr_by_hand(a: torch.Tensor, b: torch.Tensor) -> float:
    """10 log10(1 / MSE) with the MSE over every pixel and channel of the batch, in numpy float64."""
    error = float(np.mean((a.double().numpy() - b.double().numpy()) ** 2))
    return math.inf if error == 0 else 10 * math.log10(1 / error)


def test_a_batch_is_compared_image_by_image_with_kornias_psnr_and_ssim(node, monkeypatch, tmp_path):
    monkeypatch.setattr(node, "lpips_folders", lambda: [tmp_path])  # no weights: PSNR and SSIM only
    a = images(3, seed=1)
    b = torch.cat([noisy(a[:1], 0.02, seed=2), noisy(a[1:2], 0.1, seed=3), a[2:]])
    psnr, ssim64 = kornia_figures(a, b)
    ssim = node.ssim(a, b).tolist()
    assert node.psnr(a, b).tolist() == psnr
    assert max(abs(x - y) for x, y in zip(ssim, ssim64)) < 1e-4 and ssim[2] == 1.0
    difference, text, ui = run(node, a, b)
    lines = text.splitlines()
    for i in range(2):
        assert lines[i] == f"image {i + 1}: PSNR {psnr[i]:.2f} dB · SSIM {ssim[i]:.4f}"
    assert lines[2] == "image 3: PSNR ∞ dB · SSIM 1.0000" and math.isinf(psnr[2])
    # The identical third pair leaves the mean's PSNR finite: that of the mean squared error.
    assert lines[3] == f"mean of 3: PSNR {mean_psnr_by_hand(a, b):.2f} dB · SSIM {sum(ssim) / 3:.4f}"
    assert lines[4] == "the mean's PSNR: of the mean squared error over all 3 images (not the mean of their dB)"
    assert lines[5].startswith("LPIPS: not installed") and "lpips-alexnet-a286e44ce15d.safetensors" in lines[5]
    assert "install.py" in lines[5]
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


# ---- issue #51: the mean's PSNR, bounded memory, LPIPS installed by install.py --------------------

def video(frames: int, h: int, w: int, seed: int) -> torch.Tensor:
    """Video-like frames: a smooth scene, a flat sky in the top third, a little texture."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(frames, 3, h // 32 + 1, w // 32 + 1, generator=g)
    scene = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bicubic") + 0.03 * torch.randn(
        frames, 3, h, w, generator=g)
    scene[:, :, : h // 3] = 0.8 + 0.002 * torch.randn(frames, 3, h // 3, w, generator=g)
    return scene.clamp(0, 1).permute(0, 2, 3, 1).contiguous()


def test_the_mean_psnr_is_that_of_the_mean_squared_error_so_a_clean_first_frame_leaves_it_finite(
        node, monkeypatch, tmp_path):
    """Image to video: the first frame is the input image in both runs, identical (PSNR ∞); the
    mean of the frames' dB was ∞ too, whatever the other frames did."""
    monkeypatch.setattr(node, "lpips_folders", lambda: [tmp_path])
    a = images(5, seed=11)
    b = torch.cat([a[:1], *(noisy(a[i:i + 1], 0.01 * i, seed=12 + i) for i in range(1, 5))])
    _, text, _ = run(node, a, b)
    lines = text.splitlines()
    assert lines[0].startswith("image 1: PSNR ∞ dB") and "∞" not in "".join(lines[1:5])
    expected = mean_psnr_by_hand(a, b)
    assert math.isfinite(expected) and lines[5].startswith(f"mean of 5: PSNR {expected:.2f} dB · SSIM ")
    # Not the mean of the finite frames' dB either: noisier frames weigh more, as in the MSE.
    finite = node.psnr(a[1:], b[1:]).tolist()
    assert expected < sum(finite) / 4 and abs(node.mean_psnr(node.mse(a, b)) - expected) < 1e-9
    assert "mean squared error over all 5 images" in lines[6]
    _, same, _ = run(node, a[:2], a[:2])
    assert same.splitlines()[2] == "mean of 2: PSNR ∞ dB · SSIM 1.0000"  # ∞ only where all are identical


def test_ssim_frame_by_frame_in_float32_equals_float64_over_the_batch_within_1e_4(node):
    a = video(3, 480, 832, seed=20)
    b = torch.cat([noisy(a[:1], 0.005, seed=21), noisy(a[1:2], 0.05, seed=22), video(1, 480, 832, seed=23)])
    _, ssim64 = kornia_figures(a, b)
    ours = node.ssim(a, b)
    assert ours.dtype == torch.float64 and ours.shape == (3,)
    assert max(abs(x - y) for x, y in zip(ours.tolist(), ssim64)) < 1e-4, (ours.tolist(), ssim64)


def random_lpips_weights() -> dict[str, torch.Tensor]:
    """Weights of LPIPS's shapes (random, heads non-negative): its memory, not its values."""
    g = torch.Generator().manual_seed(0)
    shapes = {"features.0": (64, 3, 11, 11), "features.3": (192, 64, 5, 5), "features.6": (384, 192, 3, 3),
              "features.8": (256, 384, 3, 3), "features.10": (256, 256, 3, 3)}
    weights = {}
    for name, shape in shapes.items():
        weights[f"{name}.weight"] = torch.randn(shape, generator=g) * 0.05
        weights[f"{name}.bias"] = torch.zeros(shape[0])
    for k, channels in enumerate((64, 192, 384, 256, 256)):
        weights[f"lin{k}.weight"] = torch.rand(1, channels, 1, 1, generator=g)
    return weights


def _rss(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def glibc_returns_what_is_freed() -> bool:
    """Make glibc's malloc give every block of 1 MB or more back to the system when freed (a fixed
    mmap threshold): by default it raises the threshold to 32 MB after such a free and keeps freed
    blocks of that size cached in each thread's heap, so resident memory would show the cache, not
    what is live. Only where glibc is the C library (False elsewhere)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
        return bool(libc.mallopt(m_mmap_threshold, 1 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 20))
    except (OSError, AttributeError):
        return False


def peak_extra(work) -> int:
    """Bytes of resident memory ``work()`` needs above what was resident before it: the kernel's
    peak (VmHWM) reset at the start (Linux: /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss("VmRSS")
    result = work()
    del result
    return _rss("VmHWM") - before


GB = 1 << 30


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures peak memory the Linux way")
def test_each_metric_needs_one_frames_memory_whatever_the_number_of_frames(node):
    """Each metric's peak memory above its inputs is the same for 1 and 3 frames (within 64 MB),
    so 81 frames need what one needs, and one 720p frame's is far under 1 GB (about 130 MB for
    SSIM). SSIM in float64 over the batch took about 0.35 GB more a frame (28 GB for 81); the heat
    map's only extra beyond its own output is one frame's temporaries. LPIPS, the slowest on a CPU,
    is measured at a quarter of 720p's pixels (its memory is proportional to them)."""
    from tokenreduce_pack.tokenreduce import lpips as lpips_net

    if not glibc_returns_what_is_freed():
        pytest.skip("measures resident memory with glibc's malloc")
    weights = random_lpips_weights()
    cases = {"ssim": (720, 1280, node.ssim, GB // 2), "mse": (720, 1280, node.mse, GB // 2),
             "heat map": (720, 1280, lambda x, y: node.heat_map(x, y, 4.0), GB // 2),
             "lpips": (360, 640, lambda x, y: lpips_net.lpips(x, y, weights), GB // 8)}
    with torch.no_grad():
        for name, (h, w, metric, bound) in cases.items():
            a, b = video(3, h, w, seed=30), video(3, h, w, seed=31)
            metric(a[:1], b[:1])  # first call: the libraries' one-off set-up is not the metric's
            one = peak_extra(lambda: metric(a[:1], b[:1]))
            three = peak_extra(lambda: metric(a, b))
            if name == "heat map":  # less its output, one float32 frame a frame
                one, three = one - a[0].numel() * 4, three - 3 * a[0].numel() * 4
            print(f"{name}: peak extra at {w}x{h}, 1 frame {one / 2**20:.0f} MB, 3 frames {three / 2**20:.0f} MB")
            assert three <= one + 64 * 2**20, (name, one, three)
            assert one < bound, (name, one)


def test_install_puts_the_lpips_weights_where_the_node_finds_them(node, comfy, monkeypatch, tmp_path):
    """install.py in a ComfyUI tree (``custom_nodes/<pack>`` beside ``models``) installs into
    ``models/lpips``, the node's first folder; the fetch is the quality tools' checkpoint (their
    hash-pinned download, made on first use), so nothing more is downloaded here."""
    import folder_paths
    import install

    from quality import metrics

    try:
        metrics.weights_path()  # keeps the checkpoint beside the weights
    except Exception as problem:  # noqa: BLE001 - no registry here: the quality tests say so
        pytest.skip(f"no LPIPS checkpoint ({problem})")
    checkpoint = metrics.checkpoint_path()
    assert install.lpips_folder(Path(comfy.root) / "custom_nodes" / "pack") == Path(folder_paths.models_dir) / "lpips"
    base = tmp_path / "ComfyUI"
    (base / "models").mkdir(parents=True)
    folder = install.lpips_folder(base / "custom_nodes" / "ComfyUI-TokenReduce")
    assert folder == base / "models" / "lpips"
    fetched = []
    monkeypatch.setattr(install, "download_checkpoint",
                        lambda pins, target: fetched.append(shutil.copy(checkpoint, target)))
    monkeypatch.setattr(folder_paths, "models_dir", str(base / "models"))  # as --base-directory sets it
    monkeypatch.setenv("TOKENREDUCE_HOST_CACHE", str(tmp_path / "no-cache"))
    a = images(2, 64, 64, seed=40)
    b = noisy(a, 0.05, seed=41)
    assert "LPIPS: not installed" in run(node, a, b)[1]
    assert install.install_lpips(folder) and install.install_lpips(folder) and len(fetched) == 1
    assert node.lpips_weights_file() == folder / node.lpips_net.WEIGHTS_FILE
    _, text, _ = run(node, a, b)
    expected = metrics.lpips(a, b).tolist()
    assert text.splitlines()[0].endswith(f"LPIPS {expected[0]:.4f}") and "not installed" not in text
