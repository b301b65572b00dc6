"""ToDo on diffusers models (tiny random weights, built from config): UNet pipelines, and the DiT
transformers called as their pipelines call them. Checked at the attention itself: the keys and
values a reduced call hands to the backend are exactly the unreduced ones with the grid part
subsampled as the core says, the text and everything else around the grid intact, in each
family's own order; blocks left out stay whole; removal restores the model bit for bit."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

pytest.importorskip("diffusers")

from tokenreduce.diffusers import apply_patch, tiny  # noqa: E402
from tokenreduce.downsample import downsample_tokens, grid_keep_index  # noqa: E402

# family -> (the module whose attention entry its grid processor calls, entry name, sequence dim,
# where the grid sits in its joint calls: "text first" or "image first"; None: image-only calls)
FAMILIES = {
    "Flux": ("transformer_flux", "dispatch_attention_fn", 1, "text first"),
    "Chroma": ("transformer_flux", "dispatch_attention_fn", 1, "text first"),  # Flux's processor
    "Qwen-Image": ("transformer_qwenimage", "dispatch_attention_fn", 1, "text first"),
    "SD3": (None, "scaled_dot_product_attention", 2, "image first"),
    "AuraFlow": (None, "scaled_dot_product_attention", 2, "text first"),  # after its 8 register tokens
    "Lumina 2": (None, "scaled_dot_product_attention", 2, "text first"),
    "HunyuanVideo": ("transformer_hunyuan_video", "dispatch_attention_fn", 1, "image first"),
    "Wan": ("transformer_wan", "dispatch_attention_fn", 1, None),
    "LTX-Video": ("transformer_ltx", "dispatch_attention_fn", 1, None),
}
VIDEO = {"Wan", "HunyuanVideo", "LTX-Video"}
REGISTERS = {"AuraFlow": 8}  # tokens the model puts before the text
TEXT = tiny.TEXT_TOKENS


def _spy(monkeypatch, family: str, calls: list) -> None:
    """Record the q, k, v (and mask) every attention call of the family hands to the backend."""
    module_name, entry, _, _ = FAMILIES[family]
    owner = torch.nn.functional if module_name is None else \
        importlib.import_module(f"diffusers.models.transformers.{module_name}")
    original = getattr(owner, entry)

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        calls.append((query, key, value, attn_mask))
        return original(query, key, value, attn_mask, *args, **kwargs)
    monkeypatch.setattr(owner, entry, spy)


def _expected_index(family: str, length: int, grid: tuple, factor: int, temporal: int) -> torch.Tensor:
    """The keys a reduced call keeps, stated from the family's order (not from the patch)."""
    t, h, w = grid
    target = (-(-t // temporal), -(-h // factor), -(-w // factor))
    kept = grid_keep_index(grid, target, (temporal, factor, factor))
    tokens = t * h * w
    order = FAMILIES[family][3]
    start = TEXT + REGISTERS.get(family, 0) if order == "text first" else 0
    return torch.cat([torch.arange(start), kept + start, torch.arange(start + tokens, length)])


def _with_reference(family: str, inputs: dict) -> dict:
    """Flux Kontext's and Qwen-Image-Edit's reference image: its tokens follow the grid's (Flux:
    ids with first index 1; Qwen: a second image shape); they must stay whole."""
    hidden = inputs["hidden_states"]
    reference = torch.randn(hidden.shape[0], 4 * 4, hidden.shape[2], generator=torch.Generator().manual_seed(9))
    inputs = {**inputs, "hidden_states": torch.cat([hidden, reference], dim=1)}
    if family == "Flux":
        ids = torch.zeros(4, 4, 3)
        ids[..., 0], ids[..., 1], ids[..., 2] = 1, torch.arange(4)[:, None], torch.arange(4)[None, :]
        inputs["img_ids"] = torch.cat([inputs["img_ids"], ids.reshape(-1, 3)])
    else:
        inputs["img_shapes"] = [[(1, 8, 8), (1, 4, 4)]] * hidden.shape[0]
    return inputs


@pytest.mark.parametrize("family", [*FAMILIES, "Flux+reference", "Qwen-Image+reference"])
def test_dit_keys_reduced_on_the_grid_only(monkeypatch, family):
    family, reference = family.split("+")[0], "+" in family
    model = tiny.transformer(family)
    frames = 3 if family in VIDEO else 1
    temporal = 2 if family in VIDEO else 1
    inputs = tiny.transformer_inputs(family, model, batch=2, frames=frames)
    if reference:
        inputs = _with_reference(family, inputs)
    grid = (frames, 8, 8)
    dim = FAMILIES[family][2]
    full, reduced = [], []
    _spy(monkeypatch, family, full)
    with torch.no_grad():
        unpatched = model(**inputs, return_dict=False)[0]
        calls_per_run = len(full)
        _spy(monkeypatch, family, reduced)
        # skip_first_blocks 0: the first block sees the same inputs in both runs, so its keys compare exactly.
        # reduce_when always: what auto measures (its own attention calls, where no decision is kept
        # yet) is not what this test compares
        with apply_patch(model, "ToDo", factor=2, temporal_factor=temporal, skip_first_blocks=0,
                         skip_last_blocks=1, reduce_when="always") as patch:
            state = torch.get_rng_state()
            first = model(**inputs, return_dict=False)[0]
            assert torch.equal(torch.get_rng_state(), state)
            assert torch.equal(model(**inputs, return_dict=False)[0], first)  # rerun: bit for bit
            report = patch.report()
        restored = model(**inputs, return_dict=False)[0]
    assert torch.equal(restored, unpatched)
    assert not torch.equal(first, unpatched)
    assert report.levels and not report.warnings and report.skipped_calls == 0
    reduced = reduced[:calls_per_run]
    assert len(reduced) == calls_per_run
    # the first selected block's call (Lumina 2's refiners, text or image alone, run before its blocks)
    first = next(i for i, (f, r) in enumerate(zip(full, reduced)) if f[1].shape[dim] != r[1].shape[dim])
    assert all(torch.equal(f[1], r[1]) for f, r in zip(full[:first], reduced[:first]))
    q0, k0, v0, mask0 = full[first]
    q1, k1, v1, mask1 = reduced[first]
    index = _expected_index(family, k0.shape[dim], grid, 2, temporal)
    assert torch.equal(q1, q0)  # every query stays
    assert torch.equal(k1, k0.index_select(dim, index)) and torch.equal(v1, v0.index_select(dim, index))
    if mask0 is not None and mask0.shape[-1] == k0.shape[dim]:
        assert torch.equal(mask1, mask0.index_select(-1, index))  # HunyuanVideo's text padding mask follows
    # The last block is left whole: its calls have every key.
    assert reduced[-1][1].shape[dim] == full[-1][1].shape[dim]
    assert sum(k.shape[dim] < kf.shape[dim] for (_, k, _, _), (_, kf, _, _) in zip(reduced, full)) > 0


@pytest.mark.parametrize("size", [64, 128])
def test_method_window_runs_on_a_unets_self_attention_through_its_processor(monkeypatch, size):
    """method window on diffusers' UNets (issue #50): the pre-hook marks the self-attention call and
    the swapped processor runs it through the core's window_call (q, k and v projected). At 64 px
    the 8x8 grid is one tile's window: the unpatched image (nearest is not); at 128 px the 16x16
    grid is not (neither image); reruns bit for bit; remove gives the processors back."""
    todo = importlib.import_module("tokenreduce.diffusers.todo")
    windowed, real = [], todo.window_call
    monkeypatch.setattr(todo, "window_call", lambda q, *a, **kw: windowed.append(q.shape) or real(q, *a, **kw))
    pipe = tiny.pipeline()
    attention = pipe.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1
    processor = attention.processor
    base = tiny.generate(pipe, steps=2, size=size)
    with apply_patch(pipe, "ToDo", method="nearest", reduce_when="always"):
        nearest = tiny.generate(pipe, steps=2, size=size)
    assert not windowed
    with apply_patch(pipe, "ToDo", method="window", reduce_when="always") as patch:
        assert type(attention.processor) is not type(processor)
        first = tiny.generate(pipe, steps=2, size=size)
        assert windowed and torch.equal(tiny.generate(pipe, steps=2, size=size), first)
        lines = patch.report_lines()
        report = patch.report()
    assert attention.processor is processor and torch.equal(tiny.generate(pipe, steps=2, size=size), base)
    grid = size // 8
    assert any(line.startswith(f"ds 1 · {grid}×{grid} · q {grid * grid}→{grid * grid} · k/v {grid * grid}→")
               for line in lines), lines
    assert not report.warnings and report.skipped_calls == 0
    if size == 64:
        assert float((first - base).norm() / base.norm()) < 1e-5 and not torch.equal(nearest, base)
    else:
        assert not torch.equal(first, base) and not torch.equal(first, nearest)


def test_a_window_whose_processor_was_replaced_after_apply_patch_is_not_reported_as_run():
    """A processor set after apply_patch (an IP-Adapter loader does this) replaces ours: the window
    cannot run there, the output is the unpatched one, and the report counts no windowed call."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    pipe = tiny.pipeline()
    base = tiny.generate(pipe, steps=1, size=128)
    with apply_patch(pipe, "ToDo", method="window", reduce_when="always") as patch:
        pipe.unet.set_attn_processor(AttnProcessor2_0())
        assert torch.equal(tiny.generate(pipe, steps=1, size=128), base)
        report = patch.report()
    assert not report.levels


def test_method_window_on_a_unet_is_measured_by_the_budget_as_the_method_it_is(tmp_path):
    """The quality budget measures the window as the node's method on diffusers' UNets (set as the
    method, it has no milder step below it): at a tiny budget the level is left alone, unpatched."""
    pipe = tiny.pipeline()
    base = tiny.generate(pipe, steps=1, size=128)
    with apply_patch(pipe, "ToDo", method="window", max_change=1e-9) as patch:
        assert torch.equal(tiny.generate(pipe, steps=1, size=128), base)
        decisions = [d for site, d in patch.report().decisions if ", block " in site]  # each block (issue #51)
    assert decisions and all(not d.reduce and d.over_budget for d in decisions)


def test_rope_families_refuse_average_pooling_sd3_allows_it():
    with pytest.raises(ValueError, match="rotary positions"):
        apply_patch(tiny.transformer("Wan"), "ToDo", method="average")
    model = tiny.transformer("SD3")
    inputs = tiny.transformer_inputs("SD3", model)
    with torch.no_grad(), apply_patch(model, "ToDo", method="average", skip_first_blocks=0):
        model(**inputs)


@pytest.mark.parametrize("family", ["Flux", "SD3", "Wan"])  # dispatcher [B, N, heads, D]; SDPA [B, heads, N, D]; video
def test_method_window_runs_each_grid_call_whole_through_the_core(monkeypatch, family):
    """method window (peak_window.py): every reduced grid call, queries included, goes to
    window_call with the plan made once per layout; reruns are bit for bit and it is not nearest.
    At factor 1.05 every grid key is its own cell (count 1) and the window, far field and heavy
    keys partition the keys exactly: full attention, within float rounding."""
    from tokenreduce.diffusers import todo

    model = tiny.transformer(family)
    frames = 2 if family in VIDEO else 1
    # 16x16: the windows (4x4 tiles, 2 tokens around) do not cover the grid. Batch 2, as under CFG.
    inputs = tiny.transformer_inputs(family, model, batch=2, frames=frames, h=16, w=16)
    plans, kept = [], []
    real, real_kept = todo.window_call, todo.kept_keys

    def spy(q, k, v, heads, dim, plan, *args, **kwargs):
        plans.append(plan)
        assert q.shape == k.shape and q.shape[dim] == plan.length  # the whole call, every query
        return real(q, k, v, heads, dim, plan, *args, **kwargs)
    monkeypatch.setattr(todo, "window_call", spy)
    monkeypatch.setattr(todo, "kept_keys", lambda *args: kept.append(args) or real_kept(*args))
    # always: the spies count the model's calls only, not the budget's measuring ones (on the CPU too)
    settings = {"skip_first_blocks": 0, "skip_last_blocks": 0, "reduce_when": "always"}
    with torch.no_grad():
        unpatched = model(**inputs, return_dict=False)[0]
        with apply_patch(model, "ToDo", **settings):
            nearest = model(**inputs, return_dict=False)[0]
        assert not plans and kept
        reduced_calls, kept[:] = len(kept) // 2, []  # nearest: keys and values of each reduced call
        with apply_patch(model, "ToDo", method="window", **settings) as patch:
            windowed = model(**inputs, return_dict=False)[0]
            calls = len(plans)
            assert torch.equal(model(**inputs, return_dict=False)[0], windowed)
            report = patch.report()
        with apply_patch(model, "ToDo", method="window", factor=1.05, **settings):
            whole = model(**inputs, return_dict=False)[0]
    assert calls == reduced_calls and not kept  # every reduced call windowed, none nearest
    assert len({id(plan) for plan in plans[:2 * calls]}) == len({plan.length for plan in plans})  # one a kind, kept
    assert not torch.equal(windowed, nearest) and not torch.equal(windowed, unpatched)
    assert (whole - unpatched).abs().max() < 1e-5
    tokens = frames * 256
    assert report.levels[0].tokens == {"q": (tokens, tokens), "k/v": (tokens, round(plans[0].seen * tokens))}
    assert not report.warnings and report.skipped_calls == 0


@pytest.mark.parametrize("dim", [1, 2])
def test_a_window_call_takes_the_calls_own_scale(dim):
    """Lumina 2's proportional attention passes a scale of its own: it goes on q, so the window
    (here every key exact: target = grid) gives SDPA's attention with that scale."""
    from tokenreduce.diffusers.todo import _windowed
    from tokenreduce.peak_window import window_plan

    grid, text, heads = (1, 6, 6), 5, 2
    length = text + 36
    plan = window_plan(length, text, grid, grid, (1.0, 1.0, 1.0), "cpu")
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, heads, length, 8, generator=generator) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.2)
    layout = (lambda x: x) if dim == 2 else (lambda x: x.transpose(1, 2))  # the dispatcher's [B, N, heads, D]
    out = _windowed(layout(q), layout(k), layout(v), dim, plan, 0.2)
    assert (layout(out) - expected).abs().max() < 1e-5


