"""End to end: the pinned ComfyUI's ``main.py`` on 127.0.0.1 with this pack in custom_nodes and
a full-size random-weight SD1.5 checkpoint written by the tests, driven through its HTTP API."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import workflow
from comfy_server import ComfyServer, PromptRejected, ensure_checkpoint
from conftest import REPO, comfyui_dir

NODE = "TokenReduceToMe"
CHECKPOINT = "tokenreduce-random-sd15.safetensors"
EXAMPLES = sorted((REPO / "example_workflows").glob("*.json"))
PUBLIC_INPUTS = ["model", "ratio", "stride_x", "stride_y", "max_downsample", "mode", "merge_attn", "merge_crossattn",
                 "merge_mlp", "use_rand", "seed", "start_percent", "end_percent"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = comfyui_dir()
    checkpoint = ensure_checkpoint(root.parent, sys.executable, "SD15")
    srv = ComfyServer(root, sys.executable, tmp_path_factory.mktemp("comfy"), {CHECKPOINT: checkpoint})
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def object_info(server):
    return server.object_info()


def sd15_prompt(object_info, size=256, steps=2, **tome):
    prompt = workflow.to_api(workflow.load(REPO / "example_workflows" / "sd15_txt2img_tome.json"), object_info)
    workflow.find(prompt, "CheckpointLoaderSimple")["ckpt_name"] = CHECKPOINT
    latent = workflow.find(prompt, "EmptyLatentImage")
    latent["width"] = latent["height"] = size
    workflow.find(prompt, "KSampler")["steps"] = steps
    workflow.find(prompt, NODE).update(tome)
    return prompt


def pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def node_id(prompt, class_type):
    (nid,) = [k for k, v in prompt.items() if v["class_type"] == class_type]
    return nid


def test_node_and_inputs_are_listed(object_info):
    info = object_info[NODE]
    assert info["category"] == "model_patches/unet"
    assert info["input_order"]["required"] == PUBLIC_INPUTS
    for name, spec in info["input"]["required"].items():
        assert spec[1].get("tooltip"), f"input {name} has no tooltip"
    assert info["output"] == ["MODEL", "STRING"] and info["output_name"] == ["MODEL", "info"]
    assert "TomePatchModel" in object_info  # the built-in stays, under its own id


def test_example_workflow_runs_saves_an_image_and_reports(server, object_info):
    prompt = sd15_prompt(object_info)
    entry = server.run(prompt)
    (image,) = server.images(entry)
    assert pixels(image).shape == (256, 256, 3)
    report = entry["outputs"][node_id(prompt, NODE)]["text"][0]
    assert report.startswith("ToMe on SD15") and "5 of 16 transformer blocks" in report


def test_same_prompt_forced_to_rerun_gives_identical_images(server, object_info):
    prompt = sd15_prompt(object_info, seed=3)
    first = server.run(prompt)
    server.free()  # drops the execution cache: every node runs again
    second = server.run(copy.deepcopy(prompt))
    assert not second["status"].get("messages") or all(m[0] != "execution_cached" or not m[1]["nodes"]
                                                         for m in second["status"]["messages"])
    (a,), (b,) = server.images(first), server.images(second)
    assert a != b and np.array_equal(pixels(a), pixels(b))


def test_unpatched_sampler_in_the_same_graph_matches_a_graph_without_the_pack(server, object_info):
    """The input MODEL is never mutated: a second sampler fed by the loader's model, in the same
    graph as our patched one, gives the image a graph without the pack gives."""
    prompt = sd15_prompt(object_info)
    ksampler, loader, decode = (node_id(prompt, t) for t in ("KSampler", "CheckpointLoaderSimple", "VAEDecode"))
    both = copy.deepcopy(prompt)
    both["90"] = copy.deepcopy(prompt[ksampler])
    both["90"]["inputs"]["model"] = [loader, 0]
    # The plain branch depends on the patched one's latent size only, so it runs after it.
    both["91"] = {"class_type": "VAEDecode", "inputs": {"samples": ["90", 0], "vae": [loader, 2]}}
    both["92"] = {"class_type": "SaveImage", "inputs": {"images": ["91", 0], "filename_prefix": "plain_in_graph"}}
    entry = server.run(both)
    plain_in_graph = server.images({"outputs": {"92": entry["outputs"]["92"]}})[0]
    patched_image = server.images({"outputs": {k: v for k, v in entry["outputs"].items() if k != "92"}})[0]

    without_pack = {k: v for k, v in copy.deepcopy(prompt).items() if v["class_type"] != NODE}
    without_pack[ksampler]["inputs"]["model"] = [loader, 0]
    server.free()
    (reference,) = server.images(server.run(without_pack))
    assert np.array_equal(pixels(plain_in_graph), pixels(reference))
    assert not np.array_equal(pixels(patched_image), pixels(reference))


@pytest.mark.parametrize("override,error_type,needle", [
    ({"ratio": 0.9}, "custom_validation_failed", "0.75"),
    ({"ratio": 0.6, "stride_x": 1}, "custom_validation_failed", "= 0.5"),
    ({"start_percent": 0.8, "end_percent": 0.2}, "custom_validation_failed", "after end_percent"),
    ({"merge_attn": False}, "custom_validation_failed", "nothing to merge"),
    ({"ratio": 1.5}, "custom_validation_failed", "ratio 1.5 is out of range"),
    ({"stride_x": 0}, "custom_validation_failed", "stride_x 0 is out of range"),
    ({"end_percent": -0.1}, "custom_validation_failed", "end_percent -0.1 is out of range"),
    ({"seed": -1}, "value_smaller_than_min", "seed"),
    ({"max_downsample": "3"}, "custom_validation_failed", "max_downsample '3' is not one of"),
    ({"mode": "everything"}, "custom_validation_failed", "mode 'everything' is not one of"),
])
def test_out_of_range_inputs_are_rejected_with_node_errors(server, object_info, override, error_type, needle):
    prompt = sd15_prompt(object_info, **override)
    with pytest.raises(PromptRejected) as rejected:
        server.queue(prompt)
    errors = rejected.value.body["node_errors"][node_id(prompt, NODE)]["errors"]
    assert any(e["type"] == error_type and needle in (e["message"] + e["details"]) for e in errors), errors


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_workflows_use_existing_nodes_and_current_widgets(object_info, path):
    flow = workflow.load(path)
    assert workflow.node_types(flow) <= set(object_info), workflow.node_types(flow) - set(object_info)
    prompt = workflow.to_api(flow, object_info)  # fails if widget values no longer match the inputs
    assert set(workflow.find(prompt, NODE)) == set(PUBLIC_INPUTS)


def test_template_browser_serves_the_examples(server):
    templates = server.get("/api/workflow_templates")
    (names,) = [v for k, v in templates.items() if "TokenReduce" in k]
    assert sorted(names) == sorted(p.stem for p in EXAMPLES)
