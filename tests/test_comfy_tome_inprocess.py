"""ToMe-specific behaviour on the real ComfyUI, in-process (shared lifecycle tests live in
test_comfy_lifecycle_inprocess.py)."""

from __future__ import annotations

import pytest
import torch

from comfy_helpers import (TOME_DEFAULTS, apply, batching_tolerance, patched, reduced, rel_error, sample, spy_attn1,
                           split_cond_uncond)


def test_seed_changes_the_partition(comfy, models):
    base = models["SD15"]
    assert not torch.equal(sample(comfy, patched(comfy, "tome", base, seed=0)),
                           sample(comfy, patched(comfy, "tome", base, seed=1)))
    # Without random targets the seed does not matter.
    assert torch.equal(sample(comfy, patched(comfy, "tome", base, use_rand=False, seed=0)),
                       sample(comfy, patched(comfy, "tome", base, use_rand=False, seed=1)))


def test_builtin_tome_uses_the_global_rng_and_repeats_only_when_reseeded(comfy, models):
    """The contrast our determinism tests are about: ComfyUI's TomePatchModel."""
    from comfy_extras.nodes_tomesd import TomePatchModel

    base = models["SD15"]
    builtin = TomePatchModel.execute(base, 0.5).result[0]
    # It draws on the model's device: the global CUDA generator on a GPU.
    rng_state = torch.cuda.get_rng_state if torch.cuda.is_available() else torch.get_rng_state
    torch.manual_seed(1234)
    sample(comfy, base)
    unpatched_state = rng_state()
    torch.manual_seed(1234)
    sample(comfy, builtin)
    assert not torch.equal(rng_state(), unpatched_state)
    torch.manual_seed(5)
    assert not torch.equal(sample(comfy, builtin), sample(comfy, builtin))


def test_ratio_zero_is_exactly_unpatched(comfy, models):
    base = models["SD15"]
    assert torch.equal(sample(comfy, patched(comfy, "tome", base, ratio=0.0)), sample(comfy, base))


@pytest.mark.parametrize("family,max_downsample,merged_grids", [
    ("SD15", "auto", {(32, 32)}),
    ("SD15", "2", {(32, 32), (16, 16)}),
    ("SDXL", "auto", {(16, 16)}),  # SDXL has no attention at downsample 1
    ("SDXL", "4", {(16, 16), (8, 8)}),
])
def test_levels_patched_and_token_counts(comfy, models, family, max_downsample, merged_grids):
    records = []
    sample(comfy, spy_attn1(patched(comfy, "tome", models[family], max_downsample=max_downsample), records),
           family, steps=1)
    assert reduced(records) == merged_grids
    for r in records:
        tokens = r["grid"][0] * r["grid"][1]
        expected = tokens - int(tokens * 0.5) if r["grid"] in merged_grids else tokens
        assert r["queries"] == expected and r["keys"] == expected  # full mode: q, k, v merged


def test_queries_only_mode_keeps_keys_full(comfy, models):
    base = models["SD15"]
    records = []
    queries_only = patched(comfy, "tome", base, mode="queries only (ComfyUI built-in)")
    sample(comfy, spy_attn1(queries_only, records), steps=1)
    level1 = [r for r in records if r["grid"] == (32, 32)]
    assert level1 and all(r["queries"] == 512 and r["keys"] == 1024 for r in level1)
    # Which mode is closer to the unpatched model is measured on full-size models by the
    # benchmark; here: the two modes are different computations.
    assert not torch.equal(sample(comfy, queries_only), sample(comfy, patched(comfy, "tome", base)))


