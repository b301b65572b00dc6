"""The ToMe node on the real ComfyUI, in-process: a real ModelPatcher around a real (tiny,
random-weight) UNetModel of each family, sampled with comfy.sample."""

from __future__ import annotations

import pytest
import torch

FAMILIES = ["SD15", "SD21", "SDXL"]
DEFAULTS = dict(ratio=0.5, stride_x=2, stride_y=2, max_downsample="auto", mode="q, k, v (tomesd)", merge_attn=True,
                merge_crossattn=False, merge_mlp=False, use_rand=True, seed=0, start_percent=0.0, end_percent=1.0)


@pytest.fixture(scope="module")
def models(comfy):
    return {family: comfy.models.make_model(family, tiny=True, seed=0) for family in FAMILIES}


def tome(comfy, model, **overrides):
    return comfy.pack.ToMePatchNode.execute(model, **{**DEFAULTS, **overrides})


def patched(comfy, model, **overrides):
    return tome(comfy, model, **overrides).result[0]


def sample(comfy, model, family="SD15", *, steps=2, size=(32, 32), batch=1, cfg=5.0, seed=0, denoise=1.0,
           latent=None, positive=None, negative=None, noise=None):
    if noise is None:
        noise = torch.randn(batch, 4, *size, generator=torch.Generator().manual_seed(seed))
    if latent is None:
        latent = torch.zeros_like(noise)
    positive = positive or comfy.models.conditioning(family, True, seed=1)
    negative = negative or comfy.models.conditioning(family, True, seed=2)
    return comfy.sample.sample(model, noise, steps, cfg, "euler", "normal", positive, negative, latent,
                               denoise=denoise, disable_pbar=True, seed=seed)


def spy_attn1(model, records):
    """A clone of model with a probe after every other attn1 patch: it records what
    self-attention receives in each block call."""
    probe = model.clone()

    def record(n, context, value, extra):
        records.append({"block": extra["block"], "grid": tuple(extra["activations_shape"][-2:]),
                        "queries": n.shape[1], "keys": context.shape[1]})
        return n, context, value

    probe.set_model_attn1_patch(record)
    return probe


