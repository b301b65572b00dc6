"""reduce_when auto's quality budget, max_change (issue #46), in the real ComfyUI.

The auto rule measures how much reducing a kind of call changes that unit's output (relative L2)
with its speed decision, keeps it, and leaves the kind alone where the change is above the node's
max_change, saying so in the report; one kept measurement serves every budget. On the CPU, where
auto does not time, the budget still applies (each side run once, untimed). ToDo on DiTs measures
the change on the model call's own q, k, v (a rehearsal below every wrapper), not on the random
ones it times. The run that measures gives the image every later run gives, bit for bit.

Tiny random models; a budget of 1e-6 is exceeded by any reduction, 2.0 by none."""

from __future__ import annotations

import json
import sys

import pytest
import random_dits
import torch

from comfy_helpers import (ScriptedClock, block_changes, patched, per_block, reduced, reduced_blocks, sample,
                           session_of, spy_attn1)
from test_comfy_dit_inprocess import run, todo
from test_comfy_tome_dit_inprocess import dits, tome  # noqa: F401 - dits is a fixture

PACK = "tokenreduce_pack"
TINY, HUGE = 1e-6, 2.0
EVERY_BLOCK = {"skip_first_blocks": 0, "skip_last_blocks": 0}
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
    """On a UNet the budget decides block by block (issue #51): every block of the level over it is
    left alone, said with the smallest change a block would make; one measurement serves a budget
    nothing exceeds, which reduces every block and says nothing (untimed, nothing changed)."""
    records = []
    tight = patched(comfy, "todo", models["SD15"], max_change=TINY)
    sample(comfy, spy_attn1(tight, records), steps=1)
    assert reduced(records, "keys") == set()  # left alone: nothing reduced
    decision = per_block(tight)
    assert decision.change > TINY and decision.over_budget and decision.source == "measured"
    changes = block_changes(cpu_store)
    blocks = {block for block, _ in changes}
    assert len(blocks) > 1 and all((block, "nearest") in changes for block in blocks)
    mildest = "window" if any(method == "window" for _, method in changes) else "nearest"  # where it pays
    assert decision.change == min(c for (_, method), c in changes.items() if method == mildest)
    assert decision.full_ms is None  # the CPU is not timed: the changes alone were measured
    said = (f"auto · downsample 1 (32×32), per block · left alone: changes its output "
            f"{100 * decision.change:.3g} % > 0.0001 %")
    assert said in lines_of(tight)
    records.clear()
    measured = cpu_store.measurements
    loose = patched(comfy, "todo", models["SD15"], max_change=HUGE)
    sample(comfy, spy_attn1(loose, records), steps=1)
    assert reduced_blocks(records) == blocks and cpu_store.measurements == measured  # one measurement, both budgets
    kept = per_block(loose)
    assert (kept.source, kept.reduce) == ("kept", True)
    assert kept.change == max(changes[(block, "nearest")] for block in blocks)  # the most any block changes
    assert not any(line.startswith("auto · ") for line in lines_of(loose))  # untimed and reduced: nothing to say