def test_cross_attention_and_mlp_merging(comfy, models):
    base = models["SD15"]
    attn_only = sample(comfy, patched(comfy, "tome", base))
    assert not torch.equal(sample(comfy, patched(comfy, "tome", base, merge_crossattn=True)), attn_only)
    assert not torch.equal(sample(comfy, patched(comfy, "tome", base, merge_mlp=True)), attn_only)
    records = []
    probe = patched(comfy, "tome", base, merge_attn=False, merge_crossattn=True).clone()
    probe.set_model_attn2_patch(lambda n, c, v, extra: (records.append((n.shape[1], c.shape[1])) or (n, c, v)))
    sample(comfy, probe, steps=1)
    assert (512, 77) in records and (1024, 77) not in records  # level-1 queries merged, text keys untouched


def test_mlp_merging_is_an_object_patch_of_the_clone_only(comfy, models):
    base = models["SD15"]
    model = patched(comfy, "tome", base, merge_mlp=True)
    assert len(model.object_patches) == 5 and all(k.endswith(".ff.forward") for k in model.object_patches)
    reference = sample(comfy, base)
    sample(comfy, model)
    assert torch.equal(sample(comfy, base), reference)


def test_info_reports_what_was_patched(comfy, models):
    info = apply(comfy, "tome", models["SDXL"]).result[1]
    assert "SDXL" in info and "max_downsample 2" in info and "5 of 16 transformer blocks" in info


PROPORTIONAL = "q, k, v + proportional attention"


def _attention_spy(model, calls: list):
    """A clone of ``model`` with an attention override installed before any node's: it keeps each
    call's (query count, key count, mask) and runs the call as given."""
    spied = model.clone()

    def spy(func, *args, **kwargs):
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        calls.append((args[0].shape[1], args[1].shape[1], None if mask is None else mask.clone()))
        return func(*args, **kwargs)

    spied.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = spy
    return spied


def test_proportional_attention_weighs_each_merged_key_by_its_tokens(comfy, models):
    base = models["SD15"]
    calls = []
    model = patched(comfy, "tome", _attention_spy(base, calls), mode=PROPORTIONAL)
    image = sample(comfy, model, steps=1)
    merged = [mask for queries, keys, mask in calls if queries == keys == 512]  # level 1: 1024 -> 512 tokens
    assert len(merged) == 5  # each of the level's blocks, one model call (cond and uncond batched)
    for mask in merged:  # handed on to the override before ours: a bias per key, every token counted once
        assert mask is not None and mask.shape[1:] == (1, 512)
        assert torch.allclose(mask.float().exp().sum(-1), torch.full((mask.shape[0], 1), 1024.0))
    assert all(mask is None for queries, keys, mask in calls if not queries == keys == 512)  # the rest as they came
    assert not torch.equal(image, sample(comfy, patched(comfy, "tome", base), steps=1))  # tomesd's q, k, v differ
    assert torch.equal(image, sample(comfy, model, steps=1))  # reruns bit for bit
    assert "proportional attention" in apply(comfy, "tome", base, mode=PROPORTIONAL).result[1]
    assert base.model_options.get("transformer_options", {}).get("optimized_attention_override") is None


def test_proportional_attention_with_nothing_merged_is_the_unpatched_model(comfy, models):
    base = models["SD15"]
    assert torch.equal(sample(comfy, patched(comfy, "tome", base, ratio=0.0, mode=PROPORTIONAL)), sample(comfy, base))


VALIDATED = ("ratio", "stride_x", "stride_y", "max_downsample", "mode", "merge_attn", "merge_crossattn", "merge_mlp",
             "start_percent", "end_percent", "matching", "stride_t")


