"""The quality budget (``max_change``, issue #51) on diffusers UNets: before a level is reduced,
its first block is run on the input the model hands it in that call, unreduced and reduced; a
level whose block output changes by more than the budget is left alone, and the report says so
in the other hosts' words. The measurement leaves no trace: the call that measured returns what
the next call (the decision kept) returns, T2I-Adapter residuals included. Tiny random-weight
UNets built from configs; decisions kept in a file of the test's own."""

from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from tokenreduce import pays  # noqa: E402
from tokenreduce.diffusers import api, apply_patch, tiny  # noqa: E402

METHODS = {"ToDo": {}, "ToMe": {"use_rand": False}}  # ToMe's timed block merges with top-left targets


@pytest.fixture
def store(monkeypatch, tmp_path):
    """The auto rule's decisions in a file of this test's (the CPU untimed: the budget alone decides)."""
    decisions = pays.Decisions(tmp_path / "auto_decisions.json")
    monkeypatch.setattr(api, "decisions_at", lambda path: decisions)
    return decisions


def unet_and_call(size: int = 32, adapter: bool = False):
    """A tiny SD UNet and a call of it (batch 2, as CFG), with a T2I-Adapter's residuals: a fresh
    list per call, as diffusers' adapter pipelines hand it (the UNet pops from it)."""
    model = tiny.unet(size=size)
    g = torch.Generator().manual_seed(3)
    sample = torch.randn(2, 4, size, size, generator=g)
    text = torch.randn(2, 8, tiny.TEXT_DIM, generator=g)
    residuals = [torch.randn(2, 32, size, size, generator=g), torch.randn(2, 64, size // 2, size // 2, generator=g)]

    def call(handed: list | None = None):  # handed: the list the call was given, as the call left it
        extra = {"down_intrablock_additional_residuals": list(residuals)} if adapter else {}
        if handed is not None:
            handed.append(extra["down_intrablock_additional_residuals"])
        with torch.no_grad():
            return model(sample, 500, encoder_hidden_states=text, **extra).sample
    return model, call


REACH_500 = 0.5005005005  # the share of sampling a call at timestep 500 covers (the budget weighs by it)


def unet2d_and_call():
    """A tiny UNet2DModel (DDPM): plain self-attentions, each its own site's block."""
    model = diffusers.UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                                  block_out_channels=(16, 32), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                  up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8,
                                  attention_head_dim=8)
    tiny._random_weights(model, 0)
    sample = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))

    def call():
        with torch.no_grad():
            return model(sample, 500).sample
    return model, call


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("build", [unet_and_call, unet2d_and_call], ids=["UNet2DCondition", "UNet2D"])
def test_over_budget_the_unet_is_left_alone_and_the_report_says_why(store, method, build):
    """Fails before issue #51's diffusers budget: there both methods reduced at any budget and
    the report said nothing of it."""
    model, call = build()
    unpatched = call()
    # UNet2D's ToDo: average, which has no milder step (nearest's, the window, is one tile on its 8x8
    # level: exact, within any budget, then timing alone decides; see ..._steps_down_to_the_window)
    inputs = {**METHODS[method], **({"method": "average"} if method == "ToDo" and build is unet2d_and_call else {})}
    with apply_patch(model, method, reduce_when="auto", max_change=1e-6, **inputs) as patch:
        out = call()
        report = patch.report()
        lines = patch.report_lines()
    blocks = block_decisions(report)  # each block decided alone (issue #51)
    assert blocks and any(d.over_budget for d in blocks) and all(d.reduce == (not d.over_budget) for d in blocks)
    assert any(line.startswith("auto · downsample ") and "· left alone: changes its output " in line
               and line.endswith(" > 0.0001 %") for line in lines), lines
    if all(d.over_budget for d in blocks):
        assert torch.equal(out, unpatched)
        assert not report.levels and report.active_steps == ()
        assert any("reducing changed the output of some by more than max_change" in w for w in report.warnings)
    else:  # UNet2D: blocks whose change rounds to 1e-6 or less (average on its 8x8 level) are within any budget
        assert all(d.change <= 1e-6 for d in blocks if d.reduce)


