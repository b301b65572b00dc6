"""The main job, ``python3 devtools/demo.py``, on the photo fixtures (its default mode), small:
both fixtures at 128 px and 2 steps, one timed run each, in the ComfyUI under test with this
Python. It prints the speed-up, LPIPS and PSNR of the four runs (unpatched, ToDo, ToMe, ToMe +
ToDo) and each node's report, saves every image and a grid per fixture as PNG, its images are
pictures (not noise) and a rerun repeats each image bit for bit. ``--help`` and the refusals of
flags that do not go together."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, comfyui_dir

DEMO = REPO / "devtools" / "demo.py"
RUNS = ("unpatched", "ToDo", "ToMe", "ToMe + ToDo")
FILES = ("unpatched", "todo", "tome", "tome_todo")


def high_frequency(image: np.ndarray) -> float:
    """The mean squared difference of neighbouring pixels over twice the variance: about 1 for
    white noise, far less for a picture."""
    x = image.astype(np.float64) / 255.0
    steps = np.concatenate([(x[1:] - x[:-1]).ravel(), (x[:, 1:] - x[:, :-1]).ravel()])
    return float((steps**2).mean() / (2 * x.var()))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    done = subprocess.run([sys.executable, str(DEMO), "--size", "128", "--steps", "2", "--repeats", "1",
                           "--out", str(out), "--comfyui", str(comfyui_dir())],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # no thread contention on shared cores
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done.stdout


def test_the_demo_prints_speed_up_and_lpips_of_the_four_runs(demo):
    _, printed = demo
    assert "On a CPU, reduce_when auto reduces without timing" in printed or "reduce_when auto times" in printed
    assert "not GPU figures" in printed or "reduce_when auto times" in printed
    for title in ("SD1.5 fixture", "Flux fixture"):
        assert title in printed
    tables = printed.split("s/image")[1:]
    assert len(tables) == 2
    for table in tables:
        assert "speed-up" in table and "LPIPS" in table
        for run in RUNS:
            row = re.search(rf"^{re.escape(run)} +([\d.]+) +([\d.]+)x +([\d.]+) +(inf|[\d.]+ dB)", table, re.M)
            assert row, f"no row for {run}:\n{table}"
            if run == "unpatched":
                assert row.group(2) == "1.00" and float(row.group(3)) == 0 and row.group(4) == "inf"
        for run in RUNS[1:]:
            assert f"\n{run}, node report:\n" in table
    assert "ToDo · SD15" in printed and "ToMe · FluxSchnell" in printed


def test_the_demo_saves_images_grids_and_figures(demo):
    from PIL import Image

    out, _ = demo
    results = json.loads((out / "results.json").read_text())
    assert [f["fixture"] for f in results["fixtures"]] == ["sd15", "flux"]
    for fixture in results["fixtures"]:
        name = fixture["fixture"]
        assert fixture["px"] == 128 and fixture["steps"] == 2 and fixture["repeats"] == 1
        assert [r["run"] for r in fixture["runs"]] == list(RUNS)
        for run, file in zip(fixture["runs"], FILES):
            image = Image.open(out / f"{name}_{file}.png")
            assert image.size == (128, 128) and image.mode == "RGB"
            assert run["rerun_identical"], f"{name} {run['run']}: the timed rerun differs from the warm-up"
            assert run["seconds"] > 0 and run["lpips"] >= 0
        base = fixture["runs"][0]
        assert base["speedup"] == 1.0 and base["lpips"] == 0.0 and base["psnr"] == float("inf")
        for run in fixture["runs"][1:]:  # each node changed the image, or its budget left it alone and said so
            left = any("left alone: changes its output" in line for line in run["report"])
            assert run["lpips"] > 0 or left, (name, run["run"], run["report"])  # (at 128 px SD's too)
        grid = Image.open(out / f"{name}_grid.png")
        assert grid.size[0] > 4 * 128 and grid.size[1] > 128


def test_the_unpatched_images_are_pictures_not_noise(demo):
    from PIL import Image

    out, _ = demo
    noise = np.random.default_rng(0).normal(128, 40, (128, 128, 3)).clip(0, 255)
    assert high_frequency(noise) > 0.9
    for name in ("sd15", "flux"):
        picture = np.asarray(Image.open(out / f"{name}_unpatched.png"))
        assert picture.std() > 5, f"{name}: a flat image"
        assert high_frequency(picture) < 0.3, f"{name}: its unpatched image looks like noise"


def test_help_and_refusals():
    done = subprocess.run([sys.executable, str(DEMO), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for flag in ("--fixture", "--steps", "--size", "--seed", "--caption", "--repeats", "--checkpoint",
                 "--random-checkpoint", "--out", "--comfyui"):
        assert flag in done.stdout
    for args in (["--checkpoint", "x.safetensors", "--fixture", "sd15"], ["--random-checkpoint", "--seed", "3"],
                 ["--checkpoint", "x.safetensors", "--random-checkpoint"], ["--size", "100"], ["--fixture", "sdxl"],
                 ["--caption", "a dog", "--comfyui", str(comfyui_dir())]):
        done = subprocess.run([sys.executable, str(DEMO), *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (args, done.stderr)
