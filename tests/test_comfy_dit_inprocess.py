"""ToDo on DiTs in the real ComfyUI, in-process, on tiny random-weight models of every supported
variant (devtools/random_dits.py): what it reduces, what it leaves alone, what it says, what it
refuses, and how it combines with the step caches and torch.compile.

Each variant runs 2 euler steps at CFG 2 (cond and uncond batched in one model call). A probe
installed as the attention override before ToDo (as SageAttention-style nodes do) records every
attention call; ToDo must chain to it, so the probe sees the keys ToDo passes on. The expected
calls of one model call are written out per variant from the models' code (see the research
notes in REPORT.md of the DiT work): ``g`` a grid call (self-attention over the image or video
tokens, joint with text or image-only), ``-`` one ToDo must leave alone (text refiners,
cross-attention to text or CLIP-vision tokens)."""

from __future__ import annotations

import math
import re
import sys

import pytest
import torch

import random_dits
import random_models
from comfy_helpers import apply, rel_error, session_of

# random_dits.tested_size: 128x96 px, 16x12 latent (8x6 for Flux.2): an 8x6 token grid; a video 3 latent
# frames of 8x6 tokens (4x3 for Wan 2.2 5B, LTX-Video, MiniMax-H3)
IMAGE = random_dits.tested_size("flux_dev")
ALL_BLOCKS = dict(skip_first_blocks=0, skip_last_blocks=0)  # the tiny models have 1 or 2 blocks

# variant -> (host config, family as the node names it, blocks, calls of one model call, token grid)
VARIANTS = {
    "flux_dev": ("Flux", "Flux.1", 2, "gg", (8, 6)),
    "flux_schnell": ("FluxSchnell", "Flux.1", 2, "gg", (8, 6)),
    "flux_kontext": ("Flux", "Flux.1", 2, "gg", (8, 6)),  # + a 4x3 reference grid after the image
    "chroma": ("Chroma", "Chroma", 2, "gg", (8, 6)),
    "flux2": ("Flux2", "Flux.2", 2, "gg", (8, 6)),  # text padded to 512 tokens
    "qwen_image": ("QwenImage", "Qwen-Image", 1, "g", (8, 6)),
    "qwen_image_edit": ("QwenImage", "Qwen-Image", 1, "g", (8, 6)),
    "lumina2": ("Lumina2", "Lumina 2 / Z-Image", 2, "-gg", (8, 6)),  # caption refiner, noise refiner, joint
    "z_image": ("ZImage", "Lumina 2 / Z-Image", 2, "-gg", (8, 6)),  # the same with pad tokens
    "sd3": ("SD3", "SD3 / SD3.5", 2, "gg", (8, 6)),
    "sd35_medium": ("SD3", "SD3 / SD3.5", 2, "ggg", (8, 6)),  # joint, image-only, joint
    "wan21_t2v": ("WAN21_T2V", "Wan 2.1 / 2.2", 2, "g-g-", (3, 8, 6)),  # self, cross (512 text tokens)
    "wan21_i2v": ("WAN21_I2V", "Wan 2.1 / 2.2", 2, "g--g--", (3, 8, 6)),  # self, CLIP-vision cross, text cross
    "wan22_t2v_a14b": ("WAN21_T2V", "Wan 2.1 / 2.2", 2, "g-g-", (3, 8, 6)),
    "wan22_i2v_a14b": ("WAN21_T2V", "Wan 2.1 / 2.2", 2, "g-g-", (3, 8, 6)),
    "wan22_ti2v_5b": ("WAN22_T2V", "Wan 2.1 / 2.2", 2, "g-g-", (3, 4, 3)),
    "hunyuan_video": ("HunyuanVideo", "HunyuanVideo", 2, "--gg", (3, 8, 6)),  # 2 text refiner calls, then joint
    "hunyuan_video_i2v": ("HunyuanVideoI2V", "HunyuanVideo", 2, "--gg", (3, 8, 6)),
    "hunyuan_video15": ("HunyuanVideo15", "HunyuanVideo", 2, "--gg", (3, 8, 6)),  # + byT5 tokens
    "hunyuan_video15_i2v": ("HunyuanVideo15", "HunyuanVideo", 2, "--gg", (3, 8, 6)),  # + byT5 and SigLIP tokens
}
# The families whose fixtures live in devtools/dit_fixtures/ bring their own row.
VARIANTS.update({name: (f.spec.config, f.family, f.blocks, f.calls, f.grid) for name, f in random_dits.FIXTURES.items()})
assert set(VARIANTS) == set(random_dits.FAMILIES)
# Models that never batch cond with uncond: MiniMax-H3 takes one batch item a call (each
# conditioning's payload holds its own packed layout), so a CFG step makes two model calls.
SEPARATE_CFG = {"minimax_h3", "minimax_h3_keyframe"}


def pack(name):
    return sys.modules[f"tokenreduce_pack.{name}"]


@pytest.fixture(scope="module")
def dits(comfy):
    """Tiny models, built once per module: dits(variant, **config overrides)."""
    built = {}

    def get(variant, **overrides):
        key = (variant, repr(sorted(overrides.items())))
        if key not in built:
            built[key] = random_dits.make_dit(variant, **overrides)
        return built[key]

    return get


def size_of(variant):
    return random_dits.tested_size(variant)


