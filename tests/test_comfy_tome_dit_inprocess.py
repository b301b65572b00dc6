"""ToMe on DiTs in the real ComfyUI, in-process: whole-block token merging through the host's
block-replace seam (``patches_replace["dit"]``) on tiny random Flux.1 (with Kontext reference
tokens), Chroma and Wan 2.1 (t2v, i2v) models with 4 blocks (the first and last stay whole),
sampled with ``comfy.sample``.

A spy installed as a block replacement *before* the node (ours calls it as its inner block) sees
what a merged block is given; one wrapped *around* ours on the patched clone sees what the model
hands it. Together they show that only grid tokens merge: text and reference tokens pass through
in count, position and value, and the rotary positions follow the tokens."""

from __future__ import annotations

import math
import sys

import pytest
import torch

import random_dits
from comfy_helpers import apply, session_of, spy_stepping_aside
from test_comfy_dit_inprocess import install_probe, run, todo

# MMDiT: hidden 64 per block, so 4 blocks are 256 wide
_MMDIT4 = {"depth": 4, "context_embedder_config": {"target": "torch.nn.Linear", "params": {
    "in_features": random_dits.CONTEXT_DIM, "out_features": 256}}}
# variant -> (unet_config overrides for 4 blocks, block-replace keys of the merged blocks, grid tokens N)
VARIANTS = {
    "flux_dev": ({"depth": 2, "depth_single_blocks": 2}, [("double_block", 1), ("single_block", 0)], 48),
    "flux_kontext": ({"depth": 2, "depth_single_blocks": 2}, [("double_block", 1), ("single_block", 0)], 48),
    "flux2": ({"depth": 2, "depth_single_blocks": 2}, [("double_block", 1), ("single_block", 0)], 48),
    "chroma": ({"depth": 2, "depth_single_blocks": 2, "n_layers": 1}, [("double_block", 1), ("single_block", 0)], 48),
    "wan21_t2v": ({"num_layers": 4}, [("double_block", 1), ("double_block", 2)], 3 * 48),
    "wan21_i2v": ({"num_layers": 4}, [("double_block", 1), ("double_block", 2)], 3 * 48),
    # Chroma's blocks on a 16x16 px patched RGB image
    "chroma_radiance": ({"depth": 2, "depth_single_blocks": 2}, [("double_block", 1), ("single_block", 0)], 48),
    "longcat_image": ({"depth": 2, "depth_single_blocks": 2}, [("double_block", 1), ("single_block", 0)], 48),
    # MMDiT: double layers over [registers, text] and the image apart, single layers over all
    "auraflow": ({"n_layers": 4, "n_double_layers": 2}, [("double_block", 1), ("single_block", 0)], 48),
    "qwen_image": ({"num_layers": 4}, [("double_block", 1), ("double_block", 2)], 48),
    "qwen_image_edit": ({"num_layers": 4}, [("double_block", 1), ("double_block", 2)], 48),
    "sd3": (_MMDIT4, [("double_block", 1), ("double_block", 2)], 48),
    # an image-only self-attention in a merged block too
    "sd35_medium": ({**_MMDIT4, "x_block_self_attn_layers": [1]}, [("double_block", 1), ("double_block", 2)], 48),
    "hunyuan_video": ({"depth": 2, "depth_single_blocks": 2}, [("double_block", 1), ("single_block", 0)], 3 * 48),
    # byT5 glyph tokens after the text; a 4x3 grid (32x VAE, patch 1)
    "hunyuan_image21": ({"depth": 2, "depth_single_blocks": 2}, [("double_block", 1), ("single_block", 0)], 12),
    "ltxv": ({"num_layers": 4}, [("double_block", 1), ("double_block", 2)], 3 * 4 * 3),
    # a VACE block after main block 0: its hint stream runs on the video's own tokens, unmerged
    "wan21_vace": ({"num_layers": 4}, [("double_block", 1), ("double_block", 2)], 3 * 48),
    # Wan 2.2 TI2V 5B image to video: timesteps per frame (frame 0 clean), e0 [B, frames, 6, C]
    "wan22_ti2v_5b": ({"num_layers": 4}, [("double_block", 1), ("double_block", 2)], 3 * 12),
    # Wan 2.1 Camera: the Wan family, its blocks handed a per-sample modulation [B, 6, C]
    "wan21_camera": ({"num_layers": 4}, [("double_block", 1), ("double_block", 2)], 3 * 48),
    # [reference frame, video, pose frames at half size] (0.33 only)
    "wan21_scail": ({"num_layers": 4}, [("double_block", 1), ("double_block", 2)], 3 * 48),
    # 0.33 only: Mage-Flow (Qwen-Image's blocks at patch 1, a reference after the image), Lens
    # ([image, text], a joint mask), JoyImage (img = [image, reference], positions of img alone)
    "mage_flow": ({"num_layers": 4}, [("double_block", 1), ("double_block", 2)], 48),
    "lens": ({"num_layers": 4}, [("double_block", 1), ("double_block", 2)], 48),
    "joyimage": ({"num_layers": 4}, [("double_block", 1), ("double_block", 2)], 48),
    # x = [video, reference frame, packed motion tokens], e0 a row per timestep entry (spread in runs)
    "wan22_s2v": ({"num_layers": 4}, [("double_block", 1), ("double_block", 2)], 3 * 48),
    # NextDiT (no block lookup: reached by object patches on its layers): 2 image-only noise
    # refiners, then 2 joint layers over [caption, grid, pad tokens] (Z-Image pads both to 32)
    "lumina2": ({"n_layers": 2, "n_refiner_layers": 2}, [("noise_refiner", 1), ("layer", 0)], 48),
    "z_image": ({"n_layers": 2, "n_refiner_layers": 2}, [("noise_refiner", 1), ("layer", 0)], 48),
    # 0.33 only: the same NextDiT layers on 16x16 px RGB patches, a per-patch decoder after them
    "zimage_pixel": ({"n_layers": 2, "n_refiner_layers": 2}, [("noise_refiner", 1), ("layer", 0)], 48),
    # OmniGen2: Lumina's layer calls (object patches) over [grid] and [text, grid], no pad tokens
    "omnigen2": ({"num_layers": 2, "num_refiner_layers": 2}, [("noise_refiner", 1), ("layer", 0)], 48),
    # HiDream: double blocks (the image stream; text apart, returned with it) and single blocks
    # over [image, T5, Llama, Llama], called by keyword; positions image first (a Llama layer per block)
    "hidream": ({"num_layers": 2, "num_single_layers": 2, "llama_layers": [0, 1, 0, 1]},
                [("double_block", 1), ("single_block", 0)], 48),
    # 0.33 only: Krea 2's single-stream blocks over [text, image], reached by object patches too
    "krea2": ({"layers": 4}, [("single_block", 1), ("single_block", 2)], 48),
    # 0.33 only: Kandinsky 5's visual blocks (x: the grid alone; the text refined apart before),
    # reached by object patches (keyed apart from the host's lookup, whose original block fails)
    "kandinsky5": ({"num_visual_blocks": 4}, [("visual_block", 1), ("visual_block", 2)], 3 * 48),
    "kandinsky5_image": ({"num_visual_blocks": 4}, [("visual_block", 1), ("visual_block", 2)], 48),
    # img: the video alone, txt apart; rotary tables rope_cos and rope_sin [N, heads, D/2] (no batch)
    "mochi": ({"depth": 4}, [("double_block", 1), ("double_block", 2)], 3 * 48),
    # 0.33 only: LTX-2's blocks, handed img = (video, audio): the video merges, the audio passes whole
    "ltxav": ({"num_layers": 4}, [("double_block", 1), ("double_block", 2)], 3 * 4 * 3),
    # 0.33 only: CogVideoX's blocks (the video alone, the text apart; both returned), reached by
    # object patches, called by keyword; a (cos, sin) rotary pair [N, D] shared by the batch
    "cogvideox_t2v": ({"num_layers": 4}, [("double_block", 1), ("double_block", 2)], 3 * 48),
    "cogvideox_i2v": ({"num_layers": 4}, [("double_block", 1), ("double_block", 2)], 3 * 48),
    "cogvideox_inpaint": ({"num_layers": 4}, [("double_block", 1), ("double_block", 2)], 3 * 48),
}
# the block-replace names of the tokens, the text and the positions where they are not img, txt, pe
ARG_NAMES = {"kandinsky5": ("x", "context", "freqs"), "kandinsky5_image": ("x", "context", "freqs"),
             "mochi": ("img", "txt", "rope_cos"), "ltxav": ("img", "v_context", "v_pe")}
