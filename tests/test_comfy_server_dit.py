"""End to end on DiTs: ComfyUI's ``main.py`` on 127.0.0.1 with this pack in custom_nodes, the
example workflows for Wan 2.1 text to video, Wan 2.1 VACE, LTX-Video text to video and Flux.1
[dev] text to image, driven through the HTTP API and the websocket.

The graphs are the committed examples with these stand-ins for what cannot be had here: the
diffusion-model files are random (devtools/random_dits.py: the smallest Flux.1 dev, Wan 2.1 t2v
and VACE, and LTX-Video files ComfyUI's UNETLoader detects as those models, written once per
ComfyUI tree and cached; LTX-Video's checkpoint loader becomes a UNETLoader of its file); the
text encoders are replaced by the tests' own node, random conditioning in their shape
(tests/comfy_test_nodes: a T5-XXL cannot be built or run here), and so is WanVaceToVideo, which
encodes its control video with the VAE (random VACE frames and mask in its shapes); and the VAE
decode by SaveLatent, whose file is the sampler's output itself: no VAE of these families can be
had at a useful cost (their loaders read fixed full-size configs, ~80 M parameters of random
weights to write and run) and decoding adds nothing about ToDo. Small sizes and 2 steps keep it
fast; ToDo leaves no block unreduced (skip_first/last_blocks 0)."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

import workflow
from comfy_server import PromptRejected
from conftest import REPO
from server_helpers import execution_error, link_extra_models, link_test_nodes, node_id, start_server

TODO = "TokenReduceToDo"
RUN_EVENT = "tokenreduce.run"
# family -> example, its latent node and the small size used here, the node's header and token line
GRAPHS = {
    "wan": ("wan21_t2v_todo.json", "EmptyHunyuanLatentVideo", dict(width=128, height=96, length=9),
            "ToDo · WAN21_T2V · 1 of 1 blocks", "ds 1 · 3 frames × 8×6 · q 144→144 · k/v 144→36",
            "ToDo on WAN21_T2V (Wan 2.1 / 2.2, DiT): keys/values of the video tokens"),
    "flux": ("flux_txt2img_todo.json", "EmptySD3LatentImage", dict(width=128, height=128),
             "ToDo · Flux · 1 of 1 blocks", "ds 1 · 8×8 · q 64→64 · k/v 64→16",
             "ToDo on Flux (Flux.1, DiT): keys/values of the image tokens"),
    # 33 frames (9 latent) in windows of 17 (5 latent) overlapping by 9 (3): each window one call.
    "wan_long": ("wan21_t2v_long_context_windows_todo.json", "EmptyHunyuanLatentVideo",
                 dict(width=128, height=96, length=33), "ToDo · WAN21_T2V · 1 of 1 blocks",
                 "ds 1 · 5 frames × 8×6 · q 240→240 · k/v 240→60",
                 "ToDo on WAN21_T2V (Wan 2.1 / 2.2, DiT): keys/values of the video tokens"),
    # The VACE block's self-attention over the hint tokens (the same grid) is reduced with the block's.
    "wan_vace": ("wan21_vace_todo.json", "TokenReduceTestVaceConditioning", dict(width=128, height=96, length=9),
                 "ToDo · WAN21_Vace · 1 of 1 blocks", "ds 1 · 3 frames × 8×6 · q 144→144 · k/v 144→36",
                 "ToDo on WAN21_Vace (Wan VACE, DiT): keys/values of the video tokens"),
    # 9 frames of 128x128 px: 2 latent frames of 4x4 (LTX-Video's VAE: 8x in time, 32x in space; patch 1).
    "ltxv": ("ltxv_t2v_todo.json", "EmptyLTXVLatentVideo", dict(width=128, height=128, length=9),
             "ToDo · LTXV · 2 of 2 blocks", "ds 1 · 2 frames × 4×4 · q 32→32 · k/v 32→8",
             "ToDo on LTXV (LTX-Video, DiT): keys/values of the video tokens"),
}
MODEL_FILES = {"wan": "wan21_t2v", "flux": "flux", "wan_long": "wan21_t2v", "wan_vace": "wan21_vace", "ltxv": "ltxv"}
CONTEXT_WINDOWS = dict(context_length=17, context_overlap=9)  # the stand-in for the long clip's 81 / 30


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    base = tmp_path_factory.mktemp("comfy-dit")
    link_test_nodes(base)
    return base, link_extra_models(base, ["wan21_t2v", "flux", "wan21_vace", "ltxv", "unsupported_dit"])


@pytest.fixture(scope="module")
def server(files):
    srv = start_server(files[0], [])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def object_info(server):
    return server.object_info()


def dit_prompt(object_info, files, family, steps=2, **todo_settings) -> dict:
    """The family's example workflow as an API prompt, with the stand-ins (see the module
    docstring): random model file, random conditioning, SaveLatent."""
    example, latent_node, size, *_ = GRAPHS[family]
    prompt = workflow.to_api(workflow.load(REPO / "example_workflows" / example), object_info)
    for nid, node in list(prompt.items()):
        kind = node["class_type"]
        if kind == "CheckpointLoaderSimple":  # LTX-Video's checkpoint: its VAE output goes to the decode only
            prompt[nid] = {"class_type": "UNETLoader", "inputs": {"unet_name": "", "weight_dtype": "default"}}
        elif kind == "WanVaceToVideo":
            inputs = {k: v for k, v in node["inputs"].items() if k not in ("vae", "control_video", "control_masks",
                                                                           "reference_image")}
            prompt[nid] = {"class_type": "TokenReduceTestVaceConditioning",
                           "inputs": {**inputs, "reference": False, "seed": 3}}
        elif kind in ("CLIPLoader", "DualCLIPLoader", "VAELoader", "SaveImage", "SaveAnimatedWEBP"):
            del prompt[nid]
        elif kind == "CLIPTextEncode":
            prompt[nid] = {"class_type": "TokenReduceTestDiTConditioning",
                           "inputs": {"family": family.split("_")[0], "seed": int(nid), "tokens": 16}}
        elif kind == "VAEDecode":
            prompt[nid] = {"class_type": "SaveLatent", "inputs": {"samples": node["inputs"]["samples"],
                                                                  "filename_prefix": f"latents/{family}"}}
    workflow.find(prompt, "UNETLoader")["unet_name"] = files[1][MODEL_FILES[family]]
    workflow.find(prompt, latent_node).update(size)
    steps_node = "LTXVScheduler" if family == "ltxv" else "KSampler"
    workflow.find(prompt, steps_node)["steps"] = steps
    workflow.find(prompt, TODO).update({"skip_first_blocks": 0, "skip_last_blocks": 0, **todo_settings})
    if family == "wan_long":
        workflow.find(prompt, "WanContextWindowsManual").update(CONTEXT_WINDOWS)
    return prompt


def without_todo(prompt: dict) -> dict:
    """The prompt with ToDo taken out: what took its output takes its input."""
    plain = copy.deepcopy(prompt)
    ours = node_id(plain, TODO)
    for node in plain.values():
        if node["inputs"].get("model") == [ours, 0]:
            node["inputs"]["model"] = plain[ours]["inputs"]["model"]
    del plain[ours]
    return plain


def latent_of(server, entry) -> torch.Tensor:
    (saved,) = [item for output in entry["outputs"].values() for item in output.get("latents", [])]
    return load_file(str(server.output / saved["subfolder"] / saved["filename"]))["latent_tensor"]


# ComfyUI 0.33 puts the frame before a context window in front of it (``causal_window_fix``, on by
# default; 0.3.75 has no such thing): the windows after the first are calls of one frame more.
ANCHORED_WINDOWS = "ds 1 · 6 frames × 8×6 · q 288→288 · k/v 288→72"


def token_lines(family: str, tokens: str) -> list[list[str]]:
    """The report's token lines a host may give (the larger grid first)."""
    return [[tokens], [ANCHORED_WINDOWS, tokens]] if family == "wan_long" else [[tokens]]


