"""ToDo's ``method`` window on UNets in the real ComfyUI, in-process (issue #50): the attn1 patch
marks a level's self-attention and the attention override runs it windowed (each query tile's
neighbourhood exact, the 16 keys with the most attention, the strided far field weighted by its
counts); and the quality budget's milder step on UNets, nearest -> window."""

from __future__ import annotations

import sys

import pytest
import torch

from comfy_helpers import ScriptedClock, apply, patched, rel_error, sample, session_of
from test_comfy_max_change_inprocess import PACK, lines_of

HUGE, TINY = 2.0, 1e-9
ALWAYS = {"method": "window", "reduce_when": "always"}  # auto times the window on a CPU too: always, to test it
SIZE = (16, 16)


def test_where_the_window_holds_the_whole_grid_the_image_is_the_unpatched_one(comfy, models):
    """An 8x8 grid is one tile's window (4x4 queries and 2 tokens around, clamped inside): every
    key exact, the far field masked, so the window gives full attention; nearest does not."""
    base = models["SD15"]
    unpatched = sample(comfy, base, size=(8, 8))
    window = sample(comfy, patched(comfy, "todo", base, **ALWAYS), size=(8, 8))
    nearest = sample(comfy, patched(comfy, "todo", base), size=(8, 8))
    assert rel_error(window, unpatched) < 1e-5 < rel_error(nearest, unpatched)


@pytest.mark.parametrize("family, grid", [("SD15", "32×32"), ("SDXL", "16×16")])  # SDXL: its level 2
def test_the_window_runs_on_the_reduced_levels_reruns_bit_for_bit_and_says_what_each_query_sees(comfy, models,
                                                                                              family, grid):
    base = models[family]
    out = apply(comfy, "todo", base, **ALWAYS)
    assert "window: each tile of queries also sees the keys within 2 tokens" in out.result[1]
    model = out.result[0]
    first = sample(comfy, model, family)
    assert torch.isfinite(first).all() and torch.equal(first, sample(comfy, model, family))
    unpatched, nearest = sample(comfy, base, family), sample(comfy, patched(comfy, "todo", base), family)
    assert not torch.equal(first, unpatched) and not torch.equal(first, nearest)
    lines = lines_of(model)
    h, w = (int(n) for n in grid.split("×"))
    # each query sees its tile's window (tiles of 4: 8x8 keys) and the far field's cells outside it
    assert any(grid in line and f"k/v {h * w}→" in line for line in lines), lines
    assert base.model_options.get("transformer_options", {}).get("optimized_attention_override") is None


def test_unet_todo_over_the_budget_runs_the_window_where_it_is_within_it(comfy, models, monkeypatch, tmp_path):
    """The budget's milder step on UNets, block by block (issue #51): where nearest changes a block
    by more than max_change, the window is measured in its place and runs there where it is within
    the budget; the report names what each block runs; where every block is over the budget both
    ways the image is the unpatched one."""
    from comfy_helpers import steps_down_block_by_block

    pays = sys.modules[f"{PACK}.tokenreduce.pays"]

    def store(name: str):
        # a device where reducing pays (half the time): the CPU really times the window
        decisions = pays.Decisions(tmp_path / f"{name}.json", stopwatch=ScriptedClock((2.0, 1.0)))
        monkeypatch.setattr(sys.modules[f"{PACK}.nodes.common"], "decisions", lambda: decisions)
        return decisions

    base = models["SD15"]
    lines = []

    def one_pass(name: str, **inputs):
        decisions = store(name)
        node = patched(comfy, "todo", base, **inputs)
        image = sample(comfy, node, size=SIZE)
        lines[:] = lines_of(node)
        return image, session_of(node).last_report, decisions

    # 16x16: a tile's window holds a quarter of the grid (on these random weights the window changes
    # the 32x32 level's blocks about as much as nearest: their attention is not peaked)
    steps_down_block_by_block(one_pass, "nearest", "window", lambda method: {"method": method})
    (line,) = [line for line in lines if "per block, each block alone" in line]
    assert " · window input " in line or " · window output " in line, line
    store("both over")  # the window over the budget too: left alone, the unpatched image
    tight = patched(comfy, "todo", base, max_change=TINY)
    assert torch.equal(sample(comfy, tight, size=SIZE), sample(comfy, base, size=SIZE))
    assert all(not d.reduce for site, d in session_of(tight).last_report.decisions if site.endswith("per block"))


def with_override_after(model):
    """A clone of ``model`` with a SageAttention-style override set after our node (it replaces the
    slot and calls the backend it is handed), and the list of the attention calls it saw."""
    calls = []

    def backend_choice(func, *args, **kwargs):
        calls.append(args[0].shape)
        return func(*args, **kwargs)

    after = model.clone()
    after.model_options["transformer_options"]["optimized_attention_override"] = backend_choice
    return after, calls


def test_an_override_set_after_the_node_does_not_shut_the_window_out(comfy, models):
    """A backend node applied after ToDo (SageAttention-style: it replaces the override slot and
    calls the backend it is handed) would keep the window from running; ToDo puts itself in front
    of it at each model call, so both act: the window's image, the other override still called."""
    base = models["SD15"]
    model = patched(comfy, "todo", base, **ALWAYS)
    expected = sample(comfy, model)
    after, calls = with_override_after(model)
    assert torch.equal(sample(comfy, after), expected)
    assert calls  # cross-attention and the levels not windowed went through it
    assert any("runs in front of it" in line for line in lines_of(after))


def test_where_no_level_runs_windowed_the_override_steps_aside_and_says_nothing(comfy, models, monkeypatch, tmp_path):
    """ToDo's defaults (nearest with a budget) install the override, since the budget may step down
    to the window; where nearest is within the budget, no call of the run goes through it (no
    Python of ours per attention call) and an override another node set after ToDo is not
    'put behind' ours in the report."""
    pays = sys.modules[f"{PACK}.tokenreduce.pays"]
    decisions = pays.Decisions(tmp_path / "within.json")
    monkeypatch.setattr(sys.modules[f"{PACK}.nodes.common"], "decisions", lambda: decisions)
    todo_patch = sys.modules[f"{PACK}.tokenreduce.todo_patch"]
    ours = []
    real = todo_patch.ToDoPatch._run_before
    measuring = sys.modules[f"{PACK}.tokenreduce.run"].MEASURING

    def counted(self, *args, **kwargs):  # the calls of sampling (not the budget's measuring runs)
        if not (kwargs.get("transformer_options") or {}).get(measuring):
            ours.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(todo_patch.ToDoPatch, "_run_before", counted)
    model = patched(comfy, "todo", models["SD15"], max_change=HUGE)  # nearest, within the budget
    assert model.model_options["transformer_options"].get("optimized_attention_override") is not None
    after, calls = with_override_after(model)
    assert torch.equal(sample(comfy, after), sample(comfy, model))
    assert calls and not ours  # every attention call went to the other override; none through ours
    assert not any("in front of" in line for line in lines_of(after))