def block_decisions(report) -> list:
    """The per-block decisions of a UNet's run (issue #51: '..., block <path>'), not the level's speed."""
    return [d.decision for d in report.decisions if ", block " in d.site]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("build", [unet_and_call, unet2d_and_call], ids=["UNet2DCondition", "UNet2D"])
def test_within_budget_the_unet_is_reduced(store, method, build):
    model, call = build()
    unpatched = call()
    with apply_patch(model, method, reduce_when="auto", max_change=2.0, **METHODS[method]) as patch:
        out = call()
        report = patch.report()
    assert report.levels and report.active_steps == (1,)
    assert report.decisions and all(d.decision.reduce and 0 < d.decision.change <= 2.0 for d in report.decisions)
    assert not torch.equal(out, unpatched)
    assert store.measurements == len(report.decisions)


@pytest.mark.parametrize("method", METHODS)
def test_the_change_is_the_first_blocks_output_on_the_calls_own_input(store, method):
    """The budget reads the whole block (residuals, norms, cross-attention, MLP), run on what the
    model handed it: the same change as that block's output in an unpatched call against a
    reducing one (the first reduced block sees the same input in both)."""
    model, call = unet_and_call()
    outputs = []

    def keep(module, args, kwargs, output):
        outputs.append(output.clone())

    with apply_patch(model, method, reduce_when="always", **METHODS[method]) as patch:
        block = model.get_submodule(patch.patches[0].target.sites[0].path)
        hook = block.register_forward_hook(keep, with_kwargs=True)
        call()
    call()  # unpatched
    hook.remove()
    reduced, full = outputs
    with apply_patch(model, method, reduce_when="auto", max_change=2.0, **METHODS[method]) as patch:
        call()
        first = patch.patches[0].target.sites[0].path
        (decided,) = [d for d in patch.report().decisions if f", block {first}, " in d.site]
    assert decided.decision.change == pytest.approx(relative(reduced, full), abs=2e-6)
    assert decided.decision.change > 1e-4


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget", [1e-6, 2.0])
def test_the_measuring_call_returns_what_the_next_one_does(store, method, budget):
    """No trace: the call that measured (reduced or left alone) returns exactly what the next
    run's call, with the decision kept, returns; the adapter's residuals reach both (a measurement
    that took them would leave its call without the adapter) and are consumed as unpatched."""
    model, call = unet_and_call(adapter=True)
    with apply_patch(model, method, reduce_when="auto", max_change=budget, **METHODS[method]) as patch:
        measuring = call()
        first = patch.report()
        kept = call()  # a new run (report() ended the last): its decision is read, not measured
        second = patch.report()
    # each block; over the tiny budget its milder step too (ToDo's window, ToMe's half ratio: over it as well)
    assert first.decisions and all(d.decision.source == pays.MEASURED for d in first.decisions)
    assert [d.site for d in second.decisions] == [d.site for d in first.decisions]
    assert all(d.decision.source == pays.KEPT for d in second.decisions)
    assert store.measurements == len(first.decisions)
    assert torch.equal(measuring, kept)
    reduces = budget > 1
    assert bool(first.levels) == reduces
    if reduces:  # as reduced without any measuring at all
        with apply_patch(model, method, reduce_when="always", **METHODS[method]):
            assert torch.equal(call(), kept)
    else:
        assert torch.equal(call(), kept)  # unpatched
    handed = []
    with apply_patch(model, method, reduce_when="auto (measure again)", max_change=budget, **METHODS[method]):
        assert torch.equal(call(handed), kept)
    assert handed == [[]]  # consumed by the UNet, as it is unpatched


