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


def _with_image_prompt_attention(model):
    """An IP-Adapter-style patch: every cross-attention is replaced (``attn2`` replace) by text
    attention plus attention to four extra image-prompt tokens, as IP-Adapter does."""
    import sys

    from comfy.ldm.modules.attention import optimized_attention

    def attend(q, k, v, extra_options):
        heads = extra_options["n_heads"]
        image = torch.randn(q.shape[0], 4, q.shape[-1], generator=torch.Generator().manual_seed(3)).to(q)
        return optimized_attention(q, k, v, heads) + 0.5 * optimized_attention(q, image, image, heads)

    model = model.clone()
    layout = sys.modules["tokenreduce_pack.tokenreduce.layout"].unet_layout(model.get_model_object("diffusion_model"))
    for site in layout.sites:
        model.set_model_attn2_replace(attend, *site.key)
    return model


@pytest.mark.parametrize("node,settings", [("tome", {"merge_crossattn": True}), ("todo", {})])
@pytest.mark.parametrize("ours_first", [True, False], ids=["ours-first", "other-first"])
def test_stacks_with_an_ip_adapter_style_attn2_replace(comfy, models, node, settings, ours_first):
    base = models["SD15"]
    model = (_with_image_prompt_attention(patched(comfy, node, base, **settings)) if ours_first
             else patched(comfy, node, _with_image_prompt_attention(base), **settings))
    out = sample(comfy, model, steps=2)
    other_only = sample(comfy, _with_image_prompt_attention(base), steps=2)
    assert rel_error(other_only, sample(comfy, base, steps=2)) > 1e-3  # the replacement acts
    assert session_of(model).last_report.skipped_calls == 0
    assert 1e-4 < rel_error(out, other_only) < 0.5