def run(comfy, model, variant, steps=2, cfg=2.0, seed=0, latent_seed=None):
    size = size_of(variant)
    positive, negative = random_dits.conditioning(variant, **size)
    latent = random_dits.latent(variant, **size)
    if latent_seed is not None and latent.is_nested:  # MiniMax-H3's video and audio: each stream random
        latent, latent_seed = randn_like(latent, latent_seed), None
    sampled_from_latent = variant in random_dits.FIXTURES and random_dits.FIXTURES[variant].latent is not None
    if latent_seed is not None and (sampled_from_latent or random_dits.noise_mask(variant, latent) is not None):
        # the frames the noise mask keeps clean, or all of a model that samples from the latent
        # image itself (FlowRVS), come from the latent image: one of its own
        latent = torch.randn(latent.shape, generator=torch.Generator().manual_seed(latent_seed))
    noise = randn_like(latent, seed)
    with torch.inference_mode():
        out = comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", positive, negative, latent,
                                  seed=seed, disable_pbar=True, noise_mask=random_dits.noise_mask(variant, latent))
    return torch.cat([t.reshape(t.shape[0], -1) for t in out.unbind()], dim=-1) if out.is_nested else out


def randn_like(latent, seed):
    """Random values shaped like a latent: one tensor per stream of a nested latent (MiniMax-H3's
    video and audio), as ComfyUI's prepare_noise makes them."""
    generator = torch.Generator().manual_seed(seed)
    if latent.is_nested:
        return type(latent)([torch.randn(t.shape, generator=generator) for t in latent.unbind()])
    return torch.randn(latent.shape, generator=generator)


def todo(comfy, model, **settings):
    """ToDo's NodeOutput, as ComfyUI runs the node: every input at its default unless given (but
    no quality budget: ``comfy_helpers.apply``)."""
    return apply(comfy, "todo", model, **{"temporal_factor": 1.0, "skip_first_blocks": 1, "skip_last_blocks": 1,
                                          **settings})


def warnings_of(output):
    return output.ui["tokenreduce"][0]["warnings"]


def with_probe(model, records, measured=None):
    """A clone with an attention override that records (q, k, v) sequence lengths and the noise
    level of every attention call of sampling (those the auto rule times in ``measured``), then
    runs the backend."""
    measured = [] if measured is None else measured
    probed = model.clone()

    def probe(func, *args, **kwargs):
        dim = 2 if kwargs.get("skip_reshape") else 1
        options = kwargs["transformer_options"]
        if options.get("tokenreduce:measuring"):  # a call the auto rule times: kept apart
            measured.append(tuple(t.shape[dim] for t in args[:3]))
        else:
            records.append((*(t.shape[dim] for t in args[:3]), float(options["sigmas"].max())))
        return func(*args, **kwargs)

    install_probe(probed, probe)
    return probed


def install_probe(model, probe) -> None:
    """Make ``probe`` the attention override of ``model`` (a clone). Where the host calls a
    model's blocks without transformer_options (0.3.75's Wan S2V), an override sees their calls
    only through the pack's object patch, which ToDo's node installs: the probe gets it too."""
    model.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = probe
    pack("nodes.host").hand_options_to_blocks(model, model.get_model_object("diffusion_model"))


def grid_text(grid):
    return f"{grid[0]} frames × {grid[2]}×{grid[1]}" if len(grid) == 3 else f"{grid[1]}×{grid[0]}"