@pytest.mark.parametrize("method", METHODS)
def test_a_call_part_of_the_way_into_sampling_weighs_the_change_by_its_reach(store, method):
    """Issue #51: the change is measured once; a run that starts at timestep 150 of 999 (an
    image-to-image pipeline at strength 0.15) weighs it by the cube root of that share, so a
    budget text to image exceeds lets it reduce."""
    model = tiny.unet(size=32)
    g = torch.Generator().manual_seed(3)
    sample, text = torch.randn(2, 4, 32, 32, generator=g), torch.randn(2, 8, tiny.TEXT_DIM, generator=g)

    def call(timestep):
        with torch.no_grad():
            return model(sample, timestep, encoder_hidden_states=text).sample

    with apply_patch(model, method, reduce_when="auto", max_change=1e-6, **METHODS[method]) as patch:
        call(999)
        change = max(d.change for d in block_decisions(patch.report()))
    budget = 0.7 * change  # over it from pure noise, within it at 15 %: change * 0.15 ** (1/3) = 0.53 change
    with apply_patch(model, method, reduce_when="auto", max_change=budget, **METHODS[method]) as patch:
        unpatched = call(999)
        assert all(not d.reduce for d in block_decisions(patch.report()) if d.change > budget)
    with apply_patch(model, method, reduce_when="auto", max_change=budget, **METHODS[method]) as patch:
        reduced = call(150)
        report = patch.report()
    decisions = block_decisions(report)
    assert decisions and all(d.source == "kept" and d.reach == pytest.approx(150 / 999) for d in decisions)
    assert all(d.reduce and not d.over_budget for d in decisions) and report.levels
    assert unpatched.shape == reduced.shape


def test_an_image_to_image_pipeline_covers_its_strength_of_sampling(store):
    """A pipeline's reach is its share of the scheduler's timesteps: StableDiffusionImg2Img at
    strength 0.3 over 10 steps runs the last 3 (the decision read under it says so)."""
    from diffusers import StableDiffusionImg2ImgPipeline

    base = tiny.pipeline()
    pipe = StableDiffusionImg2ImgPipeline(**base.components)
    pipe.set_progress_bar_config(disable=True)
    image = torch.rand(1, 3, 128, 128, generator=torch.Generator().manual_seed(0))
    reaches = {}
    for strength in (1.0, 0.3):
        with apply_patch(pipe, "ToDo", reduce_when="auto", max_change=1e-6) as patch:
            pipe(image=image, strength=strength, num_inference_steps=10, guidance_scale=5.0, output_type="latent",
                 generator=torch.Generator().manual_seed(0), **tiny.prompt(pipe))
            reaches[strength] = sorted({round(d.reach, 6) for d in block_decisions(patch.report())})
    assert reaches == {1.0: [1.0], 0.3: [0.3]}


def test_todo_over_the_budget_steps_down_to_the_window(monkeypatch, tmp_path):
    """The budget's milder step on diffusers' UNets, as in ComfyUI and Forge: where nearest changes
    a block by more than max_change, the window is measured in its place (timed on the CPU too; here
    a device where reducing pays) and runs there where it is within the budget, block by block."""
    from comfy_helpers import ScriptedClock, steps_down_block_by_block

    def one_call(name: str, **inputs):
        store = pays.Decisions(tmp_path / f"{name}.json", stopwatch=ScriptedClock((2.0, 1.0)))
        monkeypatch.setattr(api, "decisions_at", lambda path: store)
        model, call = unet_and_call(size=16)
        with apply_patch(model, "ToDo", **inputs) as patch:
            out = call()
            return out, patch.report(), store

    steps_down_block_by_block(one_call, "nearest", "window", lambda method: {"method": method}, reach=REACH_500)


