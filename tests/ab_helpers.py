"""The A/B example workflows (devtools/make_examples.py: ``AB_EXAMPLES``) on the tests' servers:
their API prompt at a size and step count a CPU runs in seconds, and what a run must show. Used
by test_comfy_server.py (SD1.5), test_comfy_server_sdxl.py and test_comfy_server_dit.py (Flux.1,
Wan 2.1), each on the server it already runs."""

from __future__ import annotations

import copy
import itertools
import re

import make_examples
import server_helpers
import workflow
from conftest import REPO

RUN_EVENT = "tokenreduce.run"
PATCH = str(make_examples.PATCH)
SAMPLERS = {label: str(ids[0]) for label, ids in make_examples.AB_IDS.items()}  # A unpatched, B through ToDo
SAVES = {label: str(ids[2]) for label, ids in make_examples.AB_IDS.items()}
SEED, COMPARE, HEAT_MAP = str(make_examples.AB_SEED), str(make_examples.AB_COMPARE), str(make_examples.AB_HEAT_MAP)
# The compare node's report: a line per image pair, then their mean (nodes/compare_node.py).
FIGURES = r"PSNR (?:∞|\d+\.\d\d) dB · SSIM \d\.\d{4}(?: · LPIPS \d\.\d{4})?"
# A sampler's progress bar in ComfyUI's console (tqdm), where the Note sends users for both times:
# drawn once at its start (step 0) and redrawn as it goes, its last state the time it took.
SEEDS = itertools.count(1000)  # a new seed per run: nothing of the last run is taken from the cache
BAR_START = r"(?<![\d/])0/{steps} \["
BAR_DONE = r"(?<![\d/]){steps}/{steps} \[\d\d:\d\d<00:00"


def ab_prompt(object_info: dict, family: str, steps: int) -> dict:
    """The family's A/B example as an API prompt, each sampler at ``steps``."""
    flow = workflow.load(REPO / "example_workflows" / f"{make_examples.AB_EXAMPLES[family].name}.json")
    prompt = workflow.to_api(flow, object_info)
    for sampler in SAMPLERS.values():
        prompt[sampler]["inputs"]["steps"] = steps
    return server_helpers.without_budget(prompt)


def without_todo(prompt: dict) -> dict:
    """The A/B prompt with ToDo taken out: both samplers take the model straight from the loader."""
    plain = copy.deepcopy(prompt)
    plain[SAMPLERS["B"]]["inputs"]["model"] = plain[PATCH]["inputs"]["model"]
    del plain[PATCH]
    return plain


def run_ab(server, prompt: dict, steps: int, images: int) -> tuple[dict, list[str]]:
    """Run an A/B prompt from scratch and check what the example promises: one seed into both
    samplers, each sampler's output saved, ToDo's report with B's sampling time, a console progress
    bar per sampler (A's time), the compare node's report (a line per image pair and their mean,
    also drawn on the node) and its heat map previewed. Returns the history entry and the report's
    lines."""
    assert [prompt[s]["inputs"]["seed"] for s in SAMPLERS.values()] == [[SEED, 0], [SEED, 0]]
    # A seed of its own: both samplers run (and print their bars), the loaded model is kept.
    prompt = copy.deepcopy(prompt)
    prompt[SEED]["inputs"]["value"] = next(SEEDS)
    log_before = len(server.log())
    prompt_id, messages = server.run_collecting(prompt, {RUN_EVENT})
    entry = server.get(f"/history/{prompt_id}")[prompt_id]
    outputs = entry["outputs"]
    for label, save in SAVES.items():
        assert len(outputs[save]["images"]) == 1, (label, outputs[save])
    runs = [data for kind, data in messages if kind == RUN_EVENT]
    if PATCH in prompt:
        (run,) = runs
        assert run["node"] == PATCH and run["completed"] and not run["warnings"], run
        reduced = "1" if steps == 1 else f"1-{steps}"
        assert re.fullmatch(rf"steps {reduced} of {steps} · \d+\.\d s sampling", run["lines"][-1]), run["lines"]
    else:
        assert runs == []
    console = server.log()[log_before:]
    starts = len(re.findall(BAR_START.format(steps=steps), console))
    # One bar per sampler; without ToDo the two samplers are one computation, which ComfyUI may run once.
    assert (starts == 2) if PATCH in prompt else (starts in (1, 2)), console[-2000:]
    assert re.search(BAR_DONE.format(steps=steps), console), console[-2000:]
    (text,) = outputs[COMPARE]["text"]
    lines = text.splitlines()
    assert outputs[COMPARE]["tokenreduce"] == [{"lines": lines, "warnings": []}]
    pairs = [rf"image {i}: {FIGURES}" for i in range(1, images + 1)] + [rf"mean of {images}: {FIGURES}"]
    assert len(lines) >= len(pairs) and all(re.fullmatch(p, line) for p, line in zip(pairs, lines)), lines
    assert len(outputs[HEAT_MAP]["images"]) == images
    return entry, lines
