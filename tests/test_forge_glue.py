"""The Forge extension's glue without Forge (runs in CI): its arguments and settings built from
the methods' declared inputs, the infotext rules, the grid of a block call without
``activations_shape``, and the pass patching driven through ComfyUI's patcher (the same
``attn1_patch`` / ``model_function_wrapper`` protocol Forge's UnetPatcher has) with
``activations_shape`` taken away, as Forge gives it: it must compute exactly what the ComfyUI
nodes compute. The Forge server tests are tests/test_forge_server*.py."""

from __future__ import annotations

import logging
import subprocess
import sys
import types

import pytest
import torch

from comfy_helpers import ScriptedClock, block_changes, patched, sample, steps_down_block_by_block
from conftest import REPO
from tokenreduce.describe import run_lines
from tokenreduce.grid import grid_at
from tokenreduce.methods import MODE_QUERIES, TODO
from tokenreduce.pays import Decisions
from tokenreduce.todo_patch import plain_attention
from tokenreduce_forge import console, hooks, patching
from tokenreduce_forge import settings as S
from tokenreduce_forge.grid import grid_of
from tokenreduce_forge.texts import INTRO, INTRO_METHODS


# --- arguments and settings -------------------------------------------------------------------

def test_every_input_shown_is_declared_once_with_its_default():
    names = [arg.name for arg in S.ARGS]
    assert len(names) == len(set(names)) == 50
    assert names[:2] == ["enabled", "ToDo"] and names[25] == "hires"
    for stage in (S.FIRST, S.HIRES):
        for method, declared in S.METHODS.items():
            shown = [a for a in S.ARGS if a.stage == stage and a.method == method and a.spec is not None]
            assert [a.spec for a in shown] == [s for s in declared.inputs if s.name not in S.NOT_SHOWN]
            assert all(a.default == a.spec.default and a.kind == a.spec.kind for a in shown)
    assert not {a.spec.name for a in S.ARGS if a.spec is not None} & S.NOT_SHOWN


def test_defaults_enable_todo_only_and_the_hires_pass_follows():
    job = S.job_from_args([True], hires_runs=True)
    assert job.problem is None and list(job.stage(S.FIRST)) == ["ToDo"] and job.stage(S.HIRES) == job.stage(S.FIRST)
    assert job.stage(S.FIRST)["ToDo"] == TODO.settings(TODO.defaults())
    assert S.job_from_args([False], hires_runs=True) == S.OFF
    assert S.job_from_args([], hires_runs=True) == S.OFF


def _positional(**named):
    values = [arg.default for arg in S.ARGS]
    for name, value in named.items():  # ToMe__ratio -> "ToMe ratio", hires_ToMe -> "hires ToMe"
        name = name.replace("__", " ")
        values[S.ARG_INDEX["hires " + name[6:] if name.startswith("hires_") else name]] = value
    return values


@pytest.mark.parametrize("named,expected", [
    ({"ToMe": True, "ToMe__ratio": 0.9}, "TokenReduce ToMe: ratio 0.9 cannot be reached with strides 2x2"),
    ({"ToMe": True, "ToMe__stride_x": 2.5}, "TokenReduce ToMe: stride_x 2.5 is not a whole number."),
    ({"ToMe": True, "ToMe__merge_attn": "false"}, "TokenReduce ToMe: merge_attn 'false' is not true or false."),
    ({"ToMe": True, "ToMe__merge_attn": False}, "TokenReduce ToMe: nothing to merge"),
    ({"ToMe": True, "ToMe__mode": "fast"}, "TokenReduce ToMe: mode 'fast' is not one of"),
    ({"ToMe": True, "ToMe__ratio": None}, "TokenReduce ToMe: ratio has no value (null)."),
    ({"ToDo__factor": 1.0}, "TokenReduce ToDo: nothing to downsample"),
    ({"ToDo__factor": 9.0}, "TokenReduce ToDo: factor 9 is out of range"),
    ({"ToDo__start_percent": 0.8, "ToDo__end_percent": 0.2}, "TokenReduce ToDo: start_percent 0.8 is after"),
    ({"ToDo__level": "3"}, "TokenReduce ToDo: level '3' is not one of"),
    ({"ToDo": False}, "TokenReduce is on, but neither ToDo nor ToMe is selected"),
    ({"hires": "own settings", "hires_ToMe": True, "hires_ToMe__ratio": 0.8},
     "TokenReduce ToMe (hires pass): ratio 0.8 cannot be reached"),
    ({"hires": "twice"}, "TokenReduce: hires 'twice' is not one of"),
    # a method switched off, or a hires pass that does not run, still sends values the accordion
    # could not: refused with the message they get when it runs (the API's [true, false, "yes", ...])
    ({"ToDo": False, "ToMe": True, "ToDo__factor": "yes"}, "TokenReduce ToDo: factor 'yes' is not a number."),
    ({"ToMe__ratio": 5.0}, "TokenReduce ToMe: ratio 5 is out of range"),
    ({"ToMe__merge_attn": "no"}, "TokenReduce ToMe: merge_attn 'no' is not true or false."),
    ({"hires_ToDo__level": 3}, "TokenReduce ToDo (hires pass): level 3 is not one of"),
])
def test_bad_values_are_refused_with_a_message_naming_the_input(named, expected):
    job = S.job_from_args(_positional(enabled=True, **named), hires_runs=True)
    assert job.problem is not None and job.problem.startswith(expected), job.problem
    assert job.infotext(True) == {}


