"""Host-free tests of the core of whole-block ToMe on DiTs (``tokenreduce/tome_dit.py``, issue #45):
a row's merge does not depend on what it is batched with (CogVideoX's one rotary table for the
batch), the plan and the merge hold at fp16 magnitudes past fp16's range, a mask is merged
without rotary positions, the gathers a plan implies are made once per plan, and the project
declares what it imports."""

from __future__ import annotations

import ast
import math
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tokenreduce.tome_dit as tome_dit
from tokenreduce.dit import BlockArgs, TokenLayout
from tokenreduce.families.cogvideo import FAMILIES as COGVIDEOX
from tokenreduce.run import MERGED_GRID, call_context
from tokenreduce.tome_dit import (SHARED_PLAN, ToMeDiTPatch, accumulating, make_tiles, merge, merged_args, merged_count, plan_block,
                                  restore)

REPO = Path(__file__).resolve().parent.parent
GRID, TEXT, WIDTH = (2, 4, 6), 5, 8
N = math.prod(GRID)


def _cogvideox_patch(share_plans: bool = True) -> ToMeDiTPatch:
    """ToMe's block replacements for the CogVideoX family (its real ``DiTMerge``), on a model of
    which only the patch sizes are read."""
    settings = SimpleNamespace(ratio=0.5, stride_t=1, stride_y=2, stride_x=2, share_plans=share_plans, plan_every=1,
                               use_rand=True, seed=0)
    model = SimpleNamespace(patch_size_t=1, patch_size=2, blocks=[None] * 4)
    return ToMeDiTPatch(settings, SimpleNamespace(family=COGVIDEOX[0]), frozenset({1, 2}), model, "ctx", "ToMe")


def _cogvideox_block(args: dict) -> dict:
    """A block as CogVideoX's takes its inputs: the video tokens ``img``, the text ``txt`` apart,
    a modulation per sample ``vec`` and ONE rotary pair (cos, sin) [N, D] that it broadcasts over
    the batch; joint attention over [text, video]."""
    img, txt, vec = args["img"], args["txt"], args["vec"]
    cos, sin = args["pe"]
    assert cos.ndim == 2 and cos.shape[0] == img.shape[1], "one table for the batch, over the block's tokens"
    q = img * cos + img.roll(1, -1) * sin
    joint = torch.cat([txt, img], 1)
    weights = torch.softmax(q @ torch.cat([txt, q], 1).transpose(1, 2) / math.sqrt(WIDTH), -1)
    return {"img": img + (weights @ joint) * vec[:, None], "txt": txt * 1.5}


def _cogvideox_call(patch: ToMeDiTPatch, rows: list[int], inputs: dict, blocks=(1,), spy=None) -> list[dict]:
    """The selected CogVideoX blocks run through ToMe's replacements on the batch of ``rows`` of
    ``inputs`` (one model call: one context)."""
    layout = TokenLayout(GRID, (TEXT + N, TEXT), None)
    tiles = make_tiles(GRID, patch.strides, torch.Generator().manual_seed(3), "cpu")
    context = call_context(True, layout=layout, tiles=tiles, r=merged_count(tiles, 0.5), left=frozenset(), plans={},
                           **{SHARED_PLAN: None})
    args = {"img": inputs["img"][rows], "txt": inputs["txt"][rows], "vec": inputs["vec"][rows], "pe": inputs["pe"],
            "transformer_options": {"ctx": context}}

    def original(a):
        if spy is not None:
            spy.append(a)
        return _cogvideox_block(a)
    return [patch.replacement("double_block", i, None)(args, {"original_block": original}) for i in blocks]


def _cogvideox_inputs(batch: int = 2) -> dict:
    g = torch.Generator().manual_seed(0)
    angles = torch.rand(N, WIDTH, generator=g) * 6
    return {"img": torch.randn(batch, N, WIDTH, generator=g), "txt": torch.randn(batch, TEXT, WIDTH, generator=g),
            "vec": torch.rand(batch, WIDTH, generator=g) + 0.5, "pe": (angles.cos(), angles.sin())}


