"""What both patch nodes (ToMe and ToDo) must do on the real ComfyUI, in-process: a real
ModelPatcher around a real (tiny, random-weight) UNetModel of each family, sampled with
comfy.sample. Lifecycle, determinism and every situation users sample in."""

from __future__ import annotations

import pytest
import torch

from comfy_helpers import (apply, batching_tolerance, patched, reduced, rel_error, sample, session_of, spy_attn1,
                           split_cond_uncond)

NODES = ["tome", "todo"]
FAMILIES = ["SD15", "SD21", "SDXL"]
# The settings that reduce most: ToMe also merges for cross-attention and the MLP.
FULL = {"tome": dict(merge_crossattn=True, merge_mlp=True), "todo": dict(factor_next=2.0)}


@pytest.mark.parametrize("node", NODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_rerun_is_bit_identical_and_differs_from_unpatched(comfy, models, node, family):
    base = models[family]
    model = patched(comfy, node, base)
    first = sample(comfy, model, family)
    assert torch.equal(first, sample(comfy, model, family))
    # A fresh node execution (what a re-queued workflow does) gives the same result.
    assert torch.equal(first, sample(comfy, patched(comfy, node, base), family))
    assert torch.isfinite(first).all()
    assert rel_error(first, sample(comfy, base, family)) > 1e-3


@pytest.mark.parametrize("node", NODES)
def test_global_rng_is_untouched(comfy, models, node):
    base = models["SD15"]

    def rng_after(model):
        torch.manual_seed(1234)
        sample(comfy, model)
        return torch.get_rng_state()

    assert torch.equal(rng_after(patched(comfy, node, base)), rng_after(base))


@pytest.mark.parametrize("node", NODES)
def test_input_model_is_never_mutated(comfy, models, node):
    base = models["SD15"]
    options_before = repr(base.model_options)
    reference = sample(comfy, base)
    model = patched(comfy, node, base, **FULL[node])
    assert model is not base
    assert rel_error(sample(comfy, model), reference) > 1e-3
    assert torch.equal(sample(comfy, base), reference)
    assert repr(base.model_options) == options_before
    assert not base.object_patches and not any(base.wrappers.values())


@pytest.mark.parametrize("node", NODES)
def test_interrupted_run_then_rerun_equals_a_clean_run(comfy, models, node):
    import comfy.model_management as mm

    base = models["SD15"]
    model = patched(comfy, node, base, **FULL[node])
    clean = sample(comfy, patched(comfy, node, base, **FULL[node]))
    calls = []

    def interrupt_inside_a_block(n, context, value, extra):
        # Runs after our attn1 patch: the exception lands between merge and unmerge.
        calls.append(1)
        if len(calls) == 7:
            raise mm.InterruptProcessingException()
        return n, context, value

    doomed = model.clone()
    doomed.set_model_attn1_patch(interrupt_inside_a_block)
    with pytest.raises(mm.InterruptProcessingException):
        sample(comfy, doomed)
    assert session_of(model).run is None  # per-run state released despite the interrupt
    assert torch.equal(sample(comfy, model), clean)


@pytest.mark.parametrize("node", NODES)
def test_a_window_before_the_first_step_is_exactly_unpatched(comfy, models, node):
    base = models["SD15"]
    never = patched(comfy, node, base, start_percent=0.0, end_percent=0.0)
    assert torch.equal(sample(comfy, never, steps=4), sample(comfy, base, steps=4))


@pytest.mark.parametrize("node", NODES)
def test_step_window_limits_the_active_steps(comfy, models, node):
    base = models["SD15"]
    unpatched, full = sample(comfy, base, steps=4), sample(comfy, patched(comfy, node, base), steps=4)
    first_half = sample(comfy, patched(comfy, node, base, end_percent=0.5), steps=4)
    assert not torch.equal(first_half, unpatched) and not torch.equal(first_half, full)
    records = []
    sample(comfy, spy_attn1(patched(comfy, node, base, start_percent=0.5), records), steps=4)
    reduced_calls = [r for r in records if r["keys"] < r["grid"][0] * r["grid"][1]]
    assert 0 < len(reduced_calls) < len([r for r in records if r["grid"] == (32, 32)])


@pytest.mark.parametrize("node", NODES)
@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_batch_items_match_single_runs(comfy, models, node, batch):
    base = models["SD15"]
    model = patched(comfy, node, base)
    noise = torch.randn(batch, 4, 32, 32, generator=torch.Generator().manual_seed(9))
    together, base_together = sample(comfy, model, noise=noise), sample(comfy, base, noise=noise)
    for i in range(batch):
        alone, base_alone = sample(comfy, model, noise=noise[i:i + 1]), sample(comfy, base, noise=noise[i:i + 1])
        # Same partition, merges per item; only the host's rounding, which differs with the
        # batch size, can flip a near-tie of ToMe's similarities: far below the patch's effect.
        tolerance = batching_tolerance(base_together[i:i + 1], base_alone)
        assert rel_error(together[i:i + 1], alone) < tolerance < rel_error(alone, base_alone)


@pytest.mark.parametrize("node", NODES)
def test_split_cond_uncond_calls_match_one_batched_call(comfy, models, node):
    """ComfyUI splits cond and uncond into separate UNet calls when memory is short; the result
    must not depend on that (ToMe's partition derives from seed, step and block)."""
    base = models["SD15"]
    batched, base_batched = sample(comfy, patched(comfy, node, base)), sample(comfy, base)
    tolerance = batching_tolerance(sample(comfy, split_cond_uncond(base)), base_batched)
    split = split_cond_uncond(patched(comfy, node, base))
    assert rel_error(sample(comfy, split), batched) < tolerance < rel_error(batched, base_batched)


@pytest.mark.parametrize("node", NODES)
def test_cfg_one(comfy, models, node):
    base = models["SD15"]
    model = patched(comfy, node, base)
    a = sample(comfy, model, cfg=1.0)
    assert torch.equal(a, sample(comfy, model, cfg=1.0))
    assert rel_error(a, sample(comfy, base, cfg=1.0)) > 1e-3


@pytest.mark.parametrize("node", NODES)
def test_area_conditioning(comfy, models, node):
    """Several UNet calls of different shapes in one step."""
    base = models["SD15"]
    c_full, c_area = comfy.models.conditioning("SD15", True, seed=1), comfy.models.conditioning("SD15", True, seed=5)
    positive = [c_full[0], [c_area[0][0], {"area": (16, 24, 8, 0), "strength": 1.0}]]
    records = []
    model = patched(comfy, node, base)
    a = sample(comfy, spy_attn1(model, records), positive=positive)
    assert {(32, 32), (16, 24)} <= reduced(records, "keys")
    assert torch.isfinite(a).all()
    assert torch.equal(a, sample(comfy, model, positive=positive))
    assert rel_error(a, sample(comfy, base, positive=positive)) > 1e-3


@pytest.mark.parametrize("node", NODES)
def test_img2img(comfy, models, node):
    base = models["SD15"]
    model = patched(comfy, node, base)
    start = comfy.models.smooth_latent(1, 32, 32)
    a = sample(comfy, model, latent=start, denoise=0.5, steps=4)
    assert torch.equal(a, sample(comfy, model, latent=start, denoise=0.5, steps=4))
    assert rel_error(a, sample(comfy, base, latent=start, denoise=0.5, steps=4)) > 1e-4


@pytest.mark.parametrize("node", NODES)
@pytest.mark.parametrize("family,reduced_grid", [("SD15", (65, 97)), ("SDXL", (33, 49))])
def test_odd_non_square_size(comfy, models, node, family, reduced_grid):
    """520x776 px: a 65x97 latent, with 33x49 and 17x25 grids further down."""
    records = []
    out = sample(comfy, spy_attn1(patched(comfy, node, models[family]), records), family, size=(65, 97), steps=1)
    assert torch.isfinite(out).all()
    assert reduced(records, "keys") == {reduced_grid}


def test_tome_refuses_a_dit_it_does_not_merge_and_points_to_todo(comfy):
    import random_dits  # devtools/, on the path in the host (conftest)

    # SD3, Flux, Wan, Lumina 2, HiDream, ... are merged (#38); Cosmos Predict2's blocks take a 5-D grid
    dit = random_dits.make_dit("cosmos_predict2_t2i")
    with pytest.raises(ValueError, match="cannot patch this CosmosT2IPredict2 model: it has no UNet transformer blocks"
                       ) as refused:
        apply(comfy, "tome", dit)
    assert "use Token Downsampling (ToDo, TokenReduce), which supports Cosmos Predict2 image" in str(refused.value)


@pytest.mark.parametrize("node,setting", [("tome", "max_downsample"), ("todo", "level")])
def test_sdxl_at_level_one_says_it_does_nothing(comfy, models, node, setting):
    out = apply(comfy, node, models["SDXL"], **{setting: "1"})
    assert out.result[0] is models["SDXL"]
    assert out.result[1].startswith("WARNING") and "downsample 2, 4" in out.result[1]