def test_a_run_covering_part_of_sampling_weighs_the_change_by_its_reach(comfy, models, cpu_store):
    """Issue #51: each block's change is kept once; a run at denoise 0.2 (a hires pass) weighs it by
    the cube root of the share of sampling it covers, so a budget that refuses a block at text to
    image lets the hires pass reduce it, and the report says the weighed change where it still
    refuses. (average: one method, no milder step to weigh.)"""
    first = patched(comfy, "todo", models["SD15"], max_change=TINY, method="average")
    sample(comfy, first, steps=1)
    changes = {block: change for (block, _), change in block_changes(cpu_store).items()}
    largest = max(changes.values())
    records = []
    budget = 0.7 * largest  # over it at denoise 1, within it at 0.2: change * 0.2 ** (1/3) = 0.58 change
    model = patched(comfy, "todo", models["SD15"], max_change=budget, method="average")
    sample(comfy, spy_attn1(model, records), steps=4)
    whole = per_block(model)
    assert whole.reach == 1.0
    assert reduced_blocks(records) == {block for block, change in changes.items() if change <= budget}
    assert max(changes, key=changes.get) not in reduced_blocks(records)
    records.clear()
    sample(comfy, spy_attn1(model, records), steps=4, denoise=0.2)
    hires = per_block(model)
    assert hires.source == "kept" and 0.1 < hires.reach < 0.3 and hires.reduce  # measured once, weighed per run
    assert reduced_blocks(records) == set(changes)  # every block, the largest change included
    smallest = min(changes.values())
    tighter = patched(comfy, "todo", models["SD15"], max_change=0.3 * smallest, method="average")  # over it at 0.2
    sample(comfy, tighter, steps=4, denoise=0.2)
    refused = per_block(tighter)
    weighed = f"{100 * smallest * refused.reach ** (1 / 3):.3g} %"
    assert (f"left alone: changes its output {100 * smallest:.3g} % ({weighed} weighed by the "
            f"{describe_percent(refused.reach)} of sampling this run covers)") in " ".join(lines_of(tighter))


def describe_percent(fraction: float) -> str:
    return sys.modules[f"{PACK}.tokenreduce.describe"].percent_text(fraction)


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
    assert per_block(tight).over_budget and not per_block(tight).reduce
    assert any("per block · left alone: changes its output" in line for line in lines_of(tight))
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


# --- issue #51: measuring leaves no trace ------------------------------------------------------------


def test_merge_mlp_left_alone_leaves_no_plan_behind(comfy, models, cpu_store):
    """ToMe with merge_mlp over the budget: the measurement's reduced run plans the MLP merge of the
    block it measures (a per-thread slot the feed-forward reads); the run that measured must still
    run that block's feed-forward whole, as every later run and the unpatched model do."""
    settings = dict(ratio=0.6, merge_mlp=True, max_change=TINY)
    tight = patched(comfy, "tome", models["SD15"], **settings)
    first = sample(comfy, tight, steps=1)
    decisions = [d for _, d in session_of(tight).last_report.decisions]
    assert decisions and all(d.over_budget and d.source == "measured" for d in decisions)
    assert not session_of(tight).last_report.levels  # nothing reduced, as the report says
    assert torch.equal(first, sample(comfy, models["SD15"], steps=1))  # as unpatched
    assert torch.equal(sample(comfy, tight, steps=1), first)


def t2i_adapter(comfy, seed: int = 3):
    """A real ComfyUI T2I-Adapter (``comfy.controlnet.T2IAdapter``) around a random-weight adapter
    of the tiny SD1.5's widths: its control residuals are popped by the UNet (``apply_control``)."""
    from comfy.controlnet import T2IAdapter
    from comfy.t2i_adapter.adapter import Adapter

    channels = comfy.models.unet_config("SD15", True)["model_channels"]
    with torch.device("meta"):  # built without drawing from the global generator, then filled from a private one
        adapter = Adapter(channels=[channels, 2 * channels, 4 * channels, 4 * channels], nums_rb=1, cin=3 * 64,
                          ksize=1, sk=True, use_conv=False, xl=False)
    adapter = adapter.to_empty(device="cpu")
    comfy.models.randomize_(adapter, seed)
    return T2IAdapter(adapter, adapter.input_channels, 8, "nearest-exact", device=torch.device("cpu"))


def controlled(comfy, strength: float = 1.0) -> tuple[list, list]:
    """SD1.5 conditionings with the T2I-Adapter applied to both (ComfyUI's ControlNetApplyAdvanced)."""
    import nodes

    hint = torch.rand(1, 256, 256, 3, generator=torch.Generator().manual_seed(5))
    positive = comfy.models.conditioning("SD15", True, seed=1)
    negative = comfy.models.conditioning("SD15", True, seed=2)
    return nodes.ControlNetApplyAdvanced().apply_controlnet(positive, negative, t2i_adapter(comfy), hint, strength,
                                                            0.0, 1.0)