# --- point 4: a row's merge does not depend on its batch -------------------------------------------
@pytest.mark.parametrize("share_plans", [True, False])
def test_one_rotary_table_for_the_batch_rows_batched_or_alone_give_the_same_output(share_plans):
    """CogVideoX's blocks take one rotary table for the batch: ComfyUI batches cond and uncond or
    not (free memory decides), and each row's output is the same either way, bit for bit (each
    row runs the block apart with its own plan: the block sees a batch of one in both cases)."""
    patch, inputs = _cogvideox_patch(share_plans), _cogvideox_inputs()
    batched = _cogvideox_call(patch, [0, 1], inputs)[0]
    for row in (0, 1):
        alone = _cogvideox_call(patch, [row], inputs)[0]
        for name in ("img", "txt"):
            assert torch.equal(batched[name][row:row + 1], alone[name]), (name, row)
    unmerged = _cogvideox_block({**{k: v[[0, 1]] for k, v in inputs.items() if k != "pe"}, "pe": inputs["pe"]})
    assert not torch.equal(batched["img"], unmerged["img"])  # merged, not passed through


def test_per_row_blocks_are_each_handed_their_own_rows_plan_and_merged_table():
    patch, inputs, seen = _cogvideox_patch(), _cogvideox_inputs(3), []
    _cogvideox_call(patch, [0, 1, 2], inputs, spy=seen)
    assert len(seen) == 3 and all(a["img"].shape[0] == 1 and a["vec"].shape == (1, WIDTH) for a in seen)
    plans = [a["transformer_options"][MERGED_GRID] for a in seen]
    assert all(p.restore_map.shape[0] == 1 for p in plans)
    for a, plan in zip(seen, plans):  # each row's table: its own merged tokens' positions, no batch dimension
        assert torch.equal(a["pe"][0], inputs["pe"][0][plan.positions[0]])


# --- point 5: fp16 past its range ------------------------------------------------------------------
def _loud_fp16_tokens(c: int = 64) -> torch.Tensor:
    """fp16 tokens of Flux-like magnitude (values up to ~3e4, near ComfyUI's fp16 clamp): each
    token's norm is past 65504."""
    g = torch.Generator().manual_seed(1)
    return (torch.randn(1, 8, c, generator=g) * 1.5e4).clamp(-3e4, 3e4).half()


def test_fp16_plan_follows_similarity_past_fp16s_range():
    x = _loud_fp16_tokens()
    assert torch.isinf(x[0].norm(dim=-1)).all()  # what fp16 makes of these norms
    tiles = make_tiles((1, 2, 4), (1, 2, 2), None, "cpu")  # tile 0: positions 0, 1, 4, 5 (0 the destination)
    x[0, 5] = x[0, 0] * 0.5  # the same direction as its destination: merges first
    plan = plan_block(x, tiles, 1)
    assert plan.restore_map[0, 5] == plan.restore_map[0, 0]
    assert plan.restore_map[0, 1] != plan.restore_map[0, 0] and plan.restore_map[0, 4] != plan.restore_map[0, 0]
    assert plan.mask.dtype == torch.float32


def test_fp16_merge_averages_without_overflow_and_restores_in_fp16():
    x = _loud_fp16_tokens().abs()  # all one sign: a tile's sum is ~4 times a token's, past 65504
    tiles = make_tiles((1, 2, 4), (1, 2, 2), None, "cpu")
    plan = plan_block(x, tiles, tiles.sources)  # every source merges: one token per tile, its mean
    merged = merge(plan, x)
    assert merged.dtype == torch.float16 and torch.isfinite(merged).all()
    means = x[0].double().view(2, 2, 2, -1).permute(1, 0, 2, 3).reshape(2, 4, -1).mean(1)
    assert torch.allclose(merged[0].double(), means, rtol=1e-3)
    back = restore(plan, merged)
    assert back.dtype == torch.float16 and torch.isfinite(back).all()