def history(server, prompt_id) -> dict:
    return server.get(f"/history/{prompt_id}")[prompt_id]


@pytest.mark.parametrize("family", list(GRAPHS))
def test_the_example_graph_runs_reports_repeats_and_acts(server, object_info, files, family):
    _, _, _, header, tokens, info = GRAPHS[family]
    prompt = dit_prompt(object_info, files, family)
    ours = node_id(prompt, TODO)
    server.free()
    prompt_id, messages = server.run_collecting(prompt, {"executed", RUN_EVENT})
    entry = history(server, prompt_id)
    assert entry["outputs"][ours]["text"][0].startswith(info)
    (executed,) = [data for kind, data in messages if kind == "executed" and data["node"] == ours]
    assert executed["output"]["tokenreduce"] == [{"lines": [header], "warnings": []}]
    (run,) = [data for kind, data in messages if kind == RUN_EVENT]
    assert run["node"] == ours and run["completed"] and run["warnings"] == []
    assert run["lines"][0] == header and run["lines"][-1].startswith("steps 1-2 of 2 · ")
    assert [line for line in run["lines"] if line.startswith("ds ")] in token_lines(family, tokens)
    windows = [line for line in run["lines"] if line.startswith("context windows · ")]
    assert len(windows) == (family == "wan_long") and len(run["windows"]) == (3 if family == "wan_long" else 0)
    assert run["active_steps"] == [1, 2]
    latent = latent_of(server, entry)
    assert torch.isfinite(latent).all()

    # Without ToDo, in the same server (the loaded model is reused): another latent, not far off.
    plain = latent_of(server, server.run(without_todo(prompt)))
    error = float((latent - plain).norm() / plain.norm())
    assert 1e-5 < error < 0.1, error

    # Forced to run again from scratch: bit-identical.
    server.free()
    again = server.run(copy.deepcopy(prompt))
    assert not [m for m in again["status"]["messages"] if m[0] == "execution_cached" and m[1]["nodes"]]
    assert torch.equal(latent_of(server, again), latent)


