"""What the Comfy registry reads of the pack: ``pyproject.toml`` passes ``comfy node validate``
(the registry's own command line, comfy-cli, in a venv of its own cached beside the host), its
version is the pack's, its icon and banner are files of this repository within the registry's
limits, and the code ComfyUI imports runs no pip and no eval/exec."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib  # Python 3.11, as every host we test
import venv
from pathlib import Path

import pytest
from PIL import Image

from conftest import REPO
from tokenreduce.version import VERSION

COMFY_CLI = "comfy-cli==1.23.0"
RAW = "https://raw.githubusercontent.com/tokenreduce/ComfyUI-TokenReduce/main/"  # where the registry fetches files
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def comfy_cli() -> Path:
    """The ``comfy`` command of a venv with ``COMFY_CLI``, built once (it must not share the host's:
    its dependencies are its own)."""
    base = Path(os.environ.get("TOKENREDUCE_HOST_CACHE") or Path.home() / ".cache" / "comfyui-tokenreduce")
    root = base / COMFY_CLI.replace("==", "-")
    command = root / "bin" / "comfy"
    if not command.exists():
        venv.create(root, with_pip=True, clear=True)
        subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q", COMFY_CLI], check=True)
    return command


def tracked_copy(tmp_path: Path) -> Path:
    """The files of the repository a clean clone has (``git ls-files``), without test output."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    copy = tmp_path / "pack"
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            (copy / name).write_bytes(source.read_bytes())
    return copy


def test_comfy_node_validate_passes(tmp_path):
    result = subprocess.run([str(comfy_cli()), "--skip-prompt", "--no-enable-telemetry", "node", "validate"],
                            cwd=tracked_copy(tmp_path), capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "All validation checks passed" in output, output
    assert "warning" not in output.lower(), output


def test_the_registry_sees_this_version_and_what_the_pack_does():
    project = PYPROJECT["project"]
    assert project["version"] == VERSION
    for word in ("ToMe", "ToDo", "DiT", "Flux", "Wan", "Forge"):
        assert word in project["description"], word
    assert "Environment :: GPU :: NVIDIA CUDA" in project["classifiers"]


@pytest.mark.parametrize("field", ["Icon", "Banner"])
def test_icon_and_banner_are_files_of_this_repository_within_the_limits(field):
    url = PYPROJECT["tool"]["comfy"][field]
    assert url.startswith(RAW), url
    path = REPO / url.removeprefix(RAW)
    assert path.is_file(), path
    with Image.open(path) as image:
        if field == "Icon":
            assert image.size[0] <= 800 and image.size[1] <= 400, image.size


def test_what_comfyui_imports_runs_no_pip_eval_or_exec():
    runtime = [REPO / "__init__.py", *sorted((REPO / "nodes").glob("*.py")), *sorted((REPO / "tokenreduce").glob("*.py"))]
    for path in runtime:
        text = path.read_text()
        assert not re.search(r"\b(eval|exec)\(", text), path
        assert not re.search(r"\bpip\b", text), path  # install.py alone installs (ComfyUI-Manager runs it once)