def test_a_method_switched_off_keeps_its_values_unruled():
    """Each value is checked alone; the rules across inputs only where the method runs: a user may
    switch ToDo off rather than undo factor 1 and factor_next 1."""
    args = _positional(enabled=True, ToDo=False, ToMe=True, ToDo__factor=1.0, ToDo__factor_next=1.0,
                       ToDo__start_percent=0.9, ToDo__end_percent=0.1)
    job = S.job_from_args(args, hires_runs=True)
    assert job.problem is None and list(job.stage(S.FIRST)) == ["ToMe"]
    assert S.job_from_args([False, False, "yes"], hires_runs=False) == S.OFF  # off: nothing of it is read


def test_hires_own_settings_are_checked_only_where_a_hires_pass_runs():
    args = _positional(enabled=True, hires="own settings", hires_ToMe=True, hires_ToMe__ratio=0.8)
    assert S.job_from_args(args, hires_runs=False).problem is None
    assert S.job_from_args(args, hires_runs=True).problem is not None


def test_the_accordion_says_what_each_method_does_on_which_models_in_one_line_each():
    """The opening says no method is for one model only; under it, a line per method names its models."""
    assert "Flux" not in INTRO and "ToMe" not in INTRO
    assert list(INTRO_METHODS) == list(S.METHODS)
    for method, line in INTRO_METHODS.items():
        assert line.startswith(f"{method} (SD1.x, SD2.x, SDXL") and "Flux.1" in line and "\n" not in line
        assert not set("*_`[") & set(line)  # no inline markup: the page translates each list item whole


def test_whole_number_floats_and_sliders_convert():
    job = S.job_from_args(_positional(enabled=True, ToMe=True, ToMe__stride_x=3.0, ToMe__seed=7.0, ToDo__factor=2),
                          hires_runs=False)
    tome, todo = job.stage(S.FIRST)["ToMe"], job.stage(S.FIRST)["ToDo"]
    assert (tome.stride_x, tome.seed, todo.factor) == (3, 7, 2.0)
    assert type(tome.stride_x) is int and type(todo.factor) is float


def test_the_api_dict_form():
    job = S.job_from_args([{"tome": {"ratio": 0.3, "mode": MODE_QUERIES}, "Hires": {"ToDo": {"factor": 3}}}],
                          hires_runs=True)
    assert job.problem is None and list(job.stage(S.FIRST)) == ["ToMe"] and job.hires_mode == S.HIRES_OWN
    assert job.stage(S.FIRST)["ToMe"].ratio == 0.3 and job.stage(S.HIRES)["ToDo"].factor == 3.0
    assert S.job_from_args([{"ToDo": True, "hires": "off"}], hires_runs=True).stage(S.HIRES) == {}
    assert "unknown key 'todoo'" in S.job_from_args([{"todoo": True}], hires_runs=True).problem
    assert "unknown input 'ratioo'" in S.job_from_args([{"ToMe": {"ratioo": 1}}], hires_runs=True).problem
    assert "neither ToDo nor ToMe" in S.job_from_args([{}], hires_runs=True).problem
    # ToMe's plan reuse (no control): the dict form takes it, validated as in the nodes
    job = S.job_from_args([{"ToMe": {"share_plans": True, "plan_every": 3, "correct_from_whole": True}}],
                          hires_runs=False)
    assert (job.stage(S.FIRST)["ToMe"].plan_every, job.stage(S.FIRST)["ToMe"].correct_from_whole) == (3, True)
    assert "share_plans is off" in S.job_from_args([{"ToMe": {"plan_every": 3}}], hires_runs=False).problem


def test_the_infotext_records_the_dict_forms_inputs_set_away_from_their_defaults():
    """The inputs only the API's dict form takes (no control) are in the image's infotext where they
    differ from their defaults, so the image says how it was made; at their defaults they are not
    written (an image made from the WebUI's controls reads as before). Pasting leaves them alone."""
    job = S.job_from_args([{"ToMe": {"share_plans": True, "plan_every": 3, "min_similarity": 0.2},
                            "ToDo": {"max_change": 0.1}}], hires_runs=False)
    text = job.infotext(False)
    assert text["TokenReduce ToMe plan_every"] == 3 and text["TokenReduce ToMe min_similarity"] == 0.2
    assert text["TokenReduce ToDo max_change"] == 0.1
    assert "TokenReduce ToMe correct_from_whole" not in text and "TokenReduce ToDo measure_change" not in text
    plain = S.job_from_args([{"ToMe": True, "ToDo": True}], hires_runs=False).infotext(False)
    assert not any(key.split()[-1] in S.DICT_ONLY for key in plain)
    assert not any(arg.spec is not None and arg.spec.name in S.DICT_ONLY for arg in S.ARGS)  # nothing to paste into


