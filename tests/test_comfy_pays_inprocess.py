"""The auto rule (``reduce_when``): where reduction cannot pay for itself it is left alone, and
the run's report says so; ``always`` forces it. The measured threshold applies on CUDA GPUs; on
the CPU the tests lower it to the tiny models' sizes."""

from __future__ import annotations

import sys

import pytest

from comfy_helpers import patched, reduced, sample, session_of, spy_attn1


@pytest.fixture
def threshold(comfy, monkeypatch):
    """A minimum of 600 tokens per grid on this device: the tiny SD1.5's 32x32 grid (1024 tokens)
    pays, its 16x16 next level (256) does not."""
    pays = sys.modules["tokenreduce_pack.tokenreduce.pays"]
    monkeypatch.setattr(pays, "min_grid_tokens", lambda device: 600)


@pytest.mark.parametrize("node,settings", [("todo", {"factor_next": 2.0}), ("tome", {"max_downsample": "2"})])
def test_auto_leaves_small_grids_alone_and_says_so(comfy, models, threshold, node, settings):
    records = []
    model = patched(comfy, node, models["SD15"], **settings)
    sample(comfy, spy_attn1(model, records), steps=1)
    field = "keys" if node == "todo" else "queries"
    assert reduced(records, field) == {(32, 32)}
    report = session_of(model).last_report
    assert [level.grid for level in report.levels] == [(32, 32)]
    (warning,) = [w for w in report.warnings if "reduce_when auto" in w]
    assert "downsample 2 (16×16) (256 tokens)" in warning and "always" in warning


@pytest.mark.parametrize("node,settings", [("todo", {"factor_next": 2.0}), ("tome", {"max_downsample": "2"})])
def test_always_reduces_every_grid(comfy, models, threshold, node, settings):
    records = []
    model = patched(comfy, node, models["SD15"], reduce_when="always", **settings)
    sample(comfy, spy_attn1(model, records), steps=1)
    assert reduced(records, "keys" if node == "todo" else "queries") == {(32, 32), (16, 16)}
    assert not session_of(model).last_report.warnings


def test_on_the_cpu_auto_reduces_every_size(comfy, models):
    records = []
    model = patched(comfy, "todo", models["SD15"], factor_next=2.0)
    sample(comfy, spy_attn1(model, records), steps=1)
    assert reduced(records, "keys") == {(32, 32), (16, 16)}
