"""Our patches under torch.compile, on the real ComfyUI, in-process: ComfyUI's own
``set_torch_compile_wrapper`` (what its TorchCompileModel node does) around the tiny models.
Dynamo's counters show that our nodes add no graph break and no compiled graph of their own,
whatever the step count, the batch layout or the run: everything decided per run or per step
reaches the compiled model as values of the same kind every time.

Each case is compared with the same runs of the compiled unpatched model, whose own graphs
(recompiles when the schedule's length or the batch changes) are the host's business."""

from __future__ import annotations

import pytest
import torch

from comfy_helpers import apply, rel_error, sample, split_cond_uncond

RUNS = [dict(steps=2), dict(steps=4, seed=4), dict(steps=2, batch=2)]


@pytest.fixture
def sdpa_attention(comfy, monkeypatch):
    """PyTorch SDPA, the GPU default. ComfyUI's CPU default, sub-quadratic attention, asks psutil
    for the free memory inside the model: a graph break of the host's own."""
    import comfy.ldm.modules.attention as attention

    monkeypatch.setattr(attention, "optimized_attention", attention.attention_pytorch)


def compiled_runs(comfy, model, family, runs=RUNS, backend="eager", split=False) -> dict:
    """Sample ``runs`` with a compiled clone of ``model``; dynamo's counters and the outputs."""
    import torch._dynamo
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = model.clone()
    set_torch_compile_wrapper(compiled, backend=backend)
    if split:
        compiled = split_cond_uncond(compiled)
    outputs = [sample(comfy, compiled, family, **run) for run in runs]
    result = {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values()),
              "outputs": outputs}
    torch._dynamo.reset()
    return result


@pytest.fixture(scope="module")
def unpatched_counts():
    """The compiled unpatched runs, by (family, split): computed once per module."""
    return {}


def _unpatched(comfy, models, cache, family, split=False):
    key = (family, split)
    if key not in cache:
        cache[key] = compiled_runs(comfy, models[family], family, split=split)
    return cache[key]


CASES = [  # ToMe at its defaults: SDXL's case; SD1.5 takes the other modes and matchings
    ("SD15", [("todo", {})]),
    # issue #50: the attention override runs the level windowed (always: auto times the window on a CPU)
    ("SD15", [("todo", dict(method="window", reduce_when="always"))]),
    ("SD15", [("tome", dict(mode="queries only (ComfyUI built-in)", matching="3x3 cells", share_plans=True))]),
    # issue #50: proportional attention, the merged keys' log sizes through the attention override
    ("SD15", [("tome", dict(mode="q, k, v + proportional attention"))]),
    ("SD15", [("tome", dict(merge_crossattn=True, merge_mlp=True, use_rand=False, max_downsample="2"))]),
    # plan_every: calls that plan and calls that reuse an earlier step's plans, two kinds of call
    # whatever the steps and runs: at most one graph more
    ("SD15", [("tome", dict(matching="tile (fast)", merge_crossattn=True, merge_mlp=True, share_plans=True,
                            plan_every=2))]),
    ("SD15", [("todo", dict(factor=3.0, factor_next=2.0, method="average")), ("tome", dict(mode="queries only (ComfyUI built-in)"))]),
    ("SDXL", [("todo", dict(factor_next=2.0))]),
    ("SDXL", [("tome", {})]),
]


@pytest.mark.parametrize("family,chain", CASES, ids=lambda v: str(v)[:60])
def test_no_graph_break_and_no_graph_of_our_own(comfy, models, sdpa_attention, unpatched_counts, family, chain):
    model = models[family]
    for node, settings in chain:
        model = apply(comfy, node, model, **settings).result[0]
    unpatched = _unpatched(comfy, models, unpatched_counts, family)
    ours = compiled_runs(comfy, model, family)
    assert unpatched["breaks"] == 0
    assert ours["breaks"] == 0
    assert ours["graphs"] <= unpatched["graphs"] + sum(settings.get("plan_every", 1) > 1 for _, settings in chain)
    # Compiled, the patch computes what it computes eagerly.
    assert rel_error(ours["outputs"][1], sample(comfy, model, family, **RUNS[1])) < 1e-4


def test_a_step_window_adds_one_graph_whatever_the_steps(comfy, models, sdpa_attention, unpatched_counts):
    """Steps outside the window run the model untouched: one more graph, compiled once, not one
    per step or per run."""
    model = apply(comfy, "todo", models["SD15"], start_percent=0.3, end_percent=0.8).result[0]
    unpatched = _unpatched(comfy, models, unpatched_counts, "SD15")
    ours = compiled_runs(comfy, model, "SD15", runs=RUNS + [dict(steps=6)])
    assert ours["breaks"] == 0
    assert ours["graphs"] <= unpatched["graphs"] + 1