def test_tome_over_the_budget_steps_down_to_half_the_ratio(monkeypatch, tmp_path):
    """ToMe's milder step on diffusers' UNets (issue #51), as in ComfyUI and Forge: the node's ratio
    over max_change, half of it within: the block merges at half, block by block."""
    from comfy_helpers import steps_down_block_by_block

    def one_call(name: str, **inputs):
        store = pays.Decisions(tmp_path / f"{name}.json")
        monkeypatch.setattr(api, "decisions_at", lambda path: store)
        model, call = unet_and_call()
        with apply_patch(model, "ToMe", use_rand=False, **inputs) as patch:
            out = call()
            return out, patch.report(), store

    steps_down_block_by_block(one_call, 0.5, 0.25, lambda ratio: {"ratio": ratio}, lambda ratio: f"ratio {ratio:g}",
                              reach=REACH_500)


def test_method_window_runs_on_unet2d_models_plain_self_attentions(monkeypatch):
    """UNet2DModel's plain self-attentions (called on the feature map) run the window through their
    processor too: its 8x8 level is one tile's window, so the output is the unpatched one."""
    from tokenreduce.diffusers import todo

    windowed, real = [], todo.window_call
    monkeypatch.setattr(todo, "window_call", lambda q, *a, **kw: windowed.append(q.shape) or real(q, *a, **kw))
    model, call = unet2d_and_call()
    base = call()
    with apply_patch(model, "ToDo", method="window", reduce_when="always") as patch:
        out = call()
        lines = patch.report_lines()
    assert windowed and float((out - base).norm() / base.norm()) < 1e-5
    assert any(line.startswith("ds 2 · 8×8 · q 64→64 · k/v 64→64") for line in lines), lines


def test_a_processor_the_window_cannot_reach_refuses_it_and_turns_only_nearests_milder_step_off(store):
    """A self-attention processor that calls neither diffusers' dispatcher nor torch's SDPA (the old
    AttnProcessor): method window is refused by the processor's name, not ignored; nearest (the
    default, with the budget) still pools in its pre-hook and the report says the milder step is off."""
    from diffusers.models.attention_processor import AttnProcessor

    model, call = unet_and_call(size=16)
    model.set_attn_processor(AttnProcessor())
    with pytest.raises(ValueError, match="the self-attention processor AttnProcessor of this UNet calls neither"):
        apply_patch(model, "ToDo", method="window")
    assert all(type(p) is AttnProcessor for p in model.attn_processors.values())
    with apply_patch(model, "ToDo") as patch:
        call()
        report = patch.report()
    assert any("milder step (method window) is off" in note for note in report.notes), report.notes
    assert report.decisions and all(type(p) is AttnProcessor for p in model.attn_processors.values())


def test_dit_todo_measures_the_first_selected_blocks_change_on_the_calls_own_input(store):
    """ToDo on diffusers' DiTs where no late input can be made (Lumina 2, whose pipeline passes
    1 - sigma and negates the output; the other families decide per block: below): the budget
    compares the first selected block's output, whole and with its grid calls reduced, on the input
    the model hands it in this call (the call run again up to it, on copies). Over the budget the
    model call is left alone: the unpatched output, said with the change; within it, reduced; and
    the call that measured returns what the next call, with the decision kept, returns."""
    model = tiny.transformer("Lumina 2")
    inputs = tiny.transformer_inputs("Lumina 2", model)
    with torch.no_grad():
        unpatched = model(**inputs, return_dict=False)[0]
        with apply_patch(model, "ToDo", max_change=1e-9) as patch:
            assert torch.equal(model(**inputs, return_dict=False)[0], unpatched)
            lines = patch.report_lines()
            (_, left), (site, window) = patch.report().decisions  # nearest, then its milder step
        assert left.over_budget and 0 < left.change and any("left alone: changes its output" in line for line in lines)
        # the window left alone too (on Wan's 8x8 grid it is one tile, exact, and slower: timed on the CPU too)
        assert not window.reduce and site.endswith("method window instead")
        with apply_patch(model, "ToDo", max_change=2.0) as patch:
            measuring = model(**inputs, return_dict=False)[0]
            (_, reduced), = patch.report().decisions
            kept = model(**inputs, return_dict=False)[0]
            (_, again), = patch.report().decisions
    assert reduced.reduce and reduced.change == left.change and again.source == pays.KEPT
    assert torch.equal(measuring, kept) and not torch.equal(measuring, unpatched)