def test_bf16_merges_in_bf16_and_matches_the_float32_merge():
    """bfloat16 has float32's range: its tokens are planned and averaged as they are (a float32
    copy of every merged token cost ToMe 6-15 % of its speed-up on an H100), the plan the same as
    float32's (the same sources merge) and the averages within bfloat16's rounding of them."""
    x = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(3))
    tiles = make_tiles((1, 8, 8), (1, 2, 2), None, "cpu")
    assert accumulating(torch.bfloat16) == torch.bfloat16 and accumulating(torch.float16) == torch.float32
    plan = plan_block(x, tiles, 20)
    exact = merge(plan, x)
    # which sources merge: the same (the order of the kept ones may differ where similarities tie in bf16)
    assert torch.equal(plan_block(x.bfloat16(), tiles, 20).mask, plan.mask)
    merged = merge(plan, x.bfloat16())
    assert merged.dtype == torch.bfloat16
    assert torch.allclose(merged.float(), exact, rtol=2 ** -7, atol=2 ** -7)


# --- point 6: a mask without rotary positions ------------------------------------------------------
def test_a_mask_is_merged_whether_or_not_rotary_positions_are_given():
    grid, text = (1, 4, 6), 5
    length = text + math.prod(grid)
    layout = TokenLayout(grid, (length, text), None)
    spec = BlockArgs("img", lambda lay: lay.joint, pe="pe", pe_dim=2, in_pe=lambda lay: lay.joint, mask="mask")
    x = torch.randn(2, length, 4, generator=torch.Generator().manual_seed(0))
    mask = torch.arange(length * length, dtype=torch.float32).view(1, 1, length, length)
    plan = plan_block(x[:, text:], make_tiles(grid, (1, 2, 2), None, "cpu"), 10)
    positions = torch.cat([torch.arange(text).expand(2, text), plan.positions + text], 1)
    pe = torch.arange(length, dtype=torch.float32).view(1, 1, length, 1)
    for given in ({"pe": None}, {}, {"pe": pe}):
        new, _ = merged_args(spec, layout, plan, {"img": x, "mask": mask, **given})
        assert new["mask"].shape == (2, 1, length - 10, length - 10), given
        assert torch.equal(new["mask"][:, 0], (positions[:, :, None] * length + positions[:, None, :]).float())


# --- point 10: what a plan implies, made once per plan ---------------------------------------------
def test_blocks_sharing_a_plan_are_handed_the_same_gathers():
    """Two merged blocks of one model call (share_plans): the second is handed the very tables
    the first was (made once per plan), and gives what a block given fresh ones gives."""
    patch, inputs, seen = _cogvideox_patch(), _cogvideox_inputs(1), []
    outs = _cogvideox_call(patch, [0], inputs, blocks=(1, 2), spy=seen)
    first, second = seen
    assert second["pe"][0] is first["pe"][0] and second["pe"][1] is first["pe"][1]
    plan = first["transformer_options"][MERGED_GRID]
    assert second["transformer_options"][MERGED_GRID] is plan
    fresh = tome_dit.run_merged_block(patch.merge.args["double_block"], TokenLayout(GRID, (TEXT + N, TEXT), None),
                                      plan._replace(gathers=None), {k: (v if k == "pe" else v[[0]])
                                                                    for k, v in inputs.items()},
                                      _cogvideox_block, "img")
    assert torch.equal(outs[1]["img"], fresh["img"]) and torch.equal(outs[1]["txt"], fresh["txt"])


