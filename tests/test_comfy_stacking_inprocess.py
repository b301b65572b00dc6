"""Our nodes stacked with the built-in patches users combine them with, in both orders, on the
real ComfyUI in-process: each combination runs to a finite result and our patch still acts."""

from __future__ import annotations

import pytest
import torch

from comfy_helpers import patched, rel_error, sample, session_of


def _model_of(output):
    """Built-in nodes return a V3 NodeOutput or a V1 tuple."""
    return output.result[0] if hasattr(output, "result") else output[0]


def _others():
    from comfy_extras.nodes_freelunch import FreeU, FreeU_V2
    from comfy_extras.nodes_hypertile import HyperTile
    from comfy_extras.nodes_model_downscale import PatchModelAddDownscale
    from comfy_extras.nodes_pag import PerturbedAttentionGuidance
    from comfy_extras.nodes_sag import SelfAttentionGuidance

    return {
        "FreeU": lambda m: _model_of(FreeU().patch(m, 1.3, 1.4, 0.9, 0.2)),
        "FreeU_V2": lambda m: _model_of(FreeU_V2().patch(m, 1.3, 1.4, 0.9, 0.2)),
        "HyperTile": lambda m: _model_of(HyperTile.execute(m, 256, 2, 0, False)),
        "PAG": lambda m: _model_of(PerturbedAttentionGuidance.execute(m, 3.0)),
        "SAG": lambda m: _model_of(SelfAttentionGuidance.execute(m, 0.5, 2.0)),
        "DeepShrink": lambda m: _model_of(PatchModelAddDownscale.execute(m, 3, 2.0, 0.0, 0.35, True, "bicubic",
                                                                          "bicubic")),
    }


OTHERS = ["FreeU", "FreeU_V2", "HyperTile", "PAG", "SAG", "DeepShrink"]
# HyperTile tiles the queries in its own attn1 patch: ToMe placed after it receives tiles, not the
# grid, and must say so rather than silently do nothing. (Placed before it, ToMe works.)
SKIPPED = {("tome", "HyperTile")}


@pytest.mark.parametrize("node", ["tome", "todo"])
@pytest.mark.parametrize("other", OTHERS)
@pytest.mark.parametrize("ours_first", [True, False], ids=["ours-first", "other-first"])
def test_stacks_with_builtin_patches(comfy, models, node, other, ours_first, caplog):
    base = models["SD15"]
    apply_other = _others()[other]
    model = apply_other(patched(comfy, node, base)) if ours_first else patched(comfy, node, apply_other(base))
    out = sample(comfy, model, size=(64, 64), steps=2)
    assert torch.isfinite(out).all()
    other_only = sample(comfy, apply_other(base), size=(64, 64), steps=2)
    report = session_of(model).last_report
    if (node, other) in SKIPPED and not ours_first:
        assert report.skipped_calls > 0
        assert "was skipped in" in caplog.text and "HyperTile" in caplog.text
        assert torch.equal(out, other_only)
    else:
        assert report.skipped_calls == 0
        assert rel_error(out, other_only) > 1e-4  # our patch still acts in the combination


def test_todo_after_full_tome_says_its_keys_were_already_merged(comfy, models, caplog):
    base = models["SD15"]
    model = patched(comfy, "todo", patched(comfy, "tome", base))  # ToMe q, k, v mode merges the keys first
    sample(comfy, model, steps=1)
    assert "TokenReduceToDo was skipped in" in caplog.text
