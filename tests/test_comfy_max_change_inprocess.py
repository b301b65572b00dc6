"""reduce_when auto's quality budget, max_change (issue #46), in the real ComfyUI.

The auto rule measures how much reducing a kind of call changes that unit's output (relative L2)
with its speed decision, keeps it, and leaves the kind alone where the change is above the node's
max_change, saying so in the report; one kept measurement serves every budget. On the CPU, where
auto does not time, the budget still applies (each side run once, untimed). ToDo on DiTs measures
the change on the model call's own q, k, v (a rehearsal below every wrapper), not on the random
ones it times. The run that measures gives the image every later run gives, bit for bit.

Tiny random models; a budget of 1e-6 is exceeded by any reduction, 2.0 by none."""

from __future__ import annotations

import sys

import pytest
import torch

from comfy_helpers import patched, reduced, sample, session_of, spy_attn1
from test_comfy_dit_inprocess import run, todo
from test_comfy_tome_dit_inprocess import dits, tome  # noqa: F401 - dits is a fixture

PACK = "tokenreduce_pack"
TINY, HUGE = 1e-6, 2.0
VARIANT = "flux_dev"


@pytest.fixture
def cpu_store(comfy, monkeypatch, tmp_path):
    """The nodes' decisions: a store of this test's own that does not time the CPU (as ComfyUI's)."""
    pays = sys.modules[f"{PACK}.tokenreduce.pays"]
    store = pays.Decisions(tmp_path / "auto_decisions.json")
    monkeypatch.setattr(sys.modules[f"{PACK}.nodes.common"], "decisions", lambda: store)
    return store


def lines_of(model) -> list[str]:
    describe = sys.modules[f"{PACK}.tokenreduce.describe"]
    session = session_of(model)
    return describe.run_lines(session.header, session.last_report)


def test_a_kind_that_changes_more_than_the_budget_is_left_alone_and_said_on_the_cpu(comfy, models, cpu_store):
    records = []
    tight = patched(comfy, "todo", models["SD15"], max_change=TINY)
    sample(comfy, spy_attn1(tight, records), steps=1)
    assert reduced(records, "keys") == set()  # left alone: nothing reduced
    (site, decision), = session_of(tight).last_report.decisions
    assert decision.change > TINY and decision.over_budget and decision.source == "measured"
    assert decision.full_ms is None  # the CPU is not timed: the change alone was measured
    said = f"auto · {site} · left alone: changes its output {100 * decision.change:.3g} % > 0.0001 %"
    assert said in lines_of(tight)
    records.clear()
    loose = patched(comfy, "todo", models["SD15"], max_change=HUGE)
    sample(comfy, spy_attn1(loose, records), steps=1)
    assert reduced(records, "keys") == {(32, 32)}
    (_, kept), = session_of(loose).last_report.decisions
    assert (kept.source, kept.change, kept.reduce) == ("kept", decision.change, True)  # one measurement, both budgets
    assert not any(line.startswith("auto · ") for line in lines_of(loose))  # untimed and reduced: nothing to say


def test_without_a_budget_the_cpu_measures_nothing(comfy, models, cpu_store):
    model = patched(comfy, "todo", models["SD15"], max_change=0.0)
    sample(comfy, model, steps=1)
    assert not session_of(model).last_report.decisions and cpu_store.measurements == 0


@pytest.mark.parametrize("name", ["todo", "tome"])
def test_dit_the_measuring_run_gives_the_next_runs_image_bit_for_bit(comfy, dits, cpu_store, name):
    model = dits(VARIANT)
    apply = todo if name == "todo" else tome
    budgeted = apply(comfy, model, max_change=HUGE).result[0]
    first = run(comfy, budgeted, VARIANT)
    decisions = [d for _, d in session_of(budgeted).last_report.decisions]
    assert decisions and all(d.source == "measured" and d.change is not None and d.reduce for d in decisions)
    measured = cpu_store.measurements
    assert torch.equal(run(comfy, budgeted, VARIANT), first) and cpu_store.measurements == measured
    always = apply(comfy, model, reduce_when="always").result[0]
    assert torch.equal(run(comfy, always, VARIANT), first)


def test_dit_todo_over_the_budget_leaves_the_image_unreduced(comfy, dits, cpu_store):
    model = dits(VARIANT)
    tight = todo(comfy, model, max_change=TINY).result[0]
    image = run(comfy, tight, VARIANT)
    assert all(d.over_budget for _, d in session_of(tight).last_report.decisions)
    assert any("left alone: changes its output" in line for line in lines_of(tight))
    assert torch.equal(image, run(comfy, model, VARIANT))  # as unpatched


def _first_block(model) -> torch.nn.Module:
    unet = model.model.diffusion_model
    return next(module for name, module in unet.named_modules() if name.endswith("transformer_blocks.0"))


def test_unet_change_is_measured_on_the_blocks_own_input_and_leaves_no_trace(comfy, models, cpu_store):
    """The UNet's change is read from its block run on the input the model hands it in this call
    (a rehearsal of the call, stopped at the block), not from the timing's random tokens: the
    block sees the rehearsal with the very input the sampler's call hands it. The hook that
    captures it is gone afterwards, and the run that measured gives the image of the next run and
    of always, bit for bit."""
    run_module = sys.modules[f"{PACK}.tokenreduce.run"]
    block = _first_block(models["SD15"])
    hooks_before = dict(block._forward_pre_hooks)
    seen = []

    def spy(_module, args, kwargs):
        seen.append((bool(kwargs["transformer_options"].get(run_module.MEASURING)), args[0].clone()))

    spying = block.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        budgeted = patched(comfy, "todo", models["SD15"], max_change=HUGE)
        first = sample(comfy, budgeted, steps=1)
    finally:
        spying.remove()
    (_, decision), = session_of(budgeted).last_report.decisions
    assert decision.source == "measured" and decision.change is not None and 0 < decision.change < HUGE
    rehearsed = [x for measuring, x in seen if measuring]
    sampled = [x for measuring, x in seen if not measuring]
    assert rehearsed and sampled and torch.equal(rehearsed[0], sampled[0])  # the call's own input
    assert dict(block._forward_pre_hooks) == hooks_before
    assert torch.equal(sample(comfy, budgeted, steps=1), first)
    always = patched(comfy, "todo", models["SD15"], reduce_when="always")
    assert torch.equal(sample(comfy, always, steps=1), first)
