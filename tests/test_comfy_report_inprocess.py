"""What each node reports about a run (the lines drawn on the node in the browser), on the real
ComfyUI in-process: tokens per level before and after, active steps, warnings."""

from __future__ import annotations

import sys

import pytest

from comfy_helpers import apply, patched, sample, session_of


def report_module():
    return sys.modules["tokenreduce_pack.nodes.report"]


@pytest.mark.parametrize("node,settings,tokens", [
    ("tome", {}, {"q": (1024, 512), "k/v": (1024, 512)}),
    ("tome", {"mode": "queries only (ComfyUI built-in)", "merge_mlp": True},
     {"q": (1024, 512), "k/v": (1024, 1024), "mlp": (1024, 512)}),
    ("tome", {"merge_attn": False, "merge_crossattn": True}, {"cross q": (1024, 512)}),
    ("todo", {}, {"q": (1024, 1024), "k/v": (1024, 256)}),
])
def test_the_report_gives_tokens_per_level_before_and_after(comfy, models, node, settings, tokens):
    model = patched(comfy, node, models["SD15"], **settings)
    sample(comfy, model, steps=3)
    report = session_of(model).last_report
    assert report.completed and report.steps == 3 and report.active_steps == (1, 2, 3)
    (level,) = report.levels
    assert (level.downsample, level.grid, level.tokens) == (1, (32, 32), tokens)
    lines = report_module().run_lines(session_of(model).header, report)
    name = {"tome": "ToMe", "todo": "ToDo"}[node]
    assert lines[0] == f"{name} · SD15 · 5 of 16 blocks at downsample 1"
    assert lines[1].startswith("ds 1 · 32×32 · ")
    assert lines[2].startswith("steps 1-3 of 3 · ") and lines[2].endswith(" s sampling")
    assert not report.warnings


@pytest.mark.parametrize("node", ["tome", "todo"])
def test_the_info_says_on_the_cpu_what_a_run_on_the_cpu_shows(comfy, models, node):
    """reduce_when auto on the CPU reduces every call without timing any: the info text, made when
    the node executes, promises no times there, and the run's report has none."""
    output = apply(comfy, node, models["SD15"])
    info = output.result[1]
    assert "reduce_when auto" in info and "on a CPU every call is reduced, untimed" in info
    assert "The report shows the times" not in info
    sample(comfy, output.result[0], steps=2)
    report = session_of(output.result[0]).last_report
    assert report.completed and report.active_steps == (1, 2)
    assert not [line for line in report_module().run_lines(session_of(output.result[0]).header, report)
                if line.startswith("auto ·")]


def test_a_second_level_is_reported_finest_first(comfy, models):
    model = patched(comfy, "todo", models["SDXL"], factor_next=2.0)
    sample(comfy, model, "SDXL", size=(64, 64), steps=1)
    report = session_of(model).last_report
    assert [(lv.downsample, lv.grid, lv.tokens["k/v"]) for lv in report.levels] == [
        (2, (32, 32), (1024, 256)), (4, (16, 16), (256, 64))]


@pytest.mark.parametrize("node", ["tome", "todo"])
def test_the_report_lists_only_the_steps_inside_the_window(comfy, models, node):
    model = patched(comfy, node, models["SD15"], start_percent=0.5)
    sample(comfy, model, steps=6)
    report = session_of(model).last_report
    assert report.steps == 6 and 0 < len(report.active_steps) < 6
    assert report.active_steps == tuple(range(report.active_steps[0], 7))  # from the middle to the end


@pytest.mark.parametrize("node", ["tome", "todo"])
def test_a_window_that_holds_no_step_is_a_warning_not_silence(comfy, models, node, caplog):
    model = patched(comfy, node, models["SD15"], start_percent=0.37, end_percent=0.37)
    sample(comfy, model, steps=2)
    report = session_of(model).last_report
    assert report.active_steps == () and report.levels == ()
    (warning,) = report.warnings
    assert "active in none of the 2 steps" in warning and "start_percent 0.37" in warning
    assert warning in caplog.text
    assert report_module().run_lines(session_of(model).header, report)[-1].startswith("no step of 2")


