"""The main job on a fresh machine: ``python3 devtools/demo.py``.

Sets up the pinned ComfyUI (cached), installs this pack into it (a custom_nodes folder of a
private base directory), writes a random-weight SD1.5 checkpoint unless ``--checkpoint`` names
yours, runs the SD1.5 example workflows (``example_workflows/sd15_txt2img_tome.json`` and
``sd15_txt2img_todo.json``) with the ToMe node, with the ToDo node and without either, prints
the seconds per sampling step of each and saves the images.

    python3 devtools/demo.py                                  # random weights, 512 px, 4 steps
    python3 devtools/demo.py --checkpoint ~/models/v1-5.safetensors --size 768 --steps 20
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "devtools"))

import host  # noqa: E402

EXAMPLES = {"with ToMe": (REPO / "example_workflows" / "sd15_txt2img_tome.json", "TokenReduceToMe"),
            "with ToDo": (REPO / "example_workflows" / "sd15_txt2img_todo.json", "TokenReduceToDo")}


def _run_timed(server, prompt: dict, sampler_node: str) -> tuple[dict, float]:
    """Run a prompt and return its history entry and the seconds per sampling step, from the
    times at which the sampler's progress messages arrive."""
    ticks = []
    prompt_id = server.queue_and_follow(prompt, sampler_node, lambda value: ticks.append((time.perf_counter(), value)))
    (t0, v0), (t1, v1) = ticks[0], ticks[-1]
    return server.wait(prompt_id), (t1 - t0) / max(1, v1 - v0)


def _prompts(object_info: dict, checkpoint_name: str, size: int, steps: int) -> dict[str, dict]:
    import workflow

    prompts = {}
    for label, (path, node) in EXAMPLES.items():
        prompt = workflow.to_api(workflow.load(path), object_info)
        workflow.find(prompt, "CheckpointLoaderSimple")["ckpt_name"] = checkpoint_name
        latent = workflow.find(prompt, "EmptyLatentImage")
        latent["width"] = latent["height"] = size
        workflow.find(prompt, "KSampler")["steps"] = steps
        workflow.find(prompt, "SaveImage")["filename_prefix"] = "demo_" + node.removeprefix("TokenReduce").lower()
        prompts[label] = prompt
    # The same graph without the patch node: the loader's model goes straight to the sampler.
    without = copy.deepcopy(prompts["with ToMe"])
    (patch_id,) = [k for k, v in without.items() if v["class_type"] == EXAMPLES["with ToMe"][1]]
    workflow.find(without, "KSampler")["model"] = without.pop(patch_id)["inputs"]["model"]
    workflow.find(without, "SaveImage")["filename_prefix"] = "demo_unpatched"
    return {"unpatched": without, **prompts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="an SD1.x checkpoint (default: a random-weight SD1.5)")
    parser.add_argument("--size", type=int, default=512, help="image width and height in px (default 512)")
    parser.add_argument("--steps", type=int, default=4, help="sampling steps (default 4, at least 2)")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "demo", help="where images and logs go")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 to measure seconds per step")

    built = host.run_inside_host(__file__)

    from comfy_server import ComfyServer, ensure_checkpoint

    checkpoint = args.checkpoint.expanduser().resolve() if args.checkpoint else ensure_checkpoint(built.comfyui)
    base = args.out / "comfyui-base"
    shutil.rmtree(base, ignore_errors=True)
    server = ComfyServer(built.comfyui, sys.executable, base, {checkpoint.name: checkpoint})
    print(f"starting ComfyUI (log: {server.log_path})", flush=True)
    results = {}
    with server:
        prompts = _prompts(server.object_info(), checkpoint.name, args.size, args.steps)
        for label, prompt in prompts.items():
            (sampler,) = [k for k, v in prompt.items() if v["class_type"] == "KSampler"]
            print(f"running the example workflow {label} ({args.size}x{args.size} px, {args.steps} steps)", flush=True)
            entry, per_step = _run_timed(server, prompt, sampler)
            results[label] = (per_step, server.images(entry)[0], entry)
    base_time = results["unpatched"][0]
    print(f"\n{'run':<14} {'s/step':>8} {'speed-up':>9}  image")
    for label, (per_step, image, _) in results.items():
        print(f"{label:<14} {per_step:8.3f} {base_time / per_step:8.2f}x  {image}")
    for label in EXAMPLES:
        for output in results[label][2]["outputs"].values():
            if "text" in output:
                print(f"\n{label}, node report: {output['text'][0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