def test_xyz_axes_turn_their_method_on_and_factor_1_is_the_cell_without_todo():
    job = S.job_from_args([False], hires_runs=True, overrides={("ToMe", "ratio"): 0.25})
    assert list(job.stage(S.FIRST)) == ["ToMe"] and job.stage(S.FIRST)["ToMe"].ratio == 0.25
    job = S.job_from_args(_positional(enabled=True, ToMe=True), hires_runs=False, overrides={("ToDo", "factor"): 1.0})
    assert list(job.stage(S.FIRST)) == ["ToMe"] and "ToDo is off in this cell" in job.notes[0]
    job = S.job_from_args([False], hires_runs=False, overrides={("ToDo", "factor"): 1.0})
    assert job.problem is None and job.stage(S.FIRST) == {}


def _forge_text(value) -> str:
    """What Forge's infotext parser hands a paste rule: the value as written, a string."""
    return str(value)


def _forge_paste(arg, params):
    """Forge's paste_func for one control (modules/infotext_utils.py): the rule's value, None
    keeps the control, else converted to the type of the control's default."""
    rule = S.paste_rule(arg)
    value = rule(params) if callable(rule) else params.get(rule)
    if value is None:
        return "keep"
    kind = type(arg.default)
    if kind is bool and value == "False":
        return False
    return float(value) if kind is int else kind(value)


def test_infotext_records_every_setting_and_pasting_restores_them():
    args = _positional(enabled=True, ToDo__factor=3.0, ToDo__method="average", ToMe=True, ToMe__ratio=0.4,
                       ToMe__mode=MODE_QUERIES, ToMe__merge_mlp=True, ToMe__seed=12, hires="own settings",
                       hires_ToDo=False, hires_ToMe=True, hires_ToMe__matching="3x3 cells")
    job = S.job_from_args(args, hires_runs=True)
    text = {key: _forge_text(value) for key, value in job.infotext(True).items()}
    assert all(key.startswith("TokenReduce ") for key in text) and "Token merging ratio" not in text
    for arg, sent in zip(S.ARGS, args):
        pasted = _forge_paste(arg, text)
        assert pasted == sent or (pasted == "keep" and arg.spec is not None and arg.stage == S.HIRES
                                  and arg.method == "ToDo"), arg.name


def test_pasting_an_image_without_tokenreduce_turns_it_off_and_keeps_the_rest():
    plain = {"Steps": "20", "Token merging ratio": "0.5"}
    assert [_forge_paste(arg, plain) for arg in S.ARGS] == [False] + ["keep"] * (len(S.ARGS) - 1)
    todo_only = {key: _forge_text(v) for key, v in S.job_from_args([True], hires_runs=False).infotext(False).items()}
    assert _forge_paste(S.ARGS[S.ARG_INDEX["ToMe"]], todo_only) is False
    assert set(S.paste_field_names()) == {a.key for a in S.ARGS if a.spec is not None and a.stage == S.FIRST}


# --- the grid of a block call without activations_shape --------------------------------------------

@pytest.mark.parametrize("latent_hw", [(32, 32), (33, 47), (65, 97), (1, 7), (128, 72)])
def test_every_level_is_found_from_its_token_count(latent_hw):
    level = 1
    while level <= 64:
        h, w = grid_at(latent_hw, level)
        assert grid_of(latent_hw, h * w) == (h, w)
        level *= 2


def test_token_counts_no_level_has_give_a_grid_that_does_not_match():
    for tokens in (1000, 17, 2048):  # tiles, merged tokens
        h, w = grid_of((64, 64), tokens)
        assert h * w != tokens


# --- pass patching through ComfyUI's patcher (Forge's protocol) ------------------------------------

def forge_like(model):
    """A clone whose attention patches get no activations_shape, as under Forge."""
    clone = model.clone()
    clone.set_model_attn1_patch(lambda n, c, v, extra: (extra.pop("activations_shape", None), (n, c, v))[1])
    return clone


def forge_patched(model, family, stage=S.FIRST, size=(32, 32), **methods):
    settings = {m: S.method_settings(m, stage, values) for m, values in methods.items()}
    unet, run = patching.install(forge_like(model), family, stage, settings, (1, 4, *size))
    return unet, run


