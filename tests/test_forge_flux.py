"""ToDo, ToMe and both together on Forge's own Flux.1 (tokenreduce_forge/flux.py), in-process against
the Forge tree named by ``--forge PATH`` (skipped without it): Forge's ``backend.nn.flux`` imported from that tree on
the CPU, a tiny ``IntegratedFluxTransformer2DModel`` with random weights in Forge's ``KModel`` and
``UnetPatcher``, patched by the extension's entry point (``patching.install`` / the hooks) and
called as Forge's sampling function calls it (``model_function_wrapper``, object patches applied
and undone as Forge loads and unloads the clone). No server: Forge's Flux needs a T5-XXL."""

from __future__ import annotations

import contextlib
import math
import sys
import types

import pytest
import torch

from forge_helpers import skip_without_forge

skip_without_forge()

from forge_server import check_tree, forge_tree  # noqa: E402
from random_models import randomize_  # noqa: E402
from tokenreduce.downsample import grid_keep_index  # noqa: E402
from tokenreduce.measure import dit_attention_work  # noqa: E402
from tokenreduce.run import ModelCall, call_context  # noqa: E402
from tokenreduce_forge import flux as forge_flux  # noqa: E402
from tokenreduce_forge import hooks, patching  # noqa: E402
from tokenreduce_forge import settings as S  # noqa: E402

TEXT, LATENT = 6, (1, 4, 12, 10)  # 6 text tokens; a 12x10 latent: a 6x5 token grid
GRID = (6, 5)
BLOCKS = 5  # 2 double + 3 single; the defaults leave the first and the last alone


def _import_forge():
    """Forge's backend modules from the named tree, on the CPU (Forge reads its flags at import)."""
    tree = forge_tree()
    check_tree(tree)
    # On the path for this import only (its package then finds its own modules): later tests of
    # the session must not find the WebUI's ``modules`` (the hooks would take it for a running WebUI).
    path, argv, bytecode = list(sys.path), sys.argv, sys.dont_write_bytecode
    sys.path.append(str(tree))
    sys.argv, sys.dont_write_bytecode = ["forge", "--always-cpu"], True  # and the tree stays as it is
    try:
        from backend.modules.k_model import KModel
        from backend.modules.k_prediction import PredictionFlux
        from backend.nn import flux
        from backend.patcher.unet import UnetPatcher
    except ImportError as missing:
        pytest.fail(f"cannot import Forge's backend from {tree} in this Python ({sys.executable}): {missing!r}")
    finally:
        sys.path[:], sys.argv, sys.dont_write_bytecode = path, argv, bytecode

    class Prediction(PredictionFlux):
        """Forge's Flux prediction without its shifted sigma table, which this Python's diffusers
        (newer than Forge's pin) cannot compute unbound; the tests read none of it."""

        def apply_mu_transform(self, *args, mu=None, **kwargs):
            self.mu = mu
            self.register_buffer("sigmas", torch.arange(1, self.pseudo_timestep_range + 1) / self.pseudo_timestep_range)

    return types.SimpleNamespace(flux=flux, KModel=KModel, Prediction=Prediction, UnetPatcher=UnetPatcher)


@pytest.fixture(scope="module")
def forge():
    return _import_forge()


def make_unet(forge, seed: int = 0, cls=None):
    """Forge's UnetPatcher around a tiny random Flux.1 (weights from a private generator)."""
    cls = cls or forge.flux.IntegratedFluxTransformer2DModel
    with torch.device("meta"):
        model = cls(in_channels=4, vec_in_dim=8, context_in_dim=16, hidden_size=32, mlp_ratio=2.0, num_heads=2,
                    depth=2, depth_single_blocks=3, axes_dim=[4, 6, 6], theta=10000, qkv_bias=True,
                    guidance_embed=False)
    model.to_empty(device="cpu")
    randomize_(model, seed)
    model.eval()
    model.storage_dtype = model.computation_dtype = torch.float32
    kmodel = forge.KModel(model, None, k_predictor=forge.Prediction(mu=1.0))
    cpu = torch.device("cpu")
    return forge.UnetPatcher(kmodel, load_device=cpu, offload_device=cpu)


@pytest.fixture(scope="module")
def unet(forge):
    return make_unet(forge)


def inputs(seed: int = 1, latent=LATENT):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(latent, generator=generator), torch.randn(latent[0], TEXT, 16, generator=generator),
            torch.randn(latent[0], 8, generator=generator))