@pytest.mark.parametrize("overrides,message", [
    (dict(ratio=0.9), "at most 1 - 1/(2*2) = 0.75"),
    (dict(ratio=0.6, stride_x=1, stride_y=2), "= 0.5"),
    (dict(merge_attn=False), "nothing to merge"),
    (dict(start_percent=0.6, end_percent=0.4), "after end_percent"),
    (dict(ratio=1.2), "ratio 1.2 is out of range"),
    (dict(stride_y=9), "stride_y 9 is out of range"),
    (dict(stride_x=0), "stride_x 0 is out of range"),
    (dict(max_downsample="16"), "max_downsample '16' is not one of"),
    (dict(mode="keys"), "mode 'keys' is not one of"),
    (dict(matching="everywhere"), "matching 'everywhere' is not one of"),
    (dict(stride_t=9), "stride_t 9 is out of range"),
    (dict(ratio=0.9, stride_t=2), "at most 1 - 1/(2*2*2) = 0.875"),
])
def test_bad_settings_are_rejected(comfy, models, overrides, message):
    settings = {k: v for k, v in {**TOME_DEFAULTS, **overrides}.items() if k in VALIDATED}
    problem = comfy.pack.ToMePatchNode.validate_inputs(**settings)
    assert isinstance(problem, str) and message in problem
    with pytest.raises(ValueError, match="TokenReduceToMe"):
        apply(comfy, "tome", models["SD15"], **overrides)


def test_a_ratio_at_the_cap_is_accepted(comfy):
    settings = {k: v for k, v in {**TOME_DEFAULTS, "ratio": 0.75}.items() if k in VALIDATED}
    assert comfy.pack.ToMePatchNode.validate_inputs(**settings) is True


def test_stride_t_on_a_unet_does_nothing_and_says_so(comfy, models):
    """A UNet has no latent frames: stride_t above 1 is reported, and a ratio only stride_t
    would make reachable (queued: the node does not know the model yet) is refused when it runs."""
    settings = {k: v for k, v in {**TOME_DEFAULTS, "ratio": 0.8, "stride_t": 2}.items() if k in VALIDATED}
    assert comfy.pack.ToMePatchNode.validate_inputs(**settings) is True
    with pytest.raises(ValueError, match=r"TokenReduceToMe: ratio 0\.8 cannot be reached on this SD15 model: it has "
                                         r"no latent frames, so stride_t 2 does nothing"):
        apply(comfy, "tome", models["SD15"], ratio=0.8, stride_t=2)
    output = apply(comfy, "tome", models["SD15"], stride_t=2)
    assert output.ui["tokenreduce"][0]["warnings"] == [
        "WARNING: stride_t 2 does nothing: SD15 has no latent frames (only video DiTs merge across frames)."]
    assert apply(comfy, "tome", models["SD15"]).ui["tokenreduce"][0]["warnings"] == []


def test_shared_plans_plan_once_per_level_and_model_call(comfy, models, monkeypatch):
    import sys

    module = sys.modules["tokenreduce_pack.tokenreduce.tome_patch"]
    calls = []
    original = module.plan_merge
    monkeypatch.setattr(module, "plan_merge", lambda n, w, h, *a: calls.append((h, w)) or original(n, w, h, *a))
    base = models["SD15"]
    # max_change 0: measuring the change for the budget runs a merged block (plans counted here)
    per_block = sample(comfy, patched(comfy, "tome", base, max_downsample="2", max_change=0.0), steps=1)
    blocks_calls, calls[:] = list(calls), []
    shared_model = patched(comfy, "tome", base, max_downsample="2", share_plans=True, max_change=0.0)
    shared = sample(comfy, shared_model, steps=1)
    # One UNet call (cond and uncond batched): one plan per grid, against one per block.
    assert sorted(calls) == [(16, 16), (32, 32)]
    assert len(blocks_calls) > len(calls) and set(blocks_calls) == set(calls)
    assert torch.equal(sample(comfy, shared_model, steps=1), shared)  # rerun: identical
    assert 0 < rel_error(shared, per_block) < 0.5


def test_shared_plans_do_not_cross_model_calls(comfy, models):
    """Split cond/uncond calls each plan for themselves: the result equals one batched call."""
    base = models["SD15"]
    model = patched(comfy, "tome", base, share_plans=True)
    tolerance = batching_tolerance(sample(comfy, split_cond_uncond(base)), sample(comfy, base))
    assert rel_error(sample(comfy, split_cond_uncond(model)), sample(comfy, model)) < tolerance