def kept_tokens(grid, factor=2, temporal=1):
    *frames, h, w = grid
    t = frames[0] if frames else 1
    return -(-t // temporal) * -(-h // factor) * -(-w // factor)


# --- every variant ------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_reduces_every_grid_call_and_nothing_else(comfy, dits, variant):
    config, family, blocks, calls, grid = VARIANTS[variant]
    if not random_dits.available(variant):
        pytest.skip(f"this ComfyUI has no {config}")
    base = dits(variant)
    plain_calls, calls_seen = [], []
    plain = run(comfy, with_probe(base, plain_calls), variant)
    output = todo(comfy, with_probe(base, calls_seen), **ALL_BLOCKS)
    patched = output.result[0]
    out = run(comfy, patched, variant)

    # It acts, within a bounded error, and repeats bit for bit.
    assert torch.isfinite(out).all()
    assert 1e-5 < rel_error(out, plain) < 0.1
    assert torch.equal(out, run(comfy, patched, variant))

    # Every grid call of every step reads fewer keys and values, every query stays; every other
    # call (text refiners, cross-attention) gets what it gets unpatched.
    n = len(calls)
    step = n * (2 if variant in SEPARATE_CFG else 1)  # a step's calls: one model call, or one per conditioning
    assert len(plain_calls) == 2 * step and len(calls_seen) == 4 * step  # 2 steps; 2 runs
    tokens = math.prod(grid)
    removed = tokens - kept_tokens(grid)
    for i, (seen, unpatched) in enumerate(zip(calls_seen, plain_calls * 2)):
        if calls[i % n] == "g":
            q, k, v, sigma = unpatched
            assert seen == (q, k - removed, v - removed, sigma), (i, seen, unpatched)
        else:
            assert seen == unpatched, (i, seen, unpatched)

    # The run report: the grid, its tokens, both steps, nothing skipped, no warning.
    report = session_of(patched).last_report
    assert [(level.downsample, level.grid, level.tokens) for level in report.levels] == \
        [(1, grid, {"q": (tokens, tokens), "k/v": (tokens, kept_tokens(grid))})]
    assert report.active_steps == (1, 2) and report.skipped_calls == 0 and report.warnings == ()
    session = session_of(patched)
    lines = pack("tokenreduce.describe").run_lines(session.header, report)
    assert lines[:2] == [f"ToDo · {config} · {blocks} of {blocks} blocks",
                         f"ds 1 · {grid_text(grid)} · q {tokens}→{tokens} · k/v {tokens}→{kept_tokens(grid)}"]
    assert lines[2].startswith("steps 1-2 of 2 · ")

    # What the node says when it executes.
    info = output.result[1]
    what = "video" if len(grid) == 3 else "image"
    assert info.startswith(f"ToDo on {config} ({family}, DiT): keys/values of the {what} tokens of self-attention "
                           f"downsampled 2x per side (about 4x fewer), nearest, in blocks "
                           f"{'1' if blocks == 1 else '1-2'} of {blocks}")
    assert output.ui["tokenreduce"] == [{"lines": [lines[0]], "warnings": []}]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_tiny_model_computes_with_no_uninitialised_memory(comfy, variant):
    """ComfyUI makes some weights and buffers with ``torch.empty`` (the real files carry them:
    MiniMax-H3's rotary frequencies, MMDiT's position table): a tiny model computing with them
    would read whatever memory held (now and then NaN). Built with every unset value NaN, no
    parameter or buffer of the model is left NaN: the fixture set each one."""
    if not random_dits.available(variant):
        pytest.skip(f"this ComfyUI has no {VARIANTS[variant][0]}")
    with random_models.unset_is_nan():
        model = random_dits.make_dit(variant).model
    unset = [name for name, tensor in (*model.named_parameters(), *model.named_buffers())
             if tensor.is_floating_point() and torch.isnan(tensor).any()]
    assert unset == []


def call_keys(comfy, model, variant, index, seed):
    """The keys of attention call ``index`` of one model call, as [batch, tokens, features]."""
    seen = []
    probed = model.clone()

    def probe(func, *args, **kwargs):
        if len(seen) == index:
            k = args[1].movedim(2 if kwargs.get("skip_reshape") else 1, 1)
            seen.append(k.reshape(*k.shape[:2], -1).clone())
        else:
            seen.append(None)
        return func(*args, **kwargs)

    install_probe(probed, probe)
    run(comfy, probed, variant, steps=1, cfg=1.0, seed=seed, latent_seed=seed)
    return seen[index]


def reducing_only(model, index):
    """``model`` (ToDo's output) with ToDo reducing attention call ``index`` of a model call
    alone: every call before it computes what it computes unpatched."""
    patch = model.model_options["transformer_options"]["optimized_attention_override"].__self__

    def only(plan):
        return tuple(slot if i == index else slot._replace(kind="other") for i, slot in enumerate(plan))

    patch.plan = only(patch.plan)
    planned = patch.family.call_plan
    if planned is not None:  # a family that plans each call (LTX-2)
        patch.family = patch.family._replace(call_plan=lambda *call: only(planned(*call)))
    return model


def plan_of(comfy, model, variant):
    """The call plan of ``variant``'s model calls: its family's fixed plan, or the plan the
    family makes for this variant's calls (recorded while ToDo runs one step on it)."""
    config = VARIANTS[variant][0]
    diffusion_model = model.get_model_object("diffusion_model")
    family = pack("tokenreduce.families").dit_family(config, diffusion_model)
    if family.call_plan is None:
        return family.plan(diffusion_model)
    patched = todo(comfy, model, **ALL_BLOCKS).result[0]
    patch = patched.model_options["transformer_options"]["optimized_attention_override"].__self__
    seen = []
    patch.family = family._replace(call_plan=lambda *call: seen.append(family.call_plan(*call)) or seen[-1])
    run(comfy, patched, variant, steps=1, cfg=1.0)
    assert seen and len(set(seen)) == 1
    return seen[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_only_latent_tokens_leave_the_keys(comfy, dits, variant):
    """Where the grid sits in the key sequence, checked against the model itself, in the first
    grid call of each kind (joint, image-only) with ToDo reducing that call alone (so nothing
    before it changes): a key that depends on the latent (noise and latent image) is an
    image/video token; text, reference and register tokens do not. Every key ToDo drops must
    be one that depends on the latent, and the keys it keeps are the unreduced keys themselves,
    in order."""
    config, _, _, calls, grid = VARIANTS[variant]
    if not random_dits.available(variant):
        pytest.skip(f"this ComfyUI has no {config}")
    base = dits(variant)
    diffusion_model = base.get_model_object("diffusion_model")
    plan = plan_of(comfy, base, variant)
    assert len(plan) == len(calls)
    first = {}  # kind -> its first grid call
    for index, (slot, call) in enumerate(zip(plan, calls)):
        if call == "g":
            first.setdefault(slot.kind, index)
    assert first
    for kind, index in first.items():
        plain, other = (call_keys(comfy, base, variant, index, seed) for seed in (0, 1))
        latent_rows = {i for i in range(plain.shape[1]) if not torch.equal(plain[:, i], other[:, i])}
        kept = call_keys(comfy, reducing_only(todo(comfy, base, **ALL_BLOCKS).result[0], index), variant, index, 0)
        dropped, j = [], 0
        for i in range(kept.shape[1]):  # kept keys are a subsequence of the unreduced ones
            while j < plain.shape[1] and not torch.equal(plain[:, j], kept[:, i]):
                dropped.append(j)
                j += 1
            assert j < plain.shape[1], f"{kind} call {index}: kept key {i} is not an unreduced key"
            j += 1
        dropped += range(j, plain.shape[1])
        assert len(dropped) == math.prod(grid) - kept_tokens(grid), f"{kind} call {index}"
        assert set(dropped) <= latent_rows, \
            f"{kind} call {index}: keys that do not depend on the latent were dropped: {sorted(set(dropped) - latent_rows)}"


# --- which blocks ---------------------------------------------------------------------------------

@pytest.mark.parametrize("variant,config,settings,calls,info", [
    # 2 double + 2 single blocks; only the second double block
    ("flux_dev", dict(depth=2, depth_single_blocks=2), dict(skip_first_blocks=1, skip_last_blocks=2),
     "-g--", "in blocks 2 of 4"),
    # 4 layers at the defaults (skip 1 and 1): self-attention of blocks 2 and 3, never cross-attention
    ("wan21_t2v", dict(num_layers=4), {}, "--g-g---", "in blocks 2-3 of 4"),
    # both blocks with an image-only call after the joint one: those of block 2
    ("sd35_medium", dict(x_block_self_attn_layers=[0, 1]), dict(skip_last_blocks=0), "--gg", "in blocks 2 of 2"),
    # the noise refiner is block 1, the joint layers 2-4: skipping the first leaves the refiner alone
    ("lumina2", dict(n_layers=3), dict(skip_last_blocks=0), "--ggg", "in blocks 2-4 of 4"),
], ids=["flux", "wan", "sd35m", "lumina"])
def test_skip_first_and_last_blocks_select_the_blocks(comfy, dits, variant, config, settings, calls, info):
    base = dits(variant, **config)
    plain_calls, calls_seen = [], []
    run(comfy, with_probe(base, plain_calls), variant, steps=1)
    output = todo(comfy, with_probe(base, calls_seen), **settings)
    run(comfy, output.result[0], variant, steps=1)
    assert len(calls_seen) == len(plain_calls) == len(calls)
    reduced = "".join("g" if seen[1] < plain[1] else "-" for seen, plain in zip(calls_seen, plain_calls))
    assert reduced == calls
    assert info in output.result[1]


def test_skipping_every_block_returns_the_model_unchanged_with_a_warning(comfy, dits):
    base = dits("wan21_t2v")  # 2 blocks, default skips 1 + 1
    output = todo(comfy, base)
    assert output.result[0] is base
    assert output.result[1].startswith("WARNING: ToDo does nothing on this WAN21_T2V model with level auto: its 2 "
                                       "blocks attend over one token grid")
    assert "skip_first_blocks + skip_last_blocks leave fewer than" in output.result[1]


# --- the other inputs on DiTs -------------------------------------------------------------------

def test_temporal_factor_on_a_video_pools_along_time(comfy, dits):
    base = dits("wan21_t2v")
    output = todo(comfy, base, temporal_factor=2.0, **ALL_BLOCKS)
    out = run(comfy, output.result[0], "wan21_t2v")
    (level,) = session_of(output.result[0]).last_report.levels
    assert level.grid == (3, 8, 6) and level.tokens["k/v"] == (144, 2 * 4 * 3)  # frames 0 and 2 of 3
    assert "downsampled 2x per side and 2x along time (about 8x fewer)" in output.result[1]
    assert warnings_of(output) == []
    spatial_only = run(comfy, todo(comfy, base, **ALL_BLOCKS).result[0], "wan21_t2v")
    assert rel_error(out, spatial_only) > 1e-5
    assert rel_error(out, run(comfy, base, "wan21_t2v")) < 0.1


@pytest.mark.parametrize("setting,value,needle", [
    ("temporal_factor", 2.0, "WARNING: temporal_factor 2 does nothing: Flux.1 is an image model."),
    ("factor_next", 2.0, "WARNING: factor_next 2 does nothing on a DiT: Flux.1 attends over one token grid; "
                         "factor sets its pooling."),
])
def test_inputs_that_do_nothing_on_this_model_say_so(comfy, dits, setting, value, needle):
    base = dits("flux_dev")
    output = todo(comfy, base, **ALL_BLOCKS, **{setting: value})
    assert warnings_of(output) == [needle]
    assert torch.equal(run(comfy, output.result[0], "flux_dev"),
                       run(comfy, todo(comfy, base, **ALL_BLOCKS).result[0], "flux_dev"))


@pytest.mark.parametrize("variant,family", [("flux_dev", "Flux.1"), ("flux2", "Flux.2"), ("chroma", "Chroma"),
                                            ("qwen_image", "Qwen-Image"), ("z_image", "Lumina 2 / Z-Image"),
                                            ("wan21_t2v", "Wan 2.1 / 2.2"), ("hunyuan_video", "HunyuanVideo")])
def test_average_is_refused_where_keys_carry_rotary_positions(comfy, dits, variant, family):
    with pytest.raises(ValueError, match=re.escape(f"TokenReduceToDo: method 'average' does not work on {family}: its "
                                                   f"keys carry rotary positions")) as refused:
        todo(comfy, dits(variant), method="average", **ALL_BLOCKS)
    assert "use nearest" in str(refused.value)


def test_average_on_sd3_pools_and_other_methods_are_refused(comfy, dits):
    base = dits("sd3")
    nearest = run(comfy, todo(comfy, base, **ALL_BLOCKS).result[0], "sd3")
    average = todo(comfy, base, method="average", **ALL_BLOCKS)
    out = run(comfy, average.result[0], "sd3")
    assert "average, in blocks 1-2 of 2" in average.result[1]
    assert session_of(average.result[0]).last_report.levels[0].tokens["k/v"] == (48, 12)
    assert rel_error(out, nearest) > 1e-5 and rel_error(out, run(comfy, base, "sd3")) < 0.1
    with pytest.raises(ValueError, match=re.escape("method 'bilinear' does not work on SD3 / SD3.5: on DiTs ToDo pools "
                                                   "with nearest or average")):
        todo(comfy, base, method="bilinear", **ALL_BLOCKS)


@pytest.mark.parametrize("variant", ["flux_dev", "sd3", "wan21_t2v", "hunyuan_video"])
def test_window_on_a_grid_its_windows_cover_is_full_attention(comfy, dits, variant):
    """method window (issue #50): the tiny models' grids lie inside one window (8x6: a 4x4 tile
    and 2 tokens around it, 3 frames on video: a frame before and after), so every query sees
    every key exactly and the far field and heavy keys are masked: the unpatched output, through
    each layout the families hand attention (Flux [B, H, N, D], SD3's v [B, N, H, D], Wan
    [B, N, H*D]); the report gives the keys each query sees and the info says what ran."""
    base = dits(variant)
    output = todo(comfy, base, method="window", reduce_when="always", **ALL_BLOCKS)
    assert "window: each tile of queries also sees the keys within 2 tokens" in output.result[1]
    out = run(comfy, output.result[0], variant)
    assert torch.isfinite(out).all() and rel_error(out, run(comfy, base, variant)) < 1e-4
    grid = VARIANTS[variant][4]
    tokens = math.prod(grid)
    assert session_of(output.result[0]).last_report.levels[0].tokens["k/v"] == (tokens, tokens)


@pytest.mark.parametrize("level", ["2", "4", "8"])
def test_a_level_other_than_auto_or_1_does_nothing_and_says_so(comfy, dits, level):
    base = dits("qwen_image")
    output = todo(comfy, base, level=level)
    assert output.result[0] is base
    assert output.result[1].startswith(f"WARNING: ToDo does nothing on this QwenImage model with level {level}: its 1 "
                                       f"blocks attend over one token grid (downsample 1): use level auto or 1")
    assert todo(comfy, base, level="1", **ALL_BLOCKS).result[0] is not base


# --- refusals -------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant,config,family", [("cosmos_predict2_t2i", "CosmosT2IPredict2", "Cosmos Predict2 image")])
def test_tome_on_a_dit_it_does_not_merge_is_refused_and_points_to_todo(comfy, dits, variant, config, family):
    # HiDream, Lumina 2, ... are merged too, through the layer seam (#38); Cosmos Predict2's blocks take a 5-D grid
    # Flux, Wan and the other families with a DiTMerge are merged (tests/test_comfy_tome_dit_inprocess.py).
    with pytest.raises(ValueError, match=f"TokenReduceToMe: ToMe cannot patch this {config} model: it has no UNet "
                                         f"transformer blocks") as refused:
        apply(comfy, "tome", dits(variant))
    assert f"use Token Downsampling (ToDo, TokenReduce), which supports {family}" in str(refused.value)


def test_an_unsupported_dit_is_refused_with_its_reason(comfy):
    unsupported = random_dits.make_unsupported_dit()
    config = type(unsupported.model.model_config).__name__
    reason = pack("tokenreduce.families").REFUSED[config]
    with pytest.raises(ValueError, match=f"TokenReduceToDo: ToDo cannot patch this {config} model: ") as refused:
        todo(comfy, unsupported)
    assert reason in str(refused.value) and "these DiT families" not in str(refused.value)
    with pytest.raises(ValueError, match=f"ToMe cannot patch this {config} model") as refused:
        apply(comfy, "tome", unsupported)
    assert reason in str(refused.value) and "use Token Downsampling" not in str(refused.value)


def _renamed(obj, name, base=None):
    """``obj`` turned into an instance of a new class ``name`` (deriving from ``base``, default
    its own class) with its class's attributes: a variant the host could add later."""
    cls = type(obj)
    attributes = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    obj.__class__ = type(name, (base or cls,), attributes if base else {})
    return obj


def test_a_model_class_that_only_derives_from_a_known_one_is_refused_not_reduced(comfy):
    """A Wan whose module class is a subclass of WanModel (a variant that may add a token
    stream) is never reduced as Wan: under an unknown config it is refused with the 'derives
    from' reason; under Wan's own config with the 'not the WanModel ToDo knows' one."""
    import comfy.supported_models_base as configs  # "as": the name comfy is the fixture here

    unknown = random_dits.make_dit("wan21_t2v")
    _renamed(unknown.model.diffusion_model, "WanWithAnotherStream")
    _renamed(unknown.model.model_config, "SomeFutureVideoDiT", configs.BASE)
    with pytest.raises(ValueError, match="ToDo cannot patch this SomeFutureVideoDiT model: ") as refused:
        todo(comfy, unknown)
    assert ("its model class WanWithAnotherStream derives from WanModel (Wan 2.1 / 2.2) but ToDo does not know it"
            in str(refused.value))

    known_config = random_dits.make_dit("wan21_t2v")
    _renamed(known_config.model.diffusion_model, "WanWithAnotherStream")
    with pytest.raises(ValueError, match="ToDo cannot patch this WAN21_T2V model: ") as refused:
        todo(comfy, known_config)
    assert "but the model is a WanWithAnotherStream, not the WanModel" in str(refused.value)


# --- with ComfyUI's step caches -----------------------------------------------------------------

def _caches():
    from comfy_extras.nodes_easycache import EasyCacheNode, LazyCacheNode

    # A threshold at which both skip model calls on these random models (at 0.2 EasyCache skips none on Wan).
    return {name: (lambda model, node=node: node.execute(model, reuse_threshold=1.0, start_percent=0.0,
                                                          end_percent=1.0, verbose=False).result[0])
            for name, node in (("EasyCache", EasyCacheNode), ("LazyCache", LazyCacheNode))}


@pytest.mark.parametrize("variant", ["wan21_t2v", "flux_dev"])
@pytest.mark.parametrize("cache", ["EasyCache", "LazyCache"])
def test_stacks_with_the_step_caches_in_either_order(comfy, dits, variant, cache):
    """ComfyUI's EasyCache and LazyCache skip model calls (their wrappers return a cached output
    instead of calling the model): ToDo reduces in the calls that run, never sees a token it
    does not expect, and the order of the two nodes does not matter."""
    base, add_cache = dits(variant), _caches()[cache]
    steps = 6
    cache_only = run(comfy, add_cache(base), variant, steps=steps)
    outputs = {}
    for order, model in (("todo first", add_cache(todo(comfy, base, **ALL_BLOCKS).result[0])),
                         ("cache first", todo(comfy, add_cache(base), **ALL_BLOCKS).result[0])):
        outputs[order] = run(comfy, model, variant, steps=steps)
        report = session_of(model).last_report
        assert torch.isfinite(outputs[order]).all()
        assert report.skipped_calls == 0 and report.warnings == () and report.levels, order
        assert 1 in report.active_steps and len(report.active_steps) < steps, order  # the cache skipped some
        assert 1e-5 < rel_error(outputs[order], cache_only) < 0.2, order
    assert torch.equal(outputs["todo first"], outputs["cache first"])


# --- under torch.compile ----------------------------------------------------------------------------

@pytest.fixture
def sdpa_attention(comfy, monkeypatch):
    """PyTorch SDPA, the GPU default, in every DiT module compiled here. ComfyUI's CPU default,
    sub-quadratic attention, asks psutil for the free memory inside the model: a graph break of
    the host's own (see test_compile_inprocess.py)."""
    import comfy.ldm.flux.math
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.modules.diffusionmodules.mmdit
    import comfy.ldm.qwen_image.model
    import comfy.ldm.wan.model

    for module, name in ((comfy.ldm.flux.math, "optimized_attention"), (comfy.ldm.wan.model, "optimized_attention"),
                         (comfy.ldm.qwen_image.model, "optimized_attention_masked"),
                         (comfy.ldm.modules.diffusionmodules.mmdit, "optimized_attention")):
        monkeypatch.setattr(module, name, attention.attention_pytorch)


COMPILE_RUNS = [dict(steps=2), dict(steps=3, seed=4)]


def compiled_runs(comfy, model, variant, backend="eager") -> dict:
    import torch._dynamo
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = model.clone()
    set_torch_compile_wrapper(compiled, backend=backend)
    outputs = [run(comfy, compiled, variant, **settings) for settings in COMPILE_RUNS]
    result = {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values()),
              "outputs": outputs}
    torch._dynamo.reset()
    return result


@pytest.mark.parametrize("variant", ["flux_dev", "wan21_t2v", "qwen_image", "sd3"])
def test_no_graph_break_and_no_graph_of_our_own_under_torch_compile(comfy, dits, sdpa_attention, variant):
    base = dits(variant)
    unpatched = compiled_runs(comfy, base, variant)
    model = todo(comfy, base, **ALL_BLOCKS).result[0]
    ours = compiled_runs(comfy, model, variant)
    assert unpatched["breaks"] == 0 and ours["breaks"] == 0
    assert ours["graphs"] <= unpatched["graphs"]
    assert session_of(model).last_report.levels  # it reduced under compile
    for compiled_out, settings in zip(ours["outputs"], COMPILE_RUNS):
        assert rel_error(compiled_out, run(comfy, model, variant, **settings)) < 1e-4


@pytest.mark.parametrize("variant", ["flux_dev", "wan21_t2v"])
def test_the_window_adds_no_graph_break_under_torch_compile(comfy, dits, sdpa_attention, variant):
    """method window (issue #50) under ComfyUI's compile wrapper: the whole grid call windowed
    (its plans made per layout outside the model, its chunks a fixed split), no graph break, no
    graph of its own, the eager output."""
    base = dits(variant)
    unpatched = compiled_runs(comfy, base, variant)
    model = todo(comfy, base, method="window", reduce_when="always", **ALL_BLOCKS).result[0]
    ours = compiled_runs(comfy, model, variant)
    assert ours["breaks"] == 0 and ours["graphs"] <= unpatched["graphs"]
    assert session_of(model).last_report.levels
    for compiled_out, settings in zip(ours["outputs"], COMPILE_RUNS):
        assert rel_error(compiled_out, run(comfy, model, variant, **settings)) < 1e-4


def test_blocks_decided_per_block_add_no_graph_break_under_torch_compile(comfy, dits, sdpa_attention, monkeypatch,
                                                                         tmp_path):
    """The quality budget's per-block decisions (issue #51: nearest on one block, the window on the
    others) under ComfyUI's compile wrapper: decided before the compiled model runs, one dict per
    run in the call's context, no graph break, no graph of its own, the eager output."""
    from comfy_helpers import ScriptedClock
    from test_comfy_max_change_inprocess import EVERY_BLOCK, lines_of, mixed_budget

    pays = sys.modules["tokenreduce_pack.tokenreduce.pays"]
    store = pays.Decisions(tmp_path / "auto.json", stopwatch=ScriptedClock((2.0, 1.0)))  # reducing pays
    monkeypatch.setattr(sys.modules["tokenreduce_pack.nodes.common"], "decisions", lambda: store)
    from test_comfy_tome_dit_inprocess import VARIANTS as DEEPER  # four blocks: a mix needs three

    base = dits("flux_dev", **DEEPER["flux_dev"][0])
    _, budget = mixed_budget(comfy, base, store)
    unpatched = compiled_runs(comfy, base, "flux_dev")
    model = todo(comfy, base, **EVERY_BLOCK, max_change=budget).result[0]
    ours = compiled_runs(comfy, model, "flux_dev")
    assert ours["breaks"] == 0 and ours["graphs"] <= unpatched["graphs"]
    (line,) = [line for line in lines_of(model) if ", per block, " in line]
    assert "nearest " in line and "window " in line
    for compiled_out, settings in zip(ours["outputs"], COMPILE_RUNS):
        assert rel_error(compiled_out, run(comfy, model, "flux_dev", **settings)) < 1e-4


def test_inductor_compiles_todo_on_wan(comfy, dits, sdpa_attention):
    """The backend ComfyUI's TorchCompileModel uses: generated kernels, no graph break, and the
    eager result (the other DiT compile tests use dynamo's eager backend, which checks graphs only)."""
    model = todo(comfy, dits("wan21_t2v"), **ALL_BLOCKS).result[0]
    ours = compiled_runs(comfy, model, "wan21_t2v", backend="inductor")
    assert ours["breaks"] == 0 and session_of(model).last_report.levels
    for compiled_out, settings in zip(ours["outputs"], COMPILE_RUNS):
        assert rel_error(compiled_out, run(comfy, model, "wan21_t2v", **settings)) < 1e-3


@pytest.mark.parametrize("variant", ["flux_dev", "wan21_t2v"])
def test_the_auto_rule_measures_outside_the_compiled_model(comfy, dits, sdpa_attention, measuring, variant):
    store = measuring((10.0, 8.0))
    base = dits(variant)
    unpatched = compiled_runs(comfy, base, variant)
    model = todo(comfy, base, **ALL_BLOCKS).result[0]
    measured = compiled_runs(comfy, model, variant)
    assert store.measurements == 1 and not any(store.stopwatch.compiling)
    kept = compiled_runs(comfy, model, variant)
    assert store.measurements == 1 and measured["breaks"] == kept["breaks"] == 0
    assert measured["graphs"] == kept["graphs"] <= unpatched["graphs"]
    assert session_of(model).last_report.levels


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_auto_rule_times_grid_calls_in_the_shapes_the_model_passes(comfy, dits, variant):
    """The auto rule times one grid call of each kind (joint, image-only) with random q, k, v
    shaped by the family's geometry of that kind: heads, head size and argument layout must be
    what the model passes to attention in every grid call of the kind."""
    config, _, _, calls, _ = VARIANTS[variant]
    if not random_dits.available(variant):
        pytest.skip(f"this ComfyUI has no {config}")
    model = dits(variant)
    seen = []
    probed = model.clone()

    def probe(func, *args, **kwargs):
        heads = args[3] if len(args) > 3 else kwargs["heads"]
        seen.append((tuple(args[0].shape), bool(kwargs.get("skip_reshape")), heads))
        return func(*args, **kwargs)

    install_probe(probed, probe)
    run(comfy, probed, variant, steps=1, cfg=1.0)  # one model call
    diffusion_model = model.get_model_object("diffusion_model")
    family = pack("tokenreduce.families").dit_family(config, diffusion_model)
    plan = plan_of(comfy, model, variant)
    grid_calls = [(call, slot.kind) for call, slot, kind in zip(seen, plan, calls) if kind == "g"]
    assert len(seen) == len(calls) == len(plan) and grid_calls
    assert all(slot.kind != "other" for slot, kind in zip(plan, calls) if kind == "g")
    for (q_shape, skip_reshape, call_heads), kind in grid_calls:
        heads, head_dim, heads_first = pack("tokenreduce.dit").geometry_of(family, diffusion_model, kind)
        assert (skip_reshape, call_heads) == (heads_first, heads), kind
        assert (q_shape[1], q_shape[3]) == (heads, head_dim) if heads_first else q_shape[2] == heads * head_dim, kind


@pytest.mark.parametrize("variant,kinds", [("wan21_t2v", 1), ("flux_dev", 1), ("sd35_medium", 2)])
@pytest.mark.parametrize("faster", [True, False])
def test_auto_times_grid_calls_through_the_override_chain(comfy, dits, measuring, variant, kinds, faster):
    """On a DiT the rule times each kind of grid call (joint, image-only) through the host's
    attention with our override and the one we chain (the probe, as SageAttention would be):
    the probe sees the reduced keys while timing, and sampling follows the decision."""
    store = measuring((10.0, 8.0 if faster else 11.0))
    records, measured = [], []
    model = todo(comfy, with_probe(dits(variant), records, measured), **ALL_BLOCKS).result[0]
    run(comfy, model, variant)
    report = session_of(model).last_report
    assert store.measurements == kinds and [d.reduce for _, d in report.decisions] == [faster] * kinds
    assert any(k < q for q, k, _ in measured)  # the chained override got our reduced keys while timing
    reduced_calls = [r for r in records if r[1] < r[0]]
    assert bool(reduced_calls) == faster
    sites = [site for site, _ in report.decisions]
    assert all(site.startswith(grid_text(VARIANTS[variant][4]) + " grid, ") for site in sites)


# --- another attention override applied after ToDo --------------------------------------------------

def replacing_override(seen):
    """An override as KJNodes' SageAttention patch and ComfyUI's set_model_optimized_attention
    install one: it replaces the slot and runs its own backend, calling neither the override it
    replaced nor the ``func`` it is handed. Records the key lengths it gets."""
    import comfy.ldm.modules.attention as attention

    def backend_choice(func, *args, **kwargs):
        dim = 2 if kwargs.get("skip_reshape") else 1
        if not kwargs["transformer_options"].get("tokenreduce:measuring"):
            seen.append((args[0].shape[dim], args[1].shape[dim]))
        return attention.attention_pytorch(*args, **kwargs)

    return backend_choice


@pytest.mark.parametrize("variant", ["flux_dev", "wan21_t2v"])
def test_an_override_applied_after_todo_gets_todos_keys(comfy, dits, variant):
    """Applied after ToDo, such an override would shut ToDo out; ToDo runs in front of it, says so
    in a note, and computes exactly what it computes when the override is applied before it."""
    after_seen, before_seen = [], []
    after = todo(comfy, dits(variant), **ALL_BLOCKS).result[0].clone()
    after.model_options["transformer_options"]["optimized_attention_override"] = replacing_override(after_seen)
    before = dits(variant).clone()
    before.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = \
        replacing_override(before_seen)
    before = todo(comfy, before, **ALL_BLOCKS).result[0]
    out_after, out_before = run(comfy, after, variant), run(comfy, before, variant)
    assert torch.equal(out_after, out_before) and after_seen == before_seen
    assert any(k < q for q, k in after_seen)  # the reduced keys reached the backend it chose
    report = session_of(after).last_report
    assert not report.warnings and report.levels
    (note,) = report.notes
    assert "applied after this node (replacing_override.<locals>.backend_choice)" in note and "both act" in note
    assert not session_of(before).last_report.notes


def test_comfyuis_own_attention_choice_after_todo_keeps_todo(comfy, dits):
    """ComfyUI 0.33's ModelPatcher.set_model_optimized_attention (what its attention nodes use)."""
    import comfy.ldm.modules.attention as attention

    base = todo(comfy, dits("flux_dev"), **ALL_BLOCKS).result[0].clone()
    if not hasattr(base, "set_model_optimized_attention"):
        pytest.skip("this ComfyUI has no ModelPatcher.set_model_optimized_attention (it came after 0.3.75)")
    base.set_model_optimized_attention(attention.attention_pytorch)
    run(comfy, base, "flux_dev")
    report = session_of(base).last_report
    assert report.levels and not report.warnings and "both act" in report.notes[0]


def test_an_override_after_todo_compiles_without_a_graph_of_its_own(comfy, dits, sdpa_attention):
    base = todo(comfy, dits("wan21_t2v"), **ALL_BLOCKS).result[0].clone()
    base.model_options["transformer_options"]["optimized_attention_override"] = replacing_override([])
    plain = dits("wan21_t2v").clone()
    plain.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = replacing_override([])
    unpatched, ours = compiled_runs(comfy, plain, "wan21_t2v"), compiled_runs(comfy, base, "wan21_t2v")
    assert ours["breaks"] == unpatched["breaks"] == 0 and ours["graphs"] <= unpatched["graphs"]
    assert session_of(base).last_report.levels


def test_a_forward_that_drops_the_transformer_options_is_said(comfy, dits):
    """TeaCache's and MagCache's replacement forwards call the blocks without ComfyUI's transformer
    options, so no attention override is reached. Stand-in: a diffusion-model wrapper that calls
    the model with empty options. ToDo cannot act there; it says why, not that its window was empty."""
    import inspect

    from comfy.patcher_extension import WrappersMP

    def without_options(executor, *args, **kwargs):
        bound = inspect.signature(executor.original).bind(*args, **kwargs)
        bound.arguments["transformer_options"] = {}
        return executor(*bound.args, **bound.kwargs)

    model = todo(comfy, dits("flux_dev"), **ALL_BLOCKS).result[0].clone()
    model.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "test_forward_without_options", without_options)
    run(comfy, model, "flux_dev")
    (warning,) = session_of(model).last_report.warnings
    assert "did nothing: in 2 model calls the model's attention never reached" in warning
    assert "TeaCache and MagCache" in warning and "EasyCache or LazyCache" in warning