def test_dit_todo_over_the_budget_steps_down_to_the_window(monkeypatch, tmp_path):
    """The budget's milder step on diffusers' DiTs, as in ComfyUI: nearest over max_change, the
    window within it (measured in its place, timed on the CPU too; here a device where reducing
    pays): the window runs, its output, both decisions reported. 16x16: the windows do not cover it."""
    from comfy_helpers import ScriptedClock, steps_down_to_the_window

    model = tiny.transformer("Lumina 2")  # decided per kind (no late input)
    inputs = tiny.transformer_inputs("Lumina 2", model, h=16, w=16)

    def one_call(name: str, **settings):
        store = pays.Decisions(tmp_path / f"{name}.json", stopwatch=ScriptedClock((2.0, 1.0)))
        monkeypatch.setattr(api, "decisions_at", lambda path: store)
        with torch.no_grad(), apply_patch(model, "ToDo", **settings) as patch:
            return model(**inputs, return_dict=False)[0], patch.report()

    steps_down_to_the_window(one_call, change=lambda decision: decision.weighed_change)


EVERY_BLOCK = {"skip_first_blocks": 0, "skip_last_blocks": 0}
TINY = 1e-9


def flux_run(pipe, steps: int = 4) -> torch.Tensor:
    """One Flux pipeline run at 256 px: a 16x16 token grid, which the window's tiles do not cover."""
    with torch.no_grad():
        return tiny.generate(pipe, steps=steps, size=256)


def graded_line(lines: list[str]) -> str:
    (line,) = [line for line in lines if "per block, read at 75 % of sampling, counted 2x" in line]
    return line


def test_dit_todo_decides_per_block_on_a_late_input(monkeypatch, tmp_path):
    """The budget decides per block on diffusers' DiTs too (issue #51, as on ComfyUI's): each selected
    block's change is read alone on a late input (the pipeline's prediction moved to 3/4 of its
    scheduler's sigmas), for nearest and for its milder step, the window, and graded under one
    budget (``pays.grade_blocks``; on these random weights the window is no milder, so the grades
    are nearest or left alone): under a budget that fits some blocks, the report names what ran
    where. The run that measured gives the latents of later runs and of a restart, which measure
    nothing; the mixed run is neither every block reduced nor unpatched."""
    from comfy_helpers import ScriptedClock

    from tokenreduce.describe import graded_text

    def store(name: str):  # a device where reducing pays: the window's speed is not what this is about
        decisions = pays.Decisions(tmp_path / f"{name}.json", stopwatch=ScriptedClock((2.0, 1.0)))
        monkeypatch.setattr(api, "decisions_at", lambda path: decisions)
        return decisions

    pipe = tiny.flux_pipeline()
    unpatched = flux_run(pipe)
    measuring = store("ladder")
    with apply_patch(pipe, "ToDo", max_change=TINY, **EVERY_BLOCK) as patch:
        assert torch.equal(flux_run(pipe), unpatched)  # every block over the budget: left alone
        assert "left alone" in graded_line(patch.report_lines())
        keys = {b: patch.patches[0].patch.block_key(b) for b in range(4)}
    assert keys == {0: ("transformer_blocks", 0), 1: ("transformer_blocks", 1),
                    2: ("single_transformer_blocks", 0), 3: ("single_transformer_blocks", 1)}
    changes = {(("grid", int(site.split(", ")[1].removeprefix("block "))), site.split(", ")[2]): d.change
               for site, d in measuring.log if ", block " in site}
    units = sorted({unit for unit, _ in changes})
    assert len(changes) == 8 and all(change > 0 for change in changes.values())  # 4 blocks, both methods
    options = {unit: ("nearest", "window") for unit in units}

    def expected(budget: float) -> tuple[str, dict]:
        choice, total = pays.grade_blocks(options, changes, budget, 1.0, pays.LATE_SCALE)
        return graded_text(choice, units, options, keys, total, budget, False), choice

    top = pays.LATE_SCALE * sum(max(changes[u, "nearest"], changes[u, "window"]) for u in units)
    budget = next(top * i / 100 for i in range(1, 100) if 1 < len(expected(top * i / 100)[1]) < len(units))
    with apply_patch(pipe, "ToDo", max_change=budget, **EVERY_BLOCK) as patch:
        latents = flux_run(pipe)
        line = graded_line(patch.report_lines())
        (decision,) = [d for site, d in patch.report().decisions if site.endswith("per block")]
        measured = measuring.measurements
        assert torch.equal(flux_run(pipe), latents) and measuring.measurements == measured  # kept
    assert line.endswith(expected(budget)[0]) and "left alone " in line, line
    assert decision.reduce and decision.change <= budget and decision.reach == 1.0  # a whole run
    restarted = pays.Decisions(measuring.path)  # a new process: nothing measured again
    monkeypatch.setattr(api, "decisions_at", lambda path: restarted)
    with apply_patch(pipe, "ToDo", max_change=budget, **EVERY_BLOCK):
        assert torch.equal(flux_run(pipe), latents) and restarted.measurements == 0
    fresh = store("fresh")  # a run that measures under this budget gives the same latents
    with apply_patch(pipe, "ToDo", max_change=budget, **EVERY_BLOCK):
        assert torch.equal(flux_run(pipe), latents) and fresh.measurements
    store("every block")
    with apply_patch(pipe, "ToDo", max_change=2.0, **EVERY_BLOCK):
        every = flux_run(pipe)
    assert not torch.equal(latents, every) and not torch.equal(latents, unpatched)