@pytest.mark.parametrize("matching,reach", [("whole grid (tomesd)", None), ("3x3 cells", 1), ("5x5 cells", 2)])
def test_matching_sets_how_far_each_token_looks(comfy, models, monkeypatch, matching, reach):
    import sys

    module = sys.modules["tokenreduce_pack.tokenreduce.tome_patch"]
    reaches = []
    original = module.plan_merge
    monkeypatch.setattr(module, "plan_merge",  # (metric, w, h, sx, sy, partition, r, reach, bound)
                        lambda *args: reaches.append(args[7]) or original(*args))
    base = models["SD15"]
    output = apply(comfy, "tome", base, matching=matching)
    assert f"matching in the {'whole grid' if reach is None else matching}" in output.result[1]
    out = sample(comfy, output.result[0], size=(32, 32))
    assert reaches and set(reaches) == {reach}
    assert torch.equal(out, sample(comfy, output.result[0], size=(32, 32)))  # deterministic
    # Nearby matching changes which pairs merge, not how far the output moves from unpatched.
    unpatched = sample(comfy, base, size=(32, 32))
    whole_grid = sample(comfy, patched(comfy, "tome", base), size=(32, 32))
    assert rel_error(out, unpatched) < 1.5 * rel_error(whole_grid, unpatched)


def test_a_workflow_without_matching_gets_tomesds_whole_grid(comfy, models):
    settings = dict(TOME_DEFAULTS)
    explicit = sample(comfy, patched(comfy, "tome", models["SD15"], matching="whole grid (tomesd)"))
    assert torch.equal(sample(comfy, patched(comfy, "tome", models["SD15"], **settings)), explicit)
    assert torch.equal(sample(comfy, patched(comfy, "tome", models["SD15"], matching=None)), explicit)


