"""ToDo on MiniMax-H3 (ComfyUI 0.33) beside ComfyUI's ModelAttentionBackend node, which picks the
attention function through ModelPatcher.set_model_optimized_attention: an override that replaces
the slot and calls neither the override it replaced nor the backend it is handed (and, for the
comfy-kitchen backend, brings a ``container_function`` that takes the model's
AttentionTensorContainers itself). MiniMax-H3 passes q, k and v in such containers; ComfyUI
unwraps them for an override without ``container_function``, which ToDo's override and the
front it puts before a later override both are. In either order of the two nodes ToDo still
reduces every grid call, and the result repeats bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

import random_dits
from comfy_helpers import rel_error, session_of
from test_comfy_dit_inprocess import ALL_BLOCKS, kept_tokens, run, todo

VARIANT = "minimax_h3"
GRID = random_dits.FIXTURES[VARIANT].grid


@pytest.fixture(scope="module")
def minimax(comfy):
    """The tiny MiniMax-H3 and ComfyUI's ModelAttentionBackend node, where this ComfyUI has both."""
    if not random_dits.available(VARIANT):
        pytest.skip("this ComfyUI has no MiniMaxH3 (it came after 0.3.75)")
    node = getattr(pytest.importorskip("comfy_extras.nodes_model_advanced"), "ModelAttentionBackend", None)
    if node is None:
        pytest.skip("this ComfyUI has no ModelAttentionBackend node")
    return random_dits.make_dit(VARIANT), node


def backends(comfy):
    """The choices the node offers on this machine (the comfy-kitchen one only where it is available)."""
    import comfy_extras.nodes_model_advanced as advanced

    return advanced.ModelAttentionBackend.INPUT_TYPES()["required"]["attention"][0]


def test_attention_backend_node_in_either_order_keeps_todo(comfy, minimax):
    base, node = minimax
    tokens = math.prod(GRID)
    for attention in backends(comfy):
        chosen = node().patch(base, attention)[0]  # the backend alone: what ToDo is compared with
        alone = run(comfy, chosen, VARIANT)
        outputs = {}
        reduced = todo(comfy, base, **ALL_BLOCKS).result[0]
        for order, model in (("backend after ToDo", node().patch(reduced, attention)[0]),
                             ("backend before ToDo", todo(comfy, chosen, **ALL_BLOCKS).result[0])):
            out = outputs[order] = run(comfy, model, VARIANT)
            report = session_of(model).last_report
            where = (attention, order)
            assert [(level.grid, level.tokens) for level in report.levels] == \
                [(GRID, {"q": (tokens, tokens), "k/v": (tokens, kept_tokens(GRID))})], where
            assert report.active_steps == (1, 2) and report.skipped_calls == 0 and report.warnings == (), where
            # ToDo says it put itself in front of the override applied after it, and only then
            assert bool(report.notes) == (order == "backend after ToDo"), where
            assert all("both act" in note for note in report.notes), where
            assert torch.isfinite(out).all() and 1e-5 < rel_error(out, alone) < 0.1, where
            assert torch.equal(out, run(comfy, model, VARIANT)), where
        assert torch.equal(outputs["backend after ToDo"], outputs["backend before ToDo"]), attention
