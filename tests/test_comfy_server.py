"""End to end: the pinned ComfyUI's ``main.py`` on 127.0.0.1 with this pack in custom_nodes and
a full-size random-weight SD1.5 checkpoint written by the tests, driven through its HTTP API."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import ab_helpers
import make_examples
import workflow
from comfy_server import PromptRejected
from conftest import REPO
from server_helpers import (NODE_IDS, OPTIONAL_INPUTS, PUBLIC_INPUTS, checkpoint_name, example_prompt, node_id, pixels,
                            start_server, widget_problems, without_patch)

EXAMPLES = sorted((REPO / "example_workflows").glob("*.json"))
# 128 px: a 16x16 latent, which both examples' strides and factors divide; what is checked here
# (images, reruns, reports, interrupts) does not depend on the size
SIZE = 128


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("comfy"), ["SD15"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def object_info(server):
    return server.object_info()


@pytest.mark.parametrize("node", sorted(PUBLIC_INPUTS))
def test_nodes_and_their_inputs_are_listed(object_info, node):
    info = object_info[node]
    assert info["category"] == "model_patches/unet"
    assert info["input_order"]["required"] == PUBLIC_INPUTS[node]
    assert info["input_order"].get("optional", []) == OPTIONAL_INPUTS[node]
    for name, spec in [*info["input"]["required"].items(), *info["input"].get("optional", {}).items()]:
        assert spec[1].get("tooltip"), f"input {name} has no tooltip"
    assert info["output"] == ["MODEL", "STRING"] and info["output_name"] == ["MODEL", "info"]
    assert "TomePatchModel" in object_info  # the built-in stays, under its own id


@pytest.mark.parametrize("patch,report", [("tome", "ToMe on SD15"), ("todo", "ToDo on SD15: downsample 1: 5 blocks")])
def test_example_workflow_runs_saves_an_image_and_reports(server, object_info, patch, report):
    prompt = example_prompt(object_info, "SD15", patch, size=SIZE)
    entry = server.run(prompt)
    (image,) = server.images(entry)
    assert pixels(image).shape == (SIZE, SIZE, 3)
    assert entry["outputs"][node_id(prompt, NODE_IDS[patch])]["text"][0].startswith(report)


@pytest.mark.parametrize("patch,settings", [("tome", {"seed": 3}), ("todo", {"method": "bilinear"})])
def test_same_prompt_forced_to_rerun_gives_identical_images(server, object_info, patch, settings):
    prompt = example_prompt(object_info, "SD15", patch, size=SIZE, **settings)
    first = server.run(prompt)
    server.free()  # drops the execution cache: every node runs again
    second = server.run(copy.deepcopy(prompt))
    cached = [m[1]["nodes"] for m in second["status"]["messages"] if m[0] == "execution_cached"]
    assert cached in ([], [[]])
    (a,), (b,) = server.images(first), server.images(second)
    assert a != b and np.array_equal(pixels(a), pixels(b))


def test_unpatched_sampler_in_the_same_graph_matches_a_graph_without_the_pack(server, object_info):
    """The input MODEL is never mutated (MLP merging included, an object patch): a second sampler
    fed by the loader's model, in the same graph as our patched one, gives the image a graph
    without the pack gives."""
    prompt = example_prompt(object_info, "SD15", "tome", size=SIZE, merge_mlp=True, merge_crossattn=True)
    ksampler, loader = node_id(prompt, "KSampler"), node_id(prompt, "CheckpointLoaderSimple")
    both = copy.deepcopy(prompt)
    both["90"] = copy.deepcopy(prompt[ksampler])
    both["90"]["inputs"]["model"] = [loader, 0]
    both["91"] = {"class_type": "VAEDecode", "inputs": {"samples": ["90", 0], "vae": [loader, 2]}}
    both["92"] = {"class_type": "SaveImage", "inputs": {"images": ["91", 0], "filename_prefix": "plain_in_graph"}}
    entry = server.run(both)
    plain_in_graph = server.images({"outputs": {"92": entry["outputs"]["92"]}})[0]
    patched_image = server.images({"outputs": {k: v for k, v in entry["outputs"].items() if k != "92"}})[0]

    without_pack = without_patch(prompt)
    server.free()
    (reference,) = server.images(server.run(without_pack))
    assert np.array_equal(pixels(plain_in_graph), pixels(reference))
    assert not np.array_equal(pixels(patched_image), pixels(reference))


@pytest.mark.parametrize("patch,override,error_type,needle", [
    ("tome", {"ratio": 0.9}, "custom_validation_failed", "0.75"),
    ("tome", {"ratio": 0.6, "stride_x": 1}, "custom_validation_failed", "= 0.5"),
    ("tome", {"start_percent": 0.8, "end_percent": 0.2}, "custom_validation_failed", "after end_percent"),
    ("tome", {"merge_attn": False}, "custom_validation_failed", "nothing to merge"),
    ("tome", {"ratio": 1.5}, "custom_validation_failed", "ratio 1.5 is out of range"),
    ("tome", {"stride_x": 0}, "custom_validation_failed", "stride_x 0 is out of range"),
    ("tome", {"end_percent": -0.1}, "custom_validation_failed", "end_percent -0.1 is out of range"),
    ("tome", {"seed": -1}, "value_smaller_than_min", "seed"),
    ("tome", {"max_downsample": "3"}, "custom_validation_failed", "max_downsample '3' is not one of"),
    ("tome", {"mode": "everything"}, "custom_validation_failed", "mode 'everything' is not one of"),
    ("todo", {"factor": 1.0}, "custom_validation_failed", "nothing to downsample"),
    ("todo", {"factor": 12.0}, "custom_validation_failed", "factor 12 is out of range"),
    ("todo", {"level": "16"}, "custom_validation_failed", "level '16' is not one of"),
    ("todo", {"method": "max"}, "custom_validation_failed", "method 'max' is not one of"),
])
def test_out_of_range_inputs_are_rejected_with_node_errors(server, object_info, patch, override, error_type, needle):
    prompt = example_prompt(object_info, "SD15", patch, **override)
    with pytest.raises(PromptRejected) as rejected:
        server.queue(prompt)
    errors = rejected.value.body["node_errors"][node_id(prompt, NODE_IDS[patch])]["errors"]
    assert any(e["type"] == error_type and needle in (e["message"] + e["details"]) for e in errors), errors


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_workflows_use_existing_nodes_and_current_widgets(object_info, path):
    if reason := make_examples.lacking_nodes(path.name, object_info.__contains__):
        pytest.skip(reason)
    flow = workflow.load(path)
    assert workflow.node_types(flow) <= set(object_info), workflow.node_types(flow) - set(object_info)
    assert widget_problems(flow, object_info) == []
    prompt = workflow.to_api(flow, object_info)
    ours = [n for n in prompt.values() if n["class_type"] in PUBLIC_INPUTS]  # Wan 2.2 A14B: one per expert
    assert ours
    for node in ours:
        assert list(node["inputs"]) == PUBLIC_INPUTS[node["class_type"]] + OPTIONAL_INPUTS[node["class_type"]]


@pytest.mark.parametrize("patch,info", [("tome", "one plan per block call"), ("todo", "ToDo on SD15: downsample 1: 5 blocks")])
def test_a_workflow_saved_before_the_optional_inputs_existed_still_runs(server, object_info, patch, info):
    flow = workflow.load(REPO / "example_workflows" / f"sd15_txt2img_{patch}.json")
    (ours,) = [n for n in flow["nodes"] if n["type"] == NODE_IDS[patch]]
    # As first released: the optional inputs (the last widgets) did not exist.
    ours["widgets_values"] = ours["widgets_values"][:-len(OPTIONAL_INPUTS[NODE_IDS[patch]])]
    prompt = workflow.to_api(flow, object_info)
    assert not set(OPTIONAL_INPUTS[NODE_IDS[patch]]) & set(workflow.find(prompt, NODE_IDS[patch]))
    workflow.find(prompt, "CheckpointLoaderSimple")["ckpt_name"] = checkpoint_name("SD15")
    workflow.find(prompt, "EmptyLatentImage").update(width=SIZE, height=SIZE)
    workflow.find(prompt, "KSampler")["steps"] = 1
    entry = server.run(prompt)
    assert info in entry["outputs"][node_id(prompt, NODE_IDS[patch])]["text"][0]


def test_committed_examples_are_what_the_generator_writes():
    generated = make_examples.examples()
    assert sorted(generated) == [p.name for p in EXAMPLES]
    for path in EXAMPLES:
        assert path.read_text() == make_examples.render(generated[path.name]), "rerun devtools/make_examples.py"


def test_template_browser_serves_the_examples(server):
    templates = server.get("/api/workflow_templates")
    (names,) = [v for k, v in templates.items() if "TokenReduce" in k]
    assert sorted(names) == sorted(p.stem for p in EXAMPLES)


RUN_EVENT = "tokenreduce.run"
HEADERS = {"tome": "ToMe · SD15 · 5 of 16 blocks at downsample 1", "todo": "ToDo · SD15 · 5 of 16 blocks at downsample 1"}
TOKENS = {"tome": "ds 1 · 16×16 · q 256→128 · k/v 256→128", "todo": "ds 1 · 16×16 · q 256→256 · k/v 256→64"}


@pytest.mark.parametrize("patch", ["tome", "todo"])
def test_the_node_tells_the_browser_what_it_did(server, object_info, patch):
    """What the front end draws on the node: the node's own output when it executes, then, when
    sampling ends, a run message for that node with tokens and steps."""
    prompt = example_prompt(object_info, "SD15", patch, size=SIZE, seed=5)
    ours = node_id(prompt, NODE_IDS[patch])
    server.free()
    _, messages = server.run_collecting(prompt, {"executed", RUN_EVENT})
    (executed,) = [data for kind, data in messages if kind == "executed" and data["node"] == ours]
    assert executed["output"]["tokenreduce"] == [{"lines": [HEADERS[patch]], "warnings": []}]
    (run,) = [data for kind, data in messages if kind == RUN_EVENT]
    assert run["node"] == ours and run["node_type"] == NODE_IDS[patch] and run["completed"]
    assert run["lines"][:2] == [HEADERS[patch], TOKENS[patch]]
    assert run["lines"][2].startswith("steps 1-2 of 2 · ") and run["warnings"] == []
    assert run["active_steps"] == [1, 2] and run["sampling_seconds"] > 0

    # Queued again with another sampler seed: our node is cached (the browser keeps what it
    # showed), and the cached patched model still reports its new run to the same node.
    prompt[node_id(prompt, "KSampler")]["inputs"]["seed"] += 1
    _, messages = server.run_collecting(prompt, {"execution_cached", RUN_EVENT})
    (cached,) = [data["nodes"] for kind, data in messages if kind == "execution_cached"]
    assert ours in cached
    assert [data["node"] for kind, data in messages if kind == RUN_EVENT] == [ours]


def test_a_setting_refused_for_the_latent_is_reported_on_our_node(server, object_info):
    """The error comes from the sampler (the latent size is known only there); the run message
    puts its reason on our node too."""
    prompt = example_prompt(object_info, "SD15", "tome", size=48, stride_x=8, stride_y=8, ratio=0.5)
    _, messages = server.run_collecting(prompt, {"execution_error", RUN_EVENT}, raise_errors=False)
    (run,) = [data for kind, data in messages if kind == RUN_EVENT]
    (error,) = [data for kind, data in messages if kind == "execution_error"]
    assert run["node"] == node_id(prompt, NODE_IDS["tome"]) and not run["completed"]
    assert run["lines"] == [HEADERS["tome"]] and run["warnings"] == [error["exception_message"].strip()]
    assert "stride_x 8 / stride_y 8 do not fit" in error["exception_message"]


def _interrupt_after_first_step(server, prompt) -> str:
    """Queue the prompt and interrupt it at the sampler's first progress message."""
    return server.queue_and_follow(prompt, node_id(prompt, "KSampler"), lambda value: server.interrupt() or True)


