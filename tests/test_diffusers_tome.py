"""ToMe on diffusers pipelines equals tomesd 0.1.3 (the reference: `tomesd.apply_patch(pipe)`),
on tiny random-weight SD1.5- and SDXL-shaped pipelines built from config (nothing downloaded).

tomesd's random merge targets come from a copy of the global RNG (and are turned off for odd
batches), which no reproducible patch can match; the comparison runs with top-left targets
(``use_rand=False``), where the two must agree bit for bit. Our own random targets are checked
for what they promise instead: the same seed, the same images, the global RNG untouched."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
tomesd = pytest.importorskip("tomesd")

from tokenreduce.diffusers import apply_patch, tiny  # noqa: E402

SIZE = 64  # px: an 8x8 latent


@pytest.fixture(scope="module")
def pipes():
    return {"SD15": tiny.pipeline(sdxl=False), "SDXL": tiny.pipeline(sdxl=True)}


def _run(pipe, batch: int, guidance: float) -> torch.Tensor:
    return tiny.generate(pipe, batch=batch, steps=2, guidance=guidance, size=SIZE)


PROPORTIONAL = "q, k, v + proportional attention"


def _tomesd(pipe, batch, guidance, **args) -> torch.Tensor:
    tomesd.apply_patch(pipe, use_rand=False, **args)
    try:
        return _run(pipe, batch, guidance)
    finally:
        tomesd.remove_patch(pipe)


@pytest.mark.parametrize("family,batch,guidance,args", [
    ("SD15", 1, 5.0, {}),  # CFG: cond and uncond in one batch of 2
    ("SD15", 2, 1.0, {}),  # no CFG, two prompts
    ("SD15", 1, 5.0, {"ratio": 0.3, "sx": 1, "sy": 2, "max_downsample": 2, "merge_crossattn": True, "merge_mlp": True}),
    ("SDXL", 1, 5.0, {"max_downsample": 2}),
    ("SDXL", 3, 5.0, {"max_downsample": 4, "merge_mlp": True}),
])
def test_same_latents_as_tomesd(pipes, family, batch, guidance, args):
    pipe = pipes[family]
    reference = _tomesd(pipe, batch, guidance, **{"ratio": 0.5, **args})
    ours = {"ratio": args.get("ratio", 0.5), "stride_x": args.get("sx", 2), "stride_y": args.get("sy", 2),
            "max_downsample": str(args.get("max_downsample", 1 if family == "SD15" else 2)),
            "merge_crossattn": args.get("merge_crossattn", False), "merge_mlp": args.get("merge_mlp", False)}
    with apply_patch(pipe, "ToMe", use_rand=False, **ours) as patch:
        merged = _run(pipe, batch, guidance)
        report = patch.report()
    assert torch.equal(merged, reference)
    assert report.levels and report.active_steps == (1, 2)
    assert not torch.equal(merged, _run(pipe, batch, guidance))  # it did merge


def test_same_as_tomesd_under_model_cpu_offload(pipes):
    pytest.importorskip("accelerate")
    pipe = tiny.pipeline(sdxl=False)
    reference = _tomesd(pipes["SD15"], 1, 5.0, ratio=0.5)
    pipe.enable_model_cpu_offload(device="cpu")
    with apply_patch(pipe, "ToMe", use_rand=False):
        assert torch.equal(_run(pipe, 1, 5.0), reference)


def test_random_targets_repeat_bit_for_bit_and_leave_the_global_rng_alone(pipes):
    pipe = pipes["SD15"]
    with apply_patch(pipe, "ToMe", seed=7):
        state = torch.get_rng_state()
        first = _run(pipe, 1, 5.0)
        assert torch.equal(torch.get_rng_state(), state)
        assert torch.equal(_run(pipe, 1, 5.0), first)
    with apply_patch(pipe, "ToMe", seed=8):
        assert not torch.equal(_run(pipe, 1, 5.0), first)


def test_queries_only_mode_keeps_keys_and_values_full(pipes):
    pipe = pipes["SD15"]
    seen = []
    attention = pipe.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1
    # always: the spy sees the pipeline's calls only, not max_change's measuring ones (on the CPU too)
    with apply_patch(pipe, "ToMe", mode="queries only (ComfyUI built-in)", reduce_when="always"):
        # Registered after the patch's own pre-hook: sees what the processor gets.
        hook = attention.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append((args[0].shape[1], kwargs.get("encoder_hidden_states"))),
            with_kwargs=True)
        try:
            _run(pipe, 1, 5.0)
        finally:
            hook.remove()
    assert seen and all(q == 32 and kv is not None and kv.shape[1] == 64 for q, kv in seen)


def test_the_packs_own_modes_run_and_repeat(pipes):
    """share_plans (one plan per level and call) and local matching are not tomesd's: they run on
    diffusers as in the nodes, repeat bit for bit, and share_plans changes the later blocks' plans."""
    pipe = pipes["SD15"]
    with apply_patch(pipe, "ToMe", use_rand=False):
        per_block = _run(pipe, 1, 5.0)
    with apply_patch(pipe, "ToMe", use_rand=False, share_plans=True, matching="3x3 cells") as patch:
        shared = _run(pipe, 1, 5.0)
        assert torch.equal(_run(pipe, 1, 5.0), shared)
        assert "one plan per level and model call" in patch.info
    assert not torch.equal(shared, per_block)