@pytest.mark.parametrize("family", ["Chroma", "HunyuanVideo"])
def test_method_window_keeps_nearest_on_calls_with_a_mask(monkeypatch, family):
    """As in ComfyUI (todo_dit.py): a grid call with an attention mask of its own (Chroma's and
    HunyuanVideo's text padding) is not windowed; its keys are kept as nearest keeps them."""
    from tokenreduce.diffusers import todo

    monkeypatch.setattr(todo, "window_call", None)  # never called
    model = tiny.transformer(family)
    inputs = tiny.transformer_inputs(family, model, batch=2, frames=2 if family in VIDEO else 1)
    settings = {"skip_first_blocks": 0, "skip_last_blocks": 0}
    with torch.no_grad():
        with apply_patch(model, "ToDo", **settings):
            nearest = model(**inputs, return_dict=False)[0]
        with apply_patch(model, "ToDo", method="window", **settings) as patch:
            windowed = model(**inputs, return_dict=False)[0]
    assert torch.equal(windowed, nearest) and patch.report().levels


def test_unet_todo_pools_the_normed_tokens_as_comfyui_does():
    pipe = tiny.pipeline()
    attention = pipe.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1
    seen = []
    base = tiny.generate(pipe, steps=2, size=64)
    # always: the spy sees the pipeline's calls only, not max_change's measuring ones (on the CPU too)
    with apply_patch(pipe, "ToDo", factor=2, method="average", reduce_when="always") as patch:
        hook = attention.register_forward_pre_hook(lambda m, a, kw: seen.append((a[0], kw["encoder_hidden_states"])),
                                                   with_kwargs=True)
        reduced = tiny.generate(pipe, steps=2, size=64)
        hook.remove()
        lines = patch.report_lines()
    assert seen and all(torch.equal(kv, downsample_tokens(x, 8, 8, 2, "average")) for x, kv in seen)
    assert not torch.equal(reduced, base) and torch.equal(tiny.generate(pipe, steps=2, size=64), base)
    assert "ds 1 · 8×8 · q 64→64 · k/v 64→16" in lines


