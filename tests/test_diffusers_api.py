"""apply_patch / remove_patch as a script uses them: the nodes' inputs, checks and messages from
the same table, the nodes' info text, reversibility, the step window, and ``reduce_when auto``
with its file under the user's cache directory."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")

from tokenreduce import pays  # noqa: E402
from tokenreduce.catalog import TODO_NODE, TOME_NODE  # noqa: E402
from tokenreduce.diffusers import api, apply_patch, decisions_path, remove_patch, tiny  # noqa: E402


@pytest.fixture(scope="module")
def pipe():
    return tiny.pipeline()


@pytest.mark.parametrize("node,values", [
    (TOME_NODE, {"ratio": 0.9}),  # above the 2x2 strides' cap
    (TOME_NODE, {"merge_attn": False}),
    (TOME_NODE, {"ratio": 1.5}),
    (TODO_NODE, {"factor": 1.0}),
    (TODO_NODE, {"start_percent": 0.8, "end_percent": 0.2}),
    (TODO_NODE, {"method": "lanczos"}),
])
def test_bad_values_get_the_nodes_messages(pipe, node, values):
    expected = f"{node.node_id}: {node.method.problem({**node.method.defaults(), **values})}"
    with pytest.raises(ValueError) as raised:
        apply_patch(pipe, node.method.name, **values)
    assert str(raised.value) == expected
    assert not pipe.unet._forward_pre_hooks  # nothing was applied


def test_unknown_inputs_and_methods_are_named(pipe):
    with pytest.raises(TypeError, match="unknown input raito; ToMe's inputs are ratio, stride_x"):
        apply_patch(pipe, "ToMe", raito=0.5)
    with pytest.raises(ValueError, match="method 'ToMo' is not one of 'ToMe', 'ToDo'"):
        apply_patch(pipe, "ToMo")
    with pytest.raises(ValueError, match="does nothing on this SD UNet2DConditionModel model with level 4"):
        apply_patch(pipe, "ToDo", level="4")


def test_plan_every_needs_share_plans_and_correct_from_whole_plan_every(pipe):
    """ToMe's plan_every and correct_from_whole are validated as in the nodes: plan_every above 1
    without share_plans, and correct_from_whole with plan_every 1, are refused with the nodes'
    messages; together they patch."""
    with pytest.raises(ValueError, match="plan_every 2 reuses the shared plan across steps, and share_plans is off"):
        apply_patch(pipe, "ToMe", plan_every=2)
    with pytest.raises(ValueError, match="correct_from_whole keeps each merged block's difference .* set plan_every"):
        apply_patch(pipe, "ToMe", share_plans=True, correct_from_whole=True)
    assert not pipe.unet._forward_pre_hooks
    with apply_patch(pipe, "ToMe", share_plans=True, plan_every=2):
        assert pipe.unet._forward_pre_hooks
    assert not pipe.unet._forward_pre_hooks


def test_stride_t_on_a_unet_is_refused_above_the_spatial_cap_and_else_said(pipe):
    """A UNet has no latent frames: stride_t's higher ratio cap is the node's, refused there with
    the reason; a reachable ratio patches with a warning that stride_t does nothing."""
    with pytest.raises(ValueError, match=r"TokenReduceToMe: ratio 0\.8 cannot be reached on this .* model: it has no "
                                         r"latent frames, so stride_t 2 does nothing"):
        apply_patch(pipe, "ToMe", ratio=0.8, stride_t=2)
    assert not pipe.unet._forward_pre_hooks
    with apply_patch(pipe, "ToMe", stride_t=2) as patch:
        assert [w.split(": ", 1)[1] for w in patch.warnings] == ["stride_t 2 does nothing: SD UNet2DConditionModel has "
                                                                 "no latent frames (only video DiTs merge across frames)."]


def test_info_is_the_nodes_and_applying_twice_is_applying_once(pipe):
    processors = dict(pipe.unet.attn_processors)
    base = tiny.generate(pipe, steps=2, size=64)
    first = apply_patch(pipe, "ToMe", ratio=0.4)
    assert first.info.startswith("ToMe on SD UNet2DConditionModel: ratio 0.4, strides 2x2, max_downsample 1: 3 of 7")
    once = tiny.generate(pipe, steps=2, size=64)
    hooks = len(pipe.unet._forward_pre_hooks)
    apply_patch(pipe, "ToMe", ratio=0.4)
    assert len(pipe.unet._forward_pre_hooks) == hooks and torch.equal(tiny.generate(pipe, steps=2, size=64), once)
    remove_patch(pipe)
    remove_patch(pipe)  # nothing left: nothing to do
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in pipe.unet.modules())
    assert pipe.unet.attn_processors == processors
    assert torch.equal(tiny.generate(pipe, steps=2, size=64), base)


def test_the_window_limits_the_steps(pipe):
    with apply_patch(pipe, "ToDo", start_percent=0.5) as patch:
        tiny.generate(pipe, steps=4, size=64)
        report = patch.report()
    assert report.steps == 4 and report.active_steps == (3, 4)


def test_reduce_when_auto_measures_and_keeps_its_decisions_in_the_cache_dir(pipe, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = decisions_path()
    assert path == tmp_path / "tokenreduce" / "auto_decisions.json"
    store = pays.Decisions(path, measure_cpu=True)  # the CPU is not measured unless asked: ask
    monkeypatch.setattr(api, "decisions_at", lambda p: store if p == path else pytest.fail(str(p)))
    model = tiny.transformer("Wan")
    inputs = tiny.transformer_inputs("Wan", model, frames=2)
    for method, target, call, extra in (("ToDo", pipe, lambda: tiny.generate(pipe, steps=1, size=64), {}),
                                        ("ToMe", pipe, lambda: tiny.generate(pipe, steps=1, size=64), {}),
                                        ("ToDo", model, lambda: model(**inputs), {"skip_first_blocks": 0})):
        with torch.no_grad(), apply_patch(target, method, reduce_when="auto", **extra) as patch:
            state = torch.get_rng_state()
            call()
            assert torch.equal(torch.get_rng_state(), state)
            lines = patch.report_lines()
        assert any(line.startswith("auto · ") for line in lines), lines
    kept = json.loads(path.read_text())
    assert len(kept["decisions"] if "decisions" in kept else kept) >= 3


class _Clock:
    """A scripted stopwatch for the auto rule: every kind measured takes (full ms, reduced ms)."""

    def __init__(self, full_ms, reduced_ms):
        self.times = {"full": full_ms / 1000.0, "reduced": reduced_ms / 1000.0}

    def __call__(self, device):
        def stopwatch(name, work):
            work()
            return self.times[name]
        return stopwatch


def _scripted(monkeypatch, tmp_path, full_ms, reduced_ms):
    store = pays.Decisions(tmp_path / "auto_decisions.json", measure_cpu=True, stopwatch=_Clock(full_ms, reduced_ms))
    monkeypatch.setattr(api, "decisions_at", lambda path: store)
    return store


@pytest.mark.parametrize("method", ["ToMe", "ToDo"])
def test_a_kind_auto_leaves_alone_is_not_reported_reduced_in_the_run_that_measures(pipe, monkeypatch, tmp_path,
                                                                                 method):
    _scripted(monkeypatch, tmp_path, 10.0, 12.0)  # the reduced call is slower: left alone
    base = tiny.generate(pipe, steps=2, size=64)
    with apply_patch(pipe, method, reduce_when="auto") as patch:
        out = tiny.generate(pipe, steps=2, size=64)
        report = patch.report()
    assert report.decisions and not any(d.decision.reduce for d in report.decisions)
    assert torch.equal(out, base)
    assert not report.levels and report.active_steps == ()


def test_two_one_step_pipeline_calls_are_two_runs(pipe, monkeypatch, tmp_path):
    """Each pipeline call is its own run, also where the timesteps do not rise in between."""
    store = _scripted(monkeypatch, tmp_path, 10.0, 8.0)
    with apply_patch(pipe, "ToDo", reduce_when="auto") as patch:
        tiny.generate(pipe, steps=1, size=64)
        measured = store.measurements  # the level's speed, each block's change (issue #51)
        tiny.generate(pipe, steps=1, size=64)
        report = patch.report()
    assert measured > 1 and store.measurements == measured
    assert report.steps == 1 and report.decisions and all(d.decision.source == "kept" for d in report.decisions)


def test_the_window_maps_percents_with_the_schedulers_shift_as_comfyui_does():
    """A flow schedule shifted by 8 (Wan's): end_percent 0.5 ends at sigma 0.889, as ComfyUI's
    percent_to_sigma says, not at 0.5. Five steps at sigmas 1, 0.970, 0.923, 0.842, 0.667."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    flux = tiny.flux_pipeline()
    flux.scheduler = FlowMatchEulerDiscreteScheduler(shift=8.0)
    with apply_patch(flux, "ToDo", end_percent=0.5) as patch:
        tiny.generate(flux, steps=5, size=128)
        report = patch.report()
    assert report.steps == 5 and report.active_steps == (1, 2, 3)


def test_lumina2s_rising_timestep_is_one_run_and_its_window_falls_as_the_noise_does():
    """Lumina 2's pipeline passes its model 1 - sigma, rising as sampling goes. Read turned round:
    four calls at sigmas 1, 0.75, 0.5, 0.25 (timesteps 0 to 0.75) are one run of four steps, not
    four runs, and start_percent 0.5 makes the last two active, not the first two. Fails before:
    each call started a run of its own."""
    model = tiny.transformer("Lumina 2")
    inputs = tiny.transformer_inputs("Lumina 2", model)
    with torch.no_grad(), apply_patch(model, "ToDo", start_percent=0.5, reduce_when="always") as patch:
        for sigma in (1.0, 0.75, 0.5, 0.25):
            model(**{**inputs, "timestep": torch.full((1,), 1.0 - sigma)})
        report = patch.report()
    assert report.steps == 4 and report.active_steps == (3, 4)


def test_a_run_over_the_whole_window_reads_no_timestep_per_call(pipe, monkeypatch):
    """No device sync per model call where every step is inside the window (nothing to decide)."""
    from tokenreduce.run import RunState

    reads = []
    original = RunState.sigma
    monkeypatch.setattr(RunState, "sigma", lambda self, sigmas: reads.append(1) or original(self, sigmas))
    for method, extra in (("ToDo", {}), ("ToMe", {"use_rand": False})):  # (use_rand: the timestep seeds the draws)
        with apply_patch(pipe, method, **extra) as patch:
            tiny.generate(pipe, steps=3, size=64)
            tiny.generate(pipe, steps=3, size=64)
            assert not reads, method
            report = patch.report()
        assert report.steps == 3 and report.active_steps == (1, 2, 3) and report.levels


@pytest.mark.parametrize("window", [{}, {"end_percent": 0.8}], ids=["whole run", "window"])
@pytest.mark.parametrize("method", ["ToMe", "ToDo"])
def test_a_run_auto_leaves_alone_reads_no_timestep_and_builds_no_kind_after_its_first_call(pipe, monkeypatch, tmp_path,
                                                                                          method, window):
    """Where auto leaves every block of the UNet alone, the patch steps aside: after the run's first
    model call no call reads its timestep (a device sync on a GPU), builds a kind of block call or
    asks the rule (a cached lookup per model call), and the latent is the unpatched one bit for bit."""
    from tokenreduce.diffusers import todo, tome
    from tokenreduce.run import CallPatch, RunState

    store = _scripted(monkeypatch, tmp_path, 10.0, 12.0)  # every kind slower reduced: left alone
    base = tiny.generate(pipe, steps=4, size=64)
    counts = {"calls": 0, "sigma": [], "kind": [], "pays": []}

    def counting(name, original):
        def spy(*args, **kwargs):
            counts[name].append(counts["calls"])
            return original(*args, **kwargs)
        return spy

    monkeypatch.setattr(RunState, "sigma", counting("sigma", RunState.sigma))
    monkeypatch.setattr(CallPatch, "decision", counting("pays", CallPatch.decision))  # pays asks it too
    for module in (tome, todo):  # every kind of block call names its attention backend
        monkeypatch.setattr(module, "attention_backend", counting("kind", module.attention_backend))
    # Registered before the patch's hook: what the n-th model call reads is noted with n.
    handle = pipe.unet.register_forward_pre_hook(lambda *_: counts.update(calls=counts["calls"] + 1))
    try:
        with apply_patch(pipe, method, reduce_when="auto", **window) as patch:
            out = tiny.generate(pipe, steps=4, size=64)
            report = patch.report()
    finally:
        handle.remove()
    assert counts["calls"] == 4 and store.measurements >= 1 and counts["kind"] and counts["pays"]
    assert torch.equal(out, base)
    assert {name: [c for c in counts[name] if c > 1] for name in ("sigma", "kind", "pays")} == \
        {"sigma": [], "kind": [], "pays": []}  # only in the first call
    if not window:  # the whole run is the window: no timestep is read at all
        assert counts["sigma"] == []
    assert report.steps == 4 and report.active_steps == () and not report.levels
    assert report.decisions and not any(d.decision.reduce for d in report.decisions)
