"""Issue #45's edges in the real ComfyUI, in-process: what the run's report lists where
reduce_when auto leaves a kind of block alone, patches that run inside a block and reshape by the
full grid, and the host glue that patches ``forward_orig`` and wraps the blocks."""

from __future__ import annotations

import random_dits
from comfy_helpers import apply, session_of
from test_comfy_dit_inprocess import run
from test_comfy_tome_dit_inprocess import VARIANTS

run_lines = __import__("tokenreduce.describe", fromlist=["run_lines"]).run_lines


def test_a_kind_of_block_auto_left_alone_is_not_listed_as_merged(comfy, measuring):
    """Flux with the double blocks merged and the single blocks left alone by the auto rule: the
    report's tokens list the double blocks only, beside the single blocks' decision."""
    model = random_dits.make_dit("flux_dev", **VARIANTS["flux_dev"][0])
    measuring((10.0, 8.0), (10.0, 11.0))  # the first kind met (double blocks) gains, the second loses
    patched = apply(comfy, "tome", model, ratio=0.5).result[0]
    run(comfy, patched, "flux_dev")
    report = session_of(patched).last_report
    decided = {d.site.split(",")[0]: d.decision.reduce for d in report.decisions}
    assert decided == {"Flux.1 double blocks": True, "Flux.1 single blocks": False}, decided
    (level,) = report.levels
    assert list(level.tokens) == ["double blocks"], level.tokens
    lines = run_lines("ToMe", report, timing=False)
    assert not any("single blocks 48→" in line for line in lines), lines
    assert any("double blocks 48→" in line for line in lines), lines