def rel_error(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("family", FAMILIES)
def test_rerun_is_bit_identical_and_differs_from_unpatched(comfy, models, family):
    base = models[family]
    model = patched(comfy, base)
    first = sample(comfy, model, family)
    assert torch.equal(first, sample(comfy, model, family))
    # A fresh node execution (what a re-queued workflow does) gives the same result.
    assert torch.equal(first, sample(comfy, patched(comfy, base), family))
    assert torch.isfinite(first).all()
    assert rel_error(first, sample(comfy, base, family)) > 1e-3


def test_seed_changes_the_partition(comfy, models):
    base = models["SD15"]
    a = sample(comfy, patched(comfy, base, seed=0))
    b = sample(comfy, patched(comfy, base, seed=1))
    assert not torch.equal(a, b)
    # Without random targets the seed does not matter.
    c = sample(comfy, patched(comfy, base, use_rand=False, seed=0))
    d = sample(comfy, patched(comfy, base, use_rand=False, seed=1))
    assert torch.equal(c, d)


def test_global_rng_is_untouched_unlike_the_builtin(comfy, models):
    from comfy_extras.nodes_tomesd import TomePatchModel

    base = models["SD15"]

    def rng_after(model):
        torch.manual_seed(1234)
        sample(comfy, model)
        return torch.get_rng_state()

    unpatched_state = rng_after(base)
    assert torch.equal(rng_after(patched(comfy, base)), unpatched_state)
    # ComfyUI's built-in draws its partitions from the global RNG: it shifts every later
    # consumer's stream, and identical runs differ unless something reseeds in between.
    builtin = TomePatchModel.execute(base, 0.5).result[0]
    assert not torch.equal(rng_after(builtin), unpatched_state)
    torch.manual_seed(5)
    run1 = sample(comfy, builtin)
    run2 = sample(comfy, builtin)
    assert not torch.equal(run1, run2)


def test_input_model_is_never_mutated(comfy, models):
    base = models["SD15"]
    options_before = repr(base.model_options)
    reference = sample(comfy, base)
    model = patched(comfy, base, merge_crossattn=True, merge_mlp=True)
    assert model is not base
    assert model.object_patches and not base.object_patches  # MLP merging is an object patch
    merged = sample(comfy, model)
    assert rel_error(merged, reference) > 1e-3
    assert torch.equal(sample(comfy, base), reference)
    assert repr(base.model_options) == options_before
    assert not any(base.wrappers.values())


def _session(model):
    patch = model.model_options["transformer_options"]["patches"]["attn1_patch"][0]
    return patch.__self__.session


def test_interrupted_run_then_rerun_equals_a_clean_run(comfy, models):
    import comfy.model_management as mm

    base = models["SD15"]
    model = patched(comfy, base, merge_crossattn=True, merge_mlp=True)
    clean = sample(comfy, patched(comfy, base, merge_crossattn=True, merge_mlp=True))
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
    assert _session(model).run is None  # per-run state released despite the interrupt
    assert torch.equal(sample(comfy, model), clean)


def test_ratio_zero_is_exactly_unpatched(comfy, models):
    base = models["SD15"]
    assert torch.equal(sample(comfy, patched(comfy, base, ratio=0.0)), sample(comfy, base))


def test_step_window(comfy, models):
    base = models["SD15"]
    unpatched = sample(comfy, base, steps=4)
    # A window before the first step: never active, exactly the unpatched result.
    assert torch.equal(sample(comfy, patched(comfy, base, start_percent=0.0, end_percent=0.0), steps=4), unpatched)
    full = sample(comfy, patched(comfy, base), steps=4)
    first_half = sample(comfy, patched(comfy, base, end_percent=0.5), steps=4)
    assert not torch.equal(first_half, unpatched) and not torch.equal(first_half, full)
    records = []
    sample(comfy, spy_attn1(patched(comfy, base, start_percent=0.5), records), steps=4)
    merged_calls = [r for r in records if r["queries"] < r["grid"][0] * r["grid"][1]]
    assert 0 < len(merged_calls) < len([r for r in records if r["grid"] == (32, 32)])


@pytest.mark.parametrize("family,max_downsample,merged_grids", [
    ("SD15", "auto", {(32, 32)}),
    ("SD15", "2", {(32, 32), (16, 16)}),
    ("SDXL", "auto", {(16, 16)}),  # SDXL has no attention at downsample 1
    ("SDXL", "4", {(16, 16), (8, 8)}),
])
def test_levels_patched_and_token_counts(comfy, models, family, max_downsample, merged_grids):
    records = []
    sample(comfy, spy_attn1(patched(comfy, models[family], max_downsample=max_downsample), records), family, steps=1)
    seen = {r["grid"] for r in records if r["queries"] < r["grid"][0] * r["grid"][1]}
    assert seen == merged_grids
    for r in records:
        tokens = r["grid"][0] * r["grid"][1]
        expected = tokens - int(tokens * 0.5) if r["grid"] in merged_grids else tokens
        assert r["queries"] == expected and r["keys"] == expected  # full mode: q, k, v merged


def test_queries_only_mode_keeps_keys_full(comfy, models):
    base = models["SD15"]
    records = []
    queries_only = patched(comfy, base, mode="queries only (ComfyUI built-in)")
    sample(comfy, spy_attn1(queries_only, records), steps=1)
    level1 = [r for r in records if r["grid"] == (32, 32)]
    assert level1 and all(r["queries"] == 512 and r["keys"] == 1024 for r in level1)
    unpatched = sample(comfy, base)
    assert rel_error(sample(comfy, queries_only), unpatched) < rel_error(sample(comfy, patched(comfy, base)), unpatched)


def test_cross_attention_and_mlp_merging(comfy, models):
    base = models["SD15"]
    attn_only = sample(comfy, patched(comfy, base))
    with_cross = sample(comfy, patched(comfy, base, merge_crossattn=True))
    with_mlp = sample(comfy, patched(comfy, base, merge_mlp=True))
    assert not torch.equal(with_cross, attn_only) and not torch.equal(with_mlp, attn_only)
    records = []
    probe = patched(comfy, base, merge_attn=False, merge_crossattn=True).clone()
    probe.set_model_attn2_patch(lambda n, c, v, extra: (records.append((n.shape[1], c.shape[1])) or (n, c, v)))
    sample(comfy, probe, steps=1)
    assert (512, 77) in records and (1024, 77) not in records  # level-1 queries merged, text keys untouched


@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_batch_items_match_single_runs(comfy, models, batch):
    base = models["SD15"]
    model = patched(comfy, base)
    noise = torch.randn(batch, 4, 32, 32, generator=torch.Generator().manual_seed(9))
    together = sample(comfy, model, noise=noise)
    for i in range(batch):
        alone = sample(comfy, model, noise=noise[i:i + 1])
        # Same partition, merges per item; only BLAS rounding of the batched similarity can
        # flip a near-tie, far below the effect of merging itself.
        assert rel_error(together[i:i + 1], alone) < 1e-3 < rel_error(alone, sample(comfy, base, noise=noise[i:i + 1]))


def test_split_cond_uncond_calls_match_one_batched_call(comfy, models):
    """ComfyUI splits cond and uncond into separate UNet calls when memory is short; the
    partition must not depend on that (it is derived from seed, step and block)."""
    from comfy.samplers import calc_cond_batch

    base = models["SD15"]
    model = patched(comfy, base)
    batched = sample(comfy, model)
    split = model.clone()
    split.set_model_sampler_calc_cond_batch_function(
        lambda args: [calc_cond_batch(args["model"], [c], args["input"], args["sigma"],
                                                     args["model_options"])[0] for c in args["conds"]])
    assert rel_error(sample(comfy, split), batched) < 1e-3 < rel_error(batched, sample(comfy, base))


def test_cfg_one(comfy, models):
    base = models["SD15"]
    model = patched(comfy, base)
    a = sample(comfy, model, cfg=1.0)
    assert torch.equal(a, sample(comfy, model, cfg=1.0))
    assert rel_error(a, sample(comfy, base, cfg=1.0)) > 1e-3


def test_area_conditioning(comfy, models):
    """Several UNet calls of different shapes in one step."""
    base = models["SD15"]
    c_full, c_area = comfy.models.conditioning("SD15", True, seed=1), comfy.models.conditioning("SD15", True, seed=5)
    positive = [c_full[0], [c_area[0][0], {"area": (16, 24, 8, 0), "strength": 1.0}]]
    records = []
    model = patched(comfy, base)
    a = sample(comfy, spy_attn1(model, records), positive=positive)
    assert {(32, 32), (16, 24)} <= {r["grid"] for r in records if r["queries"] < r["grid"][0] * r["grid"][1]}
    assert torch.isfinite(a).all()
    assert torch.equal(a, sample(comfy, model, positive=positive))
    assert rel_error(a, sample(comfy, base, positive=positive)) > 1e-3


def test_img2img(comfy, models):
    base = models["SD15"]
    model = patched(comfy, base)
    start = comfy.models.smooth_latent(1, 32, 32)
    a = sample(comfy, model, latent=start, denoise=0.5, steps=4)
    assert torch.equal(a, sample(comfy, model, latent=start, denoise=0.5, steps=4))
    assert rel_error(a, sample(comfy, base, latent=start, denoise=0.5, steps=4)) > 1e-4


@pytest.mark.parametrize("family,merged_grid", [("SD15", (65, 97)), ("SDXL", (33, 49))])
def test_odd_non_square_size(comfy, models, family, merged_grid):
    """520x776 px: a 65x97 latent, with 33x49 and 17x25 grids further down."""
    records = []
    out = sample(comfy, spy_attn1(patched(comfy, models[family]), records), family, size=(65, 97), steps=1)
    assert torch.isfinite(out).all()
    merged = {r["grid"] for r in records if r["queries"] < r["grid"][0] * r["grid"][1]}
    assert merged == {merged_grid}


def test_model_without_unet_transformers_is_returned_unchanged(comfy):
    dit = comfy.models.make_dit()
    out = tome(comfy, dit)
    assert out.result[0] is dit
    assert "no UNet transformer blocks" in out.result[1] and "SD3" in out.result[1]


def test_sdxl_with_max_downsample_one_says_it_does_nothing(comfy, models):
    out = tome(comfy, models["SDXL"], max_downsample="1")
    assert out.result[0] is models["SDXL"]
    assert out.result[1].startswith("WARNING") and "downsample 2, 4" in out.result[1]


def test_info_reports_what_was_patched(comfy, models):
    info = tome(comfy, models["SDXL"]).result[1]
    assert "SDXL" in info and "max_downsample 2" in info and "5 of 16 transformer blocks" in info


@pytest.mark.parametrize("overrides,message", [
    (dict(ratio=0.9), "at most 1 - 1/(2*2) = 0.75"),
    (dict(ratio=0.6, stride_x=1, stride_y=2), "= 0.5"),
    (dict(merge_attn=False), "nothing to merge"),
    (dict(start_percent=0.6, end_percent=0.4), "after end_percent"),
    (dict(ratio=1.2), "ratio 1.2 is out of range"),
    (dict(stride_y=9), "stride_y 9 is out of range"),
    (dict(max_downsample="16"), "max_downsample '16' is not one of"),
    (dict(mode="keys"), "mode 'keys' is not one of"),
])
def test_bad_settings_are_rejected(comfy, models, overrides, message):
    settings = {**DEFAULTS, **overrides}
    node = comfy.pack.ToMePatchNode
    problem = node.validate_inputs(**{k: v for k, v in settings.items() if k not in ("use_rand", "seed")})
    assert isinstance(problem, str) and message in problem
    with pytest.raises(ValueError, match="TokenReduceToMe"):
        tome(comfy, models["SD15"], **overrides)


def test_a_ratio_at_the_cap_is_accepted(comfy, models):
    settings = {k: v for k, v in {**DEFAULTS, "ratio": 0.75}.items() if k not in ("use_rand", "seed")}
    assert comfy.pack.ToMePatchNode.validate_inputs(**settings) is True