@contextlib.contextmanager
def loaded(unet):
    """The clone loaded as Forge loads it: its object patches on the shared model, then undone."""
    unet.forge_patch_model()
    try:
        yield unet
    finally:
        unet.forge_unpatch_model()


def model_call(unet, sigma: float, x, context, y):
    """One model call as Forge's sampling function makes it."""
    options = dict(unet.model_options["transformer_options"])
    timestep = torch.full((x.shape[0],), sigma)
    options.update(cond_or_uncond=[0], sigmas=timestep)
    c = {"c_crossattn": context, "y": y, "transformer_options": options}
    wrapper = unet.model_options.get("model_function_wrapper")
    with torch.no_grad():
        if wrapper is None:
            return unet.model.apply_model(x, timestep, **c)
        return wrapper(unet.model.apply_model, {"input": x, "timestep": timestep, "c": c, "cond_or_uncond": [0]})


def sample(unet, sigmas=(1.0, 0.5), latent=LATENT, seed: int = 1):
    """Two Euler-like steps (enough to see the reduction and the report)."""
    x, context, y = inputs(seed, latent)
    with loaded(unet):
        for sigma in sigmas:
            x = model_call(unet, sigma, x, context, y)
    return x


def todo(stage=S.FIRST, **values):
    return {"ToDo": S.method_settings("ToDo", stage, values)}


def install(unet, methods, latent=LATENT, stage=S.FIRST):
    return patching.install(unet, "Flux", stage, methods, latent)


@contextlib.contextmanager
def spying(monkeypatch, forge):
    """Every call of Forge's attention function (the one its Flux module calls): q, k, v."""
    calls = []
    real = forge.flux.attention_function

    def spy(q, k, v, heads, *args, **kwargs):
        calls.append((q, k, v))
        return real(q, k, v, heads, *args, **kwargs)

    monkeypatch.setattr(forge.flux, "attention_function", spy)  # the test's spy only, undone after it
    yield calls
    monkeypatch.setattr(forge.flux, "attention_function", real)


def _keep() -> torch.Tensor:
    kept = grid_keep_index((1, *GRID), (1, 3, 3), (1.0, 2.0, 2.0)) + TEXT
    return torch.cat([torch.arange(TEXT), kept])


# --- what it computes -----------------------------------------------------------------------------

def test_image_keys_reduced_in_every_selected_block_text_and_queries_untouched(forge, unet, monkeypatch):
    with spying(monkeypatch, forge) as full_calls:
        sample(unet, sigmas=(1.0,))
    with spying(monkeypatch, forge) as calls:
        patched, run = install(unet, todo(max_change=0))  # (the budget's rehearsals: below)
        sample(patched, sigmas=(1.0,))
    tokens = TEXT + math.prod(GRID)
    assert len(calls) == len(full_calls) == BLOCKS
    for block, ((q, k, v), (fq, fk, fv)) in enumerate(zip(calls, full_calls)):
        assert q.shape[2] == tokens
        kept = TEXT + 9 if block in (1, 2, 3) else tokens  # 6x5 grid -> 3x3 kept, 4x fewer keys
        assert k.shape[2] == v.shape[2] == kept, block
    # The first reduced block sees what the unpatched one sees: its keys (rope applied to the full
    # sequence, so each kept key keeps its own position) and values are those kept, text intact.
    (q, k, v), (fq, fk, fv) = calls[1], full_calls[1]
    assert torch.equal(q, fq)
    assert torch.equal(k, fk.index_select(2, _keep())) and torch.equal(v, fv.index_select(2, _keep()))
    assert torch.equal(k[:, :, :TEXT], fk[:, :, :TEXT])
    (method, report), = run.finish(True)
    assert report.levels[0].tokens == {"q": (30, 30), "k/v": (30, 9)} and not report.warnings


SCHEDULE = (1.0, 0.75, 0.5, 0.25)  # the budget reads each block at step 4 of 4: sigma 0.25


def budgeted(unet, store, max_change: float):
    """ToDo with ``max_change`` on the pass's schedule (late_sigma 0.25), its decisions in ``store``:
    (the sampled output, the report)."""
    patched, run = patching.install(unet, "Flux", S.FIRST, todo(max_change=max_change), LATENT, decisions=store)
    run.use_schedule([*SCHEDULE, 0.0], patched)
    out = sample(patched, sigmas=SCHEDULE)
    ((_, report),) = run.finish(True)
    return out, report


