"""measure_change in the Forge extension's glue (issue #46, point 1), driven through ComfyUI's
patcher as tests/test_forge_glue.py drives it: the pass's model_function_wrapper runs the first
reduced call once more by the model's own apply_model (below the wrapper), the image is bit for
bit unchanged, and the readout goes into the infotext as ``TokenReduce ToDo prediction change``.
The WebUI shows no control for it yet (``settings.NOT_SHOWN``: a control per method and pass
would shift the API's positional arguments); the API's dict form takes it (``DICT_ONLY``)."""

from __future__ import annotations

from dataclasses import replace

import torch

from comfy_helpers import sample
from test_forge_glue import _processing, forge_like
from tokenreduce_forge import hooks, patching
from tokenreduce_forge import settings as S


def todo_pass(model, measure: bool):
    settings = replace(S.method_settings("ToDo", S.FIRST, {"reduce_when": "always"}), measure_change=measure)
    return patching.install(forge_like(model), "SD15", S.FIRST, {"ToDo": settings}, (1, 4, 32, 32))


def test_forge_pass_measures_once_and_the_image_is_unchanged(comfy, models):
    calls = []
    plain, _ = todo_pass(models["SD15"], False)
    measured, run = todo_pass(models["SD15"], True)
    handle = measured.get_model_object("diffusion_model").register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        image = sample(comfy, measured, "SD15", steps=2)
    finally:
        handle.remove()
    assert len(calls) == 2 + 1
    assert torch.equal(image, sample(comfy, plain, "SD15", steps=2))
    ((_, report),) = run.finish(True)
    assert report.prediction_change.step == 1 and report.prediction_change.change > 0


def test_the_api_dict_form_turns_it_on_and_the_infotext_says_it(comfy, models):
    args = [{"ToDo": {"measure_change": True, "reduce_when": "always"}}]
    job = S.job_from_args(args, hires_runs=False)
    assert job.problem is None and job.stage(S.FIRST)["ToDo"].measure_change is True
    assert S.job_from_args([True], hires_runs=False).stage(S.FIRST)["ToDo"].measure_change is False  # positional
    p = _processing(forge_like(models["SD15"]), args)
    hooks.before_process(p, args)
    hooks.before_sampling(p, args, {"x": torch.zeros(1, 4, 32, 32)})
    sample(comfy, p.sd_model.forge_objects.unet, "SD15", steps=2)
    hooks.after_batch(p, args)
    text = p.extra_generation_params["TokenReduce ToDo prediction change"]
    assert text.endswith(" % at step 1") and float(text.split()[0]) > 0
    assert "prediction change" in p.extra_generation_params["TokenReduce ToDo report"]
    # no control, but set away from its default: recorded, so the image says how it was made
    assert p.extra_generation_params["TokenReduce ToDo measure_change"] is True


def test_forge_readout_reruns_with_the_users_control_residuals(comfy, models):
    """Issue #51: Forge's UNet pops its control residuals (ControlNet, T2I-Adapter) from the lists it
    is handed; the readout's rerun runs on copies of them as they were before the reduced call, not
    without the control, and the image is the one of a pass without the readout."""
    from test_comfy_max_change_inprocess import controlled
    from test_comfy_prediction_change_inprocess import true_change

    positive, negative = controlled(comfy)
    measured, run = todo_pass(models["SD15"], True)
    image = sample(comfy, measured, "SD15", steps=1, positive=positive, negative=negative)
    assert torch.equal(image, sample(comfy, todo_pass(models["SD15"], False)[0], "SD15", steps=1, positive=positive,
                                     negative=negative))
    ((_, report),) = run.finish(True)
    want = true_change(comfy, models["SD15"], todo_pass(models["SD15"], False)[0], positive=positive,
                       negative=negative)
    assert want > 1e-4 and abs(report.prediction_change.change - want) <= 1e-4 * want