@pytest.mark.parametrize("family,methods", [
    ("SD15", {"ToDo": {}}),
    # max_change 0 where the budget would decide: this test compares what each computes with the
    # reduction on, and the budget would leave the level alone on these random weights
    ("SD15", {"ToDo": {"factor": 3.0, "factor_next": 2.0, "method": "average", "max_change": 0.0}}),
    ("SD15", {"ToMe": {}}),
    # these merges change even the random model's blocks by 8-10 %: over max_change's default, left alone
    ("SD15", {"ToMe": {"merge_crossattn": True, "merge_mlp": True, "max_downsample": "2", "ratio": 0.6,
                       "max_change": 0.0}}),
    ("SD15", {"ToMe": {"mode": MODE_QUERIES, "matching": "3x3 cells", "share_plans": True, "seed": 7}}),
    # plan_every (the API's dict form): step 1 reuses step 0's plans, cond and uncond each their own
    ("SD15", {"ToMe": {"share_plans": True, "plan_every": 2, "max_change": 0.0}}),
    ("SDXL", {"ToDo": {"factor_next": 2.0, "method": "bicubic", "max_change": 0.0}}),
    ("SDXL", {"ToMe": {"max_change": 0.0}}),
])
def test_forge_glue_computes_what_the_comfyui_node_computes(comfy, models, family, methods):
    (method, values), = methods.items()
    node = patched(comfy, method.lower(), models[family], **values)
    unet, run = forge_patched(models[family], family, **methods)
    assert [m.method for m in run.methods] == [method]
    expected = sample(comfy, node, family, steps=2)
    assert torch.equal(sample(comfy, unet, family, steps=2), expected)
    (report,) = [r for _, r in run.finish(True)]
    assert report.active_steps == (1, 2) and report.levels and not report.warnings
    assert not torch.equal(expected, sample(comfy, models[family], family, steps=2))


def test_correct_from_whole_on_a_unet_is_said_to_do_nothing(comfy, models):
    """The API's dict form takes correct_from_whole; on Forge's UNets it does nothing (it corrects
    whole-block merging on DiTs), said in the pass's warnings, never silently."""
    _, run = forge_patched(models["SD15"], "SD15",
                           ToMe={"share_plans": True, "plan_every": 2, "correct_from_whole": True})
    (method,) = run.methods
    assert any("correct_from_whole does nothing on SD15" in w for w in method.run.warnings), method.run.warnings


def test_both_methods_stack_in_one_pass_and_report_their_tokens(comfy, models):
    unet, run = forge_patched(models["SD15"], "SD15", size=(33, 47), ToDo={}, ToMe={"mode": MODE_QUERIES})
    out = sample(comfy, unet, "SD15", size=(33, 47), steps=2)
    assert torch.isfinite(out).all()
    reports = {m.method: r for m, r in run.finish(True)}
    todo, tome = reports["ToDo"].levels[0], reports["ToMe"].levels[0]
    assert todo.grid == tome.grid == (33, 47) and todo.tokens["k/v"] == (33 * 47, 17 * 24)
    assert tome.tokens["q"] == (33 * 47, 33 * 47 - int(33 * 47 * 0.5))
    assert tome.tokens["k/v"] == (17 * 24, 17 * 24)  # ToDo pooled them before


def test_a_clone_of_a_patched_unet_is_patched_once(comfy, models):
    """Forge's hires pass calls the hook a second time on the first pass's patched UNet."""
    once, _ = forge_patched(models["SD15"], "SD15", ToMe={})
    settings = {"ToMe": S.method_settings("ToMe", S.HIRES, {})}
    twice, run = patching.install(once, "SD15", S.HIRES, settings, (1, 4, 32, 32))
    patches = twice.model_options["transformer_options"]["patches"]
    assert len(patches["attn1_patch"]) == len(once.model_options["transformer_options"]["patches"]["attn1_patch"])
    assert torch.equal(sample(comfy, twice, "SD15"), sample(comfy, once, "SD15"))
    stripped, _ = patching.install(once, "SD15", S.HIRES, {}, (1, 4, 32, 32))
    assert "model_function_wrapper" not in stripped.model_options and patching.INSTALLED not in stripped.model_options
    assert torch.equal(sample(comfy, stripped, "SD15"), sample(comfy, forge_like(models["SD15"]), "SD15"))


def test_another_model_function_wrapper_is_called_inside(comfy, models):
    calls = []
    base = forge_like(models["SD15"])

    def other(apply_model, args):
        calls.append(args["cond_or_uncond"])
        return apply_model(args["input"], args["timestep"], **args["c"])

    base.set_model_unet_function_wrapper(other)
    todo = {"ToDo": S.method_settings("ToDo", S.FIRST, {})}
    unet, run = patching.install(base, "SD15", S.FIRST, todo, (1, 4, 32, 32))
    alone, _ = forge_patched(models["SD15"], "SD15", ToDo={})
    assert torch.equal(sample(comfy, unet, "SD15"), sample(comfy, alone, "SD15"))
    assert calls and run.calls == len(calls)