def test_the_budget_decides_forges_flux_blocks_one_by_one_on_a_late_input(forge, unet, tmp_path):
    """ToDo's quality budget on Forge's own Flux (issue #51), as in ComfyUI: each reduced block's
    change read alone on a late input (a rehearsal of the call through the block-replace seam the
    object patches give Forge's blocks), graded under the budget, said per block. Fails before:
    the budget was not applied here at all. A budget nothing fits: the unpatched output; one that
    fits every block: every block reduced (the output of max_change 0); one that fits the smallest
    block alone: one block reduced and the others said left alone. The run that measures gives
    what a later run with the kept decisions gives."""
    from tokenreduce.pays import LATE_SCALE, Decisions

    unpatched = sample(unet, sigmas=SCHEDULE)
    store = Decisions(tmp_path / "auto_decisions.json")
    out, report = budgeted(unet, store, 1e-9)
    lines = [line for line in report.notes if "per block, read at 75 % of sampling, counted 2x" in line]
    assert torch.equal(out, unpatched) and len(lines) == 1 and "left alone double 1, single 0-1" in lines[0], lines
    changes = {site: d.change for site, d in store.log if ", block " in site}
    assert len(changes) >= 3 and all(change > 0 for change in changes.values()), changes
    measured = store.measurements  # the blocks' changes (and the window's speed: timed on the CPU too)
    every, _ = budgeted(unet, Decisions(None), 0.0)  # no budget: every selected block reduced
    out, report = budgeted(unet, store, 2.0)
    assert torch.equal(out, every) and store.measurements == measured  # kept: nothing measured again
    budget = LATE_SCALE * min(changes.values()) * 1.001
    measuring = Decisions(None)
    out, report = budgeted(unet, measuring, budget)
    (graded,) = [d for site, d in report.decisions if site.endswith("per block")]
    (line,) = [line for line in report.notes if "per block, read at 75 %" in line]
    assert graded.reduce and graded.change <= budget and "left alone " in line, line
    assert not torch.equal(out, unpatched) and not torch.equal(out, every)
    measured = measuring.measurements
    again, _ = budgeted(unet, measuring, budget)
    assert torch.equal(again, out) and measuring.measurements == measured


def test_tome_on_forges_flux_is_timed_and_budgeted_per_block_as_in_comfyui(forge, unet, tmp_path):
    """ToMe's auto rule and quality budget on Forge's own Flux (issue #51; before: untimed, no budget,
    every selected block merged): its blocks reached through their seams in rehearsals of the call,
    each block's change read alone on a late input at the ratio and half of it. A budget nothing
    fits: the unpatched output, the report naming every block left alone; one that fits every block
    at the ratio: reduce_when always's output; the kept decisions measure nothing again."""
    from tokenreduce.pays import Decisions

    def budgeted_tome(store, max_change):
        patched, run = patching.install(unet, "Flux", S.FIRST, tome(reduce_when="auto", max_change=max_change),
                                        LATENT, decisions=store)
        run.use_schedule([*SCHEDULE, 0.0], patched)
        out = sample(patched, sigmas=SCHEDULE)
        ((method, report),) = run.finish(True)
        return out, method, report

    unpatched = sample(unet, sigmas=SCHEDULE)
    store = Decisions(tmp_path / "auto_decisions.json")
    out, method, report = budgeted_tome(store, 1e-9)
    (line,) = [line for line in report.notes if "per block, read at 75 % of sampling, counted 2x" in line]
    assert torch.equal(out, unpatched) and "left alone double 1, single 0-1" in line, report.notes
    assert "not timed" not in method.info and not any("not timed" in w for w in report.warnings)
    assert len([site for site, _ in store.log if site.endswith(" merged")]) == 6  # 3 blocks, 2 ratios
    measured = store.measurements
    always = sample(install(unet, tome())[0], sigmas=SCHEDULE)
    out, _, report = budgeted_tome(store, 2.0)
    (line,) = [line for line in report.notes if "per block, read at 75 %" in line]
    assert torch.equal(out, always) and "ratio 0.5 double 1, single 0-1" in line and store.measurements == measured


def tome(stage=S.FIRST, **values):
    """ToMe's settings; reduce_when always unless given (what it merges, not what auto decides: below)."""
    return {"ToMe": S.method_settings("ToMe", stage, {"reduce_when": "always", **values})}