@pytest.mark.parametrize("name", ["todo", "tome"])
def test_the_rehearsal_leaves_the_users_control_residuals_alone(comfy, models, cpu_store, name):
    """ComfyUI's UNet pops its control residuals as it goes (``apply_control``): the rehearsal that
    captures the measured block's input must run on copies of the call's control lists, or the
    call itself runs with some residuals gone. The run that measured gives the next run's image."""
    positive, negative = controlled(comfy)
    budgeted = patched(comfy, name, models["SD15"], max_change=HUGE)
    first = sample(comfy, budgeted, steps=1, positive=positive, negative=negative)
    assert all(d.source == "measured" for _, d in session_of(budgeted).last_report.decisions)
    assert torch.equal(sample(comfy, budgeted, steps=1, positive=positive, negative=negative), first)
    always = patched(comfy, name, models["SD15"], reduce_when="always")
    assert torch.equal(sample(comfy, always, steps=1, positive=positive, negative=negative), first)


def test_dit_tome_measures_the_merge_it_runs_with_a_clean_first_frame(comfy, dits, cpu_store, monkeypatch):
    """Wan 2.2 TI2V image to video (a noise mask: the first latent frame clean, kept out of every
    tile): the auto rule measures the merge the run makes, that frame kept whole too, and a call
    without the mask (the same shapes, its first frame merged) is another kind, measured apart."""
    import random_dits
    from test_tome_dit_frames_inprocess import _first_frame_mask, _sample

    variant = "wan22_ti2v_5b"
    seen = []
    tome_dit = sys.modules[f"{PACK}.tokenreduce.tome_dit"]
    merge = tome_dit.run_merged_block

    def spy(spec, layout, plan, args, *rest, **named):  # every merged block run: measuring or not, its plan
        seen.append((bool(args["transformer_options"].get("tokenreduce:measuring")), plan))
        return merge(spec, layout, plan, args, *rest, **named)

    monkeypatch.setattr(tome_dit, "run_merged_block", spy)
    budgeted = tome(comfy, dits(variant), ratio=0.5, max_change=HUGE).result[0]
    size = random_dits.tested_size(variant)
    latent = torch.randn(random_dits.latent_shape(variant, **size), generator=torch.Generator().manual_seed(2))
    _sample(comfy, budgeted, variant, latent=latent, noise_mask=_first_frame_mask(latent))
    measured = [plan for measuring, plan in seen if measuring and plan is not None]
    ran = [plan for measuring, plan in seen if not measuring and plan is not None]
    assert measured and ran and all(d.source == "measured" for _, d in session_of(budgeted).last_report.decisions)
    assert {plan.r for plan in ran} == {ran[0].r} and ran[0].r in {plan.r for plan in measured}  # and the milder
    for plan in measured:  # the ratio's merge and its milder step's (fewer merged), on the run's tiles
        assert torch.equal(plan.tiles.extra_index, ran[0].tiles.extra_index) and plan.r <= ran[0].r
        assert torch.equal(plan.tiles.tile_index, ran[0].tiles.tile_index)
    measurements = cpu_store.measurements
    _sample(comfy, budgeted, variant, latent=latent)  # no mask: the first frame merges
    assert cpu_store.measurements > measurements


