"""install.py: idempotent, installs only what is missing, never torch."""

import importlib.util
import shutil
import subprocess
import sys

from conftest import REPO


def _copy_with_requirements(tmp_path, requirements):
    shutil.copy(REPO / "install.py", tmp_path / "install.py")
    (tmp_path / "requirements.txt").write_text(requirements)
    spec = importlib.util.spec_from_file_location("pack_install", tmp_path / "install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_real_requirements_are_satisfied_and_rerun_is_a_no_op():
    for _ in range(2):
        done = subprocess.run([sys.executable, str(REPO / "install.py")], capture_output=True, text=True, check=True)
        assert "all requirements present" in done.stdout


def test_only_missing_requirements_are_listed_and_torch_never(tmp_path):
    module = _copy_with_requirements(tmp_path, "tomesd>=0.1.3\ntorch==0.0.1\ntorchvision\nnot-a-real-pkg-tokenreduce>=1  # x\n")
    assert module.missing() == ["not-a-real-pkg-tokenreduce>=1"]


def test_an_unsatisfied_version_counts_as_missing(tmp_path):
    module = _copy_with_requirements(tmp_path, "tomesd>=99\n")
    assert module.missing() == ["tomesd>=99"]