def test_proportional_attention_hands_each_merged_self_attention_its_key_sizes(pipes):
    pipe = pipes["SD15"]
    seen = []
    attention = pipe.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1
    unpatched = _run(pipe, 1, 5.0)
    with apply_patch(pipe, "ToMe", use_rand=False, reduce_when="always"):
        plain = _run(pipe, 1, 5.0)
    with apply_patch(pipe, "ToMe", use_rand=False, reduce_when="always", mode=PROPORTIONAL) as patch:
        hook = attention.register_forward_pre_hook(  # after the patch's own: what the processor gets
            lambda m, args, kwargs: seen.append((args[0].shape[1], kwargs.get("attention_mask"))), with_kwargs=True)
        try:
            weighed = _run(pipe, 1, 5.0)
            assert torch.equal(_run(pipe, 1, 5.0), weighed)  # reruns bit for bit
        finally:
            hook.remove()
        assert "proportional attention" in patch.info
    assert seen and all(q == 32 and mask is not None and mask.shape[1:] == (1, 32) for q, mask in seen)
    assert all(torch.allclose(mask.float().exp().sum(-1), torch.full((mask.shape[0], 1), 64.0)) for _, mask in seen)
    assert not torch.equal(weighed, plain)
    with apply_patch(pipe, "ToMe", ratio=0.0, reduce_when="always", mode=PROPORTIONAL):
        assert torch.equal(_run(pipe, 1, 5.0), unpatched)


@pytest.mark.parametrize("family", ["SD15", "SDXL"])
def test_tile_matching_runs_and_repeats(pipes, family):
    """matching "tile (fast)" (the DiT path's tile plan): the same on diffusers as in the nodes,
    bit for bit again, the global RNG untouched, other merges than tomesd's."""
    pipe = pipes[family]
    with apply_patch(pipe, "ToMe", use_rand=False):
        whole_grid = _run(pipe, 1, 5.0)
    state = torch.get_rng_state()
    with apply_patch(pipe, "ToMe", matching="tile (fast)", merge_mlp=True) as patch:
        tiled = _run(pipe, 1, 5.0)
        assert torch.equal(_run(pipe, 1, 5.0), tiled)
        assert "matching within each cell (tile, fast)" in patch.info
    assert torch.equal(torch.get_rng_state(), state)
    assert not torch.equal(tiled, whole_grid)


def test_min_similarity_merges_nothing_where_nothing_is_alike(pipes):
    """min_similarity (issue #50) on diffusers' UNets, as in the nodes: at 0.999 nothing on these
    random weights is alike enough, so the pipeline's image is unpatched's bit for bit."""
    pipe = pipes["SD15"]
    unpatched = _run(pipe, 1, 5.0)
    with apply_patch(pipe, "ToMe", min_similarity=0.999) as patch:
        assert torch.equal(_run(pipe, 1, 5.0), unpatched)
        assert "only tokens at least 0.999 alike" in patch.info


def test_plan_every_reuses_the_shared_plans_across_a_pipelines_steps(pipes, monkeypatch):
    """plan_every (as the nodes' rule): with share_plans a grid's plan is made on step 0 and reused
    on step 1 at 2 (4 steps: 2 plans per grid), made anew in every run, the same latents on
    reruns; the step is the scheduler's (no timestep read per call); plan_every 1 plans each step.
    correct_from_whole on a UNet is said to do nothing."""
    from tokenreduce.run import RunState
    from tokenreduce.tome_patch import ToMePatch

    pipe = pipes["SD15"]
    made, new_plan = [], ToMePatch._new_plan
    monkeypatch.setattr(ToMePatch, "_new_plan", lambda self, context, key, grid, level, n, ratio: made.append(grid) or
                        new_plan(self, context, key, grid, level, n, ratio))
    reads, step = [], RunState.step
    monkeypatch.setattr(RunState, "step", lambda self, sigmas: reads.append(sigmas) or step(self, sigmas))
    run = lambda: tiny.generate(pipe, steps=4, size=SIZE)  # noqa: E731
    with apply_patch(pipe, "ToMe", share_plans=True, use_rand=False, reduce_when="always"):
        every_step = run()
        per_run = len(made)
    made.clear()
    with apply_patch(pipe, "ToMe", share_plans=True, plan_every=2, use_rand=False, reduce_when="always"):
        first = run()
        assert len(made) == per_run // 2 and not reads
        assert torch.equal(run(), first) and len(made) == per_run  # a new run plans anew
    assert not torch.equal(first, every_step)
    with apply_patch(pipe, "ToMe", share_plans=True, plan_every=2, correct_from_whole=True) as patch:
        assert any("correct_from_whole does nothing on SD" in w for w in patch.warnings)
