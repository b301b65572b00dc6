"""The auto rule (``reduce_when``) in the real ComfyUI: each kind of call is timed on the device
unreduced and reduced, through the real patch, and reduced only where it pays; the decision is
kept (memory and file) and reported. The CPU is not measured by default; these tests switch
measuring on for it and drive the decision with a scripted clock (the timed work still runs)."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from comfy_helpers import apply, patched, reduced, sample, session_of, spy_attn1, spy_stepping_aside

DEFAULT_LEVELS = {"todo": {"factor_next": 2.0}, "tome": {"max_downsample": "2"}}


def pays():
    return sys.modules["tokenreduce_pack.tokenreduce.pays"]


def lines_of(model):
    describe = sys.modules["tokenreduce_pack.tokenreduce.describe"]
    session = session_of(model)
    return describe.run_lines(session.header, session.last_report)


@pytest.mark.parametrize("node", ["todo", "tome"])
def test_reduces_where_the_reduced_call_is_faster_and_leaves_the_rest_alone(comfy, models, measuring, node):
    store = measuring((10.0, 8.0), (10.0, 11.0))  # downsample 1 gains, downsample 2 loses
    records = []
    model = patched(comfy, node, models["SD15"], **DEFAULT_LEVELS[node])
    sample(comfy, spy_attn1(model, records), steps=2)
    assert reduced(records, "keys" if node == "todo" else "queries") == {(32, 32)}
    # per kind, each: a calibrating timing and 5 timed
    assert store.measurements == 2 and store.stopwatch.runs == {"full": 12, "reduced": 12}
    report = session_of(model).last_report
    assert [(site, d.reduce, d.full_ms, d.reduced_ms, d.source) for site, d in report.decisions] == [
        ("downsample 1 (32×32)", True, 10.0, 8.0, "measured"), ("downsample 2 (16×16)", False, 10.0, 11.0, "measured")]
    lines = lines_of(model)
    assert "auto · downsample 1 (32×32) · 10.00 → 8.00 ms · reduced" in lines
    assert "auto · downsample 2 (16×16) · 10.00 → 11.00 ms · left alone" in lines
    assert any(line.startswith("auto · measured 2 kinds of call now in ") for line in lines)
    assert not report.warnings


@pytest.mark.parametrize("reduced_ms,reduces", [(9.8, False), (9.6, True)])
def test_the_reduced_call_must_be_three_percent_faster(comfy, models, measuring, reduced_ms, reduces):
    measuring((10.0, reduced_ms))
    records = []
    model = patched(comfy, "todo", models["SD15"])
    sample(comfy, spy_attn1(model, records), steps=1)
    assert reduced(records, "keys") == ({(32, 32)} if reduces else set())


def test_leaving_every_grid_alone_is_said_as_a_warning(comfy, models, measuring):
    measuring((10.0, 12.0))
    model = patched(comfy, "todo", models["SD15"])
    sample(comfy, model, steps=1)
    (warning,) = session_of(model).last_report.warnings
    assert "reduce_when auto left every grid of this run unreduced" in warning and "always" in warning


def test_a_decision_is_kept_for_the_process_and_in_the_file(comfy, models, measuring, tmp_path):
    store = measuring((10.0, 8.0), (10.0, 11.0))
    first = patched(comfy, "todo", models["SD15"], factor_next=2.0)
    latent = sample(comfy, first)
    assert store.measurements == 2
    # Another node output in the same process: nothing is measured, the latent is bit-identical.
    again = patched(comfy, "todo", models["SD15"], factor_next=2.0, method="nearest")
    assert torch.equal(sample(comfy, again), latent) and store.measurements == 2
    assert [d.source for _, d in session_of(again).last_report.decisions] == ["kept", "kept"]
    assert not any("measured" in line for line in lines_of(again))
    assert [line for line in lines_of(again) if line.startswith("auto")] == [
        line for line in lines_of(first) if line.startswith("auto ·") and "measured" not in line]
    # A new process reads the file (see test_comfy_pays_process.py for a real second process).
    fresh = measuring((10.0, 20.0))
    restarted = patched(comfy, "todo", models["SD15"], factor_next=2.0)
    assert torch.equal(sample(comfy, restarted), latent) and fresh.measurements == 0


def test_removing_the_file_measures_again(comfy, models, measuring, tmp_path):
    store = measuring((10.0, 8.0), (10.0, 11.0))
    sample(comfy, patched(comfy, "todo", models["SD15"]), steps=1)
    (tmp_path / "auto_decisions.json").unlink()
    model = patched(comfy, "todo", models["SD15"])
    records = []
    sample(comfy, spy_attn1(model, records), steps=1)
    assert store.measurements == 2 and reduced(records, "keys") == set()  # the second script: slower
    assert (tmp_path / "auto_decisions.json").exists()


def test_measure_again_times_anew_once_and_replaces_the_kept_decision(comfy, models, measuring):
    store = measuring((10.0, 8.0), (10.0, 11.0))
    sample(comfy, patched(comfy, "todo", models["SD15"]), steps=1)
    model = patched(comfy, "todo", models["SD15"], reduce_when="auto (measure again)")
    records = []
    sample(comfy, spy_attn1(model, records), steps=1)
    assert store.measurements == 2 and reduced(records, "keys") == set()
    sample(comfy, model, steps=1)  # the same node output again: kept, not measured
    assert store.measurements == 2
    kept = patched(comfy, "todo", models["SD15"])  # plain auto now finds the new decision
    records = []
    sample(comfy, spy_attn1(kept, records), steps=1)
    assert store.measurements == 2 and reduced(records, "keys") == set()


def test_always_measures_nothing_and_reduces_every_grid(comfy, models, measuring):
    store = measuring((10.0, 20.0))
    records = []
    model = patched(comfy, "todo", models["SD15"], factor_next=2.0, reduce_when="always")
    sample(comfy, spy_attn1(model, records), steps=1)
    assert reduced(records, "keys") == {(32, 32), (16, 16)} and store.measurements == 0
    assert not session_of(model).last_report.decisions


def test_on_the_cpu_auto_reduces_every_size_without_measuring(comfy, models):
    records = []  # without a quality budget (with one the change is measured: test_comfy_max_change_inprocess.py)
    model = patched(comfy, "todo", models["SD15"], factor_next=2.0, max_change=0.0)
    sample(comfy, spy_attn1(model, records), steps=1)
    assert reduced(records, "keys") == {(32, 32), (16, 16)}
    assert not session_of(model).last_report.decisions
    assert "reduce_when auto" in apply(comfy, "todo", models["SD15"]).result[1]


@pytest.mark.parametrize("family", ["SD15", "SDXL"])
@pytest.mark.parametrize("node", ["todo", "tome"])
def test_real_timing_on_the_cpu_runs_the_real_blocks(comfy, models, monkeypatch, tmp_path, family, node):
    """With the real clock: the timed work runs the model's own blocks through the patch, the
    times are positive, what measuring cost is reported."""
    store = pays().Decisions(tmp_path / "d.json", measure_cpu=True)
    monkeypatch.setattr(sys.modules["tokenreduce_pack.nodes.common"], "decisions", lambda: store)
    settings = {"share_plans": True, "merge_mlp": True, "merge_crossattn": True} if node == "tome" else {}
    model = patched(comfy, node, models[family], **settings)
    sample(comfy, model, family, steps=1)
    report = session_of(model).last_report
    assert report.decisions and all(d.full_ms > 0 and d.reduced_ms > 0 for _, d in report.decisions)
    assert 0 < report.measure_seconds < 10 and store.measurements == len(report.decisions)


def test_stacked_nodes_each_measure_their_own_reduction_and_warn_nothing(comfy, models, measuring, caplog):
    store = measuring((10.0, 8.0))
    model = patched(comfy, "tome", patched(comfy, "todo", models["SD15"]), mode="queries only (ComfyUI built-in)")
    with caplog.at_level(logging.WARNING, logger="tokenreduce"):
        sample(comfy, model, steps=1)
    assert store.measurements == 2  # one kind each (downsample 1), ToDo's and ToMe's
    assert not [r for r in caplog.records if "outside a sampling run" in r.getMessage()]
    assert all(session.last_report.levels for session in sys.modules["tokenreduce_pack.nodes.session"]
               .sessions_of(model))


def _hypertile(comfy, model):
    from comfy_extras.nodes_hypertile import HyperTile

    out = HyperTile.execute(model, 32, 4, 1, False)  # tiles of 4 latent pixels, a random choice of 4 tilings
    return out[0] if isinstance(out, tuple) else out.result[0]


def _per_call_state(model):
    """A stand-in for a pack that keeps per-call state in the options: every attention call counts
    in a dict of the options, and the count changes its queries."""
    clone = model.clone()
    clone.model_options["transformer_options"]["standin"] = {"calls": 0}

    def counting(n, context, value, extra_options):
        state = extra_options["standin"]
        state["calls"] += 1
        return n * (1.0 + 0.01 * (state["calls"] % 5)), context, value

    clone.set_model_attn1_patch(counting)
    return clone


@pytest.mark.parametrize("other", ["HyperTile", "per-call state"])
def test_the_run_that_measures_gives_the_image_later_runs_give(comfy, models, measuring, other):
    """Measuring runs the other packs' patches in the timed block: HyperTile draws its tiling from
    the global RNG, a stand-in counts calls in the options. Neither may notice: the first run,
    which measures, equals the second, which reuses the decisions, bit for bit."""
    store = measuring((10.0, 8.0), (10.0, 11.0))
    todo = patched(comfy, "todo", models["SD15"], factor_next=2.0)
    model = _hypertile(comfy, todo) if other == "HyperTile" else _per_call_state(todo)

    def run():  # the noise as ComfyUI's KSampler makes it: seeding the global RNG, which HyperTile draws from
        return sample(comfy, model, size=(64, 64), steps=3,
                      noise=comfy.sample.prepare_noise(torch.zeros(1, 4, 64, 64), 0))

    first = run()
    assert store.measurements == 2
    second = run()
    assert store.measurements == 2 and torch.equal(first, second)


def test_a_kept_decision_is_keyed_by_comfyui_version_runtime_and_compiled_or_not(comfy, models):
    """A decision fits the conditions it was made in: the nodes' store keys by ComfyUI's version
    and the runtime (torch, its CUDA/ROCm build, driver, attention libraries where knowable); a
    model call under TorchCompileModel is its own kind."""
    import comfyui_version
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    common = sys.modules["tokenreduce_pack.nodes.common"]
    host = sys.modules["tokenreduce_pack.nodes.host"]
    measure = sys.modules["tokenreduce_pack.tokenreduce.measure"]
    run = sys.modules["tokenreduce_pack.tokenreduce.run"]
    environment = common.decisions().environment
    assert f"ComfyUI {comfyui_version.__version__}" in environment and f"torch {torch.__version__}" in environment
    assert json_key_holds(common.decisions().key(torch.device("cpu"), ("kind",)), environment)
    model = patched(comfy, "todo", models["SD15"])
    compiled = model.clone()
    set_torch_compile_wrapper(compiled, backend="eager")  # compiles lazily: nothing is compiled here
    # A model call's options hold its patcher's wrappers (the sampler merges them in).
    assert not host.compiled({"wrappers": model.wrappers}) and host.compiled({"wrappers": compiled.wrappers})
    x = torch.zeros(1, 4, 8, 8)
    calls = [run.ModelCall(x, None, {}, {}, torch.ones(1), compiled=flag) for flag in (False, True)]
    assert measure.backend_of(calls[0]) != measure.backend_of(calls[1])


def json_key_holds(key: str, environment: tuple) -> bool:
    import json

    return all(part in json.loads(key) for part in environment)


@pytest.mark.parametrize("window", [{}, {"start_percent": 0.0, "end_percent": 0.8}], ids=["whole run", "window"])
def test_a_run_auto_leaves_alone_reads_no_noise_level_and_builds_no_kind_after_its_first_call(
        comfy, models, measuring, monkeypatch, window):
    """Where auto leaves every level alone, the patched model steps aside: after the run's first
    model call no call reads its noise level (a device sync on a GPU) or builds a kind of call
    again (a cached lookup per call), and the latent is the unpatched one bit for bit."""
    run_module = sys.modules["tokenreduce_pack.tokenreduce.run"]
    levels = sys.modules["tokenreduce_pack.tokenreduce.measure"].UNetLevels
    store = measuring((10.0, 12.0))  # every kind slower reduced: left alone
    model = patched(comfy, "tome", patched(comfy, "todo", models["SD15"], factor_next=2.0, **window),
                    max_downsample="2", **window)
    unpatched = sample(comfy, models["SD15"], steps=4)
    counts, active = spy_stepping_aside(monkeypatch, run_module, {"sigma": (run_module.RunState, "sigma"),
                                                                  "kind": (levels, "kind")})
    model = model.clone()

    def call(apply_model, args):
        counts["calls"] += 1
        return apply_model(args["input"], args["timestep"], **args["c"])

    model.set_model_unet_function_wrapper(call)
    latent = sample(comfy, model, steps=4)
    assert store.measurements == 4 and counts["calls"] == 4  # ToDo's and ToMe's 2 levels; cond and uncond batched
    assert torch.equal(latent, unpatched)
    # The wrapper counts before the sessions' wrappers run: what the n-th call reads is noted with n.
    assert [c for c in counts["sigma"] + counts["kind"] if c > 1] == []  # only in the first call
    # Switched off from the first call on (it decided there): a compiled model sees one kind of call.
    assert active == [False] * 8
    if not window:  # the whole run is the window, and ToMe draws nothing: no noise level is read at all
        assert counts["sigma"] == []
    assert all(not session.last_report.levels for session in sys.modules["tokenreduce_pack.nodes.session"]
               .sessions_of(model))


def test_auto_shares_the_plans_time_over_plan_every_steps(comfy, models, measuring):
    """share_plans: a downsample-1 block of SD1.5 (5 share the plan) timed 10 ms unmerged, 9 ms merged
    with its plan made, the plan 10 ms: 9 + 10 / 5 = 11 ms, slower, left alone; with plan_every 4
    the plan serves 4 steps too: 9 + 10 / 20 = 9.5 ms, merged."""
    from comfy_helpers import ScriptedClock

    class WithPlan(ScriptedClock):
        def __call__(self, device):
            stopwatch = super().__call__(device)
            return lambda name, work: 0.010 if name == "plan" and work() is not False else stopwatch(name, work)

    decisions = {}
    for every in (1, 4):
        measuring((10.0, 9.0)).stopwatch = WithPlan((10.0, 9.0))
        model = patched(comfy, "tome", models["SD15"], share_plans=True, plan_every=every)
        sample(comfy, model, steps=1, size=(16, 16))
        (decision,) = [d for _, d in session_of(model).last_report.decisions]
        decisions[every] = (decision.reduce, round(decision.reduced_ms, 3))
    assert decisions == {1: (False, 11.0), 4: (True, 9.5)}