def test_unet_todo_level_auto_is_the_finest_with_blocks_on_sdxl():
    pipe = tiny.pipeline(sdxl=True)
    with apply_patch(pipe, "ToDo", factor=2) as patch:
        assert "downsample 2: 3 blocks, keys/values pooled 2x per side" in patch.info
        tiny.generate(pipe, steps=1, size=64)
        assert "ds 2 · 4×4 · q 16→16 · k/v 16→4" in patch.report_lines()


def test_composes_with_set_attention_backend_and_diffusers_caches():
    from diffusers import PyramidAttentionBroadcastConfig
    from diffusers.hooks import FirstBlockCacheConfig

    model = tiny.transformer("Wan")
    inputs = tiny.transformer_inputs("Wan", model, frames=2)
    with torch.no_grad():
        patch = apply_patch(model, "ToDo", skip_first_blocks=0, skip_last_blocks=0)
        model.set_attention_backend("native")  # reaches our processors' shared state
        reduced = model(**inputs, return_dict=False)[0]
        now = {"step": 900.0}
        # The pyramid broadcast serves step 2's attention from its cache: not reduced, and not said to be.
        for cache, active in ((FirstBlockCacheConfig(threshold=0.5), (1, 2, 3)),
                              (PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                                               spatial_attention_timestep_skip_range=(100, 800),
                                                               current_timestep_callback=lambda: now["step"]),
                               (1, 3))):
            model.enable_cache(cache)
            for step in (900.0, 700.0, 500.0):
                now["step"] = step
                with model.cache_context("cond"):
                    model(**{**inputs, "timestep": torch.tensor([step])}, return_dict=False)
            model.disable_cache()
            report = patch.report()
            assert report.steps == 3 and report.active_steps == active and not report.warnings
        patch.remove()
        assert model.blocks[0].attn1.processor._attention_backend is not None  # kept after removal
        assert not torch.equal(model(**inputs, return_dict=False)[0], reduced)
    assert patch.report().levels