TOKENS_BEFORE = {"wan21_scail": 48}  # tokens before the grid in a Wan block's sequence (one reference frame)
# a 64x48 px reference latent at patch 2: 4x3 tokens after the image
REFERENCE_TOKENS = {"flux_kontext": 12, "qwen_image_edit": 12, "mage_flow": 12, "joyimage": 12}
COGVIDEOX = ("cogvideox_t2v", "cogvideox_i2v", "cogvideox_inpaint")
# positions over [image, text] (Lens, HiDream) or the image stream alone
POSITIONS_IMAGE_FIRST = {"lens", "joyimage", "hidream", *ARG_NAMES, *COGVIDEOX}
# rotary tables without a batch dimension (their dimensions): Mochi's (merged, each batch item has
# its own); CogVideoX's (merged too: one table for the batch, so ToMe runs each sample apart with its own)
PE_WITHOUT_BATCH = {"mochi": 3, **dict.fromkeys(COGVIDEOX, 2)}
NEXTDIT = ("lumina2", "z_image", "zimage_pixel", "omnigen2")  # NextDiT-like layers reached by object patches
# tokens merged where ratio 0.5 asks more than the tiles hold: Wan 2.2 TI2V's clean first frame
# (image to video) stays whole, so its 2 other frames' 2 tiles of 2x2 (3 sources each) merge
MERGED = {"wan22_ti2v_5b": 12}


@pytest.fixture(scope="module")
def dits(comfy):
    built = {}

    def get(variant):
        if not random_dits.available(variant):
            pytest.skip(f"this ComfyUI has no {variant} model")
        if variant not in built:
            built[variant] = random_dits.make_dit(variant, **VARIANTS[variant][0])
        return built[variant]

    return get


def tome(comfy, model, **settings):
    """ToMe's NodeOutput (no quality budget unless given: ``comfy_helpers.apply``)."""
    return apply(comfy, "tome", model, **settings)


def _tensors(args):
    """The tensor arguments, cloned; of a (tensor, ...) pair (LTX-Video's positions on 0.33) the
    tensor, its second item too under ``name[1]`` where it is one (CogVideoX's (cos, sin))."""
    pairs = {k: v[0] for k, v in args.items() if isinstance(v, tuple) and v and torch.is_tensor(v[0])}
    seconds = {f"{k}[1]": v[1] for k, v in args.items() if isinstance(v, tuple) and len(v) > 1 and torch.is_tensor(v[1])}
    return {k: v.clone() for k, v in {**args, **pairs, **seconds}.items() if torch.is_tensor(v)}


def spy_inside(model, keys, records):
    """A clone of ``model`` with a block replacement at ``keys`` that records what its block is
    given (the merged arguments, once ToMe is applied after it) and runs the block."""
    clone = model.clone()
    for kind, number in keys:
        def spy(args, extra, key=(kind, number)):
            records.setdefault(key, []).append(_tensors(args))
            return extra["original_block"](args)
        clone.set_model_patch_replace(spy, "dit", kind, number)
    return clone


def spy_around(model, keys, records):
    """A clone of the patched ``model`` whose replacements at ``keys`` are wrapped: the wrapper
    records what the model hands the block, then calls ours."""
    clone = model.clone()
    found = clone.model_options["transformer_options"]["patches_replace"]["dit"]
    for kind, number in keys:
        ours = found[(kind, number)]

        def around(args, extra, ours=ours, key=(kind, number)):
            records.setdefault(key, []).append(_tensors(args))
            return ours(args, extra)
        clone.set_model_patch_replace(around, "dit", kind, number)
    return clone


def _named(variant, args):
    """A block's arguments also under the names the checks read (img, txt, pe); rotary tables
    given without a batch dimension (Mochi's, CogVideoX's), with one."""
    named = {**args, **{name: args[given] for name, given in zip(("img", "txt", "pe"), ARG_NAMES.get(variant, ()))}}
    if variant in PE_WITHOUT_BATCH and named["pe"].ndim == PE_WITHOUT_BATCH[variant]:
        named["pe"] = named["pe"][None]
    return named


def _block_calls(variant, keys, outside, inside):
    """(key, what the model handed the block, what the block was handed merged) of one model call
    (cond and uncond batched: the model calls each merged block once), both ``_named``. A block
    given one rotary table for the whole batch (CogVideoX's, ``BlockArgs.pe_shared``) ToMe runs
    once per sample, each with its own plan: each sample's row of the model's call (the
    batch-less tables whole) beside the block's call for that sample, in batch order."""
    for key in keys:
        assert len(outside[key]) == 1  # one model call (cond and uncond batched)
        (given,) = outside[key]
        if variant not in COGVIDEOX or given.get("pe") is None:
            assert len(inside[key]) == 1  # the batch merged in one block call
            yield key, _named(variant, given), _named(variant, inside[key][0])
            continue
        batch = given["img"].shape[0]
        assert batch > 1 and len(inside[key]) == batch  # once per sample
        tables = {"pe", "pe[1]"}  # the (cos, sin) pair [N, D]: no batch dimension
        for i, merged in enumerate(inside[key]):
            assert merged["img"].shape[0] == 1
            row = {name: value if name in tables else value[i:i + 1] for name, value in given.items()}
            yield key, _named(variant, row), _named(variant, merged)


