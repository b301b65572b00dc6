"""One process of tests/test_comfy_pays_process.py: ComfyUI and the pack loaded fresh, ToDo at
its defaults with the auto rule measuring on the CPU into a given decisions file, one sampling
run of the tiny SD1.5; prints what it measured, its report lines and the latent's digest.

    python tests/auto_rule_process.py DECISIONS_FILE (scripted | must-not-measure)

scripted: a fake clock makes downsample 1 pay and downsample 2 not; must-not-measure: a clock
that fails the run if anything is timed.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(TESTS), str(TESTS.parent), str(TESTS.parent / "devtools")]

from comfy_helpers import ScriptedClock, patched, sample, session_of  # noqa: E402
from conftest import PACK_MODULE, comfyui_dir, load_comfy  # noqa: E402


def main(path: str, mode: str) -> None:
    comfy = load_comfy(comfyui_dir())
    pays = sys.modules[f"{PACK_MODULE}.tokenreduce.pays"]

    def forbidden(device):
        raise AssertionError("this process measured")

    clock = ScriptedClock((10.0, 8.0), (10.0, 11.0)) if mode == "scripted" else forbidden
    store = pays.Decisions(Path(path), measure_cpu=True, stopwatch=clock)
    sys.modules[f"{PACK_MODULE}.nodes.common"].decisions = lambda: store
    model = comfy.models.make_model("SD15", tiny=True, seed=0)
    todo = patched(comfy, "todo", model, factor_next=2.0)
    latent = sample(comfy, todo)
    report = session_of(todo).last_report
    describe = sys.modules[f"{PACK_MODULE}.tokenreduce.describe"]
    print(json.dumps({
        "measured": store.measurements,
        "sources": [decision.source for _, decision in report.decisions],
        "lines": describe.run_lines("", report, timing=False),
        "latent": hashlib.sha256(latent.contiguous().numpy().tobytes()).hexdigest(),
    }))


if __name__ == "__main__":
    main(*sys.argv[1:])