@pytest.mark.parametrize("family,how", [("Wan", "regional"), ("Flux", "whole")])
def test_compiled_without_graph_breaks_or_recompiles_per_step(family, how):
    """Regional: diffusers' compile_repeated_blocks of the patched model. Whole: torch.compile of
    the model, then apply_patch to the compiled model (its call hooks run on the wrapper, outside
    the compiled region). fullgraph: a graph break raises; error_on_recompile: so does a recompile."""
    model = tiny.transformer(family)
    inputs = tiny.transformer_inputs(family, model, frames=2)
    steps = (0.9, 0.5, 0.1) if family == "Flux" else (900.0, 500.0, 100.0)
    settings = {"skip_first_blocks": 0, "skip_last_blocks": 0}
    torch._dynamo.reset()
    with torch.no_grad():
        with apply_patch(model, "ToDo", **settings):
            eager = model(**inputs, return_dict=False)[0]
        if how == "regional":
            patch = apply_patch(model, "ToDo", **settings)
            model.compile_repeated_blocks(fullgraph=True, backend="eager")
            compiled = model
        else:
            compiled = torch.compile(model, fullgraph=True, backend="eager")
            patch = apply_patch(compiled, "ToDo", **settings)
        first = compiled(**inputs, return_dict=False)[0]
        with torch._dynamo.config.patch(error_on_recompile=True):
            for step in steps:
                compiled(**{**inputs, "timestep": torch.tensor([step])}, return_dict=False)
        patch.remove()
    assert torch.allclose(first, eager, atol=1e-5)
    assert patch.report().levels