def test_strides_that_miss_a_level_are_a_warning_in_the_report(comfy, models):
    # 24x24 latent: grids 24 at downsample 1, 12 at 2, 6 at 4; strides 8 fit the first two only.
    model = patched(comfy, "tome", models["SD15"], max_downsample="4", stride_x=8, stride_y=8, ratio=0.5)
    sample(comfy, model, size=(24, 24), steps=1)
    (warning,) = session_of(model).last_report.warnings
    assert "larger than the token grid at downsample 4" in warning


@pytest.mark.parametrize("node,settings", [("tome", {"max_downsample": "1"}), ("todo", {"level": "1"})])
def test_a_no_op_setting_comes_back_as_a_warning_for_the_node(comfy, models, node, settings):
    output = apply(comfy, node, models["SDXL"], **settings)
    (shown,) = output.ui["tokenreduce"]
    assert shown["lines"] == [] and "does nothing" in shown["warnings"][0]


def test_a_factor_at_a_level_without_blocks_is_a_warning_for_the_node(comfy, models):
    # SDXL has transformer blocks at downsample 2 and 4: factor_next at 8 does nothing.
    output = apply(comfy, "todo", models["SDXL"], level="4", factor_next=2.0)
    (shown,) = output.ui["tokenreduce"]
    (line,) = shown["lines"]
    assert line.startswith("ToDo · SDXL · ") and line.endswith(" blocks at downsample 4")
    assert shown["warnings"] == ["WARNING: factor_next 2 does nothing: this SDXL model has no transformer blocks "
                                 "at downsample 8."]


def test_an_interrupted_run_is_reported_as_such(comfy, models):
    import comfy.model_management as mm

    model = patched(comfy, "todo", models["SD15"])
    calls = []

    def interrupt_in_second_step(args):
        calls.append(1)
        if len(calls) == 2:
            mm.interrupt_current_processing(True)
        return args["denoised"]

    model.set_model_sampler_post_cfg_function(interrupt_in_second_step)
    with pytest.raises(mm.InterruptProcessingException):
        sample(comfy, model, steps=4)
    mm.interrupt_current_processing(False)
    report = session_of(model).last_report
    assert not report.completed and report.active_steps == (1, 2)
    assert report_module().run_lines(session_of(model).header, report)[-1].endswith("interrupted")


@pytest.mark.parametrize("interrupted", [False, True])
def test_an_error_in_the_report_never_replaces_the_result_or_the_interrupt(comfy, models, monkeypatch, caplog,
                                                                            interrupted):
    """The report is made in the sampler wrapper's ``finally``: if making it fails, the sampler's
    result (or its interrupt) still comes out, and the failure is logged and said."""
    import comfy.model_management as mm
    import torch

    run_module = sys.modules["tokenreduce_pack.tokenreduce.run"]
    model = patched(comfy, "todo", models["SD15"])
    expected = sample(comfy, model, steps=1)

    def broken(*args, **kwargs):
        raise RuntimeError("report broke")

    monkeypatch.setattr(run_module.RunState, "report", broken)
    if interrupted:
        stop = model.clone()
        stop.set_model_sampler_post_cfg_function(
            lambda args: (mm.interrupt_current_processing(True), args["denoised"])[1])
        try:
            with pytest.raises(mm.InterruptProcessingException):
                sample(comfy, stop, steps=2)  # raised when the second step starts
        finally:
            mm.interrupt_current_processing(False)
    else:
        assert torch.equal(sample(comfy, model, steps=1), expected)
    report = session_of(model).last_report
    assert report.completed is not interrupted and "report broke" in report.warnings[0]
    assert "could not make the run's report" in caplog.text