def test_refusals_raise_at_the_first_model_call_before_any_step(comfy, models):
    unet, run = forge_patched(models["SD15"], "SD15", size=(6, 6), ToDo={"factor": 8.0})
    assert run.refusal.startswith("TokenReduce ToDo: factor 8 does not fit the 6x6 token grid")
    with pytest.raises(patching.Refused, match="factor 8 does not fit"):
        sample(comfy, unet, "SD15", size=(6, 6))
    unet, run = forge_patched(models["SD15"], "SD15", size=(2, 2), ToMe={"stride_x": 3})
    assert "stride_x 3 / stride_y 2 do not fit" in run.refusal
    unet, run = forge_patched(models["SD15"], "SD15", ToMe={"mode": "q, k, v + proportional attention"})
    assert "Forge has no counterpart" in run.refusal  # it needs ComfyUI's attention override
    refusing, _ = patching.refusing(models["SD15"], S.FIRST, "no")
    with pytest.raises(patching.Refused, match="^no$"):
        sample(comfy, refusing, "SD15")


def test_a_refusal_is_one_line_in_the_console_its_traceback_at_debug_level(capsys, caplog):
    """Said once where it is raised, as the UI shows it; the web server's record of it (uvicorn
    logs the exception that left the application, about 100 lines) dropped, its traceback handed
    to our logger at debug level; any other error logged as before. Installed once."""
    run = patching.PassRun(S.FIRST)
    run.refusal = "TokenReduce ToMe: ratio 0.9 cannot be reached.\nLower the ratio."
    with pytest.raises(patching.Refused) as refused:
        run.wrapper(None)(None, {})
    assert capsys.readouterr().out == "[TokenReduce] Refused: TokenReduce ToMe: ratio 0.9 cannot be reached. Lower the ratio.\n"
    server = logging.getLogger(console.SERVER_LOGGER)
    before = list(server.filters)
    try:
        console.quiet_refusals()
        console.quiet_refusals()  # Reload UI runs the script again
        assert len(server.filters) == len(before) + 1
        caplog.set_level(logging.DEBUG)
        for error in (refused.value, RuntimeError("wrapped"), ValueError("other")):
            try:
                raise error from (refused.value if isinstance(error, RuntimeError) else None)
            except Exception:  # noqa: BLE001
                server.error("Exception in ASGI application\n", exc_info=True)
        records = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
        assert records == [
            ("tokenreduce", logging.DEBUG, refused.value.line() + " (the web server's record of it)"),
            ("tokenreduce", logging.DEBUG, refused.value.line() + " (the web server's record of it)"),
            (console.SERVER_LOGGER, logging.ERROR, "Exception in ASGI application\n")]
        assert all(r.exc_info for r in caplog.records)
    finally:
        server.filters[:] = before


def test_settings_that_do_nothing_here_are_said_not_patched(comfy, models):
    unet, run = forge_patched(models["SDXL"], "SDXL", ToMe={"max_downsample": "1"})
    assert not run.methods and run.warnings[0].startswith("TokenReduce ToMe: WARNING: ToMe does nothing on this SDXL")
    assert "model_function_wrapper" not in unet.model_options


def test_a_model_without_unet_blocks_is_refused():
    fake = types.SimpleNamespace(
        model_options={"transformer_options": {}}, object_patches={},
        clone=lambda: fake, get_model_object=lambda name: torch.nn.Linear(2, 2),
        model=types.SimpleNamespace(predictor=None),
        set_model_unet_function_wrapper=lambda f: fake.model_options.__setitem__("model_function_wrapper", f))
    _, run = patching.install(fake, "Flux", S.FIRST, {"ToDo": S.method_settings("ToDo", S.FIRST, {})}, (1, 16, 64, 64))
    assert run.refusal.startswith("TokenReduce cannot patch this Flux model: it has no UNet transformer blocks.")


class TomePatcher:  # named as Forge's built-in (backend/misc/tomesd.py)
    def patch(self):
        def tomesd_m(q, k, v, extra):
            return q, k, v
        return tomesd_m


def test_builtin_tome_patches_are_taken_out(models):
    clone = models["SD15"].clone()
    clone.set_model_attn1_patch(TomePatcher().patch())
    assert patching.strip_builtin_tome(clone)
    assert clone.model_options["transformer_options"]["patches"]["attn1_patch"] == []


# --- the hooks, with a stand-in for Forge's processing object ----------------------------------------

class StableDiffusion:  # named as Forge's SD1.x engine (backend/diffusion_engine/sd15.py)
    pass


def _processing(unet, args, **fields):
    sd_model = StableDiffusion()
    sd_model.forge_objects = types.SimpleNamespace(unet=unet)
    p = types.SimpleNamespace(extra_generation_params={"Steps": 2}, override_settings=dict(fields.pop("override", {})),
                              comments={}, sd_model=sd_model,
                              is_hr_pass=False, enable_hr=False, **fields)
    p.comment = lambda text: p.comments.__setitem__(text, 1)
    return p


