"""reduce_when auto leaves no trace in the real ComfyUI (issue #45, point 7).

ToMe's whole-block merging on a DiT captures a merged block's inputs for the auto rule in a
rehearsal of the model call; that rehearsal runs below every wrapper and every other pack's
block replacement, so a pack that keeps state there (ComfyUI's own EasyCache, a call counter)
sees nothing of it: the run that measures gives the image every later run gives and the image
``always`` gives, bit for bit. ToDo on DiTs times one attention call (no model call at all): the
same holds. A measurement that fails is kept for the process and said in every run's report,
not tried again every run.

Tiny random Flux.1 (2 double, 2 single blocks); the CPU measures only when told to
(``Decisions(measure_cpu=True)``), here with a scripted clock (the timed work still runs)."""

from __future__ import annotations

import sys

import pytest
import torch

from comfy_helpers import session_of
from test_comfy_dit_inprocess import run, todo
from test_comfy_tome_dit_inprocess import dits, tome  # noqa: F401 - dits is a fixture

VARIANT = "flux_dev"
ALL_BLOCKS = {"skip_first_blocks": 0, "skip_last_blocks": 0}


def easycache(model, reuse_threshold: float):
    """``model`` with ComfyUI's own EasyCache node applied (a clone)."""
    from comfy_extras.nodes_easycache import EasyCacheNode

    return EasyCacheNode.execute(model, reuse_threshold=reuse_threshold, start_percent=0.15, end_percent=0.95,
                                 verbose=False).result[0]


def counted(model, calls: list):
    """A clone whose diffusion model and apply_model calls are counted by wrappers, and the calls
    of its first block (ToMe leaves it whole) by a block replacement (another pack's)."""
    from comfy.patcher_extension import WrappersMP

    clone = model.clone()
    for kind in (WrappersMP.DIFFUSION_MODEL, WrappersMP.APPLY_MODEL):
        def count(executor, *args, kind=kind, **kwargs):
            calls.append(kind)
            return executor(*args, **kwargs)
        clone.add_wrapper_with_key(kind, "counting", count)

    def first_block(args, extra):
        calls.append("double_block 0")
        return extra["original_block"](args)
    clone.set_model_patch_replace(first_block, "dit", "double_block", 0)
    return clone


def decisions_of(model):
    return [(d.reduce, d.source, d.error) for _, d in session_of(model).last_report.decisions]


def node(comfy, name, model, **settings):
    if name == "tome":
        return tome(comfy, model, ratio=0.5, start_percent=0.5, **settings).result[0]
    return todo(comfy, model, start_percent=0.5, **ALL_BLOCKS, **settings).result[0]


# EasyCache skips steps by how much the input changed since the model call before: a rehearsal
# through its wrapper changed that (0.5 at 6 steps: another image), or was skipped by it and
# never reached the block (0.2 at 4 steps: "not enough values to unpack", measured every run).
@pytest.mark.parametrize("name,threshold,steps", [("tome", 0.5, 6), ("tome", 0.2, 4), ("todo", 0.5, 6)])
def test_measuring_beside_easycache_changes_no_image(comfy, dits, measuring, name, threshold, steps):
    cached = easycache(dits(VARIANT), threshold)
    store = measuring((10.0, 8.0))
    patched = node(comfy, name, cached)
    first = run(comfy, patched, VARIANT, steps=steps)
    assert store.measurements >= 1 and all(d == (True, "measured", "") for d in decisions_of(patched))
    measured = store.measurements
    assert torch.equal(run(comfy, patched, VARIANT, steps=steps), first) and store.measurements == measured
    always = node(comfy, name, cached, reduce_when="always")
    assert torch.equal(run(comfy, always, VARIANT, steps=steps), first)


@pytest.mark.parametrize("name", ["tome", "todo"])
def test_measuring_adds_no_call_to_another_packs_wrappers_or_blocks(comfy, dits, measuring, name):
    measured, always = [], []
    store = measuring((10.0, 8.0))
    first = run(comfy, node(comfy, name, counted(dits(VARIANT), measured)), VARIANT, steps=4)
    assert store.measurements >= 1
    second = run(comfy, node(comfy, name, counted(dits(VARIANT), always), reduce_when="always"), VARIANT, steps=4)
    assert measured == always and len(always) == 3 * 4  # a model call a step (cond and uncond batched): 3 counts
    assert torch.equal(first, second)


class FailingClock:
    """A stopwatch factory whose timing fails (as out of memory would), counting the attempts."""

    def __init__(self):
        self.attempts = 0

    def __call__(self, device):
        self.attempts += 1

        def stopwatch(name, work):
            raise RuntimeError("out of memory (scripted)")
        return stopwatch


def test_a_failed_measurement_is_kept_and_said_in_every_run(comfy, dits, monkeypatch, tmp_path):
    pays = sys.modules["tokenreduce_pack.tokenreduce.pays"]
    clock = FailingClock()
    store = pays.Decisions(tmp_path / "auto_decisions.json", measure_cpu=True, stopwatch=clock)
    monkeypatch.setattr(sys.modules["tokenreduce_pack.nodes.common"], "decisions", lambda: store)
    model = dits(VARIANT)
    patched = tome(comfy, model, ratio=0.5).result[0]
    first = run(comfy, patched, VARIANT)
    failed = [(True, "failed", "RuntimeError: out of memory (scripted)")] * 2  # double and single blocks
    assert clock.attempts == 2 and decisions_of(patched) == failed
    warnings = session_of(patched).last_report.warnings
    assert sum("could not measure" in w and "out of memory (scripted)" in w for w in warnings) == 2
    # The next run, and another node output: not tried again, said again; merged as set, as before.
    assert torch.equal(run(comfy, patched, VARIANT), first)
    again = tome(comfy, model, ratio=0.5).result[0]
    assert torch.equal(run(comfy, again, VARIANT), first)
    assert clock.attempts == 2 and decisions_of(patched) == decisions_of(again) == failed
    assert session_of(again).last_report.warnings == warnings
    assert torch.equal(first, run(comfy, tome(comfy, model, ratio=0.5, reduce_when="always").result[0], VARIANT))
    # Measure again tries anew (once per node output and kind).
    remeasure = tome(comfy, model, ratio=0.5, reduce_when="auto (measure again)").result[0]
    run(comfy, remeasure, VARIANT)
    assert clock.attempts == 4 and decisions_of(remeasure) == failed
