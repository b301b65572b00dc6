"""``benchmark.py --diffusers`` prints the table of diffusers' ToMe docs (resolution x batch
size: seconds of vanilla, ToMe, ToMe + SDPA, ToDo, and the speed-ups), here on the smallest run;
and the example script runs as shipped."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("diffusers")

from bench import diffusers_table  # noqa: E402


def test_prints_the_docs_table(capsys):
    assert diffusers_table.main(["--diffusers", "--sizes", "64", "--batches", "1", "2", "--steps", "1",
                                 "--repeats", "0", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("| Resolution | Batch size | Vanilla | SDPA | ToMe | ToMe + SDPA | ToDo | ToMe speed-up")
    rows = [line for line in lines if re.match(r"\| 64 \| [12] \|", line)]
    assert len(rows) == 2 and all(row.count(" s |") == 5 and row.count("x |") == 3 for row in rows), lines


def test_the_example_runs_on_the_cpu_with_tiny_random_weights():
    import subprocess
    import sys

    from conftest import REPO

    result = subprocess.run([sys.executable, str(REPO / "examples" / "diffusers_example.py"), "--steps", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "k/v 256→64" in result.stdout and "q 256→128" in result.stdout, result.stdout
