"""End to end on DiTs: ComfyUI's ``main.py`` on 127.0.0.1 with this pack in custom_nodes, the
example workflows for Wan 2.1 text to video, Wan 2.1 VACE, Wan 2.2 A14B (two experts, a ToDo
node on each, 4-step LoRAs, a split schedule), LTX-Video text to video and Flux.1 [dev] text to
image, and the A/B examples of Flux.1 and Wan 2.1, driven through the HTTP API and the websocket.

The graphs are the committed examples with these stand-ins for what cannot be had here: the
diffusion-model files are random (devtools/random_dits.py: the smallest Flux.1 dev, Wan 2.1 t2v
and VACE, and LTX-Video files ComfyUI's UNETLoader detects as those models, written once per
ComfyUI tree and cached; LTX-Video's checkpoint loader becomes a UNETLoader of its file; Wan 2.2
A14B's experts are two scaled-fp8 Wan files of other weights, each with a random LoRA); the
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

import ab_helpers
import make_examples
import workflow
from comfy_server import PromptRejected
from conftest import REPO, comfyui_dir
from server_helpers import (execution_error, link_extra_models, link_test_nodes, node_id, start_server,
                            without_budget)

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
# LTX-2 (LTXAV: ComfyUI 0.33; skipped on 0.3.75, which has none) with audio: 17 frames of 128x96 px
# are 3 latent frames of 4x3 (its audio latent: 17 frames at 24 fps, 18 audio latent frames).
HAS_LTXAV = (comfyui_dir() / "comfy" / "ldm" / "lightricks" / "av_model.py").exists()
GRAPHS["ltx2"] = ("ltx2_t2v_audio_todo.json", "EmptyLTXVLatentVideo", dict(width=128, height=96, length=17),
                  "ToDo · LTXAV · 2 of 2 blocks", "ds 1 · 3 frames × 4×3 · q 36→36 · k/v 36→12", "ToDo on LTXAV (LTX-2, DiT): keys/values of the video tokens")
MODEL_FILES = {"wan": "wan21_t2v", "flux": "flux", "wan_long": "wan21_t2v", "wan_vace": "wan21_vace", "ltxv": "ltxv",
               "ltx2": "ltx2"}
CONTEXT_WINDOWS = dict(context_length=17, context_overlap=9)  # the stand-in for the long clip's 81 / 30


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    base = tmp_path_factory.mktemp("comfy-dit")
    link_test_nodes(base)
    return base, link_extra_models(base, ["wan21_t2v", "flux", "wan21_vace", "ltxv", "unsupported_dit",
                                          *sorted(set(A14B_FILES.values())), *(["ltx2"] if HAS_LTXAV else [])])


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
    prompt = without_budget(stand_ins(workflow.to_api(workflow.load(REPO / "example_workflows" / example),
                                                      object_info), family))
    workflow.find(prompt, "UNETLoader")["unet_name"] = files[1][MODEL_FILES[family]]
    workflow.find(prompt, latent_node).update(size)
    steps_node = "LTXVScheduler" if family in ("ltxv", "ltx2") else "KSampler"
    workflow.find(prompt, steps_node)["steps"] = steps
    workflow.find(prompt, TODO).update({"skip_first_blocks": 0, "skip_last_blocks": 0, **todo_settings})
    if family == "wan_long":
        workflow.find(prompt, "WanContextWindowsManual").update(CONTEXT_WINDOWS)
    if family == "ltx2":
        workflow.find(prompt, "TokenReduceTestLTX2AudioLatent")["frames_number"] = size["length"]
    return prompt


def stand_ins(prompt: dict, family: str) -> dict:
    """An example's API prompt with the stand-ins of the module docstring for the text encoders,
    VACE's conditioning, the VAE and the saved video (the model files are the caller's)."""
    for nid, node in list(prompt.items()):
        kind = node["class_type"]
        if kind == "CheckpointLoaderSimple":  # LTX-Video's checkpoint: its VAE output goes to the decode only
            prompt[nid] = {"class_type": "UNETLoader", "inputs": {"unet_name": "", "weight_dtype": "default"}}
        elif kind == "WanVaceToVideo":
            inputs = {k: v for k, v in node["inputs"].items() if k not in ("vae", "control_video", "control_masks",
                                                                           "reference_image")}
            prompt[nid] = {"class_type": "TokenReduceTestVaceConditioning",
                           "inputs": {**inputs, "reference": False, "seed": 3}}
        elif kind == "LTXVEmptyLatentAudio":  # LTX-2's audio latent, without its audio VAE
            inputs = {k: v for k, v in node["inputs"].items() if k != "audio_vae"}
            prompt[nid] = {"class_type": "TokenReduceTestLTX2AudioLatent", "inputs": inputs}
        elif kind in ("CLIPLoader", "DualCLIPLoader", "VAELoader", "SaveImage", "SaveAnimatedWEBP",
                      "LTXAVTextEncoderLoader", "LTXVAudioVAELoader", "LTXVAudioVAEDecode", "PreviewAudio"):
            del prompt[nid]
        elif kind == "CLIPTextEncode":
            prompt[nid] = {"class_type": "TokenReduceTestDiTConditioning",
                           "inputs": {"family": family.split("_")[0], "seed": int(nid), "tokens": 16}}
        elif kind == "VAEDecode":
            prompt[nid] = {"class_type": "SaveLatent", "inputs": {"samples": node["inputs"]["samples"],
                                                                  "filename_prefix": f"latents/{family}"}}
    return prompt


def without_todo(prompt: dict, ours: str | None = None) -> dict:
    """The prompt with ToDo (the node ``ours``, by default the only one) taken out: what took its
    output takes its input."""
    plain = copy.deepcopy(prompt)
    ours = ours or node_id(plain, TODO)
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
    if family == "ltx2" and not HAS_LTXAV:
        pytest.skip("this ComfyUI has no LTXAV (LTX-2): run with --comfyui of ComfyUI 0.33")
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


# The A/B examples (issue #46) of Flux.1 and Wan 2.1: family -> its GRAPHS entry (model file, latent
# node, size) and the images a run compares (Wan's 9 frames: 3 latent frames, each one image of the
# latent preview that stands in for VAEDecode: tests/comfy_test_nodes).
AB_GRAPHS = {"flux": ("flux", 1), "wan": ("wan", 3)}


@pytest.mark.parametrize("family", list(AB_GRAPHS))
def test_the_ab_example_compares_unpatched_with_todo_and_shows_both_times(server, object_info, files, family):
    """The same seed sampled without and with ToDo, both saved, the compare node's figures and heat
    map, ToDo's time on its node and both samplers' progress bars in the console; without ToDo the
    two are the same (PSNR ∞): ToDo is the only difference between the samplers."""
    graph, images = AB_GRAPHS[family]
    _, latent_node, size, *_ = GRAPHS[graph]
    prompt = ab_helpers.ab_prompt(object_info, family, steps=2)
    saves = {nid: prompt[nid] for nid in ab_helpers.SAVES.values()}  # stand_ins drops the saves
    for node in prompt.values():
        if node["class_type"] == "VAEDecode":
            node.update(class_type="TokenReduceTestLatentPreviewImage",
                        inputs={"samples": node["inputs"]["samples"], "family": family})
    prompt = {**stand_ins(prompt, family), **saves}
    workflow.find(prompt, "UNETLoader")["unet_name"] = files[1][MODEL_FILES[graph]]
    workflow.find(prompt, latent_node).update(size)
    # Every block reduced, whatever auto would decide on the tiny random DiTs: the graph is under test.
    workflow.find(prompt, TODO).update(skip_first_blocks=0, skip_last_blocks=0, reduce_when="always")
    _, lines = ab_helpers.run_ab(server, prompt, steps=2, images=images)
    assert "PSNR ∞" not in lines[images]  # the mean: ToDo changed the frames
    _, same = ab_helpers.run_ab(server, ab_helpers.without_todo(prompt), steps=2, images=images)
    assert same[images].startswith(f"mean of {images}: PSNR ∞ dB · SSIM 1.0000"), same


# Wan 2.2 A14B: two experts of Wan 2.1's architecture, each with its 4-step LoRA. Stand-ins: the
# scaled-fp8 tiny Wan file and a second one of other weights, a random attention LoRA for each.
A14B = "wan22_a14b_t2v_4step_lora_todo.json"
A14B_FILES = {  # the example's file -> the kind of its stand-in (comfy_server.EXTRA_MODELS)
    "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors": "wan21_t2v_fp8_scaled",
    "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors": "wan22_low_noise",
    "wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors": "wan21_t2v_lora",
    "wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors": "wan22_low_noise_lora",
}
# The ToDo node of each expert (make_examples.A14B_EXPERTS): the high-noise one samples steps 1-2
# of the 4, the low-noise one steps 3-4.
A14B_TODO = {"high_noise": str(make_examples.PATCH), "low_noise": str(make_examples.A14B_EXPERTS["low_noise"][2][3])}


def a14b_prompt(object_info, files, **todo_settings) -> dict:
    """The Wan 2.2 A14B example as an API prompt with the stand-ins, at 128x96, 9 frames, its 4
    steps split 2 + 2; ``todo_settings`` on both ToDo nodes."""
    prompt = without_budget(stand_ins(workflow.to_api(workflow.load(REPO / "example_workflows" / A14B), object_info),
                                      "wan"))
    for node in prompt.values():
        for name in ("unet_name", "lora_name"):
            if name in node["inputs"]:
                node["inputs"][name] = files[1][A14B_FILES[node["inputs"][name]]]
        if node["class_type"] == TODO:
            node["inputs"].update({"skip_first_blocks": 0, "skip_last_blocks": 0, **todo_settings})
    workflow.find(prompt, "EmptyHunyuanLatentVideo").update(width=128, height=96, length=9)
    return prompt


def run_reports(server, prompt) -> tuple[dict, dict, dict]:
    """Run the prompt: its history entry, each node's executed output and each node's run report."""
    prompt_id, messages = server.run_collecting(prompt, {"executed", RUN_EVENT})
    executed = {data["node"]: data["output"] for kind, data in messages if kind == "executed"}
    runs = {}
    for kind, data in messages:
        if kind == RUN_EVENT:
            assert data["node"] not in runs, "one run report per node and sampler"
            runs[data["node"]] = data
    return history(server, prompt_id), executed, runs


def test_the_wan22_a14b_example_patches_and_reports_each_expert(server, object_info, files):
    """Both experts patched by their own ToDo node, each reporting its own sampler's 2 steps; each
    node changes the result; a fresh rerun repeats it bit for bit."""
    _, _, _, header, tokens, info = GRAPHS["wan"]
    prompt = a14b_prompt(object_info, files)
    server.free()
    entry, executed, runs = run_reports(server, prompt)
    assert set(runs) == set(A14B_TODO.values())
    for ours in A14B_TODO.values():
        assert entry["outputs"][ours]["text"][0].startswith(info)
        assert executed[ours]["tokenreduce"] == [{"lines": [header], "warnings": []}]
        run = runs[ours]
        assert run["completed"] and run["warnings"] == [] and run["active_steps"] == [1, 2]
        assert run["lines"][0] == header and run["lines"][-1].startswith("steps 1-2 of 2 · ")
        assert [line for line in run["lines"] if line.startswith("ds ")] == [tokens]
    latent = latent_of(server, entry)
    assert torch.isfinite(latent).all()

    # Each ToDo node acts on its own expert: taking either out, or both, gives another latent.
    without_high = latent_of(server, server.run(without_todo(prompt, A14B_TODO["high_noise"])))
    without_low = latent_of(server, server.run(without_todo(prompt, A14B_TODO["low_noise"])))
    plain = latent_of(server, server.run(without_todo(without_todo(prompt, A14B_TODO["high_noise"]),
                                                      A14B_TODO["low_noise"])))
    for a, b in [(latent, without_high), (latent, without_low), (without_high, plain), (without_low, plain)]:
        error = float((a - b).norm() / b.norm())
        assert 1e-5 < error < 0.1, error

    server.free()
    assert torch.equal(latent_of(server, server.run(copy.deepcopy(prompt))), latent)


def test_a_wan22_a14b_window_in_percent_selects_the_same_noise_levels_on_both_samplers(server, object_info, files):
    """The 4 steps at shift 5 ("simple") run at sigma 1, 0.9375, 0.833 and 0.625; start_percent 0.2
    and end_percent 0.7 are sigma 0.952 and 0.682 (``percent_to_sigma``), so steps 2 and 3 lie
    inside: the high-noise sampler's second step and the low-noise sampler's first. Each node
    counts its own sampler's steps."""
    prompt = a14b_prompt(object_info, files, start_percent=0.2, end_percent=0.7)
    _, _, runs = run_reports(server, prompt)
    high, low = runs[A14B_TODO["high_noise"]], runs[A14B_TODO["low_noise"]]
    assert high["active_steps"] == [2] and high["lines"][-1].startswith("steps 2 of 2 · ")
    assert low["active_steps"] == [1] and low["lines"][-1].startswith("steps 1 of 2 · ")
    assert high["warnings"] == low["warnings"] == []


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
