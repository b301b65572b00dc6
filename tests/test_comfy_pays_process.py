"""The auto rule's decisions outlive the process: a second process, with the same decisions file,
makes the same decisions without measuring anything and samples a bit-identical latent (each
process is tests/auto_rule_process.py, loading ComfyUI and the pack from nothing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def run_process(decisions: Path, mode: str) -> dict:
    result = subprocess.run([sys.executable, str(TESTS / "auto_rule_process.py"), str(decisions), mode],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_second_process_keeps_the_decisions_without_measuring_and_repeats_the_latent(tmp_path):
    decisions = tmp_path / "user" / "tokenreduce" / "auto_decisions.json"
    first = run_process(decisions, "scripted")
    assert first["measured"] == 2 and first["sources"] == ["measured", "measured"]
    assert "auto · downsample 2 (16×16) · 10.00 → 11.00 ms · left alone" in first["lines"]
    second = run_process(decisions, "must-not-measure")
    assert second["measured"] == 0 and second["sources"] == ["kept", "kept"]
    assert second["lines"] == first["lines"] and second["latent"] == first["latent"]
