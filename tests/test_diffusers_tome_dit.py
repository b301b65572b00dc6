"""ToMe on diffusers DiT transformers (whole blocks, the core's plan, merge and restore), on tiny
random-weight transformers built from config: Flux (below, in detail), and SD3, Qwen-Image and
Wan (parametrized): only the image tokens merge (the text stays whole; rotary positions and
per-token modulation follow the merged tokens), reruns are bit for bit, the input model and the
global RNG are untouched, remove_patch leaves nothing on the model, ratio 0 is the unpatched model,
a small ratio stays close to it; transformers without a seam are refused, naming their class."""

from __future__ import annotations

import functools
import importlib
import math

import pytest
import torch

pytest.importorskip("diffusers")

from tokenreduce.diffusers import apply_patch, remove_patch, tiny  # noqa: E402
from tokenreduce.diffusers.families import family_of  # noqa: E402

TEXT = tiny.TEXT_TOKENS
TEXT_DIM = tiny.TEXT_DIM
H = W = 8


def _call(model, batch: int = 1) -> torch.Tensor:
    with torch.no_grad():
        return model(**tiny.transformer_inputs("Flux", model, batch=batch, h=H, w=W), return_dict=False)[0]


@pytest.fixture()
def flux():
    return tiny.transformer("Flux")


def _random(model):
    return tiny._random_weights(model, 0)


def _state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_only_image_tokens_merge(flux, monkeypatch):
    module = importlib.import_module("diffusers.models.transformers.transformer_flux")
    original, calls = module.dispatch_attention_fn, []

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        calls.append(key)
        return original(query, key, value, attn_mask, *args, **kwargs)
    monkeypatch.setattr(module, "dispatch_attention_fn", spy)
    _call(flux)
    full = list(calls)
    calls.clear()
    patch = apply_patch(flux, "ToMe", ratio=0.5, reduce_when="always")
    assert "whole blocks merged" in patch.info
    _call(flux)
    n = H * W
    lengths = [k.shape[1] for k in calls]
    # 2 double + 2 single blocks: the first and the last whole, the two between merged (half the grid)
    assert lengths == [TEXT + n, TEXT + n // 2, TEXT + n // 2, TEXT + n]
    assert torch.equal(calls[1][:, :TEXT], full[1][:, :TEXT])  # the text's keys: never merged
    assert torch.equal(calls[0], full[0])


def test_reruns_bit_for_bit_and_remove_leaves_nothing(flux):
    before, rng = _state(flux), torch.get_rng_state()
    unpatched = _call(flux, batch=2)
    apply_patch(flux, "ToMe", ratio=0.5, reduce_when="always", use_rand=True, seed=7)
    first, second = _call(flux, batch=2), _call(flux, batch=2)
    assert torch.equal(first, second)
    assert not torch.equal(first, unpatched)
    assert torch.equal(torch.get_rng_state(), rng)
    remove_patch(flux)
    assert not any("forward" in m.__dict__ for m in flux.modules())
    assert all(torch.equal(v, before[k]) for k, v in flux.state_dict().items())
    assert torch.equal(_call(flux, batch=2), unpatched)


def test_batch_samples_merge_as_alone(flux):
    """Each sample of a batch merges with its own plan, as it would alone."""
    inputs = tiny.transformer_inputs("Flux", flux, batch=2, h=H, w=W)
    apply_patch(flux, "ToMe", ratio=0.5, reduce_when="always", use_rand=False)
    with torch.no_grad():
        both = flux(**inputs, return_dict=False)[0]
        one = flux(**{k: (v[1:] if torch.is_tensor(v) and v.shape[0] == 2 and k not in ("img_ids", "txt_ids")
                          else v) for k, v in inputs.items()}, return_dict=False)[0]
    torch.testing.assert_close(both[1:], one, rtol=1e-5, atol=1e-5)


def test_ratio_zero_is_unpatched(flux):
    unpatched = _call(flux)
    apply_patch(flux, "ToMe", ratio=0.0, reduce_when="always")
    assert torch.equal(_call(flux), unpatched)


def test_auto_on_cpu_merges(flux):
    unpatched = _call(flux)
    apply_patch(flux, "ToMe", ratio=0.5, reduce_when="auto")
    assert not torch.equal(_call(flux), unpatched)


def test_unet_only_settings_are_said_to_do_nothing(flux):
    """As the ComfyUI node: the inputs whole-block merging does not read, set away from their
    defaults, are named in one warning; none at their defaults."""
    assert apply_patch(flux, "ToMe", reduce_when="always").warnings == []
    remove_patch(flux)
    patched = apply_patch(flux, "ToMe", reduce_when="always", merge_mlp=True, matching="tile (fast)")
    assert patched.warnings == ["WARNING: merge_mlp on and matching tile (fast) do nothing on Flux: ToMe merges its "
                                "whole blocks (every token matched within its tile); these inputs apply to UNets only."]


def test_blocks_and_transformers_without_a_seam_are_refused_naming_the_class():
    from diffusers import HunyuanVideoTransformer3DModel  # the I2V model's token-replace blocks: no seam
    model = HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                           num_layers=2, num_single_layers=2, num_refiner_layers=1, patch_size=2,
                                           patch_size_t=1, text_embed_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM,
                                           rope_axes_dim=(4, 6, 6), image_condition_type="token_replace")
    with pytest.raises(ValueError, match=r"ToMe cannot patch this HunyuanVideo model \(HunyuanVideoTransformer3DModel\)"
                                         r": its block transformer_blocks.1 is a HunyuanVideoTokenReplaceTransformerBlock"
                                         r".*use ToDo"):
        apply_patch(model, "ToMe")
    assert not any("forward" in m.__dict__ for m in model.modules())  # none wrapped
    from diffusers import SanaTransformer2DModel  # a class no family of the adapter knows
    sana = SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                  num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=8,
                                  cross_attention_dim=16, caption_channels=16, sample_size=8, patch_size=1)
    with pytest.raises(ValueError, match="ToMe cannot patch this SanaTransformer2DModel model.*these DiT "
                                         "transformers: AuraFlow, Chroma, Flux, HunyuanVideo, LTX-Video, Lumina 2, "
                                         "Qwen-Image, SD3, Wan; SanaTransformer2DModel is not one of them"):
        apply_patch(sana, "ToMe")


