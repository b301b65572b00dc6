"""Install what this pack needs and is missing; run by ComfyUI-Manager after cloning the pack.

Safe to run any number of times: it installs only requirements that are not satisfied yet, and
never installs, upgrades or downgrades torch (the host's own build stays as it is).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
NEVER_INSTALL = {"torch", "torchvision", "torchaudio"}


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


def main() -> int:
    todo = missing()
    if not todo:
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


if __name__ == "__main__":
    sys.exit(main())
