"""Install what this pack needs and is missing.

Two hosts run it: ComfyUI-Manager once after cloning the pack (from the pack's folder), and
Stable Diffusion WebUI Forge on every launch and after installing the extension (from the
WebUI's own working directory, with the WebUI's root on PYTHONPATH so that its ``launch``
module imports). So it resolves every path from this file, checks installed versions without
importing anything heavy, and says nothing under the WebUI when nothing is missing (the WebUI
prints what an installer prints, at every start).

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


def main() -> int:
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


if __name__ == "__main__":
    sys.exit(main())