# --- LTX-2: a plan per model call ----------------------------------------------------------------------

@pytest.mark.parametrize("options,calls", [
    # STG: block 0's self-attentions (video and audio) are their values: no attention call there
    ({"stg_self_attn_blocks": frozenset({0})}, "----g-----"),
    ({"a2v_cross_attn": False, "v2a_cross_attn": False}, "g---g---"),  # LTXVModalityGuidance's extra pass
    # the audio stream not run: the video still cross-attends to the audio tokens (audio to video)
    ({"run_ax": False}, "g--g--"),
])
def test_ltx2_plans_each_model_call_from_its_options(comfy, dits, options, calls):
    """LTX-2's attention calls follow the call's options (STG, the audio<->video coupling cut,
    the audio stream off): ToDo reduces each video self-attention that runs and nothing else."""
    if not random_dits.available("ltxav"):
        pytest.skip("this ComfyUI has no LTXAV")
    plain_calls, calls_seen = [], []
    for records, patched in ((plain_calls, False), (calls_seen, True)):
        model = with_probe(dits("ltxav"), records)
        model = todo(comfy, model, **ALL_BLOCKS).result[0] if patched else model
        model = model.clone()
        model.model_options["transformer_options"] = {**model.model_options["transformer_options"], **options}
        run(comfy, model, "ltxav", steps=1, cfg=1.0)
    assert len(plain_calls) == len(calls_seen) == len(calls)
    removed = math.prod((3, 4, 3)) - kept_tokens((3, 4, 3))
    for seen, (q, k, v, sigma), kind in zip(calls_seen, plain_calls, calls):
        assert seen == ((q, k - removed, v - removed, sigma) if kind == "g" else (q, k, v, sigma))


def test_wan_s2v_blocks_get_the_call_options_by_an_object_patch_on_the_clone_only_where_dropped(comfy, dits):
    """0.3.75 calls Wan S2V's blocks without transformer_options: ToDo's clone gets an object patch
    of forward_orig that hands them the call's options (the model and its other clones untouched);
    0.33 passes them, and nothing is patched."""
    if not random_dits.available("wan22_s2v"):
        pytest.skip("this ComfyUI has no WAN22_S2V")
    base = dits("wan22_s2v")
    patched = todo(comfy, base, **ALL_BLOCKS).result[0]
    dropped = "comfyui-0.3.75" in str(comfy.root)
    assert set(patched.object_patches) == ({"diffusion_model.forward_orig"} if dropped else set())
    assert not base.object_patches
