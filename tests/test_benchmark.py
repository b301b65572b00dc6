"""The benchmark command itself (devtools/benchmark.py), run on tiny random models: it measures
every configuration side by side and writes the table, the JSON and the plots."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from conftest import REPO

CONFIGS = ["built-in ToMe 0.5", "ToMe 0.5 queries only 3x3", "ToDo 2 + next 2"]


def test_the_benchmark_writes_side_by_side_figures(tmp_path):
    out = tmp_path / "bench"
    subprocess.run([sys.executable, str(REPO / "devtools" / "benchmark.py"), "--tiny", "--families", "SD15",
                    "--sizes", "64", "--repeats", "2", "--warmup", "1", "--evals", "2", "--attention", "sdpa",
                    "sub-quad", "--configs", *CONFIGS, "--out", str(out)], check=True, timeout=900)
    results = json.loads((out / "results.json").read_text())
    assert results["machine"] and "2 UNet forward(s) per pass" in results["settings"]
    rows = {(r["attention"], r["config"]): r for r in results["rows"]}
    assert len(rows) == 2 * (1 + len(CONFIGS))
    for attention in ("sdpa", "sub-quad"):
        base = rows[(attention, "unpatched")]
        assert base["speedup"] == 1.0 and base["rel_error"] == 0.0 and len(base["repeats"]) == 2
        assert any(key.startswith("self-attention at downsample 1") for key in base["breakdown"])
        for config in CONFIGS:
            row = rows[(attention, config)]
            assert row["rel_error"] > 0 and row["seconds"] > 0
            # Reducing costs at least its kept share: the bound at the reduction is below the
            # bound if the reduced parts were free.
            assert 0 < row["share"] < 1 and 1 < row["bound_at"] <= row["bound"]
            assert abs(row["bound"] - 1 / (1 - row["share"])) < 1e-9
        assert rows[(attention, "ToMe 0.5 queries only 3x3")]["plan_seconds"] > 0
        assert rows[(attention, "ToDo 2 + next 2")]["plan_seconds"] is None
    table = (out / "results.md").read_text()
    assert "| built-in ToMe 0.5 |" in table and "bound at its reduction" in table
    assert (out / "sd15_64_sdpa.png").stat().st_size > 10_000 and (out / "sd15_64_sub-quad.png").exists()


def test_a_timed_pass_evaluates_the_unet_evals_times_at_one_sigma(comfy, models):
    """--evals: each pass runs that many UNet forwards inside one sampling run, at the same
    sigma, and returns the output of one forward (what a single evaluation gives)."""
    import benchmark

    timesteps = []

    def count(apply_model, args):
        timesteps.append(float(args["timestep"][0]))
        return apply_model(args["input"], args["timestep"], **args["c"])

    probe = models["SD15"].clone()
    probe.set_model_unet_function_wrapper(count)
    out = benchmark.OneStep("SD15", 64, 1, 0.5, True, evals=3)(probe)
    assert len(timesteps) == 3 and len(set(timesteps)) == 1
    assert torch.equal(out, benchmark.OneStep("SD15", 64, 1, 0.5, True)(models["SD15"]))