def test_tome_merges_the_image_tokens_of_forges_own_flux_blocks(forge, unet, monkeypatch):
    """ToMe through Forge's own Flux block signatures: in the merged blocks attention sees fewer
    image tokens (queries and keys), the text whole; reruns bit for bit; ratio 0 is unpatched."""
    with spying(monkeypatch, forge) as full_calls:
        plain = sample(unet, sigmas=(1.0,))
    with spying(monkeypatch, forge) as calls:
        patched, run = install(unet, tome())
        assert run.refusal is None, run.refusal
        merged = sample(patched, sigmas=(1.0,))
    tokens = TEXT + math.prod(GRID)
    assert len(calls) == len(full_calls) == BLOCKS
    shorter = [block for block, (q, k, _) in enumerate(calls) if q.shape[2] < tokens]
    assert shorter and 0 not in shorter and BLOCKS - 1 not in shorter  # the first and last blocks stay whole
    for block in shorter:
        q, k, _ = calls[block]
        assert k.shape[2] == q.shape[2] > TEXT
    assert not torch.equal(merged, plain) and torch.isfinite(merged).all()
    again, _ = install(unet, tome())
    assert torch.equal(sample(again, sigmas=(1.0,)), merged)
    zero, _ = install(unet, tome(ratio=0.0))
    assert torch.equal(sample(zero, sigmas=(1.0,)), plain)


def _block_calls(monkeypatch, forge, unet, methods):
    """(the output of one step, Forge's attention calls, the pass's run) of ``methods`` installed
    under the spy (the patch takes Forge's attention function at install)."""
    with spying(monkeypatch, forge) as calls:
        patched, run = install(unet, methods)
        assert run.refusal is None, run.refusal
        return sample(patched, sigmas=(1.0,)), calls, run


def test_tome_and_todo_stack_on_forges_flux(forge, monkeypatch):
    """Both on: ToMe merges the grid of whole blocks and, inside the merged blocks, ToDo keeps
    keys and values of the merged grid (the merged tokens its kept grid positions were merged
    into, the text whole); the same whichever method the settings name first; reruns bit for bit;
    the model and Forge's module unchanged after; each alone as before."""
    unet = make_unet(forge)
    model = unet.model.diffusion_model
    baseline, module = sample(unet, sigmas=(1.0,)), dict(vars(forge.flux))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    only_todo, _, _ = _block_calls(monkeypatch, forge, unet, todo())
    only_tome, merged_calls, _ = _block_calls(monkeypatch, forge, unet, tome())
    stacked, calls, run = _block_calls(monkeypatch, forge, unet, {**todo(), **tome()})
    tokens = TEXT + math.prod(GRID)
    assert len(calls) == len(merged_calls) == BLOCKS
    for block, ((q, k, v), (mq, mk, _)) in enumerate(zip(calls, merged_calls)):
        assert q.shape == mq.shape, block  # the queries: ToMe's merged tokens (whole in the first and last)
        assert k.shape[2] == v.shape[2] == (TEXT + 9 if block in (1, 2, 3) else tokens), block  # ToDo's 3x3 kept
    assert TEXT < merged_calls[1][0].shape[2] < tokens
    # the first merged block has the same input and merge with ToDo or without it: its keys are the
    # text as it is and, of the grid, rows of the merged grid's keys
    (_, k, v), (_, mk, mv) = calls[1], merged_calls[1]
    assert torch.equal(k[:, :, :TEXT], mk[:, :, :TEXT]) and torch.equal(v[:, :, :TEXT], mv[:, :, :TEXT])
    for grid, merged in ((k, mk), (v, mv)):
        rows, merged_rows = grid[:, :, TEXT:].transpose(1, 2).flatten(2), merged[:, :, TEXT:].transpose(1, 2).flatten(2)
        assert (rows[0][:, None] == merged_rows[0][None]).all(-1).any(1).all()
    assert torch.isfinite(stacked).all()
    assert not torch.equal(stacked, only_todo) and not torch.equal(stacked, only_tome)
    reports = {method.method: report for method, report in run.finish(True)}
    (level,) = reports["ToDo"].levels
    m = merged_calls[1][0].shape[2] - TEXT
    assert level.tokens == {"k/v in merged blocks": (m, 9)} and not reports["ToDo"].warnings
    assert reports["ToDo"].skipped_calls == 0 and reports["ToMe"].levels
    patched, _ = install(unet, {**tome(), **todo()})  # ToMe named first: the same patches, the same result
    assert set(patched.object_patches) == {"diffusion_model.forward"} | {
        f"diffusion_model.{path}.forward" for path in ("double_blocks.1", "single_blocks.0", "single_blocks.1")}
    assert torch.equal(sample(patched, sigmas=(1.0,)), stacked)
    assert torch.equal(_block_calls(monkeypatch, forge, unet, {**todo(), **tome()})[0], stacked)  # reruns
    assert all(getattr(m.forward, "__func__", None) is type(m).forward for m in [model, *model.double_blocks,
                                                                                 *model.single_blocks])
    assert vars(forge.flux) == module
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(sample(unet, sigmas=(1.0,)), baseline)
    assert torch.equal(sample(install(unet, todo())[0], sigmas=(1.0,)), only_todo)  # each alone as before
    assert torch.equal(sample(install(unet, tome())[0], sigmas=(1.0,)), only_tome)