def test_dit_tome_decides_per_block_stepping_down_to_half_the_ratio(comfy, dits, cpu_store):
    """ToMe on DiTs under the budget, per block (issue #51): each merged block's change read alone
    on the late input at the node's ratio and at half of it (its milder step); under a budget that
    holds both blocks' milder merges and one step up, one block merges at the ratio and the other
    at half of it: said, an image of its own, the same from the kept decisions."""
    pays = sys.modules[f"{PACK}.tokenreduce.pays"]
    model = dits(VARIANT)
    unpatched = run(comfy, model, VARIANT)
    tight = tome(comfy, model, ratio=0.5, max_change=TINY).result[0]  # nothing fits: both steps measured
    assert torch.equal(run(comfy, tight, VARIANT), unpatched)
    assert session_of(tight).last_report.warnings  # every kind left alone: said
    changes = _merged_changes(cpu_store.log)
    assert len(changes) == 2 and all(len(c) == 2 for c in changes.values())
    full, half = sorted(next(iter(changes.values())), reverse=True)
    steps = sorted((c[full] - c[half], block) for block, c in changes.items())
    assert steps[0][0] < steps[1][0]
    budget = pays.LATE_SCALE * (sum(c[half] for c in changes.values()) + (steps[0][0] + steps[1][0]) / 2)
    node = tome(comfy, model, ratio=0.5, max_change=budget).result[0]
    image = run(comfy, node, VARIANT)
    (line,) = [line for line in lines_of(node) if ", per block, read at 75 % of sampling" in line]
    assert "ratio 0.5 " in line and "ratio 0.25 " in line and "left alone" not in line, line
    measured = cpu_store.measurements
    assert torch.equal(run(comfy, node, VARIANT), image) and cpu_store.measurements == measured
    always = run(comfy, tome(comfy, model, ratio=0.5, reduce_when="always").result[0], VARIANT)
    assert not any(torch.equal(image, other) for other in (unpatched, always))


def _merged_changes(log) -> dict:
    """{block site: {merged count: change}} of the per-block ToMe decisions in a store's log."""
    changes = {}
    for site, decision in log:
        if site.endswith(" merged"):
            block, merged = site.rsplit(", ", 1)
            changes.setdefault(block, {})[int(merged.split()[0])] = decision.change
    return changes


def test_dit_tome_corrected_from_whole_is_read_corrected_from_its_plans_step(comfy, dits, cpu_store):
    """With correct_from_whole the budget reads each block as the run runs it on the late step: merged
    with a plan made plan_every - 1 steps earlier, that plan's difference from the whole block added
    (issue #50; read uncorrected, the correction's blocks were left alone wherever plain merging
    was over the budget). The corrected change is smaller than the plain one, block by block, and
    kept apart from it. Where only the milder ratio fits, its blocks merge and reuse their plan on
    the next step (before, a plan kept only for the milder ratio was never found again: every step
    planned anew and, corrected, ran every block whole: the unpatched image)."""
    pays = sys.modules[f"{PACK}.tokenreduce.pays"]
    model = dits(VARIANT)
    unpatched = run(comfy, model, VARIANT, steps=4)
    reuse = {"ratio": 0.5, "share_plans": True, "plan_every": 2}
    run(comfy, tome(comfy, model, max_change=TINY, **reuse).result[0], VARIANT, steps=4)
    plain = _merged_changes(cpu_store.log)
    logged = len(cpu_store.log)
    run(comfy, tome(comfy, model, max_change=TINY, correct_from_whole=True, **reuse).result[0], VARIANT, steps=4)
    corrected = _merged_changes(cpu_store.log[logged:])
    assert set(corrected) == set(plain) and len(plain) == 2
    for block, changes in corrected.items():
        assert set(changes) == set(plain[block])  # the ratio and half of it, each measured anew
        assert all(0 <= changes[r] < plain[block][r] for r in changes), (block, changes, plain[block])
    half = min(min(c) for c in corrected.values())
    budget = pays.LATE_SCALE * sum(c[half] for c in corrected.values()) * 1.001  # both at half ...
    slack = budget - pays.LATE_SCALE * sum(c[half] for c in corrected.values())
    assert all(pays.LATE_SCALE * (c[max(c)] - c[half]) > slack for c in corrected.values())  # ... no step up
    node = tome(comfy, model, max_change=budget, correct_from_whole=True, **reuse).result[0]
    image = run(comfy, node, VARIANT, steps=4)
    (line,) = [line for line in lines_of(node) if ", per block, read at 75 % of sampling" in line]
    assert "ratio 0.25 " in line and "ratio 0.5 " not in line and "left alone" not in line, line
    assert not torch.equal(image, unpatched)
    measured = cpu_store.measurements
    assert torch.equal(run(comfy, node, VARIANT, steps=4), image) and cpu_store.measurements == measured  # kept


