"""Issue #45's edges in the real ComfyUI, in-process: what the run's report lists where
reduce_when auto leaves a kind of block alone, patches that run inside a block and reshape by the
full grid, and the host glue that patches ``forward_orig`` and wraps the blocks."""

from __future__ import annotations

import pytest
import torch

import random_dits
from comfy_helpers import apply, session_of
from test_comfy_dit_inprocess import run, todo
from test_comfy_tome_dit_inprocess import VARIANTS

run_lines = __import__("tokenreduce.describe", fromlist=["run_lines"]).run_lines


def test_a_kind_of_block_auto_left_alone_is_not_listed_as_merged(comfy, measuring):
    """Flux with the double blocks merged and the single blocks left alone by the auto rule: the
    report's tokens list the double blocks only, beside the single blocks' decision."""
    model = random_dits.make_dit("flux_dev", **VARIANTS["flux_dev"][0])
    measuring((10.0, 8.0), (10.0, 11.0))  # the first kind met (double blocks) gains, the second loses
    patched = apply(comfy, "tome", model, ratio=0.5).result[0]
    run(comfy, patched, "flux_dev")
    report = session_of(patched).last_report
    decided = {d.site.split(",")[0]: d.decision.reduce for d in report.decisions}
    assert decided == {"Flux.1 double blocks": True, "Flux.1 single blocks": False}, decided
    (level,) = report.levels
    assert list(level.tokens) == ["double blocks"], level.tokens
    lines = run_lines("ToMe", report, timing=False)
    assert not any("single blocks 48→" in line for line in lines), lines
    assert any("double blocks 48→" in line for line in lines), lines


def test_the_host_version_decides_whether_wan_s2v_blocks_get_the_options(comfy):
    host = __import__("sys").modules["tokenreduce_pack.nodes.host"]
    assert not host.s2v_blocks_get_options("0.3.75") and not host.s2v_blocks_get_options("unknown")
    assert host.s2v_blocks_get_options("0.33.0") and host.s2v_blocks_get_options("1.0")
    assert not host.s2v_blocks_get_options("0.8.1")  # between the two: the patch, redundant at worst


def test_todo_and_tome_on_wan_s2v_share_one_forward_orig_patch(comfy):
    """Where the host drops the blocks' options (0.3.75), ToDo and ToMe on one Wan S2V clone share
    one object patch of forward_orig, in either order, and sample as they do stacked."""
    if not random_dits.available("wan22_s2v"):
        pytest.skip("this ComfyUI has no WAN22_S2V")
    host = __import__("sys").modules["tokenreduce_pack.nodes.host"]
    model = random_dits.make_dit("wan22_s2v", **VARIANTS["wan22_s2v"][0])
    todo_first = apply(comfy, "tome", todo(comfy, model).result[0], ratio=0.5, reduce_when="always").result[0]
    tome_first = todo(comfy, apply(comfy, "tome", model, ratio=0.5, reduce_when="always").result[0]).result[0]
    if host.s2v_blocks_get_options(host.host_version()):
        assert not todo_first.object_patches and not tome_first.object_patches
        return
    for patched in (todo_first, tome_first):
        (key,) = patched.object_patches
        forward = patched.object_patches[key]
        assert forward.func is host._forward_handing_options
        assert forward.args[0] == model.get_model_object(key)  # the model's own forward_orig: one layer
    assert not model.object_patches
    out = run(comfy, todo_first, "wan22_s2v")
    assert torch.equal(out, run(comfy, tome_first, "wan22_s2v"))
    sessions = __import__("sys").modules["tokenreduce_pack.nodes.session"].sessions_of(todo_first)
    assert len(sessions) == 2 and all(session.last_report.levels for session in sessions)


class GridAudioPatch:
    """An attn2_patch of the shape ComfyUI's MultiTalkCrossAttnPatch has (model_multitalk.py, in
    ComfyUI after 0.3.75): handed the block's tokens, it views them frame by frame by the call's
    whole grid (``transformer_options["grid_sizes"]``), which merged tokens do not fill."""

    def __call__(self, kwargs):
        x, (frames, height, width) = kwargs["x"], kwargs["transformer_options"]["grid_sizes"]
        per_frame = x.view(x.shape[0] * frames, height * width, x.shape[-1])
        return x + 0.0 * per_frame.reshape(x.shape)


@pytest.mark.parametrize("order", ["patch then ToMe", "ToMe then patch"])
def test_patches_that_read_the_whole_grid_inside_the_blocks_leave_the_call_alone(comfy, order):
    """A Wan clone with an in-block patch that reshapes by the full grid (set before ToMe, or
    after it on its output): ToMe leaves those calls whole, bit for bit the unmerged model, and
    says why; without the patch the same clone merges."""
    model = random_dits.make_dit("wan21_t2v", **VARIANTS["wan21_t2v"][0])

    def with_patch(patcher):
        clone = patcher.clone()
        clone.set_model_patch(GridAudioPatch(), "attn2_patch")
        return clone

    if order == "patch then ToMe":
        patched = apply(comfy, "tome", with_patch(model), ratio=0.5, reduce_when="always").result[0]
    else:
        patched = with_patch(apply(comfy, "tome", model, ratio=0.5, reduce_when="always").result[0])
    out = run(comfy, patched, "wan21_t2v")
    assert torch.equal(out, run(comfy, with_patch(model), "wan21_t2v"))
    report = session_of(patched).last_report
    assert not report.levels
    assert any("left alone" in w and "attn2_patch: GridAudioPatch" in w and "InfiniteTalk" in w
               for w in report.warnings), report.warnings
    merged = apply(comfy, "tome", model, ratio=0.5, reduce_when="always").result[0]
    run(comfy, merged, "wan21_t2v")
    assert session_of(merged).last_report.levels