def test_tome_plan_reuse_corrected_from_the_whole_blocks_on_forges_own_flux(forge, unet):
    """plan_every with correct_from_whole (the API's dict form) through Forge's own Flux blocks and
    sampling options: the step that plans gives the unpatched output (its merged blocks' whole
    outputs), the next step reuses the plan with the kept differences, closer to unpatched than
    the same plans without them; reruns bit for bit."""
    plain_one, plain_two = sample(unet, sigmas=(1.0,)), sample(unet)
    settings = dict(share_plans=True, plan_every=2, reduce_when="always")
    corrected, run = install(unet, tome(correct_from_whole=True, **settings))
    assert run.refusal is None, run.refusal
    assert torch.equal(sample(corrected, sigmas=(1.0,)), plain_one)
    two = sample(corrected)
    assert torch.equal(sample(install(unet, tome(correct_from_whole=True, **settings))[0]), two)
    merged = sample(install(unet, tome(**settings))[0])
    assert (two - plain_two).norm() < 0.5 * (merged - plain_two).norm()


def test_output_differs_within_a_bounded_error_and_reruns_bit_for_bit(forge, unet):
    baseline = sample(unet)
    first = sample(install(unet, todo())[0])
    again = sample(install(unet, todo())[0])
    assert torch.equal(first, again)
    assert not torch.equal(first, baseline)
    error = (first - baseline).norm() / baseline.norm()
    assert 0 < error < 0.05, error  # 0.009 here


def test_method_window_runs_on_forges_own_flux(forge, unet, monkeypatch):
    """method window: each reduced block's call runs whole through the core's window
    (peak_window.window_call, every query); reruns bit for bit; not nearest; at factor 1.05 (every
    grid key its own cell: window, far field and heavy keys partition the keys) the unpatched output."""
    from tokenreduce import todo_dit

    latent = (2, 4, 32, 32)  # a 16x16 grid: the windows (4x4 tiles, 2 tokens around) do not cover it
    windowed, real = [], todo_dit.window_call
    monkeypatch.setattr(todo_dit, "window_call", lambda q, *args, **kwargs: windowed.append(q.shape) or
                        real(q, *args, **kwargs))
    baseline = sample(unet, sigmas=(1.0,), latent=latent)
    nearest = sample(install(unet, todo(max_change=0), latent)[0], sigmas=(1.0,), latent=latent)  # (no budget: its
    assert not windowed  # milder step would measure the window)
    first = sample(install(unet, todo(method="window", reduce_when="always"), latent)[0], sigmas=(1.0,), latent=latent)
    assert windowed == [(2, 2, TEXT + 256, 16)] * 3  # the three reduced blocks, each call whole
    assert torch.equal(sample(install(unet, todo(method="window", reduce_when="always"), latent)[0], sigmas=(1.0,), latent=latent), first)
    assert not torch.equal(first, nearest) and not torch.equal(first, baseline)
    whole = sample(install(unet, todo(method="window", reduce_when="always", factor=1.05), latent)[0], sigmas=(1.0,), latent=latent)
    assert (whole - baseline).abs().max() < 1e-5