def test_hooks_patch_report_and_turn_the_builtin_off(comfy, models):
    args = _positional(enabled=True, ToMe=True, ToMe__mode=MODE_QUERIES)
    base = forge_like(models["SD15"])
    p = _processing(base, args, override={"token_merging_ratio": 0.5})
    hooks.before_process(p, args)
    assert p.override_settings["token_merging_ratio"] == 0.0
    assert "turned off" in p.extra_generation_params["TokenReduce note"]
    assert p.extra_generation_params["TokenReduce ToMe ratio"] == 0.5
    hooks.before_sampling(p, args, {"x": torch.zeros(1, 4, 32, 32)})
    assert p.sd_model.forge_objects.unet is not base
    sample(comfy, p.sd_model.forge_objects.unet, "SD15")
    hooks.after_batch(p, args)
    assert p.extra_generation_params["TokenReduce ToDo report"] == (
        "ToDo · SD15 · 5 of 16 blocks at downsample 1 | ds 1 · 32×32 · q 1024→1024 · k/v 1024→256 | steps 1-2 of 2")
    # ToDo pooled the keys before ToMe merges the queries
    assert p.extra_generation_params["TokenReduce ToMe report"].endswith("· q 1024→512 · k/v 256→256 | steps 1-2 of 2")
    assert any(text.startswith("TokenReduce, first pass: ToMe on SD15") for text in p.comments)
    assert hooks.family_of(type("StableDiffusionXL", (), {})()) == "SDXL"


def test_hooks_refuse_bad_settings_inside_sampling(comfy, models):
    args = _positional(enabled=True, ToMe=True, ToMe__ratio=0.9)
    p = _processing(forge_like(models["SD15"]), args)
    hooks.before_process(p, args)
    assert "TokenReduce ToMe ratio" not in p.extra_generation_params
    hooks.before_sampling(p, args, {"x": torch.zeros(1, 4, 32, 32)})
    with pytest.raises(patching.Refused, match="ratio 0.9 cannot be reached"):
        sample(comfy, p.sd_model.forge_objects.unet, "SD15")


def test_an_xyz_cell_gets_its_own_infotext(models):
    args = _positional(enabled=True)
    p = _processing(forge_like(models["SD15"]), args)
    p.extra_generation_params["TokenReduce ToDo factor"] = 9  # left by the previous cell
    shared = p.extra_generation_params
    hooks.before_process(p, args)
    assert p.extra_generation_params is not shared and shared["TokenReduce ToDo factor"] == 9
    assert p.extra_generation_params["TokenReduce ToDo factor"] == 2.0 and p.extra_generation_params["Steps"] == 2


# --- install.py under the WebUI ---------------------------------------------------------------

def test_install_py_is_quiet_under_the_webui(tmp_path):
    """The WebUI runs install.py on every launch from its own directory, with its root (where
    `launch` imports from) on PYTHONPATH; it prints what an installer prints."""
    webui = tmp_path / "webui"
    (webui / "modules").mkdir(parents=True)
    (webui / "launch.py").write_text("raise SystemExit('install.py must not import launch')\n")
    (webui / "modules" / "launch_utils.py").write_text("")
    done = subprocess.run([sys.executable, str(REPO / "install.py")], capture_output=True, text=True, cwd=webui,
                          env={"PYTHONPATH": str(webui), "PATH": "/usr/bin:/bin"}, check=True)
    assert done.stdout == "" and done.stderr == ""


def test_xyz_axis_values_go_to_the_cell_only_and_bad_values_stop_the_plot():
    from tokenreduce_forge import xyz

    grid = types.SimpleNamespace()
    cell = types.SimpleNamespace(**vars(grid))
    xyz.apply_value("ToMe", "ratio")(cell, 0.25, [0.25])
    xyz.apply_value("ToDo", "factor")(cell, 3.0, [3.0])
    assert getattr(cell, hooks.XYZ) == {("ToMe", "ratio"): 0.25, ("ToDo", "factor"): 3.0}
    assert not hasattr(grid, hooks.XYZ)
    xyz.confirm_values("ToMe", "ratio")(grid, [0.0, 0.75])
    with pytest.raises(RuntimeError, match=r"\[TokenReduce\] ToDo factor: factor 9 is out of range"):
        xyz.confirm_values("ToDo", "factor")(grid, [2.0, 9.0])