def test_the_late_input_is_one_euler_step_to_three_quarters_of_the_schedule(store, monkeypatch):
    """What the blocks are measured on: the model call run whole for its velocity, then again at the
    scheduler's sigma at 3/4 of its steps (step 6 of 8), its latent moved there by one Euler step
    (``x + (late - sigma) * v``, as the pipeline's FlowMatchEuler steps) and its timestep that
    sigma (Flux's pipeline passes the sigma itself)."""
    pipe = tiny.flux_pipeline()
    model = pipe.transformer
    calls, real = [], model.forward

    def forward(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append((kwargs["hidden_states"].clone(), kwargs["timestep"].clone(), out[0].clone()))
        return out
    monkeypatch.setattr(model, "forward", forward)
    with apply_patch(pipe, "ToDo", max_change=0.05):
        with torch.no_grad():
            tiny.generate(pipe, steps=8, size=128)
    (x, t, velocity), (x_late, t_late, _), (x_real, t_real, _) = calls[:3]
    late = float(pipe.scheduler.sigmas[6])
    assert torch.equal(x_real, x) and torch.equal(t_real, t) and float(t[0]) == 1.0  # the run's own first call
    assert torch.allclose(t_late, torch.full_like(t, late))
    torch.testing.assert_close(x_late, x + (late - t.reshape(-1, 1, 1)) * velocity, rtol=0, atol=1e-6)
    assert len(calls) == 3 + 7  # measured once a run: the other steps' calls are the pipeline's


def test_a_flux_pipelines_run_covers_the_whole_of_sampling(store):
    """The run's reach from the scheduler's timesteps, in their units: Flux's pipeline hands its
    model the sigma (timestep / 1000). Fails before: the reach read 0 and weighed every change to
    nothing, so the budget never left a Flux pipeline's block alone."""
    pipe = tiny.flux_pipeline()
    with apply_patch(pipe, "ToDo", max_change=TINY) as patch:
        latents = flux_run(pipe)
        decisions = patch.report().decisions
    with torch.no_grad():
        unpatched = tiny.generate(pipe, steps=4, size=256)
    (graded,) = [d for site, d in decisions if site.endswith("per block")]
    assert graded.over_budget and all(d.reach == 1.0 for _, d in decisions)
    assert torch.equal(latents, unpatched)


def test_dit_tome_decides_per_block_at_the_ratio_or_half_of_it(monkeypatch, tmp_path):
    """ToMe on diffusers' DiTs decides per block too (issue #51): each merged block's change read
    alone on the late input at the node's ratio and at half of it, graded under the budget
    (``pays.grade_blocks``): under a budget that fits one block at half the ratio, the report says
    so, the run merges that block alone (fewer tokens), and the run that measured gives the latents
    of later runs and of a restart."""
    from tokenreduce.describe import graded_text

    def store(name: str):
        decisions = pays.Decisions(tmp_path / f"{name}.json")
        monkeypatch.setattr(api, "decisions_at", lambda path: decisions)
        return decisions

    pipe = tiny.flux_pipeline()
    unpatched = flux_run(pipe)
    measuring = store("ladder")
    with apply_patch(pipe, "ToMe", max_change=TINY) as patch:
        assert torch.equal(flux_run(pipe), unpatched)
        keys = patch.patches[0].patch.block_keys()
    assert keys == {1: ("double_block", 1), 2: ("single_block", 0)}  # the model's blocks 1 and 2
    changes = {((site.split(" ")[0], int(site.split(" ")[1].rstrip(","))), int(site.split(", ")[1].split(" ")[0])):
               d.change for site, d in measuring.log if site.endswith(" merged")}
    assert sorted({count for _, count in changes}) == [64, 128] and len(changes) == 4, changes  # 16x16: 256 tokens
    units = sorted({unit for unit, _ in changes})
    options = {unit: (128, 64) for unit in units}
    labels = {128: "ratio 0.5", 64: "ratio 0.25"}

    def expected(budget: float) -> tuple[str, dict]:
        choice, total = pays.grade_blocks(options, changes, budget, 1.0, pays.LATE_SCALE)
        said = graded_text({u: labels[c] for u, c in choice.items()}, units,
                           {u: tuple(labels[c] for c in counts) for u, counts in options.items()}, keys, total,
                           budget, False)
        return said, choice

    budget = pays.LATE_SCALE * min(changes.values()) * 1.001  # the mildest block alone, at half the ratio
    said, choice = expected(budget)
    assert list(choice.values()) == [64]
    with apply_patch(pipe, "ToMe", max_change=budget) as patch:
        latents = flux_run(pipe)
        lines = patch.report_lines()
        measured = measuring.measurements
        assert torch.equal(flux_run(pipe), latents) and measuring.measurements == measured  # kept
    assert graded_line(lines).endswith(said) and "ratio 0.25 " in said and "left alone " in said, lines
    assert any("blocks 256→192" in line for line in lines), lines  # one block at half: 64 of 256 merged
    assert not torch.equal(latents, unpatched)
    restarted = pays.Decisions(measuring.path)
    monkeypatch.setattr(api, "decisions_at", lambda path: restarted)
    with apply_patch(pipe, "ToMe", max_change=budget):
        assert torch.equal(flux_run(pipe), latents) and restarted.measurements == 0
    store("every block")
    with apply_patch(pipe, "ToMe", max_change=2.0) as patch:
        assert not torch.equal(flux_run(pipe), latents)
        assert any("blocks 256→128" in line for line in patch.report_lines())


def test_dit_tome_corrected_from_whole_is_read_corrected_from_its_plans_step(monkeypatch, tmp_path):
    """With correct_from_whole each block is read as the late step runs it: merged by the plan a
    rehearsal at the step plan_every - 1 before made, that plan's difference from the whole block
    added (issue #50; read uncorrected, it was held to plain merging's change). Smaller, block by
    block and count by count, and kept apart from the plain change."""
    reuse = {"share_plans": True, "plan_every": 2}
    pipe = tiny.flux_pipeline()
    found = {}
    for name, extra in (("plain", {}), ("corrected", {"correct_from_whole": True})):
        decisions = pays.Decisions(tmp_path / f"{name}.json")
        monkeypatch.setattr(api, "decisions_at", lambda path, decisions=decisions: decisions)
        with apply_patch(pipe, "ToMe", max_change=TINY, **reuse, **extra):
            flux_run(pipe)
        found[name] = {site: d.change for site, d in decisions.log if site.endswith(" merged")}
    assert len(found["plain"]) == 4 and set(found["corrected"]) == set(found["plain"])
    assert all(0 <= found["corrected"][site] < change for site, change in found["plain"].items()), found


def test_dit_tome_blocks_at_the_milder_ratio_alone_reuse_their_plan(monkeypatch, tmp_path):
    """With share_plans and plan_every, where the budget merges every merging block at half the
    ratio, the next step finds that plan again (the reuse looked for the node's ratio's plan
    alone: every step planned anew, and with correct_from_whole ran each block whole, the
    unpatched latents)."""
    decisions = pays.Decisions(tmp_path / "milder.json")
    monkeypatch.setattr(api, "decisions_at", lambda path: decisions)
    pipe = tiny.flux_pipeline()
    unpatched = flux_run(pipe)
    reuse = {"share_plans": True, "plan_every": 2, "correct_from_whole": True}
    with apply_patch(pipe, "ToMe", max_change=TINY, **reuse):
        flux_run(pipe)
    changes = {site: d.change for site, d in decisions.log if site.endswith(" 64 merged")}  # half the ratio
    assert len(changes) == 2, decisions.log
    budget = pays.LATE_SCALE * sum(changes.values()) * 1.001  # both blocks at half: no step up fits
    with apply_patch(pipe, "ToMe", max_change=budget, **reuse) as patch:
        latents = flux_run(pipe)
        lines = patch.report_lines()
        measured = decisions.measurements
        assert torch.equal(flux_run(pipe), latents) and decisions.measurements == measured  # the measuring run's
    assert "ratio 0.25 " in graded_line(lines) and "ratio 0.5 " not in graded_line(lines), lines
    assert not torch.equal(latents, unpatched)


@pytest.mark.parametrize("method", METHODS)
def test_each_unet_block_is_decided_on_its_own(store, method):
    """Issue #51, per block on diffusers' UNets as on ComfyUI's: under a budget between the largest
    change a block of the level makes and the next, that block's setting is left alone (it may step
    down to its milder step) and the others run it; per level, by its first block, they all ran or
    none did. Each block's change is its own entry, kept: the next call measures nothing and
    returns the same."""
    model, call = unet_and_call()
    inputs = {**METHODS[method], **({} if method == "ToDo" else {"use_rand": False})}
    full = "nearest" if method == "ToDo" else "ratio 0.5"

    def by_block(report) -> dict:
        return {tuple(d.site.split(", block ")[1].split(", ", 1)): d.decision for d in report.decisions
                if ", block " in d.site}

    with apply_patch(model, method, reduce_when="auto", max_change=2.0, **inputs) as patch:
        call()
        sites = patch.patches[0].target.sites
        changes = {path: d.change for (path, label), d in by_block(patch.report()).items() if label == full}
    level = sorted((site.path for site in sites if site.level == sites[0].level), key=changes.get)
    assert len(level) > 1 and changes[level[-1]] > changes[level[-2]]
    budget = (changes[level[-1]] + changes[level[-2]]) / 2 * REACH_500 ** (1 / 3)  # as the call's reach weighs them
    with apply_patch(model, method, reduce_when="auto", max_change=budget, **inputs) as patch:
        out = call()
        decided = by_block(patch.report())
        measured = store.measurements
        assert torch.equal(call(), out) and store.measurements == measured
    largest = decided[(level[-1], full)]
    assert not largest.reduce and largest.over_budget
    assert all(decided[(path, full)].reduce for path in level[:-1])
    with apply_patch(model, method, reduce_when="always", **inputs):
        assert not torch.equal(call(), out)  # not every block reduced so