@pytest.mark.parametrize("family,grid", [("SD15", (32, 32)), ("SDXL", (16, 16))])
def test_tile_matching_plans_within_cells(comfy, models, monkeypatch, family, grid):
    """matching "tile (fast)": the DiT path's tile plan (no whole-grid similarity, no scatter),
    the same token counts, seeded, repeatable, the global RNG untouched, quality like tomesd's."""
    import sys

    module = sys.modules["tokenreduce_pack.tokenreduce.tome_patch"]
    tiled, whole = [], []
    plan_block, plan_merge = module.plan_block, module.plan_merge
    monkeypatch.setattr(module, "plan_block",
                        lambda x, *a, **k: tiled.append(x.shape[1]) or plan_block(x, *a, **k))
    monkeypatch.setattr(module, "plan_merge", lambda *a: whole.append(a) or plan_merge(*a))
    base = models[family]
    output = apply(comfy, "tome", base, matching="tile (fast)")
    assert "matching within each cell (tile, fast)" in output.result[1]
    records = []
    sample(comfy, spy_attn1(output.result[0], records), family, steps=1)
    tokens = grid[0] * grid[1]
    assert reduced(records) == {grid} and tiled and set(tiled) == {tokens} and not whole
    assert all(r["queries"] == r["keys"] == tokens - tokens // 2 for r in records if r["grid"] == grid)
    state = torch.get_rng_state()
    out = sample(comfy, output.result[0], family)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(out, sample(comfy, output.result[0], family))  # bit for bit
    assert not torch.equal(out, sample(comfy, patched(comfy, "tome", base, matching="tile (fast)", seed=1), family))
    unpatched = sample(comfy, base, family)
    whole_grid = sample(comfy, patched(comfy, "tome", base), family)
    assert rel_error(out, unpatched) < 1.5 * rel_error(whole_grid, unpatched)


def test_plan_every_reuses_the_shared_plans_across_steps(comfy, models, monkeypatch):
    """SD1.5, 3 steps, downsample 1 and 2 merged: one plan per grid and step with share_plans, one
    per grid every plan_every steps with it (steps 1 and 3 at 2), in both matchings' planners; split
    cond and uncond calls keep their own plans (the batched result); plan_every 1 is a workflow
    without it."""
    import sys

    module = sys.modules["tokenreduce_pack.tokenreduce.tome_patch"]
    made = []
    for planner in ("plan_merge", "plan_block"):  # whole grid (tomesd), tile (fast)
        monkeypatch.setattr(module, planner, lambda n, *a, original=getattr(module, planner), **k:
                            made.append(n.shape[0]) or original(n, *a, **k))
    base = models["SD15"]
    # max_change 0: measuring the change for the budget runs a merged block (plans counted here)
    settings = dict(max_downsample="2", share_plans=True, matching="tile (fast)", max_change=0.0)

    def run(model):
        return sample(comfy, model, steps=3, size=(16, 16))

    every_step = run(patched(comfy, "tome", base, **settings))
    assert made == [2] * 6
    assert torch.equal(run(patched(comfy, "tome", base, plan_every=1, **settings)), every_step)
    output = apply(comfy, "tome", base, plan_every=2, **settings)
    assert "one plan per level and model call, reused by the calls like it of the next step. " in output.result[1]
    reusing = output.result[0]
    for model in (patched(comfy, "tome", base, plan_every=2, **{**settings, "matching": "whole grid (tomesd)"}),
                  reusing):
        made.clear()
        first = run(model)
        assert made == [2] * 4
    assert 0 < rel_error(first, every_step) < 0.5
    made.clear()
    split = run(split_cond_uncond(reusing))
    assert made == [1] * 8
    tolerance = batching_tolerance(run(split_cond_uncond(base)), run(base))
    assert rel_error(split, first) < tolerance


def test_min_similarity_merges_only_what_is_alike(comfy, models):
    """min_similarity (issue #50): on a latent half flat, half noise, ratio 0.5 merges the half's
    count of alike tokens (fewer than ratio's), in both matchings; on noise alone, nothing is alike
    at 0.999: the image is unpatched's bit for bit; 0 is a workflow without it."""
    base = models["SD15"]
    noise = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    noise[..., :16] = noise[..., :16].mean(dim=(-2, -1), keepdim=True)  # the left half flat, per channel
    for matching in ("whole grid (tomesd)", "tile (fast)"):
        records = []
        sample(comfy, spy_attn1(patched(comfy, "tome", base, min_similarity=0.9, matching=matching), records),
               steps=1, noise=noise)
        merged = {1024 - r["keys"] for r in records if r["grid"] == (32, 32)}
        assert merged and all(0 < m < 512 and m % 64 == 0 for m in merged), merged  # eighths of ratio's 512
    output = apply(comfy, "tome", base, min_similarity=0.9)
    assert "ratio 0.5 at most, only tokens at least 0.9 alike to their target (min_similarity" in output.result[1]
    assert torch.equal(sample(comfy, patched(comfy, "tome", base, min_similarity=0.999)), sample(comfy, base))
    assert torch.equal(sample(comfy, patched(comfy, "tome", base, min_similarity=0.0)),
                       sample(comfy, patched(comfy, "tome", base)))


def test_min_similarity_is_timed_at_ratios_count_on_random_tokens(comfy, models, measuring, monkeypatch):
    """reduce_when auto times a UNet level's block on random tokens, where nothing is alike: its
    plans there merge ratio's count (the most a bounded merge does), not none, while the model's
    own calls at 0.999 merge nothing (the unpatched image)."""
    import sys

    module = sys.modules["tokenreduce_pack.tokenreduce.tome_patch"]
    merged, original = [], module.plan_cells
    monkeypatch.setattr(module, "plan_cells", lambda *a, **k: (lambda plan: merged.append(
        plan.tokens - plan.merged_tokens if not plan.is_identity else 0) or plan)(original(*a, **k)))
    measuring((10.0, 8.0))
    base = models["SD15"]
    out = sample(comfy, apply(comfy, "tome", base, min_similarity=0.999, reduce_when="auto").result[0])
    assert 512 in merged  # the timed block: ratio 0.5 of the 32x32 grid
    assert torch.equal(out, sample(comfy, base))
