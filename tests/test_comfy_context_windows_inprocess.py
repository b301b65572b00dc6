"""Our nodes inside ComfyUI's context windows (``ContextWindowsManual``, in 0.3.75 and 0.33),
in-process: a long video (or an AnimateDiff-style batch of frames on a UNet) is sampled as
overlapping windows of frames, each window its own model call with its own frame count and
conditioning slice. Each window must be reduced as the call it is: ToDo's token layout and
``temporal_factor`` per window (the first frame of each window is kept), and the run's report
says that windows were seen. A probe override before ToDo records each grid call's queries and
keys."""

from __future__ import annotations

import pytest
import torch

import random_dits
from comfy_helpers import apply, patched, reduced, sample, session_of, spy_attn1
from test_comfy_dit_inprocess import ALL_BLOCKS, dits, kept_tokens, with_probe  # noqa: F401  (dits: fixture)

LONG = dict(frames=33, height_px=96, width_px=96)  # 9 latent frames of 6x6 tokens (Wan, HunyuanVideo)


def with_context_windows(model, length: int, overlap: int, dim: int):
    """ContextWindowsManual applied as ComfyUI runs it, its other inputs at their defaults (the
    two versions differ in which inputs it has)."""
    from comfy_extras.nodes_context_windows import ContextWindowsManualNode

    values = {spec.id: spec.default for spec in ContextWindowsManualNode.define_schema().inputs
              if getattr(spec, "default", None) is not None}
    values.update(context_length=length, context_overlap=overlap, dim=dim, context_schedule="standard_static")
    return ContextWindowsManualNode.execute(model, **values).result[0]


def call_frames(model, window: tuple[int, ...]) -> int:
    """The frames the model call of ``window`` sees: the window's own, and in 0.33 the frame just
    before a window that does not start the video (``causal_window_fix``)."""
    handler = model.model_options.get("context_handler")
    return len(window) + (1 if getattr(handler, "causal_window_fix", False) and window[0] > 0 else 0)


def host_can(run):
    """Run the unpatched case first: where this ComfyUI cannot sample it with context windows
    itself, there is nothing of ours to test (skipped with the host's own error)."""
    try:
        return run()
    except RuntimeError as error:
        pytest.skip(f"this ComfyUI cannot sample it with context windows, unpatched: {str(error)[:160]}")


def run_long(comfy, model, variant, steps=2):
    positive, negative = random_dits.conditioning(variant, **LONG)
    latent = random_dits.latent(variant, **LONG)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        return comfy.sample.sample(model, noise, steps, 2.0, "euler", "simple", positive, negative, latent, seed=0,
                                   disable_pbar=True)


@pytest.mark.parametrize("variant", ["wan21_t2v", "wan21_i2v", "hunyuan_video"])
@pytest.mark.parametrize("temporal", [1.0, 2.0])
def test_each_window_of_a_long_video_is_reduced_as_its_own_call(comfy, dits, variant, temporal):  # noqa: F811
    host_can(lambda: run_long(comfy, with_context_windows(dits(variant), length=5, overlap=2, dim=2), variant, steps=1))
    records = []
    model = apply(comfy, "todo", with_probe(dits(variant), records), temporal_factor=temporal, **ALL_BLOCKS).result[0]
    model = with_context_windows(model, length=5, overlap=2, dim=2)
    out = run_long(comfy, model, variant)
    assert torch.isfinite(out).all()
    report = session_of(model).last_report
    assert len(report.windows) >= 2 and all(len(window) <= 5 for window in report.windows)
    # Each window's grid: all its queries, the keys that grid keeps (its first frame among them).
    # 0.33 puts the frame before a window in front of it (causal_window_fix, on by default).
    assert {level.grid for level in report.levels} == {(call_frames(model, w), 6, 6) for w in report.windows}
    for level in report.levels:
        tokens = level.grid[0] * 36
        assert level.tokens == {"q": (tokens, tokens), "k/v": (tokens, kept_tokens(level.grid, temporal=int(temporal)))}
    assert any(k < q for q, k, *_ in records)  # the reduced keys reached the override chained after ToDo
    lines = sys_describe().run_lines(session_of(model).header, report)
    (line,) = [line for line in lines if line.startswith("context windows")]
    assert f"context windows · {len(report.windows)} of" in line and "each its own call" in line


@pytest.mark.parametrize("node", ["todo", "tome"])
def test_a_unet_batch_of_frames_in_windows(comfy, models, node):
    """AnimateDiff-style: the frames are the batch (dim 0), windows of 4 of 8."""
    noise = torch.randn(8, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    host_can(lambda: sample(comfy, with_context_windows(models["SD15"], length=4, overlap=1, dim=0), noise=noise,
                            batch=8, steps=1))
    records = []
    model = with_context_windows(spy_attn1(patched(comfy, node, models["SD15"]), records), length=4, overlap=1, dim=0)
    out = sample(comfy, model, noise=noise, batch=8)
    assert torch.isfinite(out).all()
    assert reduced(records, "keys" if node == "todo" else "queries") == {(32, 32)}
    report = session_of(model).last_report
    assert len(report.windows) >= 2 and {len(window) for window in report.windows} == {4}


def sys_describe():
    import sys

    return sys.modules["tokenreduce_pack.tokenreduce.describe"]