def test_dit_todo_a_failed_capture_is_said_every_run_and_tried_again_after_a_restart(comfy, dits, cpu_store,
                                                                                     monkeypatch, tmp_path):
    """ToDo on a DiT captures its block's input in a rehearsal of the model call; a rehearsal that
    fails (out of memory here) fails the measurement: reduced as set and said in every run's
    report, kept for the process only, never kept in the file as a change not knowable (after a
    restart that would reduce at any budget). After a restart it is tried again: measured, and left
    alone at a budget every reduction exceeds."""
    pays = sys.modules[f"{PACK}.tokenreduce.pays"]
    run_module = sys.modules[f"{PACK}.tokenreduce.run"]
    model = dits(VARIANT)
    unpatched = run(comfy, model, VARIANT)

    def out_of_memory(_module, _args, kwargs):
        if kwargs.get("transformer_options", {}).get(run_module.MEASURING):
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")

    hook = model.get_model_object("diffusion_model").register_forward_pre_hook(out_of_memory, with_kwargs=True)
    try:
        tight = todo(comfy, model, max_change=TINY).result[0]
        for _ in range(2):  # the first run tries, the second is told what the first found
            run(comfy, tight, VARIANT)
            failed = per_block(tight)
            assert failed.source == "failed" and "OutOfMemoryError" in failed.error
            assert any("could not measure" in w for w in session_of(tight).last_report.warnings)
    finally:
        hook.remove()
    kept = json.loads(cpu_store.path.read_text())["decisions"] if cpu_store.path.exists() else {}
    assert all(entry.get("change") is not None for entry in kept.values())  # none kept as "not knowable"
    restarted = pays.Decisions(cpu_store.path)  # a new process on the same file
    monkeypatch.setattr(sys.modules[f"{PACK}.nodes.common"], "decisions", lambda: restarted)
    again = todo(comfy, model, max_change=TINY).result[0]
    image = run(comfy, again, VARIANT)
    assert per_block(again).source == "measured" and per_block(again).over_budget
    assert torch.equal(image, unpatched)


def mixed_budget(comfy, model, store) -> tuple[dict, float]:
    """Each block's changes ({(block, method): change}, read from ``store``'s log after a run at a
    budget nothing fits: the unpatched image, both steps measured) and a budget under which every
    block runs the window and the one whose step up adds least runs nearest."""
    pays = sys.modules[f"{PACK}.tokenreduce.pays"]
    tight = todo(comfy, model, **EVERY_BLOCK, max_change=TINY).result[0]
    assert torch.equal(run(comfy, tight, VARIANT), run(comfy, model, VARIANT))
    changes = {tuple(site.rsplit(", ", 2)[1:]): d.change for site, d in store.log if ", block " in site}
    blocks = sorted({block for block, _ in changes})
    assert len(blocks) > 2 and all(changes[b, "window"] < changes[b, "nearest"] for b in blocks), [s for s, _ in store.log]
    steps = sorted(changes[b, "nearest"] - changes[b, "window"] for b in blocks)
    assert steps[0] < steps[1]
    windows = sum(changes[b, "window"] for b in blocks)
    return changes, pays.LATE_SCALE * (windows + (steps[0] + steps[1]) / 2)