@pytest.mark.parametrize("patch", ["tome", "todo"])
def test_interrupt_during_sampling_then_the_same_prompt_matches_an_uninterrupted_run(server, object_info, patch):
    prompt = example_prompt(object_info, "SD15", patch, size=SIZE, steps=4)
    (reference,) = server.images(server.run(copy.deepcopy(prompt)))
    server.free()
    interrupted = server.wait(_interrupt_after_first_step(server, copy.deepcopy(prompt)))
    assert interrupted["status"]["status_str"] == "error"
    assert "execution_interrupted" in [m[0] for m in interrupted["status"]["messages"]]
    (again,) = server.images(server.run(copy.deepcopy(prompt)))  # queued as is: cached nodes stay cached
    assert np.array_equal(pixels(again), pixels(reference))


def _compare_prompt(size_b: int = 64, batch_b: int = 2) -> dict:
    """Two EmptyImage batches (black, and grey 0x404040) into the Image Compare node, its heat map
    into a Preview Image: no model, a second or so."""
    return {
        "1": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 2, "color": 0}},
        "2": {"class_type": "EmptyImage", "inputs": {"width": size_b, "height": 64, "batch_size": batch_b,
                                                     "color": 0x404040}},
        "3": {"class_type": "TokenReduceImageCompare", "inputs": {"image_a": ["1", 0], "image_b": ["2", 0],
                                                                 "gain": 4.0}},
        "4": {"class_type": "PreviewImage", "inputs": {"images": ["3", 0]}},
    }