def test_split_cond_uncond_calls_compile_once(comfy, models, sdpa_attention, unpatched_counts):
    model = apply(comfy, "tome", models["SD15"]).result[0]
    unpatched = _unpatched(comfy, models, unpatched_counts, "SD15", split=True)
    ours = compiled_runs(comfy, model, "SD15", split=True)
    assert ours["breaks"] == 0 and ours["graphs"] <= unpatched["graphs"]


def test_inductor_compiles_both_nodes_stacked(comfy, models, sdpa_attention):
    """The backend ComfyUI's TorchCompileModel uses: generated kernels, same result."""
    model = apply(comfy, "todo", models["SD15"]).result[0]
    model = apply(comfy, "tome", model, mode="queries only (ComfyUI built-in)", matching="3x3 cells").result[0]
    runs = [dict(steps=2), dict(steps=3)]
    ours = compiled_runs(comfy, model, "SD15", runs=runs, backend="inductor")
    assert ours["breaks"] == 0
    eager = [sample(comfy, model, "SD15", **run) for run in runs]
    for compiled_out, eager_out in zip(ours["outputs"], eager):
        assert rel_error(compiled_out, eager_out) < 1e-3
    assert torch.isfinite(ours["outputs"][0]).all()


def test_the_auto_rule_measures_outside_the_compiled_model(comfy, models, sdpa_attention, unpatched_counts,
                                                          measuring):
    """The rule times its blocks before the model call, eagerly: a compiled run that measures has
    the counters of one whose decisions are kept, no graph break, and no graph of our own."""
    store = measuring((10.0, 8.0), (10.0, 11.0))  # downsample 1 reduced, downsample 2 left alone
    model = apply(comfy, "todo", models["SD15"], factor_next=2.0).result[0]
    model = apply(comfy, "tome", model, mode="queries only (ComfyUI built-in)", max_downsample="2").result[0]
    unpatched = _unpatched(comfy, models, unpatched_counts, "SD15")
    measured = compiled_runs(comfy, model, "SD15")
    assert store.measurements == 4 and not any(store.stopwatch.compiling)
    kept = compiled_runs(comfy, model, "SD15")
    assert store.measurements == 4
    assert measured["breaks"] == kept["breaks"] == 0
    assert measured["graphs"] == kept["graphs"] <= unpatched["graphs"]
    assert all(torch.equal(a, b) for a, b in zip(measured["outputs"], kept["outputs"]))



def _counted(comfy, model, runs) -> dict:
    """Sample ``runs`` with ``model`` (compiled already); dynamo's counters and the outputs."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    outputs = [sample(comfy, model, "SD15", **run) for run in runs]
    result = {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values()),
              "outputs": outputs}
    torch._dynamo.reset()
    return result


@pytest.mark.parametrize("node", ["todo", "tome"])
def test_a_node_the_budget_leaves_alone_adds_no_graph_break(comfy, models, sdpa_attention, monkeypatch, tmp_path,
                                                            node):
    """Issue #51: the quality budget measures its change on the block's own input, captured in a
    rehearsal of the model call (stopped at the block); that rehearsal runs the diffusion model
    uncompiled, also where ComfyUI's compile wrapper runs around ours (TorchCompileModel applied
    before the node: the wrapper has put the compiled model in place when ours runs). A node whose
    every call the budget leaves alone compiles as the unpatched model does."""
    import sys

    from comfy_api.torch_helpers import set_torch_compile_wrapper

    pays = sys.modules["tokenreduce_pack.tokenreduce.pays"]
    store = pays.Decisions(tmp_path / "auto_decisions.json")  # the CPU untimed: the change alone is measured
    monkeypatch.setattr(sys.modules["tokenreduce_pack.nodes.common"], "decisions", lambda: store)
    compiled = models["SD15"].clone()
    set_torch_compile_wrapper(compiled, backend="eager")
    runs = [dict(steps=2)]
    unpatched = _counted(comfy, compiled, runs)
    ours = _counted(comfy, apply(comfy, node, compiled, max_change=1e-6).result[0], runs)
    changes = [decision.change for _, decision in store.log if decision.full_ms is None]  # not the window's timing
    assert changes and all(change > 1e-6 for change in changes)
    assert (ours["breaks"], ours["graphs"]) == (unpatched["breaks"], unpatched["graphs"]) and ours["breaks"] == 0
    assert torch.equal(ours["outputs"][0], unpatched["outputs"][0])