def test_dit_todo_decides_per_block_stepping_down_to_the_window(comfy, dits, monkeypatch, tmp_path):
    """The budget decides per block (issue #51): each reduced block's change is read alone, on a
    late input (the model's prediction noised again to 3/4 of the schedule), for nearest and for
    its milder step, the window; the blocks' changes add up under the budget, as many blocks as
    fit run the window first, then the ones whose step up adds least run nearest. The report names
    what ran where; the run that measured gives the image later runs give, and later runs (a
    restart too) measure nothing."""
    pays = sys.modules[f"{PACK}.tokenreduce.pays"]

    def store(name: str):
        # a device where reducing pays (half the time): the CPU really times the window, whose speed
        # on a tiny grid is not what this test is about
        decisions = pays.Decisions(tmp_path / f"{name}.json", stopwatch=ScriptedClock((2.0, 1.0)))
        monkeypatch.setattr(sys.modules[f"{PACK}.nodes.common"], "decisions", lambda: decisions)
        return decisions

    model = dits(VARIANT)
    unpatched = run(comfy, model, VARIANT)
    measuring = store("ladder")
    changes, budget = mixed_budget(comfy, model, measuring)
    blocks = sorted({block for block, _ in changes})
    windows = sum(changes[b, "window"] for b in blocks)
    scale = pays.LATE_SCALE  # a change read late counts this much against the budget
    node = todo(comfy, model, **EVERY_BLOCK, max_change=budget).result[0]
    image = run(comfy, node, VARIANT)
    decision = per_block(node)
    assert decision.reduce and decision.source == "kept" and decision.change <= budget
    (line,) = [line for line in lines_of(node) if "per block, read at 75 % of sampling, counted 2x" in line]
    nearest, window = line.split(" · ")[2:4]  # 'nearest double 1', 'window double 0, single 0-1'
    assert nearest.startswith("nearest ") and "," not in nearest and "-" not in nearest
    assert window.startswith("window ") and "left alone" not in line
    measured = measuring.measurements
    assert torch.equal(run(comfy, node, VARIANT), image) and measuring.measurements == measured  # kept
    restarted = pays.Decisions(measuring.path, stopwatch=ScriptedClock((2.0, 1.0)))  # a new process
    monkeypatch.setattr(sys.modules[f"{PACK}.nodes.common"], "decisions", lambda: restarted)
    assert torch.equal(run(comfy, todo(comfy, model, **EVERY_BLOCK, max_change=budget).result[0], VARIANT), image)
    assert restarted.measurements == 0
    fresh = store("fresh")  # a run that measures under this budget gives the same image
    assert torch.equal(run(comfy, todo(comfy, model, **EVERY_BLOCK, max_change=budget).result[0], VARIANT), image)
    assert fresh.measurements
    # the mixed image is neither every block windowed nor every block nearest, nor unpatched
    store("window")
    window_image = run(comfy, todo(comfy, model, **EVERY_BLOCK, max_change=HUGE, method="window").result[0], VARIANT)
    store("nearest")
    nearest_image = run(comfy, todo(comfy, model, **EVERY_BLOCK, max_change=HUGE).result[0], VARIANT)
    assert not any(torch.equal(image, other) for other in (window_image, nearest_image, unpatched))
    # a budget between the windows' sum and their sum without the largest: that block is left alone
    largest = max(blocks, key=lambda b: changes[b, "window"])
    store("one left")
    node = todo(comfy, model, **EVERY_BLOCK, max_change=scale * (windows - changes[largest, "window"] / 2)).result[0]
    run(comfy, node, VARIANT)
    (line,) = [line for line in lines_of(node) if "per block, read at 75 % of sampling, counted 2x" in line]
    assert "left alone" in line and "nearest" not in line


@pytest.mark.parametrize("variant", ["wan21_t2v", "wan22_ti2v_5b", "qwen_image_edit", "sd3", "hunyuan_video",
                                     "ltxv", "flux_kontext", "lumina2", "auraflow", "hunyuan_image21", "wan21_vace",
                                     "wan21_scail", "mage_flow", "lens", "joyimage", "minimax_h3"])