@pytest.mark.parametrize("method", ["nearest", "window"])
def test_a_compiled_unet_reduces_as_the_eager_one_and_says_so(method):
    """apply_patch on a pipeline whose UNet is torch.compile'd: the same image as the eager UNet
    patched, no recompile on the next run, and the report counts the reduced level (the window's
    processor notes only eagerly: compiled, its pre-hook notes the call it marks)."""
    pipe = tiny.pipeline()
    unet = pipe.unet
    torch._dynamo.reset()
    with apply_patch(pipe, "ToDo", method=method, reduce_when="always"):
        eager = tiny.generate(pipe, steps=2, size=128)
    pipe.unet = torch.compile(unet, backend="eager")
    try:
        with apply_patch(pipe, "ToDo", method=method, reduce_when="always") as patch:
            first = tiny.generate(pipe, steps=2, size=128)
            with torch._dynamo.config.patch(error_on_recompile=True):
                assert torch.equal(tiny.generate(pipe, steps=2, size=128), first)
            lines, report = patch.report_lines(), patch.report()
    finally:
        pipe.unet = unet
    assert torch.equal(first, eager)
    keys = 112 if method == "window" else 64  # the window's keys a query sees (plan.seen), nearest's kept
    assert f"ds 1 · 16×16 · q 256→256 · k/v 256→{keys}" in lines, lines
    assert report.active_steps == (1, 2) and not report.warnings


