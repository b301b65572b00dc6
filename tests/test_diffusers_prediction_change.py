"""measure_change in the diffusers adapter (issue #46, point 1): ``report()`` and
``report_lines()`` say how much the reduction changed the model's output at the first reduced
step, measured by one extra call of the model's own forward; the latents are bit for bit those
of a run without it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from tokenreduce.diffusers import apply_patch, tiny  # noqa: E402


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def first_call_of(model, kept: list):
    """Keep the first call's arguments and output (a forward hook, after the patch's own)."""
    def keep(module, args, kwargs, output):
        if not kept:
            kept.append((args, dict(kwargs), (output[0] if isinstance(output, tuple) else output.sample).clone()))
    return model.register_forward_hook(keep, with_kwargs=True)


def test_sd_pipeline_todo_readout_one_extra_call_same_latents():
    pipe = tiny.pipeline()
    with apply_patch(pipe, "ToDo", reduce_when="always"):
        plain = tiny.generate(pipe, steps=2, size=64)
    calls = []
    counter = pipe.unet.conv_in.register_forward_pre_hook(lambda *_: calls.append(1))  # reached by the rerun too
    kept: list = []
    with apply_patch(pipe, "ToDo", reduce_when="always", measure_change=True) as patch:
        recorder = first_call_of(pipe.unet, kept)
        latents = tiny.generate(pipe, steps=2, size=64)
        recorder.remove()
        report = patch.report()
        lines = patch.report_lines()
    counter.remove()
    assert torch.equal(latents, plain)
    assert len(calls) == 2 + 1  # CFG batched: one call per step, and one unreduced
    args, kwargs, reduced = kept[0]
    with torch.no_grad():
        full = pipe.unet(*args, **kwargs)
    full = full[0] if isinstance(full, tuple) else full.sample
    assert report.prediction_change.step == 1
    assert report.prediction_change.change == pytest.approx(relative(reduced, full), rel=1e-5)
    assert any(line.startswith("prediction change ") and "(step 1 of 2, one model call" in line for line in lines)


@pytest.mark.parametrize("method,settings", [("ToMe", {}), ("ToDo", {"skip_first_blocks": 0, "skip_last_blocks": 0})])
def test_dit_on_a_bare_transformer(method, settings):
    model = tiny.transformer("Flux")
    inputs = tiny.transformer_inputs("Flux", model, batch=2)
    settings = {"reduce_when": "always", **settings}
    with torch.no_grad():
        full = model(**inputs, return_dict=False)[0]
        with apply_patch(model, method, measure_change=True, **settings) as patch:
            reduced = model(**inputs, return_dict=False)[0]
            report = patch.report()
        with apply_patch(model, method, **settings) as plain:
            assert torch.equal(model(**inputs, return_dict=False)[0], reduced)
            assert plain.report().prediction_change is None
    assert report.prediction_change.change == pytest.approx(relative(reduced, full), rel=1e-5)
    assert report.prediction_change.change > 1e-4


def test_unet_readout_reruns_with_the_adapters_residuals():
    """Issue #51: diffusers' UNet pops ``down_intrablock_additional_residuals`` (a T2I-Adapter's)
    from the list it is handed; the readout's rerun, after the reduced call, runs on a copy of it as
    it was before that call, not without the adapter."""
    model = tiny.unet(size=32)
    g = torch.Generator().manual_seed(3)
    sample = torch.randn(1, 4, 32, 32, generator=g)
    text = torch.randn(1, 8, tiny.TEXT_DIM, generator=g)
    residuals = [torch.randn(1, 32, 32, 32, generator=g), torch.randn(1, 64, 16, 16, generator=g)]

    def call():  # a fresh list per call, as diffusers' adapter pipelines hand it
        return model(sample, 500, encoder_hidden_states=text,
                     down_intrablock_additional_residuals=list(residuals)).sample

    with torch.no_grad():
        full = call()
        assert relative(model(sample, 500, encoder_hidden_states=text).sample, full) > 0.1  # the adapter acts
        with apply_patch(model, "ToMe", ratio=0.5, reduce_when="always", measure_change=True) as patch:
            reduced = call()
            report = patch.report()
    # (a rerun without the adapter would read about its own effect, some 30 %, on this tiny UNet)
    assert report.prediction_change.change == pytest.approx(relative(reduced, full), rel=1e-5)
