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
    with pytest.raises(ValueError, match="ToMe cannot patch this Flux model.*use ToDo"):
        apply_patch(tiny.transformer("Flux"), "ToMe")
    with pytest.raises(ValueError, match="does nothing on this SD UNet2DConditionModel model with level 4"):
        apply_patch(pipe, "ToDo", level="4")


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
