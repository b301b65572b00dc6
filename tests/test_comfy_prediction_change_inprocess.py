"""measure_change in the real ComfyUI (issue #46, point 1): the run report says how much the
reduction changed the model's prediction at its first reduced step.

The readout must be the relative L2 between the reduced and the unreduced output of that model
call (computed here from two apply_model calls with the call's own inputs), cost exactly one
extra diffusion-model call per run (counted with a forward pre-hook on the diffusion model: the
extra call runs below every APPLY_MODEL wrapper), and leave the sampled latent bit for bit as a
run without it gives. A tiny random SD1.5 UNet with ToDo, a tiny random Flux.1 with ToMe."""

from __future__ import annotations

import sys

import pytest
import torch

from comfy_helpers import apply, sample, session_of, split_cond_uncond
from test_comfy_dit_inprocess import run as run_dit
from test_comfy_tome_dit_inprocess import dits, tome  # noqa: F401 - dits is a fixture

FLUX = "flux_dev"
MEASURING = "tokenreduce:measuring"
ALWAYS = {"reduce_when": "always"}  # what reduce_when auto decides is not under test here


def recording(model, first: list):
    """A clone that keeps the (args, kwargs, output) of its first apply_model call."""
    from comfy.patcher_extension import WrappersMP

    clone = model.clone()

    def keep(executor, *args, **kwargs):
        output = executor(*args, **kwargs)
        if not first:
            first.append((args, kwargs, output.clone()))
        return output
    clone.add_wrapper_with_key(WrappersMP.APPLY_MODEL, "recording", keep)
    return clone


def counting_forwards(model) -> tuple[list, object]:
    """Count the diffusion model's forward calls (a pre-hook: below every wrapper)."""
    calls = []
    handle = model.get_model_object("diffusion_model").register_forward_pre_hook(lambda *_: calls.append(1))
    return calls, handle


def unreduced_output(model, recorded) -> torch.Tensor:
    """The recorded apply_model call run again on the same BaseModel with every TokenReduce node
    passing through (no call context, marked as a measurement) and no wrapper."""
    args, kwargs, _ = recorded
    args = list(args)
    options = {k: v for k, v in args[5].items()
               if not (isinstance(k, str) and k.startswith("tokenreduce.")) and k not in ("wrappers", "callbacks")}
    args[5] = {**options, MEASURING: True}
    with torch.inference_mode():
        return model.model._apply_model(*args, **kwargs)


def expected_change(model, recorded) -> float:
    reduced = recorded[2]
    full = unreduced_output(model, recorded)
    return float((reduced.float() - full.float()).norm() / full.float().norm())


def readout(model):
    return session_of(model).last_report.prediction_change


def test_unet_readout_is_the_relative_change_and_the_image_is_bit_for_bit(comfy, models):
    base = models["SD15"]
    plain = apply(comfy, "todo", base, **ALWAYS).result[0]
    measured = apply(comfy, "todo", base, measure_change=True, **ALWAYS).result[0]
    first: list = []
    probe = recording(measured, first)
    calls, handle = counting_forwards(probe)
    try:
        image = sample(comfy, probe, steps=2)
        assert len(calls) == 2 + 1  # one model call per step (cond and uncond batched), one extra
        assert torch.equal(image, sample(comfy, plain, steps=2))
        assert len(calls) == 2 + 1 + 2  # off (the default): no extra call
    finally:
        handle.remove()
    change = readout(probe)
    assert change is not None and change.step == 1
    want = expected_change(base, first[0])
    assert want > 1e-4  # the reduction changed something
    assert change.change == pytest.approx(want, rel=1e-5)
    assert readout(plain) is None
    lines = sys.modules["tokenreduce_pack.nodes.report"].run_message(session_of(plain), session_of(plain).last_report)
    assert not any("prediction change" in line for line in lines["lines"])


def test_dit_tome_readout_is_the_relative_change_and_the_image_is_bit_for_bit(comfy, dits):
    model = dits(FLUX)
    plain = tome(comfy, model, ratio=0.5, **ALWAYS).result[0]
    measured = tome(comfy, model, ratio=0.5, measure_change=True, **ALWAYS).result[0]
    first: list = []
    probe = recording(measured, first)
    calls, handle = counting_forwards(probe)
    try:
        image = run_dit(comfy, probe, FLUX, steps=2)
    finally:
        handle.remove()
    assert len(calls) == 2 + 1
    assert torch.equal(image, run_dit(comfy, plain, FLUX, steps=2))
    change = readout(probe)
    assert change.step == 1
    want = expected_change(model, first[0])
    assert want > 1e-4 and change.change == pytest.approx(want, rel=1e-5)