def _grid_starts(model, variant, key, given, n, refs):
    """Where the grid starts in a block's ``img`` and in its positions: double blocks are handed
    the image stream alone ([main image, references]), single blocks every token; the positions
    run over the whole sequence, text first, or image first (HunyuanVideo on 0.3.75)."""
    if variant.startswith(("wan", "ltx")):  # positions and tokens of the video (and its references, poses)
        return TOKENS_BEFORE.get(variant, 0), TOKENS_BEFORE.get(variant, 0)
    if variant in POSITIONS_IMAGE_FIRST:
        return 0, 0
    if variant in NEXTDIT:  # noise refiners: [grid, pads]; layers: [caption, grid, pads]
        multiple = getattr(model.model.diffusion_model, "pad_tokens_multiple", None) or 1
        text = 0 if key[0] == "noise_refiner" else given["img"].shape[1] - math.ceil(n / multiple) * multiple
        return text, text
    blocks = getattr(model.model.diffusion_model, "double_blocks", None)
    image_first = bool(blocks is not None and getattr(blocks[0], "flipped_img_txt", False))
    text = given["txt"].shape[1] if "txt" in given else given["img"].shape[1] - n - refs
    return (0 if "txt" in given or image_first else text), (0 if image_first else text)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_only_grid_tokens_merge_and_positions_follow(comfy, dits, variant):
    _, keys, n = VARIANTS[variant]
    model = dits(variant)
    inside, outside = {}, {}
    patched = tome(comfy, spy_inside(model, keys, inside), ratio=0.5).result[0]
    out = run(comfy, spy_around(patched, keys, outside), variant, steps=1)
    assert torch.isfinite(out).all()
    r = MERGED.get(variant, int(n * 0.5))
    refs = REFERENCE_TOKENS.get(variant, 0)
    for key, given, merged in _block_calls(variant, keys, outside, inside):
        x, y = given["img"], merged["img"]
        if "txt" in given:  # double blocks: the text apart
            assert torch.equal(merged["txt"], given["txt"])  # text untouched
        start, pe_start = _grid_starts(model, variant, key, given, n, refs)
        after = x.shape[1] - start - n  # reference (and, image first, text) tokens after the grid
        assert y.shape[1] == x.shape[1] - r  # the merged count the plan makes
        assert torch.equal(y[:, :start], x[:, :start])  # tokens in front: unchanged
        assert torch.equal(y[:, y.shape[1] - after:], x[:, x.shape[1] - after:])  # tokens after: unchanged
        vec = given.get("vec")
        if variant == "wan22_s2v":  # e0: a row per timestep entry, spread over x in runs; each merged token its run's
            length, entries = x.shape[1], vec.shape[1]
            run_length = -(-length // entries)  # as the block's repeat_e spreads them
            assert 1 < entries <= length // 2 and merged["vec"].shape[1] == y.shape[1]
            full_pe, merged_pe = given["pe"].flatten(2)[0], merged["pe"].flatten(2)
            for b in range(y.shape[0]):
                for row, position in zip(merged["vec"][b], merged_pe[b]):
                    index = int((full_pe == position).all(-1).nonzero()[0, 0])
                    assert torch.equal(row, vec[b, index // run_length])
        if variant == "wan22_ti2v_5b":  # the per-frame modulation follows: each merged token its frame's
            frames, per_frame = vec.shape[1], n // vec.shape[1]
            assert merged["vec"].shape[1] == y.shape[1] and frames > 1
            rows = merged["vec"].flatten(2)
            grid_pe, merged_pe = given["pe"].flatten(2)[0], merged["pe"].flatten(2)  # positions are unique
            for b in range(rows.shape[0]):
                for row, position in zip(rows[b], merged_pe[b]):
                    frame = int((grid_pe == position).all(-1).nonzero()[0, 0]) // per_frame
                    assert torch.equal(row, vec[b, frame].flatten())
            assert not torch.equal(rows[:, :per_frame], rows[:, -per_frame:])  # frames differ (frame 0 clean)
        if "pe" not in given:  # SD3: positions added to the tokens before the blocks
            continue
        pe_x, pe_y = given["pe"], merged["pe"]
        if variant == "mochi":  # rope_sin follows rope_cos: each merged row a pair of the same angles
            assert merged["rope_sin"].shape == pe_y.shape
            torch.testing.assert_close(pe_y ** 2 + merged["rope_sin"] ** 2, torch.ones_like(pe_y))
        if variant in COGVIDEOX:  # sin follows cos; still one batch-less table, the sample's own
            head_dim = model.model.diffusion_model.attention_head_dim
            assert merged["pe[1]"].shape == merged["pe"].shape[1:] == (n - r, head_dim)
            torch.testing.assert_close(pe_y[0] ** 2 + merged["pe[1]"] ** 2, torch.ones_like(pe_y[0]))
        # [B, L, ...] (Wan; LTX-Video on 0.33) or [B, 1, L, ...]
        pe_dim = 1 if variant.startswith("wan") or variant in (*NEXTDIT, "joyimage", "hidream", *ARG_NAMES, *COGVIDEOX) or (
            variant.startswith("ltx") and pe_x.shape[1] != 1) else 2
        assert pe_y.shape[pe_dim] == pe_x.shape[pe_dim] - r
        pe_after = pe_x.shape[pe_dim] - pe_start - n
        for first, count in ((0, pe_start), (pe_start + n, pe_after)):  # positions around the grid: unchanged
            kept = pe_y.narrow(pe_dim, first - (r if first else 0), count)
            assert torch.equal(kept, pe_x.narrow(pe_dim, first, count).expand_as(kept))
        # each merged grid token's position is one of the grid's own positions, none twice
        grid_pe = pe_y.narrow(pe_dim, pe_start, n - r).flatten(pe_dim + 1)
        all_pe = pe_x.narrow(pe_dim, pe_start, n).flatten(pe_dim + 1).expand(grid_pe.shape[0], *[-1] * (grid_pe.ndim - 1))
        for b in range(grid_pe.shape[0]):
            rows = grid_pe[b].movedim(pe_dim - 1, 0).flatten(1)
            full = all_pe[b].movedim(pe_dim - 1, 0).flatten(1)
            matches = (rows[:, None] == full[None]).all(-1)
            assert (matches.sum(1) >= 1).all()
    report = session_of(patched).last_report
    (level,) = report.levels
    assert set(level.tokens.values()) == {(n, n - r)}


@pytest.mark.parametrize("variant", ["flux_kontext", "wan21_i2v", "qwen_image_edit", "sd3", "hunyuan_video", "ltxv",
                                     "wan21_scail", "lumina2", "z_image", "zimage_pixel", "mage_flow", "lens",
                                     "joyimage", "wan22_s2v", "krea2", "omnigen2", "hidream", "kandinsky5", "mochi",
                                     "cogvideox_i2v", "ltxav"])
def test_reruns_bit_for_bit_rng_and_input_untouched(comfy, dits, variant):
    model = dits(variant)
    options_before = repr(model.model_options)
    # 0.4: fewer than all sources merge, so the drawn destinations matter (a tile whose every
    # source merges averages the same tokens whichever is its destination)
    patched = tome(comfy, model, ratio=0.4, use_rand=True, seed=3).result[0]
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = run(comfy, patched, variant)
    assert torch.equal(torch.get_rng_state(), state)
    second = run(comfy, patched, variant)
    assert torch.equal(first, second)
    assert repr(model.model_options) == options_before
    assert "patches_replace" not in model.model_options.get("transformer_options", {})
    assert not model.object_patches  # NextDiT's layers are reached by object patches: on the clone only
    unpatched = run(comfy, model, variant)
    # the object patches were undone when the input model was loaded: none of ours left on its modules
    assert not any(hasattr(module.forward, "tokenreduce_key") for module in model.model.diffusion_model.modules())
    assert not torch.equal(first, unpatched)  # it did merge
    other_seed = run(comfy, tome(comfy, model, ratio=0.4, use_rand=True, seed=4).result[0], variant)
    assert not torch.equal(first, other_seed)


@pytest.mark.parametrize("variant", ["flux_dev", "wan21_t2v", "qwen_image", "sd35_medium", "hunyuan_image21",
                                     "wan21_vace", "lumina2", "z_image", "zimage_pixel", "mage_flow", "lens",
                                     "joyimage", "krea2", "omnigen2", "hidream", "kandinsky5_image", "mochi",
                                     "cogvideox_inpaint", "ltxav"])
def test_ratio_zero_is_the_unpatched_model(comfy, dits, variant):
    model = dits(variant)
    assert torch.equal(run(comfy, tome(comfy, model, ratio=0.0).result[0], variant), run(comfy, model, variant))


def test_cogvideox_2b_without_rotary_positions_merges(comfy):
    """CogVideoX 2B adds its positions to the tokens before the blocks and hands them no rotary
    table (None): its blocks merge the video alone, the text untouched, reruns bit for bit (0.33
    only)."""
    if not random_dits.available("cogvideox_t2v"):
        pytest.skip("this ComfyUI has no cogvideox_t2v model")
    # width 96 (2 heads of 48): the 3-D sine positions split the width in thirds
    model = random_dits.make_dit("cogvideox_t2v", num_layers=4, use_rotary_positional_embeddings=False,
                                 attention_head_dim=48)
    keys, n = VARIANTS["cogvideox_t2v"][1:]
    inside, outside = {}, {}
    patched = tome(comfy, spy_inside(model, keys, inside), ratio=0.5).result[0]
    first = run(comfy, spy_around(patched, keys, outside), "cogvideox_t2v", steps=1)
    for key in keys:
        (given,), (merged,) = outside[key], inside[key]
        assert "pe" not in given and given["img"].shape[1] == n and merged["img"].shape[1] == n - n // 2
        assert torch.equal(merged["txt"], given["txt"])
    assert torch.equal(run(comfy, patched, "cogvideox_t2v", steps=1), first)
    assert not torch.equal(first, run(comfy, model, "cogvideox_t2v", steps=1))


def _left_alone_with_a_reference(comfy, model, variant) -> list[str]:
    """Sample ``variant`` with a reference latent (ReferenceLatent's ``reference_latents``), with
    ToMe and without: the same latent; the warnings of the patched run."""
    size = random_dits.tested_size(variant)
    latent = random_dits.latent(variant, **size)
    reference = torch.randn(latent.shape, generator=torch.Generator().manual_seed(5))
    positive, negative = ([[c, {**e, "reference_latents": [reference]}] for c, e in cond]
                          for cond in random_dits.conditioning(variant, **size))
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(0))

    def sample(m):
        with torch.inference_mode():
            return comfy.sample.sample(m, noise, 1, 2.0, "euler", "simple", positive, negative, latent, seed=0,
                                       disable_pbar=True)

    patched = tome(comfy, model).result[0]
    assert torch.equal(sample(patched), sample(model))
    return session_of(patched).last_report.warnings


def test_z_image_with_reference_images_is_left_alone_and_says_why(comfy, dits):
    """Z-Image Omni's reference images (ComfyUI 0.33: ReferenceLatent's ``ref_latents``) put tokens
    of their own before the caption and modulate them apart over token ranges the layers are given
    outside their tokens: ToMe leaves such a model call alone, as ToDo does, and says why."""
    import inspect

    from comfy.ldm.lumina.model import NextDiT

    if "ref_latents" not in inspect.signature(NextDiT._forward).parameters:
        pytest.skip("this ComfyUI's NextDiT takes no reference images")
    warnings = _left_alone_with_a_reference(comfy, dits("z_image"), "z_image")
    assert any("this Lumina 2 / Z-Image model call was left alone: its reference images (ref_latents" in w
               for w in warnings), warnings


def test_omnigen2_with_reference_images_is_left_alone_and_says_why(comfy, dits):
    """OmniGen2's reference images run through a refiner of their own the plan does not place:
    ToMe leaves such a model call alone, as ToDo does, and says why."""
    warnings = _left_alone_with_a_reference(comfy, dits("omnigen2"), "omnigen2")
    assert any("this OmniGen2 model call was left alone: its reference images run through a reference-image "
               "refiner" in w for w in warnings), warnings


def test_krea2_with_zero_timestep_references_is_left_alone_and_says_why(comfy):
    """Krea 2's index_timestep_zero references are modulated apart from a token index its blocks
    are given outside their tokens: ToMe leaves such a call alone and says why (0.33 only)."""
    if not random_dits.available("krea2_edit"):
        pytest.skip("this ComfyUI has no krea2 model")
    model = random_dits.make_dit("krea2_edit", layers=4)
    patched = tome(comfy, model).result[0]
    assert torch.equal(run(comfy, patched, "krea2_edit", steps=1), run(comfy, model, "krea2_edit", steps=1))
    warnings = session_of(patched).last_report.warnings
    assert any("this Krea 2 model call was left alone: its references (reference_latents_method "
               "index_timestep_zero)" in w for w in warnings), warnings


def test_kandinsky5_with_nabla_beyond_40_frames_is_left_alone_and_says_why(comfy, monkeypatch):
    """Where Kandinsky 5's self-attention takes NABLA's ``sparse_params`` (a stand-in on 0.33), more
    than 40 latent frames are attended over the whole grid in NABLA's own order: ToMe leaves those
    model calls alone and says why, as ToDo does."""
    from test_comfy_dit_inputs_inprocess import _long_run, with_nabla

    if not random_dits.available("kandinsky5"):
        pytest.skip("this ComfyUI has no kandinsky5 model")
    model = with_nabla(random_dits.make_dit("kandinsky5", num_visual_blocks=3), monkeypatch)
    patched = tome(comfy, model).result[0]
    assert torch.equal(_long_run(comfy, patched), _long_run(comfy, model))
    report = session_of(patched).last_report
    assert report.levels == () and report.skipped_calls == 0
    (warning,) = [w for w in report.warnings if "NABLA" in w]
    assert "this Kandinsky 5 model call was left alone: with more than 40 latent frames (41 here)" in warning
    assert "NABLA sparse attention" in warning and "never reaches the host's attention" in warning


def test_families_without_a_description_are_refused(comfy):
    if not random_dits.available("cosmos_predict2_t2i"):
        pytest.skip("this ComfyUI has no cosmos_predict2_t2i model")
    model = random_dits.make_dit("cosmos_predict2_t2i")
    with pytest.raises(ValueError, match=r"ToMe does not merge whole blocks of Cosmos Predict2 image: its model calls "
                       r"its blocks directly \(no block-replace lookup\), which ToMe reaches only through a layer "
                       r"call it describes, and its blocks take the latent as a \[B, T, H, W, D\] grid"):
        tome(comfy, model)


@pytest.mark.parametrize("variant", ["minimax_h3"])
def test_families_reached_but_not_described_are_refused_with_their_reason(comfy, variant):
    # 0.33 only: MiniMax-H3 (a packed sequence without a batch, modulation by token ranges)
    if not random_dits.available(variant):
        pytest.skip(f"this ComfyUI has no {variant} model")
    name = random_dits.FIXTURES[variant].family
    family = next(f for f in sys.modules["tokenreduce_pack.tokenreduce.families"].FAMILIES if f.name == name)
    with pytest.raises(ValueError) as refused:
        tome(comfy, random_dits.make_dit(variant))
    assert f"ToMe does not merge whole blocks of {name}: {family.merge_refusal} (it does on " in str(refused.value)
    assert f"use Token Downsampling (ToDo, TokenReduce), which supports {name}" in str(refused.value)


def _ltx2_spy(model, keys, records):
    """A clone of the LTX-2 ``model`` whose block replacements at ``keys`` record what they are given
    (video, audio, the video's timestep rows, the audio's positions), then call the replacement that
    was there (ToMe's: what the model hands it) or the block (inside ToMe's: the merged call)."""
    clone = model.clone()
    found = clone.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    for kind, number in keys:
        def spy(args, extra, key=(kind, number), previous=found.get((kind, number))):
            vx, ax = args["img"]
            # the video's timestep rows (of the host's CompressedTimestep objects): its own and the
            # audio<->video cross-attention's
            rows = [t if torch.is_tensor(t) else t.data for t in (args[name] for name in (
                "v_timestep", "v_cross_scale_shift_timestep", "v_cross_gate_timestep"))]
            records.setdefault(key, []).append((vx.clone(), ax.clone(), rows[0].clone(), args["a_pe"][0].clone(),
                                                [r.clone() for r in rows]))
            return previous(args, extra) if previous is not None else extra["original_block"](args)
        clone.set_model_patch_replace(spy, "dit", kind, number)
    return clone


def test_ltx2_merges_the_video_alone_and_the_audio_comes_out_as_unmerged(comfy, dits):
    """LTX-2 (0.33 only): each merged block is handed the video merged and the audio whole (its
    tokens and positions as the model gives them); with the audio<->video cross-attention cut
    (LTXVModalityGuidance's pass) the audio comes out bit for bit as unmerged, the video not."""
    _, keys, n = VARIANTS["ltxav"]
    model = dits("ltxav")
    severed = model.clone()
    severed.model_options["transformer_options"] = {**model.model_options.get("transformer_options", {}),
                                                    "a2v_cross_attn": False, "v2a_cross_attn": False}
    inside, outside = {}, {}
    patched = tome(comfy, _ltx2_spy(severed, keys, inside), ratio=0.5).result[0]
    merged = run(comfy, patched, "ltxav", steps=1)
    unmerged = run(comfy, _ltx2_spy(severed, keys, outside), "ltxav", steps=1)
    video = 128 * n  # the run's output: [video, audio] flattened per sample
    assert torch.equal(merged[:, video:], unmerged[:, video:]) and not torch.equal(merged[:, :video], unmerged[:, :video])
    for key in keys:
        ((vx, ax, rows, a_pe, _),), ((full_vx, full_ax, full_rows, full_a_pe, _),) = inside[key], outside[key]
        assert full_vx.shape[1] == n and vx.shape[1] == n - n // 2  # the video merged
        assert torch.equal(ax, full_ax) and torch.equal(a_pe, full_a_pe) and ax.shape[1] > 0  # the audio whole
        assert rows.shape[1] == full_rows.shape[1] == 1  # one timestep per sample: the host's object as it is


def test_ltx2_per_frame_timesteps_follow_the_merged_video_beside_the_audio(comfy, dits, monkeypatch):
    """LTX-2 with its first frame kept clean (a noise mask per stream, as LTXVConcatAVLatent makes
    it) and the audio beside (0.33 only): the video's three timestep modulations come a row per
    latent frame (CompressedTimestep), and each merged token gets its own frame's rows, in the
    audio<->video cross-attention too."""
    from comfy.nested_tensor import NestedTensor

    def first_frame_clean(latent):
        video, audio = latent.unbind()
        mask = torch.ones_like(video)
        mask[:, :, :1] = 0.0
        return NestedTensor((mask, torch.ones_like(audio)))

    monkeypatch.setitem(random_dits.FIXTURES, "ltxav", random_dits.FIXTURES["ltxav"]._replace(mask=first_frame_clean))
    _, keys, n = VARIANTS["ltxav"]
    inside, outside = {}, {}
    patched = tome(comfy, _ltx2_spy(dits("ltxav"), keys, inside), ratio=0.5).result[0]
    assert torch.isfinite(run(comfy, _ltx2_spy(patched, keys, outside), "ltxav", steps=1, cfg=1.0)).all()
    per_frame = n // 3
    for key in keys:
        ((vx, _, _, _, merged_rows),), ((full_vx, _, _, _, full_rows),) = inside[key], outside[key]
        assert vx.shape[1] == n - n // 2
        for rows, full, per_noise in zip(merged_rows, full_rows, (True, True, False)):  # the gate: the audio's
            assert full.shape[1] == 3 and torch.equal(full[:, 0], full[:, 1]) != per_noise  # a row per frame
            assert rows.shape[1] == vx.shape[1]  # a row per merged token: its frame's
            for j in range(vx.shape[1]):  # a token kept as it was: the row of the frame it is in
                found = {i // per_frame for i in range(n) if torch.equal(full_vx[0, i], vx[0, j])}
                if len(found) == 1:
                    assert torch.equal(rows[0, j], full[0, found.pop()])


def test_ltx2_merges_in_stg_and_with_a_stream_switched_off(comfy, dits):
    """LTX-2's other passes (0.33 only): STG's (a merged block's self-attentions pass their values)
    and the audio stream off merge; with the video stream off its tokens come back unchanged from
    every block, so the video comes out exactly as unmerged."""
    model = dits("ltxav")
    for options in ({"stg_self_attn_blocks": frozenset({1})}, {"run_ax": False}, {"run_vx": False}):
        base = model.clone()
        base.model_options["transformer_options"] = {**model.model_options.get("transformer_options", {}), **options}
        patched = tome(comfy, base, ratio=0.5).result[0]
        merged = run(comfy, patched, "ltxav", steps=1, cfg=1.0)
        assert torch.isfinite(merged).all() and session_of(patched).last_report.levels, options
    video = 128 * VARIANTS["ltxav"][2]
    assert torch.equal(merged[:, :video], run(comfy, base, "ltxav", steps=1, cfg=1.0)[:, :video])


def test_ltx2_guides_stay_whole_and_per_frame_timesteps_follow(comfy, dits, monkeypatch):
    """LTX-2 with a guide frame at strength 1 (0.33 only): its tokens after the video stay whole,
    and the video's per-frame timesteps (a CompressedTimestep row per latent frame, the guide's
    clean) reach each merged token as its own frame's row. At another strength the host weights the
    attention to the guide with a mask over the unmerged tokens: that call is left alone, said."""
    guide = sys.modules[random_dits.FIXTURES["ltxav_guide"].latent.__module__]
    _, keys, n = VARIANTS["ltxav"]
    model = dits("ltxav")
    monkeypatch.setattr(guide, "GUIDE_STRENGTH", 1.0)
    inside, outside = {}, {}
    patched = tome(comfy, _ltx2_spy(model, keys, inside), ratio=0.5).result[0]
    run(comfy, _ltx2_spy(patched, keys, outside), "ltxav_guide", steps=1, cfg=1.0)
    per_frame = n // 3
    for key in keys:
        ((vx, _, rows, _, _),), ((full_vx, _, full_rows, _, _),) = inside[key], outside[key]
        assert full_vx.shape[1] == n + per_frame and vx.shape[1] == n + per_frame - n // 2
        assert torch.equal(vx[:, -per_frame:], full_vx[:, -per_frame:])  # the guide's tokens: after, whole
        assert full_rows.shape[1] == 4 and not torch.equal(full_rows[:, 0], full_rows[:, 3])  # a row per frame
        assert rows.shape[1] == vx.shape[1] and torch.equal(rows[:, -per_frame:], full_rows[:, 3:].expand_as(rows[:, -per_frame:]))
        grid_rows = rows[:, :n - n // 2]
        assert torch.equal(grid_rows, full_rows[:, :1].expand_as(grid_rows))  # the video's frames share their timestep
    assert session_of(patched).last_report.levels
    monkeypatch.setattr(guide, "GUIDE_STRENGTH", 0.5)
    patched = tome(comfy, model).result[0]
    assert torch.equal(run(comfy, patched, "ltxav_guide", steps=1, cfg=1.0), run(comfy, model, "ltxav_guide", steps=1, cfg=1.0))
    assert any("this LTX-2 model call was left alone: its guides weight the video's attention" in w
               for w in session_of(patched).last_report.warnings)


def test_info_says_how_auto_decides(comfy, dits):
    output = tome(comfy, dits("flux_dev"))
    info = output.result[1]
    assert "whole blocks merged (1 double blocks, 1 single blocks" in info
    assert ("reduce_when auto: on a CPU every block is merged, untimed; on a GPU (any other device) each kind of "
            "block is merged only where timing one there, unmerged and merged (plan, merge, block, restore), shows "
            "that it pays") in info
    assert "reduce_when always: reduced wherever set." in tome(comfy, dits("flux_dev"), reduce_when="always").result[1]


# wan22_s2v: on 0.3.75 its blocks get the call's options only through the pack's hand-over
@pytest.mark.parametrize("variant", ["flux_dev", "wan21_t2v", "lumina2", "z_image", "wan22_s2v", "kandinsky5",
                                     "mochi", "hidream", "omnigen2", "krea2", "cogvideox_t2v", "ltxav"])
def test_stacks_with_todo_in_both_orders(comfy, dits, variant):
    """ToDo reduces the keys and values of the blocks ToMe merged too (their grid: the merged
    tokens), the same whichever node is applied first: no call is left alone, the report shows
    the merged blocks' keys reduced, and reruns are bit for bit."""
    _stacks_with_todo(comfy, dits(variant), lambda m: run(comfy, m, variant), VARIANTS[variant][2])


def _stacks_with_todo(comfy, model, sample, grid_tokens):
    """ToMe then ToDo and ToDo then ToMe on ``model``, each sampled by ``sample``: the same latent,
    reruns bit for bit, ToDo acting in the merged blocks too, no call left alone."""
    todo_settings = dict(skip_first_blocks=0, skip_last_blocks=0)
    tome_then_todo = todo(comfy, tome(comfy, model).result[0], **todo_settings).result[0]
    todo_then_tome = tome(comfy, todo(comfy, model, **todo_settings).result[0]).result[0]
    a, b = sample(tome_then_todo), sample(todo_then_tome)
    assert torch.isfinite(a).all() and torch.equal(a, b)
    assert torch.equal(sample(tome_then_todo), a)  # reruns bit for bit
    only_tome = sample(tome(comfy, model).result[0])
    assert not torch.equal(a, only_tome)  # ToDo acted too
    for patched in (tome_then_todo, todo_then_tome):
        sessions = {s.label: s for s in sys.modules["tokenreduce_pack.nodes.session"].sessions_of(patched)}
        report = sessions["TokenReduceToDo"].last_report
        assert report.skipped_calls == 0 and not report.warnings
        (level,) = report.levels
        before, after = level.tokens["k/v in merged blocks"]
        assert after < before < grid_tokens  # ToDo's kept keys of ToMe's merged grid
        assert sessions["TokenReduceToMe"].last_report.levels


def _first_merged_keys(comfy, model, variant):
    """(keys, the merge, the key dimension) of the first attention call of a merged block."""
    found = []

    def probe(func, *args, **kwargs):
        options = kwargs["transformer_options"]
        merged = options.get("tokenreduce:merged grid")
        if merged is not None and not found and not options.get("tokenreduce:measuring"):
            found.append((args[1].clone(), merged, 2 if kwargs.get("skip_reshape") else 1))
        return func(*args, **kwargs)

    probed = model.clone()
    install_probe(probed, probe)
    return probed, found


@pytest.mark.parametrize("variant", ["flux_dev", "wan21_t2v"])
def test_todo_in_a_merged_block_keeps_merged_grid_keys_and_the_text(comfy, dits, variant):
    """In the first merged block (ToDo reducing the merged blocks only, so both runs reach it with
    the same inputs) the keys ToDo hands on are the block's own keys at ToDo's index: the tokens
    around the grid all kept, in order; of the grid, the merged tokens ToDo's kept positions were
    merged into."""
    model = dits(variant)
    full, full_found = _first_merged_keys(comfy, model, variant)
    reduced, reduced_found = _first_merged_keys(comfy, model, variant)
    run(comfy, tome(comfy, full).result[0], variant, steps=1)
    run(comfy, todo(comfy, tome(comfy, reduced).result[0]).result[0], variant, steps=1)
    (k_full, plan, dim), = full_found
    (k_reduced, plan_reduced, _), = reduced_found
    n, m, length = plan.tokens, plan.merged_tokens, k_full.shape[dim]
    assert torch.equal(plan.restore_map, plan_reduced.restore_map)
    start = {"flux_dev": length - m, "wan21_t2v": 0}[variant]  # Flux: text first; Wan: the video alone
    kept = k_reduced.shape[dim] - (length - m)
    assert 0 < kept < m
    assert torch.equal(k_reduced.narrow(dim, 0, start), k_full.narrow(dim, 0, start))  # the text as it is
    end = start + m
    assert torch.equal(k_reduced.narrow(dim, start + kept, length - end), k_full.narrow(dim, end, length - end))
    grid_keys, merged_keys = k_reduced.narrow(dim, start, kept), k_full.narrow(dim, start, m)
    for batch in range(k_full.shape[0]):  # every kept grid key is one of the block's merged tokens
        rows = grid_keys[batch].movedim(dim - 1, 0).flatten(1)
        merged_rows = merged_keys[batch].movedim(dim - 1, 0).flatten(1)
        assert (rows[:, None] == merged_rows[None]).all(-1).any(1).all()
    assert n > m


def _compiled(comfy, model, variant):
    """Two sampling runs (2 and 3 steps, other seeds) of a compiled clone: dynamo's counters and outputs."""
    import torch._dynamo
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = model.clone()
    set_torch_compile_wrapper(compiled, backend="eager")
    outputs = [run(comfy, compiled, variant, steps=2), run(comfy, compiled, variant, steps=3, seed=5)]
    result = {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values()), "reasons": dict(counters["graph_break"]),
              "outputs": outputs}
    torch._dynamo.reset()
    return result


@pytest.mark.parametrize("variant", ["flux_kontext", "wan21_t2v", "lumina2"])
def test_compiles_without_graph_breaks_or_recompiles(comfy, dits, variant, monkeypatch):
    import importlib

    import comfy.ldm.modules.attention as attention

    # PyTorch SDPA everywhere (ComfyUI's CPU default asks psutil for free memory: a graph break of
    # the host's own), also where a model module imported the backend by name
    for name in ("comfy.ldm.modules.attention", "comfy.ldm.wan.model", "comfy.ldm.flux.math"):
        module = importlib.import_module(name)
        if hasattr(module, "optimized_attention"):
            monkeypatch.setattr(module, "optimized_attention", attention.attention_pytorch)
    lumina = importlib.import_module("comfy.ldm.lumina.model")  # NextDiT's layers: through object patches
    monkeypatch.setattr(lumina, "optimized_attention_masked", attention.attention_pytorch)
    model = dits(variant)
    unpatched = _compiled(comfy, model, variant)
    patched = tome(comfy, model).result[0]
    ours = _compiled(comfy, patched, variant)
    # no graph break and no graph of its own (no recompile per step or per run)
    assert unpatched["breaks"] == 0 and ours["breaks"] == 0, ours["reasons"]
    assert ours["graphs"] <= unpatched["graphs"]
    eager = run(comfy, patched, variant, steps=3, seed=5)
    assert torch.allclose(ours["outputs"][1], eager, rtol=1e-4, atol=1e-5)
    # stacked with ToDo, which reduces the merged blocks' keys too
    stacked = todo(comfy, patched, skip_first_blocks=0, skip_last_blocks=0).result[0]
    both = _compiled(comfy, stacked, variant)
    assert both["breaks"] == 0 and both["graphs"] <= unpatched["graphs"], both["reasons"]
    eager = run(comfy, stacked, variant, steps=3, seed=5)
    assert torch.allclose(both["outputs"][1], eager, rtol=1e-4, atol=1e-5)


# --- reduce_when auto: each kind of block timed merged and unmerged (scripted clock) -------------

def _auto(store, model):
    report = session_of(model).last_report
    return [(site, d.reduce, d.source) for site, d in report.decisions], store.measurements


@pytest.mark.parametrize("variant", ["flux_dev", "wan21_t2v", "lumina2", "hidream"])
def test_auto_merges_the_kinds_of_block_where_merging_is_faster(comfy, dits, measuring, variant):
    model = dits(variant)
    store = measuring((10.0, 8.0))
    patched = tome(comfy, model, ratio=0.5).result[0]
    first = run(comfy, patched, variant)
    decided, measured = _auto(store, patched)
    kinds = {kind for kind, _ in VARIANTS[variant][1]}
    assert measured == len(kinds) and [reduce for _, reduce, _ in decided] == [True] * len(kinds)
    assert all(source == "measured" for _, _, source in decided)
    assert all(any(kind.replace("_", " ") in site for kind in kinds) for site, _, _ in decided)  # its kind of block
    assert store.stopwatch.compiling and not any(store.stopwatch.compiling)
    always = run(comfy, tome(comfy, model, ratio=0.5, reduce_when="always").result[0], variant)
    assert torch.equal(first, always)  # measuring changed nothing of the run
    assert torch.equal(run(comfy, patched, variant), first) and store.measurements == measured  # kept


@pytest.mark.parametrize("variant", ["flux_kontext", "wan21_i2v"])
def test_auto_leaves_blocks_alone_where_merging_is_slower(comfy, dits, measuring, variant):
    model = dits(variant)
    store = measuring((10.0, 11.0))
    patched = tome(comfy, model, ratio=0.5).result[0]
    first = run(comfy, patched, variant)
    assert torch.equal(first, run(comfy, model, variant))  # bit for bit the unpatched model
    decided, measured = _auto(store, patched)
    assert measured >= 1 and not any(reduce for _, reduce, _ in decided)
    report = session_of(patched).last_report
    assert not report.levels and not report.active_steps
    # Another node output: the decisions are kept (memory and file), nothing measured again.
    again = tome(comfy, model, ratio=0.5).result[0]
    assert torch.equal(run(comfy, again, variant), first) and store.measurements == measured
    assert {source for _, _, source in _auto(store, again)[0]} == {"kept"}


def test_auto_decides_per_kind_of_block(comfy, dits, measuring):
    model = dits("flux_dev")
    store = measuring((10.0, 8.0), (10.0, 11.0))  # the first kind met gains, the second loses
    records = {}
    patched = tome(comfy, spy_inside(model, VARIANTS["flux_dev"][1], records), ratio=0.5).result[0]
    first = run(comfy, patched, "flux_dev")
    decided, measured = _auto(store, patched)
    assert measured == 2 and [reduce for _, reduce, _ in decided] == [True, False]
    records.clear()  # the timed blocks ran the spy too: what a run with kept decisions hands it
    assert torch.equal(run(comfy, patched, "flux_dev"), first) and store.measurements == 2
    merged_kind = decided[0][0].split()[1]  # "Flux.1 double blocks, ..." -> "double"
    unmerged = {}
    run(comfy, spy_inside(model, VARIANTS["flux_dev"][1], unmerged), "flux_dev")
    for key, calls in records.items():
        lengths, full = {c["img"].shape[1] for c in calls}, {c["img"].shape[1] for c in unmerged[key]}
        merged = key[0].startswith(merged_kind)
        assert (max(lengths) < min(full)) if merged else lengths == full, (key, lengths, full)


def test_auto_on_the_cpu_merges_everywhere_untimed(comfy, dits):
    model = dits("flux_dev")
    patched = tome(comfy, model, ratio=0.5).result[0]
    out = run(comfy, patched, "flux_dev")
    assert torch.equal(out, run(comfy, tome(comfy, model, ratio=0.5, reduce_when="always").result[0], "flux_dev"))
    assert not session_of(patched).last_report.decisions


def test_a_block_that_changes_its_input_in_place_keeps_its_change(comfy, dits):
    """ComfyUI's Flux blocks add to their input in place under inference mode (``x += ...``): the
    change restored must be the block's, not zero (the merged input is changed by the block)."""
    clone = dits("flux_dev").clone()
    clone.set_model_patch_replace(lambda args, extra: {"img": args["img"].add_(0.5), "txt": args["txt"]},
                                  "dit", "double_block", 1)
    patched = tome(comfy, clone, ratio=0.5).result[0]
    changes = []
    around = patched.clone()
    ours = around.model_options["transformer_options"]["patches_replace"]["dit"][("double_block", 1)]

    def wrap(args, extra):
        before = args["img"].clone()
        out = ours(args, extra)
        changes.append(out["img"] - before)
        return out
    around.set_model_patch_replace(wrap, "dit", "double_block", 1)
    run(comfy, around, "flux_dev")
    assert changes and session_of(patched).last_report.levels
    for change in changes:
        torch.testing.assert_close(change, torch.full_like(change, 0.5))


def test_auto_that_leaves_every_kind_alone_steps_aside_after_the_first_call(comfy, dits, measuring, monkeypatch):
    """Where auto leaves every kind of block alone, later model calls of the run read no noise level
    and lay out no tokens (a cached lookup per call), and their contexts are off from the first."""
    import sys

    run_module = sys.modules["tokenreduce_pack.tokenreduce.run"]
    patch_class = sys.modules["tokenreduce_pack.tokenreduce.tome_dit"].ToMeDiTPatch
    model = dits("wan21_t2v")
    store = measuring((10.0, 11.0))
    run(comfy, tome(comfy, model, ratio=0.5, use_rand=True).result[0], "wan21_t2v")  # decides: kept
    measured = store.measurements
    counts, active = spy_stepping_aside(monkeypatch, run_module, {"sigma": (run_module.RunState, "sigma"),
                                                                  "tiles": (patch_class, "_tiles")})
    patched = tome(comfy, model, ratio=0.5, use_rand=True).result[0]
    assert torch.equal(run(comfy, patched, "wan21_t2v", steps=3), run(comfy, model, "wan21_t2v", steps=3))
    assert store.measurements == measured
    assert len(active) >= 3 and not any(active)
    assert len(counts["tiles"]) == 1 and len(counts["sigma"]) <= 1  # the first call only


# --- stride_t: tiles across latent frames on video DiTs --------------------------------------

def _plans_of(model, key):
    """A clone that keeps the merge each call of the block at ``key`` runs with (applied before
    ToMe: ours hands it the merged arguments and its plan in the options)."""
    plans, clone = [], model.clone()

    def keep(args, extra):
        plans.append(args["transformer_options"].get("tokenreduce:merged grid"))
        return extra["original_block"](args)
    clone.set_model_patch_replace(keep, "dit", *key)
    return clone, plans


def test_stride_t_merges_across_frames_and_leaves_the_first_whole(comfy, dits):
    """Wan's tiny grid is 3 latent frames of 8x6: with stride_t 2 every tile spans frames 1 and 2
    (frame 0, a causal VAE's lone first frame, stays whole), so merged tokens stand for two frames;
    the ratio's count merges, reruns are bit for bit and the info says it."""
    from test_comfy_dit_inprocess import warnings_of

    model = dits("wan21_t2v")
    spied, plans = _plans_of(model, ("double_block", 1))
    output = tome(comfy, spied, ratio=0.5, stride_t=2, use_rand=True, seed=3)
    patched = output.result[0]
    assert "tiles 2x2 x 2 latent frames" in output.result[1] and warnings_of(output) == []
    first = run(comfy, patched, "wan21_t2v", steps=1)
    (plan,) = plans
    n, per_frame = 3 * 48, 48
    assert plan.r == int(n * 0.5) and plan.tiles.extra_index.tolist() == list(range(per_frame))
    for b in range(plan.restore_map.shape[0]):
        groups = {}
        for position, row in enumerate(plan.restore_map[b].tolist()):
            groups.setdefault(row, set()).add(position // per_frame)
        assert all(frames in ({0}, {1}, {2}, {1, 2}) for frames in groups.values())
        assert any(frames == {1, 2} for frames in groups.values())
    assert torch.equal(run(comfy, patched, "wan21_t2v", steps=1), first)
    per_frame_tiles = run(comfy, tome(comfy, model, ratio=0.5, use_rand=True, seed=3).result[0], "wan21_t2v", steps=1)
    assert not torch.equal(first, per_frame_tiles)
    assert "(frames not merged: stride_t 1)" in tome(comfy, model).result[1]


def test_stride_t_raises_the_ratio_cap_on_video_only(comfy, dits):
    """With strides 2, 2, 2 a ratio up to 1 - 1/8 is accepted (queued and run) on a video DiT; on
    an image DiT, where stride_t does nothing, a ratio above 1 - 1/4 is refused with the reason,
    and a lower one runs with a warning that stride_t does nothing."""
    from test_comfy_dit_inprocess import warnings_of

    node = comfy.pack.ToMePatchNode
    values = {**{spec.name: spec.default for spec in node.METHOD.inputs}, "stride_t": 2}
    assert node.validate_inputs(**{**values, "ratio": 0.875}) is True
    refused = node.validate_inputs(**{**values, "ratio": 0.9})
    assert "with strides 2x2 and stride_t 2" in refused and "1 - 1/(2*2*2) = 0.875" in refused
    assert "1 - 1/(2*2) = 0.75" in node.validate_inputs(**{**values, "stride_t": 1, "ratio": 0.8})
    wan = tome(comfy, dits("wan21_t2v"), ratio=0.875, stride_t=2)
    assert warnings_of(wan) == []
    run(comfy, wan.result[0], "wan21_t2v", steps=1)
    (level,) = session_of(wan.result[0]).last_report.levels
    assert set(level.tokens.values()) == {(144, 144 - 84)}  # every source of frames 1-2 (frame 0 whole)
    with pytest.raises(ValueError, match=r"TokenReduceToMe: ratio 0\.875 cannot be reached on this Flux") as error:
        tome(comfy, dits("flux_dev"), ratio=0.875, stride_t=2)
    assert "no latent frames, so stride_t 2 does nothing" in str(error.value)
    assert "at most 1 - 1/(2*2) = 0.75" in str(error.value)
    flux = tome(comfy, dits("flux_dev"), ratio=0.5, stride_t=2)
    assert warnings_of(flux) == ["WARNING: stride_t 2 does nothing: Flux.1 has no latent frames (only video DiTs "
                                 "merge across frames)."]


def test_stride_t_partial_frame_tiles_warn_once(comfy, dits):
    """Wan's tiny grid has 3 latent frames: with stride_t 2 or 3 the first stays whole (in no tile of
    frames), so ratio 0.875 merges 84 of the 126 tokens it asks: the run's report says so once (two
    steps, cond and uncond), with why and, as no frame count or stride_t would merge 126, the ratio
    that merges what it can; ratio 0.5 (72 asked, 84 can merge) is not warned."""
    model = dits("wan21_t2v")
    capped = tome(comfy, model, ratio=0.875, stride_t=2).result[0]
    run(comfy, capped, "wan21_t2v", steps=2)
    (warning,) = session_of(capped).last_report.warnings
    assert warning.startswith("TokenReduceToMe: ratio 0.875 asks 126 of the 144 grid tokens of this Wan 2.1 / 2.2 call "
                              "(3 frames × 6×8) to merge, but 84 merge: with stride_t 2 its first latent frame is kept "
                              "whole")
    assert warning.endswith("Set ratio 0.58 or lower, which merges what this call can.")
    for settings, merged in (({"ratio": 0.875, "stride_t": 3}, 84), ({"ratio": 0.5, "stride_t": 2}, 72),
                             ({"ratio": 0.5, "stride_t": 3}, 72)):
        patched = tome(comfy, model, **settings).result[0]
        run(comfy, patched, "wan21_t2v", steps=1)
        report = session_of(patched).last_report
        assert len(report.warnings) == (merged < int(144 * settings["ratio"]))
        assert {t for level in report.levels for t in level.tokens.values()} == {(144, 144 - merged)}


# --- plan_every: the shared plan reused across steps ---------------------------------------------

def _counting_plans(monkeypatch, module: str, name: str) -> list:
    """Every plan made through ``module.name``, as the batch size it was made for."""
    target = sys.modules[f"tokenreduce_pack.tokenreduce.{module}"]
    made, original = [], getattr(target, name)
    monkeypatch.setattr(target, name, lambda tokens, *a, **k: made.append(tokens.shape[0]) or original(tokens, *a, **k))
    return made


def test_plan_every_reuses_the_shared_plan_across_steps(comfy, dits, monkeypatch):
    """Flux.1, 3 steps, cond and uncond batched: one plan per step with share_plans, one per
    plan_every steps with it (steps 1 and 3 at 2), made anew in every run (also after an
    interrupt); split cond and uncond calls each keep their own plan, so the result is the
    batched one; plan_every 1 is a workflow without it."""
    import comfy.model_management as mm

    from comfy_helpers import batching_tolerance, rel_error, split_cond_uncond

    model = dits("flux_dev")
    made = _counting_plans(monkeypatch, "tome_dit", "plan_block")
    every_step = run(comfy, tome(comfy, model, share_plans=True).result[0], "flux_dev", steps=3)
    assert made == [2] * 3
    assert torch.equal(run(comfy, tome(comfy, model, share_plans=True, plan_every=1).result[0], "flux_dev", steps=3),
                       every_step)
    reusing = tome(comfy, model, share_plans=True, plan_every=2).result[0]
    made.clear()
    first = run(comfy, reusing, "flux_dev", steps=3)
    assert made == [2, 2] and not torch.equal(first, every_step)
    assert rel_error(first, every_step) < 0.5

    calls = []

    def interrupt(args, extra):
        calls.append(1)
        if len(calls) == 2:  # in the second step, which reuses the first one's plan
            raise mm.InterruptProcessingException()
        return extra["original_block"](args)

    doomed = reusing.clone()
    doomed.set_model_patch_replace(interrupt, "dit", "double_block", 0)
    with pytest.raises(mm.InterruptProcessingException):
        run(comfy, doomed, "flux_dev", steps=3)
    assert session_of(reusing).run is None
    made.clear()
    assert torch.equal(run(comfy, reusing, "flux_dev", steps=3), first) and made == [2, 2]  # a new run plans anew

    made.clear()
    split = run(comfy, split_cond_uncond(reusing), "flux_dev", steps=3)
    assert made == [1, 1, 1, 1]  # cond and uncond: each its own plan, at steps 1 and 3
    tolerance = batching_tolerance(run(comfy, split_cond_uncond(model), "flux_dev", steps=3),
                                   run(comfy, model, "flux_dev", steps=3))
    assert rel_error(split, first) < tolerance


# --- Wan HuMo: its audio cross-attention splits a block's tokens into equal groups, one per
# frame, so ToMe merges it frame by frame (DiTMerge.frame_grouped); without a reference latent only

HUMO_KEYS = [("double_block", 1), ("double_block", 2)]
HUMO_FRAMES, HUMO_FRAME_TOKENS = 3, 48  # 3 latent frames of 8x6 tokens


@pytest.fixture(scope="module")
def humo(comfy):
    if not random_dits.available("wan21_humo"):
        pytest.skip("this ComfyUI has no Wan HuMo model")
    return random_dits.make_dit("wan21_humo", num_layers=4)


def _humo_run(comfy, model, reference=False, steps=2, audio_frames=None):
    """Wan HuMo sampled with WanHuMoImageToVideo's audio windows (padded with zeros to
    ``audio_frames``), and its reference frame only where ``reference``."""
    size = random_dits.tested_size("wan21_humo")

    def extras(e):
        e = {k: v for k, v in e.items() if reference or k != "reference_latents"}
        if audio_frames is not None:
            audio = e["audio_embed"]
            e["audio_embed"] = torch.cat([audio, audio.new_zeros(1, audio_frames - audio.shape[1], *audio.shape[2:])], 1)
        return e

    positive, negative = ([[c, extras(e)] for c, e in cond] for cond in random_dits.conditioning("wan21_humo", **size))
    latent = random_dits.latent("wan21_humo", **size)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        return comfy.sample.sample(model, noise, steps, 2.0, "euler", "simple", positive, negative, latent, seed=0,
                                   disable_pbar=True)


def test_humo_merges_every_frame_alike_in_frame_order(comfy, humo):
    """Each frame merges the same count of its own tokens and the merged tokens are frame by frame
    (the audio cross-attention's groups), the text untouched, the positions following."""
    inside, outside = {}, {}
    patched = tome(comfy, spy_inside(humo, HUMO_KEYS, inside), ratio=0.5).result[0]
    assert torch.isfinite(_humo_run(comfy, spy_around(patched, HUMO_KEYS, outside), steps=1)).all()
    n = HUMO_FRAMES * HUMO_FRAME_TOKENS
    per_frame = n // 2 // HUMO_FRAMES
    for key in HUMO_KEYS:
        (given,), (merged,) = outside[key], inside[key]
        assert given["img"].shape[1] == n and merged["img"].shape[1] == per_frame * HUMO_FRAMES
        assert torch.equal(merged["txt"], given["txt"])
        full_pe, merged_pe = given["pe"].flatten(2)[0], merged["pe"].flatten(2)
        assert merged_pe.shape[0] == 2  # cond and uncond, each its own merge
        for rows in merged_pe:
            index = torch.tensor([int((full_pe == row).all(-1).nonzero()[0, 0]) for row in rows])
            assert len(set(index.tolist())) == len(index)
            assert torch.equal(index // HUMO_FRAME_TOKENS, torch.arange(HUMO_FRAMES).repeat_interleave(per_frame))
    (level,) = session_of(patched).last_report.levels
    assert set(level.tokens.values()) == {(n, per_frame * HUMO_FRAMES)}


def test_humo_reruns_bit_for_bit_input_untouched_and_ratio_zero_is_unpatched(comfy, humo):
    options_before = repr(humo.model_options)
    patched = tome(comfy, humo, ratio=0.4, use_rand=True, seed=3).result[0]
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = _humo_run(comfy, patched)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(_humo_run(comfy, patched), first)
    assert not session_of(patched).last_report.warnings
    assert repr(humo.model_options) == options_before
    unpatched = _humo_run(comfy, humo)
    assert not torch.equal(first, unpatched)  # it did merge
    assert torch.equal(_humo_run(comfy, tome(comfy, humo, ratio=0.0).result[0]), unpatched)


def test_humo_stacks_with_todo_in_both_orders(comfy, humo):
    _stacks_with_todo(comfy, humo, lambda m: _humo_run(comfy, m), HUMO_FRAMES * HUMO_FRAME_TOKENS)


def test_humo_with_a_reference_frame_or_stride_t_is_left_alone_or_refused(comfy, humo):
    """WanHuMoImageToVideo's reference frame (never merged) would be a larger group than a merged
    frame: that call is left alone and said, as one whose audio frames are not its latent frames;
    stride_t > 1 (tiles across frames) is refused."""
    patched = tome(comfy, humo).result[0]
    assert torch.equal(_humo_run(comfy, patched, reference=True, steps=1), _humo_run(comfy, humo, reference=True, steps=1))
    warnings = session_of(patched).last_report.warnings
    assert any("left alone" in warning and "reference frame" in warning for warning in warnings), warnings
    # audio of a frame more than the video: the groups are not its frames (the host runs it unmerged)
    patched = tome(comfy, humo).result[0]
    more = HUMO_FRAMES + 1
    assert torch.equal(_humo_run(comfy, patched, steps=1, audio_frames=more),
                       _humo_run(comfy, humo, steps=1, audio_frames=more))
    warnings = session_of(patched).last_report.warnings
    assert any(f"split their tokens into {more} equal groups" in warning for warning in warnings), warnings
    with pytest.raises(ValueError, match="stride_t 2 cannot be used on this .* Set stride_t to 1"):
        tome(comfy, humo, stride_t=2)


def test_unet_only_inputs_say_so_and_warn_on_dits(comfy, dits):
    """The inputs whole-block merging does not read (how UNet attention merges, which UNet levels,
    where a token looks for its target) end their tooltips with "UNets only", and on a DiT, set away
    from their defaults, make one warning naming each with its value; at their defaults, none."""
    from test_comfy_dit_inprocess import warnings_of

    methods = sys.modules["tokenreduce_pack.tokenreduce.methods"]
    unet_only = {"max_downsample", "mode", "merge_attn", "merge_crossattn", "merge_mlp", "matching"}
    assert set(methods.TOME_UNET_ONLY) == unet_only
    for spec in comfy.pack.ToMePatchNode.METHOD.inputs:
        assert ("UNets only (DiTs" in spec.tooltip) == (spec.name in unet_only), spec.name
    flux = tome(comfy, dits("flux_dev"), max_downsample="2", merge_attn=False, merge_mlp=True, matching="3x3 cells")
    assert warnings_of(flux) == ["WARNING: max_downsample 2, merge_attn off, merge_mlp on and matching 3x3 cells do "
                                 "nothing on Flux.1: ToMe merges its whole blocks (every token matched within its "
                                 "tile); these inputs apply to UNets only."]
    assert warnings_of(tome(comfy, dits("wan21_t2v"), mode=methods.MODE_QUERIES)) == [
        "WARNING: mode queries only (ComfyUI built-in) does nothing on Wan 2.1 / 2.2: ToMe merges its whole blocks "
        "(every token matched within its tile); this input applies to UNets only."]
    assert warnings_of(tome(comfy, dits("flux_dev"))) == []


def test_plan_every_compiles_with_at_most_one_graph_more(comfy, dits, monkeypatch):
    """Flux.1 compiled: the calls that plan and those that reuse an earlier step's plan are two kinds
    of call, whatever the steps and runs: no graph break, at most one graph more than share_plans
    alone, the eager result."""
    import comfy.ldm.flux.math as flux_math
    import comfy.ldm.modules.attention as attention

    monkeypatch.setattr(flux_math, "optimized_attention", attention.attention_pytorch)  # SDPA: no break of the host's
    model = dits("flux_dev")
    shared = _compiled(comfy, tome(comfy, model, share_plans=True).result[0], "flux_dev")
    reusing = tome(comfy, model, share_plans=True, plan_every=2).result[0]
    ours = _compiled(comfy, reusing, "flux_dev")
    assert shared["breaks"] == 0 and ours["breaks"] == 0, ours["reasons"]
    assert ours["graphs"] <= shared["graphs"] + 1
    assert torch.allclose(ours["outputs"][1], run(comfy, reusing, "flux_dev", steps=3, seed=5), rtol=1e-4, atol=1e-5)
    # correct_from_whole: the step that plans runs each block twice, the others add what it kept
    corrected = tome(comfy, model, share_plans=True, plan_every=2, correct_from_whole=True).result[0]
    ours = _compiled(comfy, corrected, "flux_dev")
    assert ours["breaks"] == 0, ours["reasons"]
    assert ours["graphs"] <= shared["graphs"] + 1
    assert torch.allclose(ours["outputs"][1], run(comfy, corrected, "flux_dev", steps=3, seed=5), rtol=1e-4, atol=1e-5)


# --- correct_from_whole: the whole block's difference kept with the plan (issue #50) -------------

@pytest.mark.parametrize("variant", ["flux_dev", "wan21_t2v", "hidream"])
def test_correct_from_whole_gives_the_whole_step_and_corrects_the_steps_after(comfy, dits, variant, monkeypatch):
    """On the step that plans every merged block runs whole too and gives the whole output, so a
    one-step run is the unpatched model's bit for bit (Flux's blocks add to their inputs in place:
    the merged run before it is given copies); the steps that reuse the plan add the kept
    difference, which brings the run closer to unpatched than the same plans without it, at the
    same plans (made at steps 1 and 3 of 3); reruns are bit for bit, and a new run keeps nothing
    of the last (its first step is whole again)."""
    from comfy_helpers import rel_error

    model = dits(variant)
    made = _counting_plans(monkeypatch, "tome_dit", "plan_block")
    settings = dict(share_plans=True, plan_every=2, use_rand=False)
    corrected = tome(comfy, model, correct_from_whole=True, **settings).result[0]
    assert torch.equal(run(comfy, corrected, variant, steps=1), run(comfy, model, variant, steps=1))
    made.clear()
    out = run(comfy, corrected, variant, steps=3)
    assert made == [2, 2]
    plain = run(comfy, tome(comfy, model, **settings).result[0], variant, steps=3)
    full = run(comfy, model, variant, steps=3)
    assert rel_error(out, full) < 0.5 * rel_error(plain, full)
    assert torch.equal(run(comfy, corrected, variant, steps=3), out)


def test_auto_times_the_whole_run_correct_from_whole_adds_once_per_plan(comfy, dits, measuring):
    """reduce_when auto on the CPU, timed (a scripted clock: each kind 10 ms whole, 8 ms merged):
    with plans every 4 steps merging pays (8 ms); corrected, the step that plans runs the block
    whole too, 10 ms shared over the plan's 4 steps: 8 + 10 / 4 = 10.5 ms, slower, left alone
    (a kind of its own: the plain decision is not reused)."""
    decided = {}
    for correct in (False, True):
        measuring((10.0, 8.0))
        model = tome(comfy, dits("flux_dev"), share_plans=True, plan_every=4, correct_from_whole=correct).result[0]
        run(comfy, model, "flux_dev", steps=1)
        decided[correct] = {(d.reduce, round(d.reduced_ms, 3), d.source) for _, d in session_of(model).last_report.decisions}
    assert decided == {False: {(True, 8.0, "measured")}, True: {(False, 10.5, "measured")}}


def test_correct_from_whole_needs_plan_reuse_and_does_nothing_on_unets(comfy, dits, models):
    """Without plan_every 2 or more no step reuses a plan: refused at validation, saying what to
    set; on a UNet (ToMe merges inside self-attention) it does nothing, and says so; the info text
    says what it does."""
    validate = comfy.pack.ToMePatchNode.validate_inputs
    problem = validate(share_plans=True, plan_every=1, correct_from_whole=True)
    assert isinstance(problem, str) and "set plan_every to 2 or more" in problem
    assert validate(share_plans=True, plan_every=2, correct_from_whole=True) is True
    output = tome(comfy, models["SD15"], share_plans=True, plan_every=2, correct_from_whole=True)
    assert output.ui["tokenreduce"][0]["warnings"] == [
        "WARNING: correct_from_whole does nothing on SD15: it corrects ToMe's whole-block merging on DiTs; on UNets "
        "ToMe merges inside self-attention (see mode)."]
    info = tome(comfy, dits("flux_dev"), share_plans=True, plan_every=2, correct_from_whole=True).result[1]
    assert "the step that plans also runs each merged block whole and keeps the difference" in info


def test_min_similarity_leaves_a_grid_with_nothing_alike_whole(comfy, dits):
    """min_similarity (issue #50) on a DiT: noise has no token 0.999 alike to its tile's target,
    so no block merges (the unpatched model bit for bit); 0 is a workflow without it."""
    model = dits("flux_dev")
    assert torch.equal(run(comfy, tome(comfy, model, min_similarity=0.999).result[0], "flux_dev"),
                       run(comfy, model, "flux_dev"))
    assert torch.equal(run(comfy, tome(comfy, model, min_similarity=0.0).result[0], "flux_dev"),
                       run(comfy, tome(comfy, model).result[0], "flux_dev"))