def test_the_auto_rule_measures_once_and_the_infotext_repeats(comfy, models, tmp_path):
    """reduce_when auto under Forge: the pass measures into the store it is given (Forge's data
    directory in the WebUI), the next pass keeps the decisions, and the report written into the
    infotext (without timing) is the same both times."""
    store = Decisions(tmp_path / "auto_decisions.json", measure_cpu=True,
                      stopwatch=ScriptedClock((10.0, 8.0), (10.0, 11.0)))
    infotexts, measured = [], []
    for _ in range(2):
        settings = {"ToDo": S.method_settings("ToDo", S.FIRST, {"factor_next": 2.0})}
        unet, run = patching.install(forge_like(models["SD15"]), "SD15", S.FIRST, settings, (1, 4, 32, 32),
                                     decisions=store)
        sample(comfy, unet, "SD15", steps=1)
        ((method, report),) = run.finish(True)
        infotexts.append(" | ".join(run_lines(method.header, report, timing=False)))
        measured.append(store.measurements)
    # each level timed, each block of the level that pays measured for the budget (issue #51), once
    assert measured[0] > 2 and measured[1] == measured[0] and infotexts[0] == infotexts[1]
    assert "auto · downsample 1 (32×32) · 10.00 → 8.00 ms · reduced" in infotexts[0]
    assert "auto · downsample 2 (16×16) · 10.00 → 11.00 ms · left alone" in infotexts[0]


def test_measure_again_measures_once_not_on_every_generation(comfy, models, tmp_path):
    """Forge makes a new pass (and rule) each generation: "auto (measure again)" still times each
    kind once, as its tooltip says, and later generations keep what it measured."""
    store = Decisions(tmp_path / "auto_decisions.json", measure_cpu=True,
                      stopwatch=ScriptedClock((10.0, 8.0), (10.0, 11.0)))
    measured = []
    for _ in range(3):
        settings = {"ToDo": S.method_settings("ToDo", S.FIRST, {"factor_next": 2.0,
                                                                 "reduce_when": "auto (measure again)"})}
        unet, run = patching.install(forge_like(models["SD15"]), "SD15", S.FIRST, settings, (1, 4, 32, 32),
                                     decisions=store)
        sample(comfy, unet, "SD15", steps=1)
        run.finish(True)
        measured.append(store.measurements)
    assert measured[0] > 2 and measured[1] == measured[2] == measured[0]  # the levels, their blocks: once


def test_a_hires_pass_weighs_the_budgets_change_by_the_share_of_sampling_it_covers(comfy, models, tmp_path):
    """Issue #51: the pass's schedule (known before its first step) gives its reach; a hires pass
    at denoising strength 0.2 weighs the kept change by its cube root, so a budget the first
    pass exceeds lets the hires pass reduce."""
    store = Decisions(tmp_path / "auto_decisions.json")
    import comfy.samplers as samplers

    def one_pass(budget: float, denoise: float):
        # average: one method (nearest over the budget would step down to the window)
        settings = {"ToDo": S.method_settings("ToDo", S.FIRST, {"max_change": budget, "method": "average"})}
        unet, run = patching.install(forge_like(models["SD15"]), "SD15", S.FIRST, settings, (1, 4, 32, 32),
                                     decisions=store)
        sampling = unet.get_model_object("model_sampling")
        schedule = samplers.calculate_sigmas(sampling, "normal", round(4 / denoise))[-5:]
        run.use_schedule([float(s) for s in schedule], unet)
        sample(comfy, unet, "SD15", steps=4, denoise=denoise)
        ((_, report),) = run.finish(True)
        (decision,) = [d for site, d in report.decisions if site.endswith("per block")]  # issue #51
        return decision

    one_pass(1e-6, 1.0)
    largest = max(block_changes(store).values())
    first, hires = one_pass(0.7 * largest, 1.0), one_pass(0.7 * largest, 0.2)
    assert first.reach == 1.0 and first.change < largest  # the block that changes most left alone
    assert 0.1 < hires.reach < 0.3 and hires.reduce  # every block, weighed by the pass's reach
    assert hires.change == pytest.approx(largest * hires.reach ** (1 / 3))


# --- ToDo's method window on Forge's UNets: attn1 replace patches (todo_patch.BY_REPLACE) -----------

WINDOW_ALWAYS = {"method": "window", "reduce_when": "always"}  # auto times the window on a CPU too


def _replaced(unet) -> dict:
    return patching._patches_replace(unet)


@pytest.mark.parametrize("family", ["SD15", "SDXL"])
def test_method_window_runs_in_attn1_replace_patches_and_computes_what_the_comfyui_node_computes(comfy, models,
                                                                                                 family):
    """Forge has no attention override: the window runs in an attn1 replace patch on each block of
    the levels ToDo reduces, which Forge's block hands q, k and v. The same image as the ComfyUI
    node's window (through its override), not nearest's, not the unpatched one; reruns bit for bit;
    the input model gets no replace patch, and a clone re-installed without ToDo none either."""
    base = models[family]
    unet, run = forge_patched(base, family, ToDo=WINDOW_ALWAYS)
    (method,) = run.methods
    assert set(_replaced(unet)) == {site.key for site in method.target.sites}
    assert not _replaced(base)
    first = sample(comfy, unet, family)
    assert torch.equal(first, sample(comfy, patched(comfy, "todo", base, **WINDOW_ALWAYS), family))
    assert torch.equal(first, sample(comfy, unet, family))
    nearest, _ = forge_patched(base, family, ToDo={"reduce_when": "always", "max_change": 0.0})
    assert not torch.equal(first, sample(comfy, nearest, family))
    assert not torch.equal(first, sample(comfy, base, family))
    ((_, report),) = run.finish(True)
    assert report.levels and not report.warnings
    assert "window: each tile of queries also sees the keys within 2 tokens" in method.info
    stripped, _ = patching.install(unet, family, S.HIRES, {}, (1, 4, 32, 32))
    assert not _replaced(stripped)
    assert torch.equal(sample(comfy, stripped, family), sample(comfy, forge_like(base), family))