def _previewed(server, image: dict) -> np.ndarray:
    """An image a Preview Image node showed, fetched as the browser does (it lives in the temp folder)."""
    import io

    import requests
    from PIL import Image

    response = requests.get(f"{server.url}/view", params={k: image[k] for k in ("filename", "subfolder", "type")},
                            timeout=60)
    response.raise_for_status()
    return np.asarray(Image.open(io.BytesIO(response.content)).convert("RGB"))


def test_the_image_compare_node_reports_and_previews_its_heat_map(server, object_info):
    info = object_info["TokenReduceImageCompare"]
    assert info["output"] == ["IMAGE", "STRING"] and info["output_name"] == ["difference", "report"]
    assert all(spec[1].get("tooltip") for spec in info["input"]["required"].values())
    entry = server.run(_compare_prompt())
    (text,) = entry["outputs"]["3"]["text"]
    psnr = -10 * np.log10((0x40 / 255) ** 2)  # the two differ by 64/255 in every pixel and channel
    lines = text.splitlines()
    assert [line.split(" · SSIM ")[0] for line in lines[:3]] == [
        f"image 1: PSNR {psnr:.2f} dB", f"image 2: PSNR {psnr:.2f} dB", f"mean of 2: PSNR {psnr:.2f} dB"]
    assert entry["outputs"]["3"]["tokenreduce"] == [{"lines": lines, "warnings": []}]
    heat = [_previewed(server, image) for image in entry["outputs"]["4"]["images"]]
    assert len(heat) == 2 and all(h.shape == (64, 64, 3) and (h == h[0, 0]).all() for h in heat)


