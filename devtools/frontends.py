"""ComfyUI frontends from PyPI, for testing this pack's front-end extension on several of them.

ComfyUI serves its web frontend from the ``comfyui-frontend-package`` wheel (its ``static/``
folder) unless ``--front-end-root`` names another folder. This module downloads a pinned
version of that wheel with pip (``pip download --no-deps``; no GitHub access needed), checks its
SHA-256 against the pin, extracts the static web root into a cache outside the clone and
returns the folder to pass to ``--front-end-root``:

    ~/.cache/comfyui-tokenreduce/frontends/<version>/   (index.html, assets/, ...)

The folder appears complete or not at all (extracted beside it, then renamed), is reused by
every later run, and is keyed by the version alone (a wheel on PyPI never changes; the pinned
hash makes sure of it). ``TOKENREDUCE_HOST_CACHE`` moves the cache, as for the host.

    python3 devtools/frontends.py            # fetch every pinned frontend, print the folders
    python3 devtools/frontends.py 1.49.6     # one of them

The matrix the browser tests run on is ``MATRIX``: the host's own frontend (served without
``--front-end-root``), the one the newest ComfyUI release pins, and the newest stable release on
PyPI when it was last bumped. Change the versions (and their hashes) here only.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "comfyui-frontend-package"
STATIC_IN_WHEEL = "comfyui_frontend_package/static/"
HOST = "host"  # the frontend the host's own venv serves (no --front-end-root)

# version -> SHA-256 of its wheel on PyPI (checked after download).
PINNED = {
    # The frontend that ComfyUI 0.33.0 pins in its requirements.txt.
    "1.49.6": "69cef7e67f22854852d1d7be68ff82f27bd4ff4b33de9c643d7eb1339769c421",
    # The newest stable release on PyPI (`pip index versions comfyui-frontend-package`), 2025-11.
    "1.58.1": "37912597537a731a8f421179618a736c24184c5bdbfa327f38b2fb7c291852d9",
}
# What the browser tests run on, in this order: the host's own first (1.32.9 on the pinned
# ComfyUI 0.3.75), then the pinned PyPI versions.
MATRIX = [HOST, *PINNED]


def cache_root() -> Path:
    base = os.environ.get("TOKENREDUCE_HOST_CACHE") or Path.home() / ".cache" / "comfyui-tokenreduce"
    return Path(base) / "frontends"


def web_root(version: str) -> Path:
    """Where the static web root of ``version`` lives once fetched."""
    return cache_root() / version


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(version: str, workdir: Path, python: str) -> Path:
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q", "--no-input",
           f"{PACKAGE}=={version}", "-d", str(workdir)]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    (wheel,) = workdir.glob("comfyui_frontend_package-*.whl")
    return wheel


def _extract(wheel: Path, target: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.infolist() if m.filename.startswith(STATIC_IN_WHEEL) and not m.is_dir()]
        if not any(m.filename == STATIC_IN_WHEEL + "index.html" for m in members):
            raise RuntimeError(f"{wheel.name} has no {STATIC_IN_WHEEL}index.html")
        for member in members:
            relative = member.filename[len(STATIC_IN_WHEEL):]
            if relative.startswith("/") or ".." in Path(relative).parts:
                raise RuntimeError(f"{wheel.name}: unsafe path {member.filename}")
            path = target / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)


def ensure(version: str, python: str = sys.executable) -> Path | None:
    """The folder to pass to ``--front-end-root`` for ``version`` (downloaded and extracted on
    first use); ``None`` for ``HOST``, the host's own frontend."""
    if version == HOST:
        return None
    if version not in PINNED:
        raise KeyError(f"frontend {version} is not pinned in devtools/frontends.py (pinned: {', '.join(PINNED)})")
    target = web_root(version)
    if (target / "index.html").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be fetching the same version
        if (target / "index.html").exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{version}-") as tmp:
            workdir = Path(tmp)
            wheel = _download(version, workdir / "wheel", python)
            found = _sha256(wheel)
            if found != PINNED[version]:
                raise RuntimeError(f"{wheel.name}: SHA-256 {found} is not the pinned {PINNED[version]}")
            staged = workdir / "static"
            _extract(wheel, staged)
            if target.exists():  # a leftover without index.html: not complete
                shutil.rmtree(target)
            staged.rename(target)  # same file system: atomic
    return target


def installed_version() -> str | None:
    """The frontend this Python's ComfyUI serves by default (its own ``comfyui-frontend-package``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return None


def server_args(version: str, python: str = sys.executable) -> list[str]:
    """The ComfyUI command-line arguments that serve ``version`` (none for the host's own)."""
    root = ensure(version, python)
    return [] if root is None else ["--front-end-root", str(root)]


def main() -> int:
    versions = sys.argv[1:] or list(PINNED)
    print(json.dumps({v: str(ensure(v)) for v in versions}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
