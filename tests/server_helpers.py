"""Helpers of the end-to-end tests: a ComfyUI server with this pack and random checkpoints,
and prompts made from the example workflows."""

from __future__ import annotations

import copy

import sys
from pathlib import Path

import numpy as np
from PIL import Image

import workflow
from comfy_server import ComfyServer, ensure_checkpoint
from conftest import REPO, comfyui_dir

NODE_IDS = {"tome": "TokenReduceToMe", "todo": "TokenReduceToDo"}
PUBLIC_INPUTS = {  # public interface: saved workflows depend on these names and their order
    "TokenReduceToMe": ["model", "ratio", "stride_x", "stride_y", "max_downsample", "mode", "merge_attn",
                        "merge_crossattn", "merge_mlp", "use_rand", "seed", "start_percent", "end_percent"],
    "TokenReduceToDo": ["model", "factor", "factor_next", "level", "method", "start_percent", "end_percent"],
}
OPTIONAL_INPUTS = {  # added after the first release, optional so that older workflows still load
    "TokenReduceToMe": ["share_plans", "matching", "reduce_when", "stride_t", "plan_every", "measure_change",
                        "max_change", "min_similarity", "correct_from_whole"],
    "TokenReduceToDo": ["temporal_factor", "skip_first_blocks", "skip_last_blocks", "reduce_when", "measure_change", "max_change"],
}
MODEL_FILE = (".safetensors", ".sft", ".ckpt", ".pt", ".pth", ".gguf")


def checkpoint_name(family: str) -> str:
    return f"tokenreduce-random-{family.lower()}.safetensors"


def start_server(base: Path, families: list[str], extra_args: list[str] | None = None) -> ComfyServer:
    root = comfyui_dir()
    checkpoints = {checkpoint_name(f): ensure_checkpoint(root, sys.executable, f) for f in families}
    return ComfyServer(root, sys.executable, base, checkpoints, extra_args=extra_args).start()


def example_prompt(object_info, family: str, patch: str, size=256, steps=2, **settings) -> dict:
    prompt = workflow.to_api(workflow.load(REPO / "example_workflows" / f"{family.lower()}_txt2img_{patch}.json"),
                             object_info)
    workflow.find(prompt, "CheckpointLoaderSimple")["ckpt_name"] = checkpoint_name(family)
    latent = workflow.find(prompt, "EmptyLatentImage")
    latent["width"] = latent["height"] = size
    workflow.find(prompt, "KSampler")["steps"] = steps
    workflow.find(prompt, NODE_IDS[patch]).update({"max_change": 0.0, **settings})  # see without_budget
    return prompt


def without_budget(prompt: dict) -> dict:
    """``prompt`` with our nodes' quality budget off (``max_change`` 0), in place: at the tests'
    few hundred pixels a random checkpoint's blocks change by more than the default budget on
    their own inputs, so auto would leave them alone and the flow under test would not reduce
    (the budget has tests of its own: test_comfy_max_change_inprocess.py)."""
    for node in prompt.values():
        if node.get("class_type") in NODE_IDS.values():
            node["inputs"]["max_change"] = 0.0
    return prompt


def without_patch(prompt: dict) -> dict:
    """The same example-workflow prompt with our patch node taken out: the sampler gets the
    loader's model."""
    plain = copy.deepcopy(prompt)
    (ours,) = [k for k, v in plain.items() if v["class_type"] in NODE_IDS.values()]
    del plain[ours]
    plain[node_id(plain, "KSampler")]["inputs"]["model"] = [node_id(plain, "CheckpointLoaderSimple"), 0]
    return plain


def node_id(prompt, class_type):
    (nid,) = [k for k, v in prompt.items() if v["class_type"] == class_type]
    return nid


def pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def link_extra_models(base: Path, kinds: list[str]) -> dict[str, str]:
    """Random-weight model files (see comfy_server.EXTRA_MODELS) linked into a server's model
    folders before it starts; returns the file name of each kind."""
    from comfy_server import ensure_extra_model

    names = {}
    for kind in kinds:
        folder, path = ensure_extra_model(comfyui_dir(), kind)
        target = base / "models" / folder / f"tokenreduce-random-{kind}.safetensors"
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.symlink_to(path)
        names[kind] = target.name
    return names


def widget_problems(flow: dict, object_info: dict) -> list[str]:
    """Widget values of a UI-format workflow that do not fit the server's inputs: a choice not
    among the options (model file names excepted: the test server has none of the real files),
    a number out of range or of the wrong type, a non-boolean, a non-string."""
    problems = []
    for node in flow["nodes"]:
        if node["type"] in workflow.FRONTEND_ONLY:  # notes: the frontend's own, no inputs
            continue
        info = object_info[node["type"]]
        linked = {inp["name"] for inp in node.get("inputs", []) if inp.get("link") is not None}
        values = iter(node.get("widgets_values", []))
        for name, spec in workflow._input_specs(info):
            if not workflow._is_widget(spec):
                continue
            value = next(values, workflow._MISSING)
            options = spec[1] if len(spec) > 1 else {}
            if options.get("control_after_generate"):
                next(values, None)
            if value is workflow._MISSING or name in linked:
                continue
            where = f"{node['type']} (node {node['id']}) input {name} = {value!r}"
            kind = options.get("widgetType", spec[0])  # a MultiType input: the widget it names
            choices = kind if isinstance(kind, list) else options.get("options") if kind == "COMBO" else None
            if choices is not None:
                if value not in choices and not str(value).endswith(MODEL_FILE):
                    problems.append(f"{where}: not one of {choices}")
            elif kind in ("INT", "FLOAT"):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind == "INT" and value != int(value)):
                    problems.append(f"{where}: not a {kind}")
                elif not options.get("min", value) <= value <= options.get("max", value):
                    problems.append(f"{where}: out of range [{options.get('min')}, {options.get('max')}]")
            elif kind == "BOOLEAN" and not isinstance(value, bool):
                problems.append(f"{where}: not a boolean")
            elif kind == "STRING" and not isinstance(value, str):
                problems.append(f"{where}: not a string")
        if next(values, workflow._MISSING) is not workflow._MISSING:
            problems.append(f"{node['type']} (node {node['id']}): more widget values than widget inputs")
    return problems


TEST_NODES = REPO / "tests" / "comfy_test_nodes"  # random DiT conditioning, for tests only


def link_test_nodes(base: Path) -> None:
    """Install the tests' own node pack (tests/comfy_test_nodes) in a server's custom_nodes
    before it starts."""
    target = base / "custom_nodes" / "TokenReduce-TestNodes"
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        target.symlink_to(TEST_NODES, target_is_directory=True)


def execution_error(entry: dict) -> dict:
    """The data of a finished prompt's execution_error message."""
    (error,) = [data for name, data in entry["status"]["messages"] if name == "execution_error"]
    return error


def rel_error(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