def test_dit_todo_readout_and_image(comfy, dits):
    from test_comfy_dit_inprocess import todo

    model = dits(FLUX)
    settings = dict(skip_first_blocks=0, skip_last_blocks=0, **ALWAYS)
    plain = todo(comfy, model, **settings).result[0]
    measured = todo(comfy, model, measure_change=True, **settings).result[0]
    first: list = []
    probe = recording(measured, first)
    image = run_dit(comfy, probe, FLUX, steps=2)
    assert torch.equal(image, run_dit(comfy, plain, FLUX, steps=2))
    assert readout(probe).change == pytest.approx(expected_change(model, first[0]), rel=1e-5)


def test_separate_cond_and_uncond_calls_measure_the_first_only(comfy, models):
    base = models["SD15"]
    measured = split_cond_uncond(apply(comfy, "todo", base, measure_change=True, **ALWAYS).result[0])
    first: list = []
    probe = recording(measured, first)
    calls, handle = counting_forwards(probe)
    try:
        sample(comfy, probe, steps=2)
    finally:
        handle.remove()
    assert len(calls) == 2 * 2 + 1
    change = readout(probe)
    assert change.step == 1 and change.change == pytest.approx(expected_change(base, first[0]), rel=1e-5)


def test_measured_at_the_first_step_of_the_window_and_said_in_the_report(comfy, models):
    base = models["SD15"]
    measured = apply(comfy, "todo", base, measure_change=True, start_percent=0.5, **ALWAYS).result[0]
    sample(comfy, measured, steps=4)
    report = session_of(measured).last_report
    assert report.prediction_change.step == report.active_steps[0] > 1
    report_module = sys.modules["tokenreduce_pack.nodes.report"]
    message = report_module.run_message(session_of(measured), report)
    line = next(line for line in message["lines"] if line.startswith("prediction change"))
    assert f"(step {report.active_steps[0]} of 4, one model call; not the final image's change)" in line
    assert message["prediction_change"]["step"] == report.active_steps[0]


def test_no_reduction_no_readout(comfy, models):
    """A run whose window holds no step reduced nothing: nothing is measured, nothing is said."""
    measured = apply(comfy, "todo", models["SD15"], measure_change=True, start_percent=1.0, end_percent=1.0,
                     **ALWAYS).result[0]
    calls, handle = counting_forwards(measured)
    try:
        sample(comfy, measured, steps=2)
    finally:
        handle.remove()
    assert len(calls) == 2 and readout(measured) is None


# --- issue #51: the readout's rerun runs what the reduced call ran, unreduced -----------------------


def first_output(comfy, model, **sampling) -> torch.Tensor:
    """The output of ``model``'s first apply_model call in a one-step run."""
    first: list = []
    sample(comfy, recording(model, first), steps=1, **sampling)
    return first[0][2]


def true_change(comfy, base, reduced_model, **sampling) -> float:
    """The first call's change: both runs' first calls get the same inputs (noise, sigma, text)."""
    full, reduced = first_output(comfy, base, **sampling), first_output(comfy, reduced_model, **sampling)
    return float((reduced.float() - full.float()).norm() / full.float().norm())


def test_merge_mlp_readout_runs_the_feed_forward_whole(comfy, models):
    """ToMe with merge_mlp: the feed-forward finds its block's plan in a per-thread slot; the
    readout's unreduced rerun must not find the reduced call's plans there."""
    base = models["SD15"]
    measured = apply(comfy, "tome", base, ratio=0.6, merge_mlp=True, measure_change=True, **ALWAYS).result[0]
    sample(comfy, measured, steps=1)
    want = true_change(comfy, base, apply(comfy, "tome", base, ratio=0.6, merge_mlp=True, **ALWAYS).result[0])
    assert want > 1e-4 and readout(measured).change == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("name", ["todo", "tome"])
def test_the_readout_reruns_with_the_users_control_residuals(comfy, models, name):
    """ComfyUI's UNet pops its control residuals from the lists it is handed (``apply_control``):
    the readout's rerun, after the reduced call, runs on copies of them as they were before it,
    not without the ControlNet; and the sampled image is the one of a run without the readout."""
    from test_comfy_max_change_inprocess import controlled

    positive, negative = controlled(comfy)
    base = models["SD15"]
    measured = apply(comfy, name, base, measure_change=True, **ALWAYS).result[0]
    plain = apply(comfy, name, base, **ALWAYS).result[0]
    image = sample(comfy, measured, steps=1, positive=positive, negative=negative)
    assert torch.equal(image, sample(comfy, plain, steps=1, positive=positive, negative=negative))
    want = true_change(comfy, base, plain, positive=positive, negative=negative)
    assert want > 1e-4 and readout(measured).change == pytest.approx(want, rel=1e-4)