def test_the_model_and_forges_module_are_unchanged_after_the_clone(forge, monkeypatch):
    unet = make_unet(forge)
    baseline = sample(unet)
    module = dict(vars(forge.flux))
    model = unet.model.diffusion_model
    patched, run = install(unet, todo())
    assert set(patched.object_patches) == {"diffusion_model.forward"} | {
        f"diffusion_model.{path}.forward" for path in ("double_blocks.1", "single_blocks.0", "single_blocks.1")}
    assert not unet.object_patches and "model_function_wrapper" not in unet.model_options
    with loaded(patched):
        block = model.double_blocks[1]
        rebuilt = block.forward.__wrapped__  # ours, on the shared model while loaded (the budget's seam around it)
        assert block.forward.__name__ == "forward" and rebuilt.__name__ == "forward"
        assert rebuilt.__func__ is not type(block).forward
        assert rebuilt.__func__.__code__ is type(block).forward.__code__  # Forge's code, our attention
    for block in [*model.double_blocks, *model.single_blocks]:
        assert getattr(block.forward, "__func__", None) is type(block).forward
    assert vars(forge.flux) == module  # the module's globals (its attention) never changed
    assert torch.equal(sample(unet), baseline)
    # A clone Forge dropped without unloading it leaves its patches on the shared model: calls
    # outside its pass go through them unreduced, and the next clone patches from the class.
    stale, _ = install(unet, todo())
    stale.forge_patch_model()
    assert model.double_blocks[1].forward.__wrapped__.__func__ is not type(model.double_blocks[1]).forward
    x, context, y = inputs()
    expected = model_call(unet, 1.0, x, context, y)
    assert torch.equal(model_call(unet, 1.0, x, context, y), expected)
    fresh, run = install(unet, todo())
    assert run.refusal is None and run.methods
    stale.forge_unpatch_model()
    assert torch.equal(sample(fresh), sample(install(unet, todo())[0]))


def test_a_clone_of_a_patched_unet_is_patched_once(forge, unet):
    """Forge's hires pass calls the hook a second time on the first pass's patched UNet."""
    once, _ = install(unet, todo())
    twice, _ = install(once, todo(S.HIRES))
    assert set(twice.object_patches) == set(once.object_patches)
    assert torch.equal(sample(twice), sample(once))
    stripped, _ = install(once, {})
    assert not stripped.object_patches and patching.INSTALLED not in stripped.model_options
    assert torch.equal(sample(stripped), sample(unet))


# --- checks, refusals and reports ---------------------------------------------------------------

@pytest.mark.parametrize("methods,latent,expected", [
    ({"ToDo": {"method": "average"}}, LATENT, "TokenReduce ToDo: method 'average' does not work on Flux.1: its keys "
                                              "carry rotary positions"),
    ({"ToDo": {"factor": 4.0}}, (1, 4, 6, 6), "TokenReduce ToDo: factor 4 does not fit the 3x3 token grid"),
])
def test_refusals_raise_at_the_first_model_call(forge, unet, methods, latent, expected):
    settings = {m: S.method_settings(m, S.FIRST, v) for m, v in methods.items()}
    patched, run = install(unet, settings, latent)
    assert run.refusal.startswith(expected), run.refusal
    assert not patched.object_patches
    with pytest.raises(patching.Refused, match="^" + expected.replace("(", r"\(")[:40]):
        sample(patched, latent=latent)


def test_settings_that_do_nothing_are_said(forge, unet):
    patched, run = install(unet, todo(level="2"))
    assert not run.methods and run.warnings[0].startswith("TokenReduce ToDo: WARNING: ToDo does nothing on this Flux")
    assert not patched.object_patches and "model_function_wrapper" not in patched.model_options
    patched, run = install(unet, todo(factor_next=2.0))
    sample(patched)
    (method, report), = run.finish(True)
    assert any("factor_next 2 does nothing on a DiT" in w for w in report.warnings)


def test_other_forge_dits_and_subclasses_are_refused_with_the_reason(forge):
    class FluxWithAnotherStream(forge.flux.IntegratedFluxTransformer2DModel):
        pass

    _, run = install(make_unet(forge, cls=FluxWithAnotherStream), todo())
    assert run.refusal.startswith("TokenReduce cannot patch this Flux model: it has no UNet transformer blocks. In "
                                  "Forge, TokenReduce works on UNet models (SD1.x, SD2.x, SDXL) and ToMe or ToDo on "
                                  "Forge's Flux.1"), run.refusal


