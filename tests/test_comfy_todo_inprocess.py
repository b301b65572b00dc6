"""ToDo-specific behaviour on the real ComfyUI, in-process (shared lifecycle tests live in
test_comfy_lifecycle_inprocess.py)."""

from __future__ import annotations


import pytest
import torch

from comfy_helpers import TODO_DEFAULTS, apply, patched, rel_error, sample, spy_attn1


def keys_at(records):
    return {r["grid"]: (r["queries"], r["keys"], r["values"]) for r in records}


@pytest.mark.parametrize("family,overrides,expected", [
    # grid -> keys seen; queries always stay full
    ("SD15", {}, {(32, 32): 256, (16, 16): 256, (8, 8): 64}),
    ("SD15", {"factor_next": 2.0}, {(32, 32): 256, (16, 16): 64, (8, 8): 64}),
    ("SD15", {"factor": 3.0}, {(32, 32): 121, (16, 16): 256}),  # ceil(32/3) = 11
    ("SD15", {"factor": 1.5, "level": "2"}, {(32, 32): 1024, (16, 16): 121}),  # ceil(16/1.5) = 11
    ("SDXL", {}, {(16, 16): 64, (8, 8): 64}),  # auto: SDXL's first transformer level is downsample 2
    ("SDXL", {"factor": 4.0, "factor_next": 2.0}, {(16, 16): 16, (8, 8): 16}),
])
def test_keys_each_block_sees_are_what_the_settings_say(comfy, models, family, overrides, expected):
    records = []
    sample(comfy, spy_attn1(patched(comfy, "todo", models[family], **overrides), records), family, steps=1)
    seen = keys_at(records)
    for grid, keys in expected.items():
        queries, got_keys, got_values = seen[grid]
        assert queries == grid[0] * grid[1] and got_keys == keys and got_values == keys, (grid, seen[grid])


def test_sdxl_defaults_patch_attention_and_change_the_output(comfy, models):
    base = models["SDXL"]
    out = apply(comfy, "todo", base)
    assert "ToDo on SDXL: downsample 2: 5 blocks" in out.result[1]
    assert rel_error(sample(comfy, out.result[0], "SDXL"), sample(comfy, base, "SDXL")) > 1e-3


@pytest.mark.parametrize("method", ["nearest", "average", "bilinear", "bicubic"])
def test_every_method_runs_deterministically_on_odd_grids(comfy, models, method):
    model = patched(comfy, "todo", models["SD15"], method=method, factor=2.5, factor_next=1.5)
    a = sample(comfy, model, size=(33, 45), steps=1)
    assert torch.isfinite(a).all() and torch.equal(a, sample(comfy, model, size=(33, 45), steps=1))


def test_methods_differ(comfy, models):
    base = models["SD15"]
    outs = [sample(comfy, patched(comfy, "todo", base, method=m)) for m in ("nearest", "average", "bilinear")]
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])


@pytest.mark.parametrize("first", ["tome", "todo"])
def test_stacked_with_tome_queries_merged_and_keys_pooled(comfy, models, first):
    """The combined mode: ToMe merges the queries, ToDo pools keys/values, in either order."""
    base = models["SD15"]
    tome_settings = dict(mode="queries only (ComfyUI built-in)")
    if first == "tome":
        model = patched(comfy, "todo", patched(comfy, "tome", base, **tome_settings))
    else:
        model = patched(comfy, "tome", patched(comfy, "todo", base))  # full mode sees pooled keys: merges q only
    records = []
    out = sample(comfy, spy_attn1(model, records), steps=1)
    level1 = [r for r in records if r["grid"] == (32, 32)]
    assert level1 and all(r["queries"] == 512 and r["keys"] == 256 for r in level1)
    assert torch.isfinite(out).all()


VALIDATED = ("factor", "factor_next", "level", "method", "start_percent", "end_percent")


@pytest.mark.parametrize("overrides,message", [
    (dict(factor=1.0), "nothing to downsample"),
    (dict(factor=0.5), "factor 0.5 is out of range"),
    (dict(factor_next=9.0), "factor_next 9 is out of range"),
    (dict(level="3"), "level '3' is not one of"),
    (dict(method="max"), "method 'max' is not one of"),
    (dict(start_percent=0.7, end_percent=0.3), "after end_percent"),
])
def test_bad_settings_are_rejected(comfy, models, overrides, message):
    settings = {k: v for k, v in {**TODO_DEFAULTS, **overrides}.items() if k in VALIDATED}
    problem = comfy.todo.ToDoPatchNode.validate_inputs(**settings)
    assert isinstance(problem, str) and message in problem
    with pytest.raises(ValueError, match="TokenReduceToDo"):
        apply(comfy, "todo", models["SD15"], **overrides)


def test_a_factor_for_a_level_without_blocks_is_reported(comfy, models):
    # SD1.5 at level 4: the next level (8) is the middle block; level 16 does not exist.
    info = apply(comfy, "todo", models["SD15"], level="8", factor_next=2.0).result[1]
    assert "downsample 16: no transformer blocks in this model (factor 2 does nothing)" in info