def test_kontext_reference_tokens_stay_whole(flux, monkeypatch):
    """Kontext's reference image: its tokens follow the grid's (ids with first index 1); never merged."""
    module = importlib.import_module("diffusers.models.transformers.transformer_flux")
    original, lengths = module.dispatch_attention_fn, []

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        lengths.append(key.shape[1])
        return original(query, key, value, attn_mask, *args, **kwargs)
    monkeypatch.setattr(module, "dispatch_attention_fn", spy)
    inputs = tiny.transformer_inputs("Flux", flux, h=H, w=W)
    reference = torch.randn(1, 16, inputs["hidden_states"].shape[2], generator=torch.Generator().manual_seed(9))
    ids = torch.zeros(4, 4, 3)
    ids[..., 0], ids[..., 1], ids[..., 2] = 1, torch.arange(4)[:, None], torch.arange(4)[None, :]
    inputs = {**inputs, "hidden_states": torch.cat([inputs["hidden_states"], reference], 1),
              "img_ids": torch.cat([inputs["img_ids"], ids.reshape(-1, 3)])}
    apply_patch(flux, "ToMe", ratio=0.5, reduce_when="always")
    with torch.no_grad():
        out = flux(**inputs, return_dict=False)[0]
    n = H * W
    assert lengths == [TEXT + n + 16, TEXT + n // 2 + 16, TEXT + n // 2 + 16, TEXT + n + 16]
    assert out.shape[1] == n + 16


# --- SD3, Qwen-Image, Wan: each through its family's seam ------------------------------------------

# family -> its blocks' attention over the grid, the model's inputs, whether text joins that attention,
# whether a batch runs the block once per sample (a rotary without a batch dimension)
COVERED = {"SD3": ("attn", {}, True, False), "Qwen-Image": ("attn", {}, True, True),
           "Wan": ("attn1", {"frames": 2}, False, False), "HunyuanVideo": ("attn", {"frames": 2}, True, True),
           "LTX-Video": ("attn1", {"frames": 2}, False, False), "Chroma": ("attn", {}, True, True),
           "AuraFlow": ("attn", {}, True, False), "Lumina 2": ("attn", {}, False, False)}


@pytest.fixture(scope="module", params=sorted(COVERED))
def covered(request):
    """A covered family's tiny transformer (3 blocks: the middle one merged) and its inputs."""
    family = request.param
    model = tiny.transformer(family)
    return family, model, tiny.transformer_inputs(family, model, batch=2, h=H, w=W, **COVERED[family][1])


def _run(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def _attention_inputs(model, family, inputs) -> list[dict]:
    """What each block's attention over the grid is handed, in one call of the model."""
    seen, handles = [], []
    for block in (block for name in family_of(model).blocks for block in getattr(model, name)):
        handles.append(getattr(block, COVERED[family][0]).register_forward_pre_hook(
            lambda module, args, kwargs: seen.append({**dict(zip(("hidden_states", "encoder_hidden_states",
                                                                  "attention_mask", "image_rotary_emb"), args)),
                                                      **kwargs}),
            with_kwargs=True))
    try:
        _run(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_covered_merge_only_the_image_tokens_with_their_positions(covered):
    family, model, inputs = covered
    full = _attention_inputs(model, family, inputs)
    with apply_patch(model, "ToMe", ratio=0.5, reduce_when="always") as patch:
        assert "whole blocks merged" in patch.info
        merged = _attention_inputs(model, family, inputs)
    n = (2 if "frames" in COVERED[family][1] else 1) * H * W
    _, _, joint, per_sample = COVERED[family]
    runs = 2 if per_sample else 1
    lengths = [f["hidden_states"].shape[1] for f in full]  # the grid, or the grid and the text (Chroma's single blocks)
    # the first and the last block whole, those between merged (each run per sample: per_sample)
    assert [m["hidden_states"].shape[1] for m in merged] == \
        lengths[:1] + [length - n // 2 for length in lengths[1:-1] for _ in range(runs)] + lengths[-1:]
    if joint:  # the text, joined inside the attention, whole and as unpatched
        text = full[1]["encoder_hidden_states"]
        torch.testing.assert_close(torch.cat([m["encoder_hidden_states"] for m in merged[1:1 + runs]]), text,
                                   rtol=1e-6, atol=1e-6)  # (per sample: the modulation's matmul on one row)
    if family == "Lumina 2":  # the caption, first in its joint sequence: whole and as unpatched
        assert torch.equal(merged[1]["hidden_states"][:, :TEXT], full[1]["hidden_states"][:, :TEXT])
    if family not in ("SD3", "AuraFlow"):  # each merged token's rotary row is a grid position's (a different one, where rows differ)
        given, whole = (_rows(m["image_rotary_emb"][0]) for m in (merged[1], full[1]))
        rows = (given[:, :, None] == whole[:, None]).all(-1)  # [B, L', L]
        assert rows.shape[1] == whole.shape[1] - n // 2 and bool(rows.any(-1).all())
        if bool(((whole[:, :, None] == whole[:, None]).all(-1).sum(-1) == 1).all()):  # (not LTX's tiny rotary, Chroma's text)
            assert bool((rows.sum(-1) == 1).all()) and bool((rows.any(1).sum(-1) == rows.shape[1]).all())
        if family == "Qwen-Image":  # the text's freqs as they were
            assert torch.equal(merged[1]["image_rotary_emb"][1], full[1]["image_rotary_emb"][1])
    if family == "HunyuanVideo":  # the mask's columns follow: the padded text still masked, after the merged video
        mask = merged[1]["attention_mask"]
        assert mask.shape[-1] == n - n // 2 + TEXT and mask[..., :-2].all() and not mask[..., -2:].any()
    if family == "Chroma":  # [text, image] x [text, image]: the padded text's columns still masked
        mask = merged[1]["attention_mask"][:, 0, -1]  # the last image query's row
        assert mask.shape[-1] == TEXT + n - n // 2 and not mask[:, TEXT - 2:TEXT].any() and mask[:, TEXT:].all()


def _rows(rope: torch.Tensor) -> torch.Tensor:
    """A rotary table as [B or 1, L, features] (Wan's [1, L, 1, D], Flux-like [L, D], LTX's [B, L, D])."""
    return (rope if rope.ndim > 2 else rope[None]).flatten(2)


def test_covered_reruns_ratio_zero_and_remove(covered):
    family, model, inputs = covered
    before, rng = _state(model), torch.get_rng_state()
    unpatched = _run(model, inputs)
    apply_patch(model, "ToMe", ratio=0.0, reduce_when="always")
    assert torch.equal(_run(model, inputs), unpatched)
    apply_patch(model, "ToMe", ratio=0.5, reduce_when="always", use_rand=True, seed=7)
    first, second = _run(model, inputs), _run(model, inputs)
    assert torch.equal(first, second) and not torch.equal(first, unpatched)
    apply_patch(model, "ToMe", ratio=0.1, reduce_when="always")
    small = _run(model, inputs)
    assert not torch.equal(small, unpatched)
    assert (small - unpatched).norm() < 0.05 * unpatched.norm()  # a few tokens merged in one block: close
    assert torch.equal(torch.get_rng_state(), rng)
    remove_patch(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(_run(model, inputs), unpatched)


@pytest.mark.parametrize("family", ["Qwen-Image", "Wan", "LTX-Video", "HunyuanVideo", "Chroma"])
def test_per_token_inputs_follow_and_samples_merge_as_alone(family):
    """Qwen-Image-Edit-2511 (zero_cond_t: ``modulate_index`` per token, a doubled ``temb``, a reference
    image after the grid, run per sample), Wan 2.2 TI2V and LTX-Video's conditioned first frame
    (``temb`` per token, the batch at once), HunyuanVideo and Chroma (each sample's own text mask, run
    per sample): each sample of a batch merges as it would alone, and the reference tokens stay whole."""
    if family in ("Wan", "LTX-Video", "HunyuanVideo", "Chroma"):
        model = tiny.transformer(family)
        inputs = tiny.transformer_inputs(family, model, batch=2, frames=1 if family == "Chroma" else 2, h=H, w=W)
        if family == "HunyuanVideo":
            inputs["encoder_attention_mask"][0, 1:] = 0  # the first sample's text: one token
        elif family == "Chroma":
            inputs["attention_mask"][0, 1:TEXT] = False
        else:
            timestep = torch.full((2, 2 * H * W), 700.0)
            timestep[:, :H * W] = 0.0  # the first frame clean (TI2V's image frame, LTX's conditioning frame)
            inputs["timestep"] = timestep
    else:
        from diffusers import QwenImageTransformer2DModel
        model = _random(QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=3,
                                                    attention_head_dim=16, num_attention_heads=2,
                                                    joint_attention_dim=TEXT_DIM, axes_dims_rope=(4, 6, 6),
                                                    zero_cond_t=True))
        inputs = tiny.transformer_inputs("Qwen-Image", model, batch=2, h=H, w=W)
        reference = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(5))  # a 4x4 reference image
        inputs.update(hidden_states=torch.cat([inputs["hidden_states"], reference], 1),
                      img_shapes=[[(1, H, W), (1, 4, 4)]] * 2)
    unpatched = _run(model, inputs)
    with apply_patch(model, "ToMe", ratio=0.5, reduce_when="always", use_rand=False) as patch:
        both = _run(model, inputs)
        one = _run(model, {k: (v[1:] if torch.is_tensor(v) and v.shape[0] == 2 else v[1:] if k == "img_shapes" else v)
                           for k, v in inputs.items()})
        assert f"blocks {64 if family in ('Qwen-Image', 'Chroma') else 128}→" in " ".join(patch.report_lines())
    assert both.shape == unpatched.shape and not torch.equal(both, unpatched)
    torch.testing.assert_close(both[1:], one, rtol=1e-5, atol=1e-5)


def test_covered_auto_times_the_merged_block_where_it_measures(covered, monkeypatch, tmp_path):
    """reduce_when auto where it measures (asked to on the CPU, a scripted clock: merged is faster):
    the first block of each kind timed unmerged and merged with the inputs the model hands it,
    then merged as ``always`` merges."""
    from tokenreduce import pays
    from tokenreduce.diffusers import api

    def clock(device):
        return lambda name, work: (work(), {"full": 0.010, "reduced": 0.005}.get(name, 0.001))[1]
    store = pays.Decisions(tmp_path / "auto_decisions.json", measure_cpu=True, stopwatch=clock)
    monkeypatch.setattr(api, "decisions_at", lambda path: store)
    family, model, inputs = covered
    with apply_patch(model, "ToMe", ratio=0.5, reduce_when="always", use_rand=False):
        always = _run(model, inputs)
    with apply_patch(model, "ToMe", ratio=0.5, reduce_when="auto", use_rand=False) as patch:
        auto = _run(model, inputs)
        lines = patch.report_lines()
    assert any(line.startswith("auto · ") for line in lines), lines
    assert torch.equal(auto, always)


def test_lumina_captions_of_several_lengths_are_left_alone_and_said():
    """Lumina 2 joins each sample's valid caption and its image: captions of several lengths put
    each sample's grid elsewhere, a layout ToMe does not take: the call runs unmerged, said."""
    model = tiny.transformer("Lumina 2")
    inputs = tiny.transformer_inputs("Lumina 2", model, batch=2, h=H, w=W)
    inputs["encoder_attention_mask"][0, -2:] = False
    unpatched = _run(model, inputs)
    with apply_patch(model, "ToMe", ratio=0.5, reduce_when="always") as patch:
        assert torch.equal(_run(model, inputs), unpatched)
        assert "token layout ToMe does not know" in " ".join(patch.report_lines())


def test_compiled_without_graph_breaks_or_recompiles_per_step():
    """torch.compile of the model (fullgraph: a graph break raises), then apply_patch to the
    compiled model: its call hooks run on the wrapper, outside the compiled region; the merged
    blocks inside it (HunyuanVideo's: positional arguments, a mask, a run per sample). Steps
    with new timesteps (new tiles) do not recompile."""
    family = "HunyuanVideo"
    model = tiny.transformer(family)
    inputs = tiny.transformer_inputs(family, model, frames=2, h=H, w=W)
    torch._dynamo.reset()
    with torch.no_grad():
        with apply_patch(model, "ToMe", ratio=0.5, reduce_when="always"):
            eager = _run(model, inputs)
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        with apply_patch(compiled, "ToMe", ratio=0.5, reduce_when="always") as patch:
            first = compiled(**inputs, return_dict=False)[0]
            with torch._dynamo.config.patch(error_on_recompile=True):
                for step in (900.0, 500.0, 100.0):
                    compiled(**{**inputs, "timestep": torch.tensor([step])}, return_dict=False)
            assert "blocks 128→64" in " ".join(patch.report_lines())
    torch.testing.assert_close(first, eager, rtol=1e-5, atol=1e-5)


# --- one implementation of a merged block with the ComfyUI node's (issue #45, point 9) -------------
def _kinds(model, monkeypatch, **settings) -> list[tuple]:
    """The kinds reduce_when auto decides for, one model call (merged as it decides: yes)."""
    from tokenreduce.diffusers import tome_dit as diffusers_tome_dit

    kinds = []
    monkeypatch.setattr(diffusers_tome_dit.DiffusersToMeDiT, "decision",
                        lambda self, run, device, kind, describe, model=None, **how: kinds.append(kind))
    with apply_patch(model, "ToMe", ratio=0.5, reduce_when="auto", **settings):
        _call(model)
    return kinds


def test_auto_kind_names_the_attention_backend_compiled_and_share_plans(flux, monkeypatch):
    """As the ComfyUI node's: decisions never cross attention backends, compiled and eager, or
    share_plans on and off."""
    from tokenreduce.diffusers.hooks import attention_backend

    kinds = _kinds(flux, monkeypatch, share_plans=True)
    backend = attention_backend(flux.single_transformer_blocks[0].attn.processor)
    assert backend and all(backend in kind for kind in kinds) and len(kinds) == 2  # double and single blocks
    assert set(_kinds(flux, monkeypatch, share_plans=False)).isdisjoint(kinds)
    with apply_patch(flux, "ToMe", ratio=0.5, reduce_when="auto") as applied:
        patch = applied.patches[0]
        patch.patch.wrapped = True  # under a torch.compile wrapper
        seen = []
        monkeypatch.setattr(type(patch.patch), "decision",
                            lambda self, run, device, kind, describe, model=None, **how: seen.append(kind))
        _call(flux)
    assert all("compiled" in kind for kind in seen) and seen


def test_plan_time_is_timed_where_the_run_profiles(flux):
    with apply_patch(flux, "ToMe", ratio=0.5, reduce_when="always") as applied:
        patch = applied.patches[0]
        _call(flux)
        run = patch.session.run
        assert run.plan_seconds == 0.0
        run.profile = True  # as benchmarks set it: the calls after it time their planning
        _call(flux)
        assert patch.session.run is run and run.plan_seconds > 0


def test_a_block_editing_its_input_in_place_restores_as_one_that_does_not(flux, monkeypatch):
    """The block's change is taken from merged tokens it was not handed: a block that edits its
    input in place after using it gives what one that leaves it gives."""
    block_class = type(flux.single_transformer_blocks[0])
    with apply_patch(flux, "ToMe", ratio=0.5, reduce_when="always", use_rand=False):
        expected = _call(flux)
    original = block_class.forward

    @functools.wraps(original)  # its parameters, as the adapter reads them
    def editing(self, hidden_states, *args, **kwargs):
        out = original(self, hidden_states, *args, **kwargs)
        hidden_states.mul_(3)
        return out
    monkeypatch.setattr(block_class, "forward", editing)
    with apply_patch(flux, "ToMe", ratio=0.5, reduce_when="always", use_rand=False):
        assert torch.equal(_call(flux), expected)


@pytest.mark.parametrize("use_rand", [False, True])
def test_tiles_are_made_once_per_run_and_timestep(flux, monkeypatch, use_rand):
    from tokenreduce.diffusers import tome_dit as diffusers_tome_dit

    made, make_tiles = [], diffusers_tome_dit.make_tiles
    monkeypatch.setattr(diffusers_tome_dit, "make_tiles", lambda *a: made.append(a) or make_tiles(*a))
    with apply_patch(flux, "ToMe", ratio=0.5, reduce_when="always", use_rand=use_rand):
        first = [_call(flux) for _ in range(3)]  # three calls at one timestep (cond and uncond apart, say)
    assert len(made) == 1 and all(torch.equal(out, first[0]) for out in first)


def test_a_pipeline_run_reads_no_timestep_per_call_to_draw(monkeypatch):
    """use_rand on, under a pipeline: the draw's timestep is the scheduler's, read once per run,
    not each call's from the device; the same latents on every run."""
    from tokenreduce.run import RunState

    pipe = tiny.flux_pipeline()
    reads = []
    original = RunState.sigma
    monkeypatch.setattr(RunState, "sigma", lambda self, sigmas: reads.append(sigmas) or original(self, sigmas))
    apply_patch(pipe, "ToMe", ratio=0.5, reduce_when="always", use_rand=True)
    first = tiny.generate(pipe, steps=3)
    assert not reads
    assert torch.equal(tiny.generate(pipe, steps=3), first)
    remove_patch(pipe)
    assert not torch.equal(tiny.generate(pipe, steps=3), first)  # it merged


def test_merged_blocks_run_through_the_cores_run_merged_block(monkeypatch):
    """One implementation: diffusers' merged blocks run through ``tome_dit.run_merged_block``, as
    the ComfyUI node's (and Forge's) block replacement; a block given a rotary with a batch
    dimension (Wan's) runs once for the batch."""
    import tokenreduce.tome_dit as core
    from tokenreduce.diffusers import tome_dit as diffusers_tome_dit

    assert diffusers_tome_dit.run_merged_block is core.run_merged_block
    model = tiny.transformer("Wan")
    inputs = tiny.transformer_inputs("Wan", model, batch=2, h=H, w=W)
    runs, blocks = [], []
    monkeypatch.setattr(diffusers_tome_dit, "run_merged_block",
                        lambda *a, **k: runs.append(a) or core.run_merged_block(*a, **k))
    block_class = type(model.blocks[0])
    original = block_class.forward
    monkeypatch.setattr(block_class, "forward", functools.wraps(original)(lambda self, hidden_states, *a, **k: blocks.append(
        hidden_states.shape[0]) or original(self, hidden_states, *a, **k)))
    with apply_patch(model, "ToMe", ratio=0.5, reduce_when="always"):
        _run(model, inputs)
    assert len(runs) == 1 and blocks == [2, 2, 2]  # the middle block merged, the batch at once


@pytest.mark.parametrize("family", ["Wan", "LTX-Video"])
def test_a_clean_first_frame_stays_whole(family):
    """Issue #51: Wan 2.2 TI2V and LTX-Video's image to video give each token a timestep of its own,
    the first latent frame the clean start image: its tokens are kept out of every tile, as the
    ComfyUI node keeps them (``TokenLayout.whole_frames``), so fewer tokens merge than ratio asks."""
    from tokenreduce.tome_dit import make_tiles, merged_count

    model = tiny.transformer(family)
    inputs = tiny.transformer_inputs(family, model, batch=1, frames=2, h=H, w=W)
    timestep = torch.full((1, 2 * H * W), 700.0)
    timestep[:, :H * W] = 0.0  # the first frame clean
    inputs["timestep"] = timestep
    r = merged_count(make_tiles((2, H, W), (1, 2, 2), None, "cpu", whole_frames=1), 0.5)
    assert r < H * W  # fewer than half of 2 frames: the first frame's tokens are no tile's
    with apply_patch(model, "ToMe", ratio=0.5, reduce_when="always", use_rand=False) as patch:
        _run(model, inputs)
        assert f"blocks {2 * H * W}→{2 * H * W - r} " in " ".join(patch.report_lines()) + " "


def test_min_similarity_leaves_a_grid_with_nothing_alike_whole(flux):
    """min_similarity (issue #50), as the ComfyUI node: random tokens have none 0.999 alike to their
    tile's target, so no block merges; 0.5 merges some, fewer than ratio's count, and repeats."""
    unpatched = _call(flux)
    apply_patch(flux, "ToMe", ratio=0.5, reduce_when="always", min_similarity=0.999)
    assert torch.equal(_call(flux), unpatched)
    remove_patch(flux)
    patch = apply_patch(flux, "ToMe", ratio=0.5, reduce_when="always", min_similarity=0.05)
    first = _call(flux)
    assert not torch.equal(first, unpatched) and torch.equal(_call(flux), first)
    assert "at most, only tokens at least 0.05 alike to their target" in patch.info


def _counting_plans(monkeypatch) -> list:
    import tokenreduce.tome_dit as core

    made, plan_block = [], core.plan_block
    monkeypatch.setattr(core, "plan_block", lambda *a, **k: made.append(a[0].shape) or plan_block(*a, **k))
    return made


def test_plan_every_reuses_the_shared_plan_across_a_pipelines_steps(monkeypatch):
    """plan_every (issue #50's correct_from_whole needs it here too): one plan per model call with
    share_plans, made on steps 0 and 2 of 4 at plan_every 2 and reused between, made anew in each
    run (reruns bit for bit); the step is the scheduler's, read from no device."""
    from tokenreduce.run import RunState

    pipe = tiny.flux_pipeline()
    made = _counting_plans(monkeypatch)
    reads, step = [], RunState.step
    monkeypatch.setattr(RunState, "step", lambda self, sigmas: reads.append(sigmas) or step(self, sigmas))
    with apply_patch(pipe, "ToMe", ratio=0.5, reduce_when="always", share_plans=True):
        every_step = tiny.generate(pipe, steps=4)
    assert len(made) == 4
    made.clear()
    with apply_patch(pipe, "ToMe", ratio=0.5, reduce_when="always", share_plans=True, plan_every=2):
        first = tiny.generate(pipe, steps=4)
        assert len(made) == 2 and not reads
        assert torch.equal(tiny.generate(pipe, steps=4), first) and len(made) == 4
    assert not torch.equal(first, every_step)


def _steps(model, inputs: list, times: list) -> list:
    """The model called on each of ``inputs`` at each timestep of ``times`` (a bare model's run)."""
    with torch.no_grad():
        return [model(**{**given, "timestep": torch.full((1,), t)}, return_dict=False)[0]
                for t in times for given in inputs]


def test_calls_apart_in_a_step_keep_their_own_plans(flux, monkeypatch):
    """A model called for cond and uncond apart in each step (Wan's pipeline does): each call keeps
    the plan and the correction of its own place in the step, so each gives what it gives in a run
    of its own; a bare model's steps are its distinct timesteps."""
    cond = tiny.transformer_inputs("Flux", flux, h=H, w=W, seed=3)
    uncond = tiny.transformer_inputs("Flux", flux, h=H, w=W, seed=4)
    times = [0.9, 0.8, 0.7]
    settings = dict(ratio=0.5, reduce_when="always", share_plans=True, plan_every=2, correct_from_whole=True)
    made = _counting_plans(monkeypatch)
    with apply_patch(flux, "ToMe", **settings):
        both = _steps(flux, [cond, uncond], times)
        assert len(made) == 4  # steps 0 and 2, two places each
        alone = [_steps(flux, [given], times) for given in (cond, uncond)]
    assert all(torch.equal(a, b) for a, b in zip(both[0::2], alone[0]))
    assert all(torch.equal(a, b) for a, b in zip(both[1::2], alone[1]))


def test_correct_from_whole_keeps_a_pipeline_closer_to_unpatched(monkeypatch):
    """correct_from_whole through the core's ``corrected_block``, as in the ComfyUI node: the step
    that plans gives the whole blocks' output (one step: the unpatched latents bit for bit); over
    four steps with a plan every 4 the latents are closer to unpatched than the same plans' without
    it; reruns bit for bit; the planning step runs each merged block merged, then whole."""
    import tokenreduce.whole_difference as whole_difference
    from tokenreduce.diffusers import tome_dit as diffusers_tome_dit

    assert diffusers_tome_dit.corrected_block is whole_difference.corrected_block
    pipe = tiny.flux_pipeline()
    unpatched = {steps: tiny.generate(pipe, steps=steps) for steps in (1, 4)}
    settings = dict(ratio=0.5, reduce_when="always", share_plans=True, plan_every=4, use_rand=False)
    with apply_patch(pipe, "ToMe", **settings):
        plain = tiny.generate(pipe, steps=4)
    with apply_patch(pipe, "ToMe", correct_from_whole=True, **settings) as patch:
        assert torch.equal(tiny.generate(pipe, steps=1), unpatched[1])
        corrected = tiny.generate(pipe, steps=4)
        assert torch.equal(tiny.generate(pipe, steps=4), corrected)
        assert "blocks" in " ".join(patch.report_lines())

    def far(x):
        return ((x - unpatched[4]).norm() / unpatched[4].norm()).item()
    assert far(corrected) < 0.5 * far(plain), (far(corrected), far(plain))
