"""ToMe's correct_from_whole on DiTs (issue #50): on the step that plans a merged block runs whole
and merged on the same input and keeps the difference; the steps that reuse the plan add it."""

from __future__ import annotations

import torch

from tokenreduce.whole_difference import DIFFERENCE, corrected, corrected_block, difference


def _in_place_block(scale: float):
    """A block that adds to its inputs in place, as ComfyUI's Flux blocks do, and returns them
    in a dict beside a tuple (the shapes of outputs the hosts' blocks give)."""
    def block(args):
        img, txt = args["img"], args["txt"]
        img += scale * img.tanh()
        txt += 1.0
        return {"img": img, "pair": (txt, "not a tensor")}
    return block


def test_the_planning_step_is_the_whole_block_and_keeps_the_difference():
    img, txt = torch.randn(2, 6, 4), torch.randn(2, 3, 4)
    args = {"img": img.clone(), "txt": txt.clone(), "pe": None}
    plans = {}
    out = corrected_block(plans, ("single_block", 1), True, args, _in_place_block(1.0), _in_place_block(0.5))
    whole = _in_place_block(1.0)({"img": img.clone(), "txt": txt.clone()})
    assert torch.equal(out["img"], whole["img"]) and torch.equal(out["pair"][0], whole["pair"][0])
    kept = plans[(DIFFERENCE, ("single_block", 1))]
    merged = _in_place_block(0.5)({"img": img.clone(), "txt": txt.clone()})
    assert torch.equal(kept["img"], whole["img"] - merged["img"])
    assert torch.equal(kept["pair"][0], torch.zeros_like(txt)) and kept["pair"][1] is None


def test_a_reusing_step_adds_the_kept_difference_and_a_plan_without_one_runs_merged():
    img, txt = torch.randn(2, 6, 4), torch.randn(2, 3, 4)
    plans = {}
    corrected_block(plans, "b", True, {"img": img.clone(), "txt": txt.clone()}, _in_place_block(1.0),
                    _in_place_block(0.5))
    # the same input again: the merged run plus the difference is the whole block's output
    out = corrected_block(plans, "b", False, {"img": img.clone(), "txt": txt.clone()}, _in_place_block(1.0),
                          _in_place_block(0.5))
    whole = _in_place_block(1.0)({"img": img.clone(), "txt": txt.clone()})
    assert torch.allclose(out["img"], whole["img"], atol=1e-6) and out["pair"][1] == "not a tensor"
    alone = corrected_block({}, "b", False, {"img": img.clone(), "txt": txt.clone()}, _in_place_block(1.0),
                            _in_place_block(0.5))
    assert torch.equal(alone["img"], _in_place_block(0.5)({"img": img.clone(), "txt": txt.clone()})["img"])


def test_a_block_that_cannot_merge_is_left_to_the_caller_and_keeps_nothing():
    plans = {}
    assert corrected_block(plans, "b", True, {"img": torch.ones(1, 2, 2)}, lambda a: a, lambda a: None) is None
    assert plans == {}


def test_shapes_that_differ_keep_and_add_nothing():
    assert difference(torch.ones(2, 3), torch.ones(2, 4)) is None
    assert difference({"a": torch.ones(1)}, {"b": torch.ones(1)}) is None
    x = torch.ones(2, 3)
    assert corrected(x, torch.ones(2, 4)) is x and corrected(x, None) is x
