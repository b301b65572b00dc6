"""Our nodes beside kijai's "Patch Sage Attention KJ" (``PathchSageAttentionKJ``), the real node
class from a ComfyUI-KJNodes tree named with ``python3 devtools/run_tests.py --kjnodes PATH``
(skipped without it). The ``sageattention`` package needs CUDA: its ``sageattn`` is replaced by a
stand-in (PyTorch SDPA in the layout Sage takes) that records the key lengths it is given;
everything else is KJNodes' own code (its override, its fp16 cast, its layout handling).

KJ's node sets ``optimized_attention_override`` on its clone and calls neither the override it
replaces nor the backend it is handed. Wired before ToDo, ToDo chains it; wired after, ToDo puts
itself in front of it at each model call: in both orders the reduced keys reach the Sage kernel,
and the two orders compute the same. On UNets both nodes work through attention patches, which
the override does not replace."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import custom_packs
from comfy_helpers import apply, patched, sample, session_of
from test_comfy_dit_inprocess import ALL_BLOCKS, dits, run  # noqa: F401  (dits: the module's fixture)

pytestmark = pytest.mark.skipif(custom_packs.tree("kjnodes") is None, reason=custom_packs.skip_reason("kjnodes"))


@pytest.fixture
def sage(monkeypatch):
    """The stand-in ``sageattention`` module; returns the (queries, keys) lengths it saw."""
    seen = []

    def sageattn(q, k, v, is_causal=False, attn_mask=None, tensor_layout="NHD", **kwargs):
        seq = 1 if tensor_layout == "NHD" else 2
        seen.append((q.shape[seq], k.shape[seq]))
        if tensor_layout == "NHD":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                               attn_mask=attn_mask).to(q.dtype)
        return out.transpose(1, 2) if tensor_layout == "NHD" else out

    monkeypatch.setitem(sys.modules, "sageattention", types.SimpleNamespace(sageattn=sageattn))
    return seen


def sage_patched(model):
    node = custom_packs.load_module("kjnodes", "nodes/model_optimization_nodes.py").PathchSageAttentionKJ
    return node().patch(model, "auto")[0]


@pytest.mark.parametrize("variant", ["wan21_t2v", "flux_dev"])
def test_todo_and_sage_act_together_in_either_order(comfy, dits, sage, variant):  # noqa: F811
    before = apply(comfy, "todo", sage_patched(dits(variant)), **ALL_BLOCKS).result[0]
    out_before, seen_before = run(comfy, before, variant), list(sage)
    sage.clear()
    after = sage_patched(apply(comfy, "todo", dits(variant), **ALL_BLOCKS).result[0])
    out_after, seen_after = run(comfy, after, variant), list(sage)
    assert any(k < q for q, k in seen_before) and seen_after == seen_before
    assert torch.equal(out_after, out_before)
    assert session_of(before).last_report.levels and not session_of(before).last_report.notes
    report = session_of(after).last_report
    assert report.levels and not report.warnings and "attention_override_sage" in report.notes[0]


@pytest.mark.parametrize("node", ["todo", "tome"])
@pytest.mark.parametrize("sage_first", [True, False])
def test_both_nodes_on_a_unet_reach_the_sage_kernel(comfy, models, sage, node, sage_first):
    settings = {"mode": "queries only (ComfyUI built-in)"} if node == "tome" else {}
    model = (patched(comfy, node, sage_patched(models["SD15"]), **settings) if sage_first else
             sage_patched(patched(comfy, node, models["SD15"], **settings)))
    out = sample(comfy, model)
    assert torch.isfinite(out).all() and session_of(model).last_report.levels
    level_one = [(q, k) for q, k in sage if max(q, k) == 32 * 32 or q == 32 * 32 - 512]
    if node == "todo":
        assert (32 * 32, 16 * 16) in level_one  # every query, a quarter of the keys
    else:
        assert (32 * 32 - 512, 32 * 32) in level_one  # merged queries, full keys