def test_the_image_compare_node_refuses_batches_that_do_not_pair_up(server):
    entry = server.wait(server.queue(_compare_prompt(size_b=48, batch_b=1)))
    assert entry["status"]["status_str"] == "error"
    (error,) = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert error["node_type"] == "TokenReduceImageCompare"
    assert "image_a is 64x64 px and image_b 48x64 px: compare images of one size" in error["exception_message"]


def test_the_sd15_ab_example_compares_unpatched_with_todo_and_shows_both_times(server, object_info):
    """The A/B example (issue #46): the same seed sampled without and with ToDo, both saved, the
    compare node's figures and heat map, ToDo's time on its node and both samplers' progress bars
    in the console; without ToDo the two images are the same (PSNR ∞): ToDo is the only difference."""
    prompt = ab_helpers.ab_prompt(object_info, "sd15", steps=2)
    workflow.find(prompt, "CheckpointLoaderSimple")["ckpt_name"] = checkpoint_name("SD15")
    workflow.find(prompt, "EmptyLatentImage").update(width=SIZE, height=SIZE)
    _, lines = ab_helpers.run_ab(server, prompt, steps=2, images=1)
    assert "PSNR ∞" not in lines[0]  # ToDo changed the image (random weights: a little)
    _, same = ab_helpers.run_ab(server, ab_helpers.without_todo(prompt), steps=2, images=1)
    assert all(line.startswith(("image 1: PSNR ∞ dB · SSIM 1.0000", "mean of 1: PSNR ∞ dB · SSIM 1.0000"))
               for line in same[:2]), same
