"""Robust under real use, end to end on the pinned ComfyUI server (full-size random-weight SD1.5,
LoRA, ControlNet, a tiny SD3 and a tiny Hunyuan 3D 2.0 written by the tests):

- bad input through ``POST /prompt``: every input of both nodes out of range or of the wrong
  type, settings that do not fit the latent, a model the node cannot patch (ToMe on a DiT, ToDo
  on an unsupported DiT), our node twice: each a clear error naming the node and the value;
- our nodes combined with LoRA (both orders), a ControlNet and a hires-fix two-pass graph;
- an interrupt during sampling;
- and at the end: after all of that, the same server still gives for valid prompts exactly
  the images a fresh server gives.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from comfy_server import PromptRejected
from server_helpers import (NODE_IDS, example_prompt, execution_error, link_extra_models, pixels, rel_error, start_server,
                            without_patch)

# 128 px: a 16x16 latent, which both examples' strides and factors divide; nothing checked here
# (errors, combinations, interrupts, a fresh server's images) depends on the size
SIZE, STEPS = 128, 2
LOADER, OURS, POSITIVE, NEGATIVE, LATENT, SAMPLER, DECODE = "4", "10", "6", "7", "5", "3", "8"  # ids in the examples
REFERENCE_PROMPTS = {}  # name -> prompt whose image the fresh-server test compares
REFERENCE_IMAGES = {}  # name -> pixels from the server these tests abused


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    base = tmp_path_factory.mktemp("comfy-robust")
    return base, link_extra_models(base, ["dit", "unsupported_dit", "lora", "controlnet"])


@pytest.fixture(scope="module")
def server(files):
    srv = start_server(files[0], ["SD15"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def object_info(server):
    return server.object_info()


def prompt_for(object_info, patch="tome", **settings):
    return example_prompt(object_info, "SD15", patch, size=SIZE, steps=STEPS, **settings)


def image_of(server, prompt):
    (path,) = server.images(server.run(prompt))
    return pixels(path)


# --- bad input: validation ----------------------------------------------------------------------

BAD_INPUTS = [
    # ToMe: every input, out of range and of the wrong type
    ("tome", "ratio", -0.1, "ratio -0.1 is out of range"),
    ("tome", "ratio", "half", "ratio 'half' is not a number"),
    ("tome", "stride_x", 9, "stride_x 9 is out of range"),
    ("tome", "stride_x", "two", "stride_x 'two' is not a number"),
    ("tome", "stride_y", 0, "stride_y 0 is out of range"),
    ("tome", "stride_y", "wide", "stride_y 'wide' is not a number"),
    ("tome", "max_downsample", "3", "max_downsample '3' is not one of"),
    ("tome", "max_downsample", 2, "max_downsample 2 is not one of"),
    ("tome", "mode", "everything", "mode 'everything' is not one of"),
    ("tome", "mode", 1, "mode 1 is not one of"),
    ("tome", "seed", -1, "smaller than min"),
    ("tome", "seed", 2 ** 64, "bigger than max"),
    ("tome", "seed", "lucky", "Failed to convert"),
    ("tome", "start_percent", 1.5, "start_percent 1.5 is out of range"),
    ("tome", "start_percent", "soon", "start_percent 'soon' is not a number"),
    ("tome", "end_percent", -0.1, "end_percent -0.1 is out of range"),
    ("tome", "end_percent", {"a": 1}, "end_percent {'a': 1} is not a number"),
    ("tome", "matching", "everywhere", "matching 'everywhere' is not one of"),
    ("tome", "matching", 3, "matching 3 is not one of"),
    # ToDo: every input
    ("todo", "factor", 0.5, "factor 0.5 is out of range"),
    ("todo", "factor", "double", "factor 'double' is not a number"),
    ("todo", "factor_next", 9.0, "factor_next 9 is out of range"),
    ("todo", "factor_next", "x", "factor_next 'x' is not a number"),
    ("todo", "level", "16", "level '16' is not one of"),
    ("todo", "level", 1, "level 1 is not one of"),
    ("todo", "method", "max", "method 'max' is not one of"),
    ("todo", "start_percent", -1, "start_percent -1 is out of range"),
    ("todo", "end_percent", "late", "end_percent 'late' is not a number"),
    ("todo", "temporal_factor", 0.5, "temporal_factor 0.5 is out of range"),
    ("todo", "temporal_factor", "slow", "temporal_factor 'slow' is not a number"),
    ("todo", "skip_first_blocks", -1, "skip_first_blocks -1 is out of range"),
    ("todo", "skip_last_blocks", 65, "skip_last_blocks 65 is out of range"),
]


@pytest.mark.parametrize("patch,name,value,needle", BAD_INPUTS, ids=lambda v: str(v)[:12])
def test_every_bad_input_is_rejected_with_node_errors(server, object_info, patch, name, value, needle):
    prompt = prompt_for(object_info, patch)
    prompt[OURS]["inputs"][name] = value
    with pytest.raises(PromptRejected) as rejected:
        server.queue(prompt)
    errors = rejected.value.body["node_errors"][OURS]["errors"]
    text = " ".join(e["message"] + " " + e["details"] for e in errors)
    assert needle in text and name in text, errors


@pytest.mark.parametrize("patch", ["tome", "todo"])
def test_a_model_input_of_the_wrong_type_is_rejected(server, object_info, patch):
    prompt = prompt_for(object_info, patch)
    prompt[OURS]["inputs"]["model"] = [LOADER, 1]  # the loader's CLIP output
    with pytest.raises(PromptRejected) as rejected:
        server.queue(prompt)
    assert rejected.value.body["node_errors"][OURS]["errors"][0]["type"] == "return_type_mismatch"


def test_booleans_and_integers_are_converted_by_the_host_before_our_nodes_see_them(server, object_info):
    """ComfyUI itself turns any value of a BOOLEAN input into bool(value) and of an INT input
    into int(value) during validation, before a node's own check runs: an API client's "yes"
    is True and 2.9 is 2 (documented in docs/nodes.md). The prompt runs."""
    prompt = prompt_for(object_info, "tome", merge_mlp="yes", stride_x=2.9)
    prompt[SAMPLER]["inputs"]["steps"] = 1
    entry = server.run(prompt)
    assert "strides 2x2" in entry["outputs"][OURS]["text"][0] and "MLP" in entry["outputs"][OURS]["text"][0]


# --- bad input: errors when the prompt runs ------------------------------------------------------

def _run_error(server, prompt) -> dict:
    entry = server.wait(server.queue(prompt))
    assert entry["status"]["status_str"] == "error"
    return execution_error(entry)


@pytest.mark.parametrize("patch,settings,size,needle", [
    ("tome", {"stride_x": 4, "stride_y": 4}, 16, "TokenReduceToMe: stride_x 4 / stride_y 4 do not fit"),
    ("todo", {"factor": 8.0}, 32, "TokenReduceToDo: factor 8 does not fit the 4x4 token grid"),
])
def test_settings_that_do_not_fit_the_latent_fail_before_the_first_step(server, object_info, patch, settings, size,
                                                                          needle):
    prompt = prompt_for(object_info, patch, **settings)
    prompt[LATENT]["inputs"].update(width=size, height=size)
    error = _run_error(server, prompt)
    assert needle in error["exception_message"]


@pytest.mark.parametrize("patch,name", [("tome", "mode"), ("todo", "method")])
def test_a_null_value_fails_at_our_node(server, object_info, patch, name):
    """A null passes validation (the host cannot tell it from a link there); our node refuses
    it when it runs, before the sampler."""
    prompt = prompt_for(object_info, patch)
    prompt[OURS]["inputs"][name] = None
    error = _run_error(server, prompt)
    assert error["node_type"] == NODE_IDS[patch] and f"{name} has no value (null)" in error["exception_message"]


@pytest.mark.parametrize("patch,model,needles", [
    ("tome", "unsupported_dit", ["ToMe cannot patch this Hunyuan3Dv2 model: ",
                                 "a 3-D shape model: its tokens are a set of shape latents"]),
    ("todo", "unsupported_dit", ["ToDo cannot patch this Hunyuan3Dv2 model: ",
                                 "a 3-D shape model: its tokens are a set of shape latents"]),
], ids=["tome on an unsupported DiT", "todo on an unsupported DiT"])
def test_a_model_our_node_cannot_patch_is_refused_by_our_node(server, object_info, files, patch, model, needles):
    prompt = prompt_for(object_info, patch)
    prompt["20"] = {"class_type": "UNETLoader", "inputs": {"unet_name": files[1][model], "weight_dtype": "default"}}
    prompt[OURS]["inputs"]["model"] = ["20", 0]
    error = _run_error(server, prompt)
    assert error["node_type"] == NODE_IDS[patch]
    for needle in needles:
        assert needle in error["exception_message"]


@pytest.mark.parametrize("patch", ["tome", "todo"])
def test_our_node_applied_twice_is_refused(server, object_info, patch):
    prompt = prompt_for(object_info, patch)
    prompt["21"] = copy.deepcopy(prompt[OURS])
    prompt["21"]["inputs"]["model"] = [OURS, 0]
    prompt[SAMPLER]["inputs"]["model"] = ["21", 0]
    error = _run_error(server, prompt)
    assert error["node_type"] == NODE_IDS[patch] and "is already applied to this model" in error["exception_message"]


def test_tome_on_top_of_the_builtin_is_refused(server, object_info):
    prompt = prompt_for(object_info, "tome")
    prompt["22"] = {"class_type": "TomePatchModel", "inputs": {"model": [LOADER, 0], "ratio": 0.3}}
    prompt[OURS]["inputs"]["model"] = ["22", 0]
    error = _run_error(server, prompt)
    assert "built-in TomePatchModel is already applied" in error["exception_message"]


# --- combined with what users combine it with -----------------------------------------------------

@pytest.mark.parametrize("patch", ["tome", "todo"])
def test_lora_in_either_order_gives_the_same_image(server, object_info, files, patch):
    lora = {"class_type": "LoraLoaderModelOnly", "inputs": {"lora_name": files[1]["lora"], "strength_model": 1.0}}
    # LoRA first, then our node
    lora_first = prompt_for(object_info, patch)
    lora_first["30"] = copy.deepcopy(lora)
    lora_first["30"]["inputs"]["model"] = [LOADER, 0]
    lora_first[OURS]["inputs"]["model"] = ["30", 0]
    # our node first, then LoRA
    ours_first = prompt_for(object_info, patch)
    ours_first["30"] = copy.deepcopy(lora)
    ours_first["30"]["inputs"]["model"] = [OURS, 0]
    ours_first[SAMPLER]["inputs"]["model"] = ["30", 0]
    lora_only = without_patch(lora_first)
    lora_only[SAMPLER]["inputs"]["model"] = ["30", 0]
    a, b = image_of(server, lora_first), image_of(server, ours_first)
    assert np.array_equal(a, b)  # weights and attention patches commute
    reference = image_of(server, lora_only)
    assert not np.array_equal(reference, image_of(server, without_patch(lora_first)))  # the LoRA acts
    assert 0 < rel_error(a, reference) < 0.5


def test_controlnet(server, object_info, files):
    def with_controlnet(prompt):
        prompt = copy.deepcopy(prompt)
        prompt["40"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": files[1]["controlnet"]}}
        prompt["41"] = {"class_type": "EmptyImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1,
                                                               "color": 0x808080}}
        prompt["42"] = {"class_type": "ControlNetApplyAdvanced",
                        "inputs": {"positive": [POSITIVE, 0], "negative": [NEGATIVE, 0], "control_net": ["40", 0],
                                   "image": ["41", 0], "strength": 1.0, "start_percent": 0.0, "end_percent": 1.0}}
        prompt[SAMPLER]["inputs"].update(positive=["42", 0], negative=["42", 1])
        return prompt

    for patch in ("tome", "todo"):
        patched = with_controlnet(prompt_for(object_info, patch))
        controlled = image_of(server, patched)
        reference = image_of(server, without_patch(patched))
        assert 0 < rel_error(controlled, reference) < 0.5, patch


def test_hires_fix_two_pass_with_different_settings_per_pass(server, object_info):
    """Pass 1 with ToMe, pass 2 (upscaled latent, denoise 0.5) with ToDo: each patches the
    loader's model on its own."""
    prompt = prompt_for(object_info, "tome", ratio=0.4)
    prompt["50"] = {"class_type": "LatentUpscaleBy", "inputs": {"samples": [SAMPLER, 0], "upscale_method": "bilinear",
                                                                "scale_by": 1.5}}
    prompt["51"] = {"class_type": NODE_IDS["todo"], "inputs": {"model": [LOADER, 0], "factor": 3.0, "factor_next": 1.0,
                                                               "level": "auto", "method": "average",
                                                               "start_percent": 0.0, "end_percent": 1.0}}
    prompt["52"] = copy.deepcopy(prompt[SAMPLER])
    prompt["52"]["inputs"].update(model=["51", 0], latent_image=["50", 0], denoise=0.5)
    prompt[DECODE]["inputs"]["samples"] = ["52", 0]
    entry = server.run(prompt)
    (path,) = server.images(entry)
    two_pass = pixels(path)
    assert two_pass.shape == (SIZE * 3 // 2, SIZE * 3 // 2, 3)  # upscaled by 1.5
    assert entry["outputs"]["51"]["text"][0].startswith("ToDo on SD15: downsample 1: 5 blocks, keys/values pooled 3x")
    plain = copy.deepcopy(prompt)
    plain[SAMPLER]["inputs"]["model"] = plain["52"]["inputs"]["model"] = [LOADER, 0]
    del plain[OURS], plain["51"]
    assert 0 < rel_error(two_pass, image_of(server, plain)) < 0.5


# --- interrupts, then the same server against a fresh one --------------------------------------

@pytest.mark.parametrize("patch", ["tome", "todo"])
def test_interrupt_during_sampling_then_same_prompt(server, object_info, patch):
    """Interrupted at its first step, the run stops there and says so on our node; the same prompt
    queued again (our node cached, so the same patched model) gives the uninterrupted image bit for
    bit: nothing of the interrupted run is left. The fresh-server test below compares it again."""
    prompt = prompt_for(object_info, patch, seed=5) if patch == "tome" else prompt_for(object_info, patch, factor=3.0)
    prompt[SAMPLER]["inputs"]["steps"] = 3
    uninterrupted = image_of(server, copy.deepcopy(prompt))
    server.free()  # else the whole prompt is cached and nothing samples
    messages = []

    def interrupt_at_first_step(kind, data):
        messages.append((kind, data))
        if kind == "progress" and data.get("node") == SAMPLER and sum(k == "progress" for k, _ in messages) == 1:
            server.interrupt()
        return kind == "execution_interrupted"

    prompt_id = server._follow(copy.deepcopy(prompt), interrupt_at_first_step, raise_errors=False)
    assert "execution_interrupted" in [name for name, _ in server.wait(prompt_id)["status"]["messages"]]
    (run,) = [data for kind, data in messages if kind == "tokenreduce.run"]
    assert run["node"] == OURS and not run["completed"] and run["lines"][-1].endswith(" · interrupted")
    assert run["active_steps"] and run["active_steps"][-1] < 3
    again = image_of(server, copy.deepcopy(prompt))
    assert np.array_equal(again, uninterrupted)
    REFERENCE_PROMPTS[f"after interrupt {patch}"] = prompt
    REFERENCE_IMAGES[f"after interrupt {patch}"] = again


def test_after_all_of_this_the_server_matches_a_fresh_server(server, object_info, tmp_path_factory):
    prompts = {**REFERENCE_PROMPTS,
               "tome": prompt_for(object_info, "tome", merge_crossattn=True, share_plans=True),
               "todo": prompt_for(object_info, "todo", factor_next=2.0, method="bilinear"),
               "unpatched": without_patch(prompt_for(object_info, "tome"))}
    images = {name: REFERENCE_IMAGES.get(name) for name in prompts}
    for name, prompt in prompts.items():
        if images[name] is None:
            images[name] = image_of(server, copy.deepcopy(prompt))
    server.stop()  # one full-size model in memory at a time
    fresh = start_server(tmp_path_factory.mktemp("comfy-fresh"), ["SD15"])
    try:
        for name, prompt in prompts.items():
            assert np.array_equal(image_of(fresh, copy.deepcopy(prompt)), images[name]), name
    finally:
        fresh.stop()