def test_a_flux_pipeline_runs_by_its_own_timesteps():
    """Flux's pipeline passes sigma-scaled timesteps (t / 1000): the window and the run's steps
    are read from those, and the next pipeline call is a new run."""
    pipe = tiny.flux_pipeline()
    base = tiny.generate(pipe, steps=4, size=128)
    with apply_patch(pipe, "ToDo", start_percent=0.5) as patch:
        for _ in range(2):
            reduced = tiny.generate(pipe, steps=4, size=128)
            report = patch.report()
            assert report.steps == 4 and report.active_steps == (3, 4) and not report.warnings
    assert report.levels[0].tokens == {"q": (64, 64), "k/v": (64, 16)}
    assert not torch.equal(reduced, base) and torch.equal(tiny.generate(pipe, steps=4, size=128), base)


def test_processors_swapped_after_apply_patch_are_said_not_reported_as_reduced():
    """IP-Adapter and PAG loaders set processors after apply_patch: those blocks never reach ours.
    Nothing reduced is reported as nothing reduced, with a warning that says why."""
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    model = tiny.transformer("Flux")
    inputs = tiny.transformer_inputs("Flux", model)
    with torch.no_grad():
        unpatched = model(**inputs, return_dict=False)[0]
        with apply_patch(model, "ToDo", skip_first_blocks=0, skip_last_blocks=0) as patch:
            model.transformer_blocks[0].attn.processor = FluxAttnProcessor()  # one block swapped
            partly = model(**inputs, return_dict=False)[0]
            report = patch.report()
            assert report.levels and not torch.equal(partly, unpatched)
            (warning,) = report.warnings
            assert "1 of the 4 attention processors" in warning and "after apply_patch" in warning
            model.set_attn_processor(FluxAttnProcessor())  # every block swapped
            untouched = model(**inputs, return_dict=False)[0]
            report = patch.report()
    assert torch.equal(untouched, unpatched)
    assert not report.levels and report.active_steps == ()
    assert any("4 of the 4 attention processors" in w and "reduced nothing" in w for w in report.warnings)


def test_remove_leaves_nothing_on_the_model():
    model = tiny.transformer("Flux")
    inputs = tiny.transformer_inputs("Flux", model)
    before = set(model.__dict__)
    with torch.no_grad(), apply_patch(model, "ToDo"):
        model(**inputs)
    assert set(model.__dict__) == before


def test_a_decision_names_the_attention_backend_it_was_timed_with(monkeypatch, tmp_path):
    """A decision timed under one attention backend is not reused under another."""
    from tokenreduce import pays
    from tokenreduce.diffusers import api

    store = pays.Decisions(tmp_path / "auto_decisions.json", measure_cpu=True)
    monkeypatch.setattr(api, "decisions_at", lambda path: store)
    model = tiny.transformer("Wan")
    inputs = tiny.transformer_inputs("Wan", model, frames=2)
    with torch.no_grad():
        # (diffusers' active backend is native: setting it is no other backend)
        for backend, measured in ((None, 1), ("native", 1), ("_native_math", 2)):
            if backend is not None:
                model.set_attention_backend(backend)
            # (no budget: its per-block changes are kept too; this counts the timed kinds)
            with apply_patch(model, "ToDo", reduce_when="auto", skip_first_blocks=0, max_change=0):
                model(**inputs)
            assert store.measurements == measured, backend
    kinds = [json.loads(key) for key in json.loads(store.path.read_text())["decisions"]]
    assert len({str(kind) for kind in kinds}) == 2