@pytest.mark.parametrize("name,value,needle", [
    ("temporal_factor", 0.5, "temporal_factor 0.5 is out of range"),
    ("temporal_factor", 9.0, "temporal_factor 9 is out of range"),
    ("temporal_factor", "twice", "temporal_factor 'twice' is not a number"),
    ("skip_first_blocks", -1, "skip_first_blocks -1 is out of range"),
    ("skip_first_blocks", 65, "skip_first_blocks 65 is out of range"),
    ("skip_last_blocks", 100, "skip_last_blocks 100 is out of range"),
])
def test_bad_dit_inputs_are_rejected_with_node_errors(server, object_info, files, name, value, needle):
    prompt = dit_prompt(object_info, files, "wan", **{name: value})
    with pytest.raises(PromptRejected) as rejected:
        server.queue(prompt)
    errors = rejected.value.body["node_errors"][node_id(prompt, TODO)]["errors"]
    assert any(needle in e["message"] + " " + e["details"] for e in errors), errors


def _run_error(server, prompt) -> dict:
    entry = server.wait(server.queue(prompt))
    assert entry["status"]["status_str"] == "error"
    return execution_error(entry)


@pytest.mark.parametrize("family,settings,needle", [
    ("flux", dict(method="average"), "TokenReduceToDo: method 'average' does not work on Flux.1: its keys carry "
                                     "rotary positions"),
    ("wan", dict(factor=8.0), "TokenReduceToDo: factor 8 does not fit the 8x6 token grid of this latent"),
])
def test_settings_that_cannot_work_on_this_model_fail_with_a_message(server, object_info, files, family, settings,
                                                                     needle):
    error = _run_error(server, dit_prompt(object_info, files, family, **settings))
    assert needle in error["exception_message"]


def test_an_unsupported_dit_file_is_refused_with_its_reason(server, object_info, files):
    prompt = dit_prompt(object_info, files, "wan")
    workflow.find(prompt, "UNETLoader")["unet_name"] = files[1]["unsupported_dit"]
    error = _run_error(server, prompt)
    assert error["node_type"] == TODO
    assert "ToDo cannot patch this Hunyuan3Dv2 model: " in error["exception_message"]
    assert "a 3-D shape model: its tokens are a set of shape latents" in error["exception_message"]