def test_forge_todo_over_the_budget_steps_down_to_the_window(comfy, models, tmp_path):
    """The budget's milder step on Forge's UNets, block by block as in ComfyUI (issue #51): a block
    whose nearest is over max_change runs the window where that is within it."""
    def one_pass(name: str, **values):
        store = Decisions(tmp_path / f"{name}.json", stopwatch=ScriptedClock((2.0, 1.0)))
        settings = {"ToDo": S.method_settings("ToDo", S.FIRST, values)}
        unet, run = patching.install(forge_like(models["SD15"]), "SD15", S.FIRST, settings, (1, 4, 16, 16),
                                     decisions=store)
        image = sample(comfy, unet, "SD15", size=(16, 16))
        ((_, report),) = run.finish(True)
        return image, report, store

    steps_down_block_by_block(one_pass, "nearest", "window", lambda method: {"method": method})


def test_forge_tome_over_the_budget_steps_down_to_half_the_ratio(comfy, models, tmp_path):
    """ToMe's milder step on Forge's UNets (issue #51, the core's): the node's ratio over
    max_change, half of it within: the level merges at half (its image), both decisions said."""
    def one_pass(name: str, **values):
        store = Decisions(tmp_path / f"{name}.json")
        settings = {"ToMe": S.method_settings("ToMe", S.FIRST, {"use_rand": False, **values})}
        unet, run = patching.install(forge_like(models["SD15"]), "SD15", S.FIRST, settings, (1, 4, 32, 32),
                                     decisions=store)
        image = sample(comfy, unet, "SD15")
        ((_, report),) = run.finish(True)
        return image, report, store

    steps_down_block_by_block(one_pass, 0.5, 0.25, lambda ratio: {"ratio": ratio}, lambda ratio: f"ratio {ratio:g}")


def test_another_extensions_attn1_replace_refuses_the_window_and_turns_the_milder_step_off(models):
    """Forge calls one attn1 replacement per block: where another extension holds one on a block
    ToDo reduces, method window is refused naming the blocks, and nearest's milder step is off
    (said); the other extension's patch stays."""
    other = forge_like(models["SD15"])
    theirs = lambda q, k, v, extra: q  # noqa: E731 - a stand-in for another extension's replacement
    other.set_model_attn1_replace(theirs, "input", 1)
    _, run = patching.install(other, "SD15", S.FIRST, {"ToDo": S.method_settings("ToDo", S.FIRST, WINDOW_ALWAYS)},
                              (1, 4, 32, 32))
    assert "method window cannot run here: another extension replaces the self-attention of blocks " \
           "('input', 1, 0)" in run.refusal
    unet, run = patching.install(other, "SD15", S.FIRST, {"ToDo": S.method_settings("ToDo", S.FIRST, {})},
                                 (1, 4, 32, 32))
    assert run.refusal is None and not run.methods[0].patch.may_window
    assert any("milder step (method window) is off" in w for w in run.methods[0].run.warnings)
    assert _replaced(unet) == {("input", 1): theirs}


def test_where_no_level_runs_windowed_the_replace_patches_step_aside(comfy, models, tmp_path):
    """ToDo's defaults (nearest with a budget) register the replace patches, since the budget may
    step down to the window; where nearest is within it, each call's options go without ours, so
    Forge's own self-attention runs (the attention function ours would hand calls to is never
    called) and the image is the one without replace patches."""
    store = Decisions(tmp_path / "within.json")
    calls = []

    def attention(q, k, v, heads):  # Forge's attention_function, counted
        calls.append(q.shape)
        return plain_attention(q, k, v, heads)

    def one_pass():
        settings = {"ToDo": S.method_settings("ToDo", S.FIRST, {"max_change": 2.0})}
        unet, run = patching.install(forge_like(models["SD15"]), "SD15", S.FIRST, settings, (1, 4, 32, 32),
                                     decisions=store, attention=attention)
        assert run.methods[0].patch.may_window and _replaced(unet)
        return sample(comfy, unet, "SD15"), run

    one_pass()  # measures nearest (within the budget); the measuring runs the blocks with ours
    calls.clear()
    measured = store.measurements
    image, run = one_pass()  # decided: no call measured, none windowed
    assert not calls and measured and store.measurements == measured
    assert torch.equal(image, sample(comfy, patched(comfy, "todo", models["SD15"], max_change=2.0), "SD15"))
    ((_, report),) = run.finish(True)
    assert report.levels and not report.warnings
