"""The main job on a fresh machine: ``python3 devtools/demo.py``.

Sets up the pinned ComfyUI (cached; the script re-executes itself in the host's Python) and, by
default, samples the two photo fixtures trained here (``devtools/photo_fixtures.py``: ComfyUI's
SD1.5 UNet and Flux.1 classes, trained on photographs; ``devtools/trained/MODEL_CARD.md``) in
this process, as ComfyUI's KSampler samples and VAEDecode decodes, four times each at one seed:
unpatched, with the ToDo node, with the ToMe node and with both (ToDo applied first, closer to the
model, as docs/nodes.md says to stack them on UNets; on DiTs either order gives the same image),
every node at its declared defaults and executed as ComfyUI executes it. For each run it prints
the seconds per image (one untimed warm-up run of each, then ``--repeats`` timed runs, the
configurations interleaved round by round; the median), the speed-up against unpatched and the
LPIPS and PSNR of its image against the unpatched one, then each node's report. It saves every
image and one side-by-side grid per fixture (unpatched | ToDo | ToMe | ToMe + ToDo, each with its
speed-up and LPIPS written under it) as PNG, and the figures as ``results.json``, to ``--out``.

    python3 devtools/demo.py                                  # both fixtures, native size, 8 steps
    python3 devtools/demo.py --fixture sd15 --steps 20 --seed 3 --caption "a cat"

At their defaults the nodes' quality budget (``max_change`` 0.05, docs/quality.md) leaves ToMe
alone on the Flux fixture (merging changes its blocks by 6-10 %) and decides ToDo there block by
block (mostly method window; the report's ``per block`` line says which): ``--max-change 0``
shows what the nodes' own settings do there.

The fixtures are tiny (3-5 M parameters, nine photographs): their speed-ups on a CPU are not GPU
figures (docs/benchmarks.md has those), and on a CPU ``reduce_when auto`` reduces without timing.
The default run takes about 40 s on 2 CPU cores. Where other processes share those cores, torch's
threads wait on each other and it can take ten times as long: ``OMP_NUM_THREADS=1`` avoids that.

With ``--checkpoint`` (your own SD1.x model) or ``--random-checkpoint`` (a random-weight SD1.5
checkpoint: noise, but the full-size UNet) it serves ComfyUI on 127.0.0.1 with this pack in its
custom_nodes, runs the SD1.5 example workflows (``example_workflows/sd15_txt2img_tome.json`` and
``sd15_txt2img_todo.json``) with the ToMe node, with the ToDo node and without either, prints the
seconds per sampling step of each and saves the images.

    python3 devtools/demo.py --checkpoint ~/models/v1-5.safetensors --size 768 --steps 20
    python3 devtools/demo.py --random-checkpoint             # 512 px, 4 steps

``--comfyui PATH`` runs it in that ComfyUI tree with the Python running the script instead of the
pinned host.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "devtools"))

import host  # noqa: E402

EXAMPLES = {"with ToMe": (REPO / "example_workflows" / "sd15_txt2img_tome.json", "TokenReduceToMe"),
            "with ToDo": (REPO / "example_workflows" / "sd15_txt2img_todo.json", "TokenReduceToDo")}

# --- the photo fixtures, in-process (the default) ----------------------------------------------

FIXTURES = ("sd15", "flux")
# What each fixture draws recognisably (photo_fixtures.PHOTOS; MODEL_CARD.md), and its title.
CAPTIONS = {"sd15": "an astronaut", "flux": "a rocket"}
TITLES = {"sd15": "SD1.5 fixture (ComfyUI's SD1.5 UNet class, 3.3 M parameters)",
          "flux": "Flux fixture (ComfyUI's Flux.1 class, 5.1 M parameters)"}
FIXTURE_STEPS, FIXTURE_SEED, FIXTURE_REPEATS = 8, 1, 2
# The runs: label, file name, the nodes applied in order (the first closest to the model).
RUNS = (("unpatched", "unpatched", ()),
        ("ToDo", "todo", ("todo",)),
        ("ToMe", "tome", ("tome",)),
        ("ToMe + ToDo", "tome_todo", ("todo", "tome")))
PACK = "tokenreduce_pack"  # the name the pack is loaded under, as ComfyUI would (devtools/bench)


def _png(image, path: Path) -> None:
    """A ComfyUI IMAGE [1, H, W, 3] in 0..1 as an 8-bit PNG, as SaveImage writes it."""
    from PIL import Image

    array = (image[0].clamp(0, 1) * 255).round().byte().cpu().numpy()
    Image.fromarray(array).save(path)


def _grid(tiles: list, captions: list[list[str]], title: str, path: Path) -> None:
    """The images side by side, a title above and each one's lines of text under it."""
    from PIL import Image, ImageDraw, ImageFont

    try:
        font = ImageFont.load_default(size=14)
    except TypeError:  # Pillow before 10.1: the bitmap font, one size
        font = ImageFont.load_default()
    size, gap, line = tiles[0].shape[2], 8, 18
    top, bottom = line + 2 * gap, len(captions[0]) * line + 2 * gap
    width = len(tiles) * size + (len(tiles) + 1) * gap
    sheet = Image.new("RGB", (width, top + size + bottom), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((gap, gap), title, fill="black", font=font)
    for i, (image, lines) in enumerate(zip(tiles, captions)):
        x = gap + i * (size + gap)
        array = (image[0].clamp(0, 1) * 255).round().byte().cpu().numpy()
        sheet.paste(Image.fromarray(array), (x, top))
        for k, text in enumerate(lines):
            draw.text((x, top + size + gap + k * line), text, fill="black", font=font)
    sheet.save(path)


def _report_lines(patched, sessions_of) -> list[str]:
    describe = importlib.import_module(f"{PACK}.tokenreduce.describe")
    lines = []
    for session in sessions_of(patched):
        if session.last_report is not None:
            lines += describe.run_lines(session.header, session.last_report)
            lines += list(session.last_report.warnings)
    return lines


def _fixture_demo(name: str, env, args) -> dict:
    import torch

    import photo_fixtures as pf
    from quality import metrics

    TOME = importlib.import_module(f"{PACK}.tokenreduce.methods").TOME
    TODO = importlib.import_module(f"{PACK}.tokenreduce.methods").TODO
    budget = {} if args.max_change is None else {"max_change": args.max_change}
    defaults = {"tome": {**TOME.defaults(), **budget}, "todo": {**TODO.defaults(), **budget}}
    fixture = pf.load(name)
    px = args.size or fixture.spec.native_px
    caption = args.caption if args.caption is not None else CAPTIONS[name]
    steps = args.steps or FIXTURE_STEPS
    models = {}
    for label, _, nodes in RUNS:
        model = fixture.patcher
        for node in nodes:
            model = env.appliers[node](model, defaults[node])
        models[label] = model

    def run(label):
        start = time.perf_counter()
        image = pf.sample(fixture, models[label], caption, args.seed, steps, px=px)
        return image, time.perf_counter() - start

    print(f"\n{TITLES[name]}: \"{caption}\", {px}x{px} px, {steps} steps, euler / simple, CFG {pf.CFG[name]:g}, "
          f"seed {args.seed}", flush=True)
    images, seconds, identical = {}, {label: [] for label in models}, {}
    for label in models:  # the warm-up: the image each run makes
        images[label], _ = run(label)
    for _ in range(args.repeats):  # timed, the configurations interleaved round by round
        for label in models:
            image, elapsed = run(label)
            seconds[label].append(elapsed)
            identical[label] = identical.get(label, True) and torch.equal(image, images[label])
    per_image = {label: statistics.median(times) for label, times in seconds.items()}
    base = images["unpatched"]
    rows = []
    for label, file, nodes in RUNS:
        path = args.out / f"{name}_{file}.png"
        _png(images[label], path)
        rows.append({"run": label, "nodes": list(nodes), "seconds": per_image[label], "timed": seconds[label],
                     "speedup": per_image["unpatched"] / per_image[label],
                     "lpips": float(metrics.lpips(images[label], base)[0]),
                     "psnr": float(metrics.psnr(images[label], base)[0]),
                     "rerun_identical": identical[label], "image": str(path),
                     "report": _report_lines(models[label], env.sessions_of) if nodes else []})
    grid = args.out / f"{name}_grid.png"
    _grid([images[label] for label, _, _ in RUNS],
          [[row["run"], f"{row['speedup']:.2f}x ({row['seconds']:.2f} s)",
            f"LPIPS {row['lpips']:.3f}" + (f", PSNR {row['psnr']:.1f} dB" if math.isfinite(row["psnr"]) else "")]
           for row in rows],
          f"{TITLES[name]}: \"{caption}\", {px} px, {steps} steps, seed {args.seed}", grid)
    timed = f"median of {args.repeats} timed run{'s' if args.repeats > 1 else ''} after a warm-up"
    print(f"{'run':<12} {'s/image':>8} {'speed-up':>9} {'LPIPS':>7} {'PSNR':>9}  image   ({timed}; "
          f"LPIPS and PSNR against unpatched, same seed)")
    for row in rows:
        psnr = f"{row['psnr']:6.1f} dB" if math.isfinite(row["psnr"]) else "     inf "
        print(f"{row['run']:<12} {row['seconds']:8.3f} {row['speedup']:8.2f}x {row['lpips']:7.3f} {psnr}  {row['image']}")
    print(f"grid: {grid}")
    spread = [label for label, times in seconds.items() if len(times) > 1 and max(times) > 1.25 * min(times)]
    if spread:
        print(f"note: the timed runs of {', '.join(spread)} differ by more than 25 %: something else was using the "
              f"machine, so these speed-ups are unreliable (the times of each run are in results.json)")
    if not all(identical.values()):
        print("note: a timed rerun did not repeat its warm-up image bit for bit: "
              + ", ".join(label for label, same in identical.items() if not same))
    for row in rows:
        if row["report"]:
            print(f"\n{row['run']}, node report:\n  " + "\n  ".join(row["report"]))
    return {"fixture": name, "caption": caption, "px": px, "steps": steps, "seed": args.seed, "cfg": pf.CFG[name],
            "repeats": args.repeats, "grid": str(grid), "runs": rows}


def fixtures_main(args, comfyui: Path) -> int:
    import torch

    from bench import environment

    env = environment.load(comfyui)
    import comfy.model_management

    args.out.mkdir(parents=True, exist_ok=True)
    device = comfy.model_management.get_torch_device()
    print(f"TokenReduce demo on the photo fixtures trained here (devtools/trained/MODEL_CARD.md), in-process "
          f"with ComfyUI at {comfyui}\n{environment.machine()}; device {device}; every node at its declared "
          f"defaults, executed as ComfyUI executes it", flush=True)
    if env.auto_measures:
        print("reduce_when auto times each kind of call on this device once and reduces only where that is "
              "faster (the report lines below say what it decided; docs/auto-rule.md).")
    else:
        print("On a CPU, reduce_when auto reduces without timing (on a GPU it times each kind of call and "
              "reduces only where that pays: docs/auto-rule.md). The fixtures are tiny models: their speed-ups "
              "on a CPU are not GPU figures (docs/benchmarks.md has those).")
    budget = "the nodes' default" if args.max_change is None else f"{args.max_change:g}"
    print(f"Quality budget max_change {budget}: auto leaves a kind of call alone where reducing it changes its "
          f"block's output by more (on every device; the reports say which and by how much). On the Flux fixture "
          f"the default leaves ToMe's blocks alone and decides ToDo per block (mostly method window); "
          f"--max-change 0 shows what the nodes' own settings do there.")
    _say_each_warning_once()
    names = FIXTURES if args.fixture == "both" else (args.fixture,)
    started = time.perf_counter()
    results = [_fixture_demo(name, env, args) for name in names]
    summary = {"machine": environment.machine(), "device": str(device), "torch": torch.__version__,
               "auto_measures": env.auto_measures, "fixtures": results}
    (args.out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{time.perf_counter() - started:.0f} s of sampling and metrics; images, grids and results.json "
          f"in {args.out}")
    return 0


def _say_each_warning_once() -> None:
    """The demo runs each node several times (a warm-up, the timed repeats): a run's warning (auto
    left everything alone, say) is printed the first time, not once a run; the reports repeat it."""
    import logging

    said = set()

    def first_time(record) -> bool:
        message = record.getMessage()
        if message in said:
            return False
        said.add(message)
        return True

    logging.getLogger("tokenreduce").addFilter(first_time)


# --- a checkpoint through a ComfyUI server (--checkpoint, --random-checkpoint) -----------------

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


def server_main(args, comfyui: Path) -> int:
    from comfy_server import ComfyServer, ensure_checkpoint

    checkpoint = args.checkpoint.expanduser().resolve() if args.checkpoint else ensure_checkpoint(comfyui)
    base = args.out / "comfyui-base"
    shutil.rmtree(base, ignore_errors=True)
    server = ComfyServer(comfyui, sys.executable, base, {checkpoint.name: checkpoint})
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixture", choices=(*FIXTURES, "both"), default=None,
                        help="which photo fixture to sample (default both)")
    parser.add_argument("--caption", help="the caption for every fixture (default: 'an astronaut' on sd15, "
                                          "'a rocket' on flux; the words of photo_fixtures.VOCABULARY)")
    parser.add_argument("--seed", type=int, default=None, help=f"the fixtures' seed (default {FIXTURE_SEED})")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed runs of each configuration after its warm-up (default {FIXTURE_REPEATS})")
    parser.add_argument("--checkpoint", type=Path,
                        help="an SD1.x checkpoint: run the example workflows on it through a ComfyUI server")
    parser.add_argument("--random-checkpoint", action="store_true",
                        help="the same with a random-weight SD1.5 checkpoint (the demo before the fixtures: noise)")
    parser.add_argument("--size", type=int, help="image width and height in px (default: each fixture's native "
                                                 "size, 256 sd15 and 512 flux; 512 with a checkpoint)")
    parser.add_argument("--steps", type=int, help=f"sampling steps (default {FIXTURE_STEPS}; "
                                                  "4 with a checkpoint, at least 2)")
    parser.add_argument("--max-change", type=float, default=None,
                        help="both nodes' quality budget on the fixtures (default: the nodes' own, 0.05, which leaves "
                             "the Flux fixture's blocks alone; 0: no budget, to see what the reduction does there)")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "demo", help="where images and logs go")
    parser.add_argument("--comfyui", type=Path, help="a ComfyUI tree to run in, with this Python (default: the "
                                                     "pinned host)")
    args = parser.parse_args()
    served = args.checkpoint is not None or args.random_checkpoint
    if args.checkpoint is not None and args.random_checkpoint:
        parser.error("--checkpoint and --random-checkpoint exclude each other")
    if served:
        given = [flag for flag, value in (("--fixture", args.fixture), ("--caption", args.caption),
                                          ("--seed", args.seed), ("--repeats", args.repeats)) if value is not None]
        if given:
            parser.error(f"{', '.join(given)}: only for the photo fixtures, not with a checkpoint")
        args.size = args.size or 512
        args.steps = args.steps or 4
        if args.steps < 2:
            parser.error("--steps must be at least 2 to measure seconds per step")
    else:
        args.fixture = args.fixture or "both"
        args.seed = FIXTURE_SEED if args.seed is None else args.seed
        args.repeats = FIXTURE_REPEATS if args.repeats is None else args.repeats
        if args.repeats < 1:
            parser.error("--repeats must be at least 1")
        if args.steps is not None and args.steps < 1:
            parser.error("--steps must be at least 1")
        if args.size is not None and (args.size < 64 or args.size % 16):
            parser.error("--size must be a multiple of 16, at least 64 (LPIPS needs 31 px, the UNet three halvings)")
    args.out = args.out.expanduser().resolve()

    if args.comfyui is None:
        comfyui = host.run_inside_host(__file__).comfyui
    else:
        comfyui = args.comfyui.expanduser().resolve()
    if served:
        return server_main(args, comfyui)
    if args.caption is not None:
        import photo_fixtures

        try:
            photo_fixtures.token_ids(args.caption)
        except ValueError as problem:
            parser.error(str(problem))
    return fixtures_main(args, comfyui)


if __name__ == "__main__":
    sys.exit(main())