def test_gathers_run_once_per_plan(monkeypatch):
    """positions, modulation and mask gathers (``take``) and sequence indices: the first block of
    a plan makes them, the next blocks (the same arguments) none; a new plan makes them again."""
    grid, text = (1, 4, 6), 5
    length = text + math.prod(grid)
    layout = TokenLayout(grid, (length, text), None)
    spec = BlockArgs("img", lambda lay: lay.joint, pe="pe", pe_dim=2, in_pe=lambda lay: lay.joint, mask="mask",
                     modulation="vec")
    g = torch.Generator().manual_seed(0)
    args = {"img": torch.randn(2, length, 4, generator=g), "pe": torch.randn(2, 1, length, 3, generator=g),
            "mask": torch.randn(2, length, length, generator=g), "vec": torch.randn(2, length, 3, generator=g)}
    counts = {"take": 0, "sequence_index": 0}
    for name in counts:
        def counted(*a, original=getattr(tome_dit, name), name=name):
            counts[name] += 1
            return original(*a)
        monkeypatch.setattr(tome_dit, name, counted)
    plan = plan_block(args["img"][:, text:], make_tiles(grid, (1, 2, 2), None, "cpu"), 10)
    outs = [tome_dit.run_merged_block(spec, layout, plan, args, lambda a: {"img": a["img"] * 2}, "img")
            for _ in range(3)]
    assert counts == {"take": 4, "sequence_index": 1}  # positions, modulation, the mask's columns and rows
    assert all(torch.equal(out["img"], outs[0]["img"]) for out in outs)
    tome_dit.run_merged_block(spec, layout, plan._replace(gathers={}), args, lambda a: {"img": a["img"]}, "img")
    assert counts == {"take": 8, "sequence_index": 2}


def test_a_block_that_edits_its_input_in_place_is_restored_as_one_that_does_not():
    """The block's change is taken from the merged grid tokens the block was not handed (no clone
    of its input is needed): a block adding to its input in place (Flux) gives the same output."""
    grid = (1, 4, 6)
    n = math.prod(grid)
    layout = TokenLayout(grid, None, (n, 0))
    spec = BlockArgs("img", lambda lay: lay.image)
    x = torch.randn(2, n, 4, generator=torch.Generator().manual_seed(0))
    plan = plan_block(x, make_tiles(grid, (1, 2, 2), None, "cpu"), 10)

    def in_place(a):
        img = a["img"]
        img += img.tanh()
        return {"img": img}
    expected = tome_dit.run_merged_block(spec, layout, plan, {"img": x}, lambda a: {"img": a["img"] + a["img"].tanh()},
                                         "img")
    assert torch.equal(tome_dit.run_merged_block(spec, layout, plan, {"img": x}, in_place, "img")["img"],
                       expected["img"])


# --- point 12: what the project imports, it declares -----------------------------------------------
def _third_party_imports(root: Path) -> set[str]:
    names = set()
    for path in root.rglob("*.py"):
        if "diffusers" in path.relative_to(REPO).parts[1:]:  # the diffusers adapter: an optional extra
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {name for name in names if name not in sys.stdlib_module_names and name != "tokenreduce"}


def _requirement_names(lines) -> set[str]:
    names = set()
    for line in lines:
        requirement = line.split("#")[0].strip()
        for stop in "<>=!~;[ ":
            requirement = requirement.split(stop)[0]
        if requirement:
            names.add(requirement.lower())
    return names


def test_every_package_the_core_imports_is_declared():
    """``filelock`` (the auto rule's decisions file) arrives through torch today, but is the pack's
    own dependency: declared in pyproject.toml and in requirements.txt (ComfyUI's installers read
    it; torch itself is the host's)."""
    imported = _third_party_imports(REPO / "tokenreduce")
    assert "filelock" in imported
    project = _requirement_names(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])
    requirements = _requirement_names((REPO / "requirements.txt").read_text().splitlines())
    assert imported <= project, imported - project
    assert imported - {"torch"} <= requirements, imported - {"torch"} - requirements


def test_the_shared_plan_kept_for_a_step_is_the_ratios_or_else_the_milder_ones():
    """plan_every finds a step's plans again by a shared plan: the node's ratio's, or where the
    budget merges every block at its milder ratio, that one (else every step planned anew)."""
    ratio, milder = object(), object()
    difference = ("whole minus merged", ("single", 0))
    assert tome_dit.shared_plan({tome_dit.SHARED_PLAN: ratio, (tome_dit.SHARED_PLAN, 12): milder}) is ratio
    assert tome_dit.shared_plan({difference: object(), (tome_dit.SHARED_PLAN, 12): milder}) is milder
    assert tome_dit.shared_plan({difference: object()}) is None and tome_dit.shared_plan({}) is None
