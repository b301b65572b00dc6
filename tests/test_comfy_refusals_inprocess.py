"""Settings and combinations that cannot work are refused with a message naming the node and
the value, before anything is applied; the next valid run is unaffected. In-process on the
real ComfyUI (the same checks through the HTTP API are in test_comfy_robustness.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from comfy_helpers import apply, patched, sample, session_of

NODES = ["tome", "todo"]
NODE_IDS = {"tome": "TokenReduceToMe", "todo": "TokenReduceToDo"}


@pytest.mark.parametrize("node", NODES)
def test_applying_the_same_node_twice_is_refused(comfy, models, node):
    once = patched(comfy, node, models["SD15"])
    with pytest.raises(ValueError, match=f"{NODE_IDS[node]} is already applied to this model"):
        apply(comfy, node, once)
    # The other node on top is a supported combination.
    other = "todo" if node == "tome" else "tome"
    assert torch.isfinite(sample(comfy, patched(comfy, other, once), steps=1)).all()


def test_tome_on_top_of_the_builtin_is_refused_todo_is_not(comfy, models):
    from comfy_extras.nodes_tomesd import TomePatchModel

    builtin = TomePatchModel.execute(models["SD15"], 0.5).result[0]
    with pytest.raises(ValueError, match="built-in TomePatchModel is already applied"):
        apply(comfy, "tome", builtin)
    # The built-in merges the queries only; ToDo pools the keys/values, which stay full.
    assert torch.isfinite(sample(comfy, patched(comfy, "todo", builtin), steps=1)).all()


@pytest.mark.parametrize("node,settings,size,needle", [
    ("tome", {"stride_x": 4, "stride_y": 4}, (2, 3), "stride_x 4 / stride_y 4 do not fit the token grids of this 24x16 px"),
    ("tome", {"stride_x": 8}, (16, 4), "this 32x128 px latent (16x4 at downsample 1)"),
    ("todo", {"factor": 6.0}, (4, 5), "factor 6 does not fit the 4x5 token grid at downsample 1"),
    ("todo", {"factor": 1.0, "factor_next": 4.0, "level": "1"}, (6, 6), "factor_next 4 does not fit the 3x3"),
])
def test_settings_that_do_not_fit_the_latent_are_refused_before_the_first_step(comfy, models, node, settings, size,
                                                                                 needle):
    model = patched(comfy, node, models["SD15"], **settings)
    with pytest.raises(ValueError, match=NODE_IDS[node]) as refused:
        sample(comfy, model, size=size, steps=1)
    assert needle in str(refused.value)
    report = session_of(model).last_report  # the node shows the reason in the browser
    assert report.refused and report.warnings == (str(refused.value),)
    # Nothing half-applied: the same patched model then samples a size that fits, exactly as
    # a fresh copy of it does.
    fresh = patched(comfy, node, models["SD15"], **settings)
    assert torch.equal(sample(comfy, model, size=(16, 16), steps=1), sample(comfy, fresh, size=(16, 16), steps=1))


def test_strides_that_fit_only_some_levels_warn_and_merge_the_others(comfy, models, caplog):
    model = patched(comfy, "tome", models["SD15"], max_downsample="2", stride_x=6, stride_y=6)
    with caplog.at_level(logging.WARNING, logger="tokenreduce"):
        out = sample(comfy, model, size=(8, 8), steps=1)
    assert "larger than the token grid at downsample 2" in caplog.text
    assert not torch.equal(out, sample(comfy, models["SD15"], size=(8, 8), steps=1))