def test_another_extensions_attention_is_refused_not_bypassed(forge, unet, monkeypatch):
    def attention(q, k, v, pe):  # as a SageAttention extension might swap Forge's module global
        return None

    monkeypatch.setattr(forge.flux, "attention", attention)
    _, run = install(unet, todo())
    assert run.refusal == (
        "TokenReduce ToDo cannot reach the attention of Forge's Flux: in block double_blocks.1, Forge's Flux attention "
        "was replaced by test_forge_flux.test_another_extensions_attention_is_refused_not_bypassed.<locals>.attention "
        "(another extension). Turn one of them off."), run.refusal


class Flux:  # named as Forge's Flux engine (backend/diffusion_engine/flux.py)
    pass


def hooks_run(unet, **values):
    """A generation through the script's hooks, the accordion on with ``values`` (by argument name)."""
    args = [arg.default for arg in S.ARGS]
    for name, value in {"enabled": True, **values}.items():
        args[S.ARG_INDEX[name]] = value
    sd_model = Flux()
    sd_model.forge_objects = types.SimpleNamespace(unet=unet)
    p = types.SimpleNamespace(extra_generation_params={"Steps": 2}, override_settings={}, comments={},
                              sd_model=sd_model, is_hr_pass=False, enable_hr=False)
    p.comment = lambda text: p.comments.__setitem__(text, 1)
    hooks.before_process(p, args)
    hooks.before_sampling(p, args, {"x": torch.zeros(LATENT)})
    assert sd_model.forge_objects.unet is not unet
    sample(sd_model.forge_objects.unet)
    hooks.after_batch(p, args)
    return p


def test_the_hooks_patch_and_report_in_the_infotext(forge, unet):
    p = hooks_run(unet)
    assert p.extra_generation_params["TokenReduce ToDo report"] == (
        "ToDo · Flux · 3 of 5 blocks | ds 1 · 5×6 · q 30→30 · k/v 30→9 | auto · 5×6 grid, per block, read at 75 % of "
        "sampling, counted 2x · nearest double 1, single 0-1 · 3.6 % of the 5.0 % budget | steps 1-2 of 2")
    assert any(text.startswith("TokenReduce, first pass: ToDo on Flux (Flux.1, DiT): keys/values of the image tokens")
               for text in p.comments)


def test_the_hooks_report_tome_and_todo_together(forge, unet):
    """Both ticked in the accordion: each method's report in the infotext, ToDo's keys counted in
    the merged blocks."""
    p = hooks_run(unet, **{"ToMe": True, "ToMe reduce_when": "always"})
    assert p.extra_generation_params["TokenReduce ToDo report"] == (
        "ToDo · Flux · 3 of 5 blocks | ds 1 · 5×6 · k/v in merged blocks 15→9 | auto · 5×6 grid, per block, read at "
        "75 % of sampling, counted 2x · nearest double 1, single 0-1 · 3.6 % of the 5.0 % budget | steps 1-2 of 2")
    assert p.extra_generation_params["TokenReduce ToMe report"] == (
        "ToMe · Flux · 3 of 5 blocks | ds 1 · 5×6 · double blocks 30→15 · single blocks 30→15 | steps 1-2 of 2")
    assert "TokenReduce warnings" not in p.extra_generation_params


def test_the_auto_rule_times_through_forges_attention(forge, unet, monkeypatch):
    """On a GPU the auto rule times one joint call through Forge's attention function, unreduced
    and reduced (on the CPU it reduces without timing)."""
    with spying(monkeypatch, forge) as calls:
        patched, run = install(unet, todo())
    (method,) = run.methods
    patch = method.patch
    x, context, y = inputs()
    call = ModelCall(x, context, {}, {}, torch.ones(1), torch.float32, run.attention)
    tokens = TEXT + math.prod(GRID)
    reducing = call_context(True, plan=patch.plan, keep={("joint", tokens): patch._keep_plans(run.methods[0].run, patch.family.tokens(
        patch.model, patch.patch, x, context, {}), x.device)[("joint", tokens)]}, left=frozenset())
    work = dit_attention_work(run.attention, patch.family.geometry(patch.model), tokens, call, patch.override,
                              patch.context_key, reducing, 1)()
    with spying(monkeypatch, forge):  # the spy the patch took at install records the calls
        work.runs["full"]()
        work.runs["reduced"]()
    assert [k.shape[2] for _, k, _ in calls] == [tokens, TEXT + 9]
    assert install(unet, todo())[1].attention.__name__ == forge.flux.attention_function.__name__