def test_dit_todo_per_block_across_families_leaves_no_trace(comfy, cpu_store, variant):
    """The late rehearsal across families (video, a clean first frame with per-frame timesteps,
    reference latents, MMDiT, LTX's frame timesteps, VACE; Lumina's NextDiT and MiniMax-H3, whose
    blocks have no block-replace key: decided per kind instead): within a budget nothing exceeds every block runs
    nearest, so the run that measures gives the image of a run with the decisions kept and of
    reduce_when always, bit for bit, and nothing fails."""
    from test_comfy_tome_dit_inprocess import VARIANTS as DEEPER

    if not random_dits.available(variant):
        pytest.skip(f"this ComfyUI has no {variant} model")
    model = random_dits.make_dit(variant, **(DEEPER[variant][0] if variant in DEEPER else {}))
    budgeted = todo(comfy, model, **EVERY_BLOCK, max_change=HUGE).result[0]
    first = run(comfy, budgeted, variant, steps=3)
    report = session_of(budgeted).last_report
    decisions = dict(report.decisions)
    assert not report.warnings and all(d.source != "failed" for d in decisions.values())
    per_block = [d for site, d in decisions.items() if site.endswith("per block")]
    if variant in ("lumina2", "minimax_h3"):  # no block-replace key to catch a block's input at
        assert not per_block and all(d.change is None or d.reduce for d in decisions.values())
    else:
        assert len(per_block) == 1 and per_block[0].reduce and per_block[0].source == "measured"
        (line,) = [line for line in report.notes if ", per block, " in line]
        assert "nearest " in line and "left alone" not in line and "window" not in line
    measured = cpu_store.measurements
    assert torch.equal(run(comfy, budgeted, variant, steps=3), first) and cpu_store.measurements == measured
    always = todo(comfy, model, **EVERY_BLOCK, reduce_when="always").result[0]
    assert torch.equal(run(comfy, always, variant, steps=3), first)


def test_dit_todo_window_is_timed_on_the_cpu_and_left_alone_where_it_is_slower(comfy, dits, monkeypatch, tmp_path):
    """The window can be more work than full attention on a small grid, so auto times it on a CPU
    too (nearest is not timed there): where the reduced call is slower, it is left alone."""
    pays = sys.modules[f"{PACK}.tokenreduce.pays"]
    decisions = pays.Decisions(tmp_path / "slower.json", stopwatch=ScriptedClock((1.0, 2.0)))  # reduced: twice
    monkeypatch.setattr(sys.modules[f"{PACK}.nodes.common"], "decisions", lambda: decisions)
    model = dits(VARIANT)
    node = todo(comfy, model, max_change=HUGE, method="window").result[0]
    assert torch.equal(run(comfy, node, VARIANT), run(comfy, model, VARIANT))
    (_, decision), = session_of(node).last_report.decisions
    assert not decision.reduce and not decision.over_budget and decision.full_ms is not None  # timed
    nearest = todo(comfy, model, max_change=HUGE).result[0]  # the same store: nearest is not timed on a CPU
    run(comfy, nearest, VARIANT)
    (_, decision), = session_of(nearest).last_report.decisions
    assert decision.reduce and decision.full_ms is None


def test_tome_over_the_budget_steps_down_to_half_the_ratio(comfy, models, monkeypatch, tmp_path):
    """ToMe's milder step on the node's UNets (issue #51), block by block, as ToDo's nearest steps
    down to the window: a block whose merge at the node's ratio is over max_change merges at half
    of it where that is within. Fails before: over the budget the level was left alone."""
    from comfy_helpers import steps_down_block_by_block

    pays = sys.modules[f"{PACK}.tokenreduce.pays"]

    def one_pass(name: str, **inputs):
        store = pays.Decisions(tmp_path / f"{name}.json")
        monkeypatch.setattr(sys.modules[f"{PACK}.nodes.common"], "decisions", lambda: store)
        model = patched(comfy, "tome", models["SD15"], use_rand=False, **inputs)
        image = sample(comfy, model)
        return image, session_of(model).last_report, store

    steps_down_block_by_block(one_pass, 0.5, 0.25, lambda ratio: {"ratio": ratio}, lambda ratio: f"ratio {ratio:g}")
