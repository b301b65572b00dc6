"""Write the template-browser thumbnails of the example workflows: ``example_workflows/<name>.jpg``,
a picture of each graph as ComfyUI's own frontend draws it.

    python3 devtools/make_thumbnails.py                     # every example
    python3 devtools/make_thumbnails.py wan21_t2v_todo      # only those named (without .json)
    python3 devtools/make_thumbnails.py --comfyui ~/hosts/comfyui-0.33.0 \
        --python ~/hosts/venv-0.33/bin/python ltx2_t2v_audio_todo   # on another ComfyUI tree

Serves the pinned ComfyUI with this pack (or, with ``--comfyui``, that tree with its own Python:
``--python``, by default as devtools/run_tests.py finds it), loads each example in headless
Chromium (see browser.py), fits the view and saves a JPEG. ComfyUI's template browser shows
``<name>.jpg`` beside ``<name>.json`` for custom-node templates. An example whose nodes only a
newer ComfyUI has (make_examples.NEEDS) is drawn on such a tree: on the pinned one
its nodes would be drawn as missing.

The A/B examples of SD1.5 and Flux.1 (make_examples.AB_EXAMPLES) show instead what the graph
makes, on the trained photo fixture of the same model class (photo_fixtures.py; ``FIXTURE_OF``):
A unpatched and B through ToDo at its defaults from one seed, sampled in this process as KSampler
samples and VAEDecode decodes, and the compare node's heat map and figures, run as ComfyUI runs
it; the picture says whose images they are. The SDXL and Wan A/B examples have no fixture of
their class (a fixture of another class would show a reduction their graphs do not make: ToDo
reduces SDXL at downsample 2 and Wan's video tokens): theirs are pictures of the graph, as the
other examples'. About 20 s of CPU for the two.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "devtools"))

import host  # noqa: E402

SIZE = (640, 400)  # at most; the graph's own aspect is kept
VIEWPORT = {"width": 1920, "height": 1200}  # large enough that fitting the graph keeps its text legible
# Where the examples' loaders look for their files. Each model file an example names is put in
# each of these folders of the server's throwaway models folder as an empty stand-in: newer
# frontends (ComfyUI 0.33's 1.49) outline a loader whose file the server lacks in red.
MODEL_FOLDERS = ("checkpoints", "diffusion_models", "text_encoders", "vae", "loras")
MODEL_FILES = (".safetensors", ".ckpt", ".pt", ".pth", ".gguf", ".sft")
# A/B family -> the trained photo fixture of its model class, and the model the example loads.
FIXTURE_OF = {"sd15": ("sd15", "SD1.5"), "flux": ("flux", "Flux.1 [dev]")}
TILE, GAP, LINE, FONT_SIZE = 200, 8, 17, 13  # the A/B picture: three tiles and lines of text


def _wrapped(draw, font, text: str, width: int) -> list[str]:
    """``text`` in lines no wider than ``width`` pixels, broken between words."""
    lines = [""]
    for word in text.split():
        candidate = f"{lines[-1]} {word}".strip()
        if lines[-1] and draw.textlength(candidate, font=font) > width:
            lines.append(word)
        else:
            lines[-1] = candidate
    return lines


def ab_picture(tiles: list, labels: list[list[str]], header: str, footer: str, path: Path) -> None:
    """Three IMAGE tensors side by side at ``TILE`` px, each with its label lines under it, a
    header above and a footer below (wrapped to the width): a JPEG at ``path``."""
    from PIL import Image, ImageDraw, ImageFont

    try:
        font = ImageFont.truetype("DejaVuSans.ttf", FONT_SIZE)  # has the report's ∞, Pillow's own font not
    except OSError:
        font = ImageFont.load_default(size=FONT_SIZE)
    width = len(tiles) * TILE + (len(tiles) + 1) * GAP
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    top = _wrapped(measure, font, header, width - 2 * GAP)
    bottom = _wrapped(measure, font, footer, width - 2 * GAP)
    label_rows = max(len(lines) for lines in labels)
    tiles_y = GAP + len(top) * LINE + GAP
    footer_y = tiles_y + TILE + GAP + label_rows * LINE + GAP
    sheet = Image.new("RGB", (width, footer_y + len(bottom) * LINE + GAP), "white")
    draw = ImageDraw.Draw(sheet)
    for row, text in enumerate(top):
        draw.text((GAP, GAP + row * LINE), text, fill="black", font=font)
    for i, (image, lines) in enumerate(zip(tiles, labels)):
        x = GAP + i * (TILE + GAP)
        array = (image[0].clamp(0, 1) * 255).round().byte().cpu().numpy()
        sheet.paste(Image.fromarray(array).resize((TILE, TILE), Image.Resampling.LANCZOS), (x, tiles_y))
        for row, text in enumerate(lines):
            draw.text((x, tiles_y + TILE + GAP + row * LINE), text, fill="black", font=font)
    for row, text in enumerate(bottom):
        draw.text((GAP, footer_y + row * LINE), text, fill="#333", font=font)
    sheet.save(path, quality=90)


def fixture_thumbnail(family: str, comfyui: Path, path: Path) -> None:
    """The A/B example of ``family`` as its graph runs it, on the trained photo fixture of its model
    class (``FIXTURE_OF``), at the fixture's native size, the demo's caption, steps and seed."""
    import importlib

    import demo
    import photo_fixtures
    from bench import PACK, environment

    env = environment.load(comfyui)
    todo_defaults = importlib.import_module(f"{PACK}.tokenreduce.methods").TODO.defaults()
    compare_node = importlib.import_module(f"{PACK}.nodes.compare_node")
    describe = importlib.import_module(f"{PACK}.tokenreduce.describe")
    name, model = FIXTURE_OF[family]
    fixture = photo_fixtures.load(name)
    todo = env.appliers["todo"](fixture.patcher, todo_defaults)
    caption, steps, seed = demo.CAPTIONS[name], demo.FIXTURE_STEPS, demo.FIXTURE_SEED
    a, b = (photo_fixtures.sample(fixture, patcher, caption, seed, steps) for patcher in (fixture.patcher, todo))
    heat_map, report = compare_node.ImageCompareNode.execute(a, b).result
    (session,) = env.sessions_of(todo)
    said = [line for line in describe.run_lines(session.header, session.last_report, timing=False)[1:]
            if not line.startswith("ds ")]  # what auto decided and in which steps ToDo acted
    figures = report.splitlines()[0].removeprefix("image 1: ")
    header = (f"Not {model}: its graph run on the {demo.TITLES[name]}, trained here on photographs; "
              f"\"{caption}\", {fixture.spec.native_px} px, {steps} steps, seed {seed}, on a CPU.")
    footer = (f"ToDo's report: {'; '.join(said)}. Image Compare (TokenReduce): {figures}. On your model its "
              f"figures and both sampling times are in the run's reports (the graph's Note says where).")
    ab_picture([a, b, heat_map], [["A: unpatched"], ["B: ToDo at its defaults"],
                                  [f"where they differ (gain {compare_node.GAIN_DEFAULT:g})"]],
               header, footer, path)


def stand_in_models(base: Path, flows: list[dict]) -> None:
    """Empty files under ``base/models`` named as the model files these workflows load."""
    files = {value for flow in flows for node in flow["nodes"] for value in node.get("widgets_values") or []
             if isinstance(value, str) and value.endswith(MODEL_FILES)}
    for folder in MODEL_FOLDERS:
        (base / "models" / folder).mkdir(parents=True, exist_ok=True)
        for name in files:
            (base / "models" / folder / name).touch()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="examples to draw (file names without .json; default: all)")
    parser.add_argument("--comfyui", type=Path, help="a ComfyUI tree to serve (default: the pinned host)")
    parser.add_argument("--python", help="that tree's Python (default: its venv, else this Python)")
    args = parser.parse_args()
    if args.python and not args.comfyui:
        parser.error("--python goes with --comfyui")
    pinned = host.run_inside_host(__file__)  # this script's own tools (Playwright, Pillow) live there
    from PIL import Image
    from playwright.sync_api import sync_playwright

    import make_examples
    from browser import Frontend, chromium_path, returning_user
    from comfy_server import ComfyServer
    from run_tests import _python_of

    if args.comfyui is None:
        comfyui, python = pinned.comfyui, sys.executable
    else:
        comfyui = args.comfyui.expanduser().resolve()
        python = _python_of(comfyui, str(Path(args.python).expanduser()) if args.python else None)
    names = set(args.names)
    examples = [path for path in sorted((REPO / "example_workflows").glob("*.json")) if not names or path.stem in names]
    if names - {path.stem for path in examples}:
        raise SystemExit(f"no example named {', '.join(sorted(names - {path.stem for path in examples}))}")
    from_fixtures = {make_examples.AB_EXAMPLES[family].name: family for family in FIXTURE_OF}
    for path in [path for path in examples if path.stem in from_fixtures]:
        fixture_thumbnail(from_fixtures[path.stem], comfyui, path.with_suffix(".jpg"))
        print("wrote", path.with_suffix(".jpg").relative_to(REPO), "from the trained photo fixture")
    examples = [path for path in examples if path.stem not in from_fixtures]
    if not examples:
        return 0
    with tempfile.TemporaryDirectory() as base:
        returning_user(Path(base))
        stand_in_models(Path(base), [json.loads(path.read_text()) for path in examples])
        with ComfyServer(comfyui, python, Path(base)) as server, sync_playwright() as playwright:
            known = set(server.object_info())
            lacking = {path: f"{path.stem}: {reason}" for path in examples
                       if (reason := make_examples.lacking_nodes(path.name, known.__contains__))}
            if lacking and names:  # drawn here, its nodes would be missing-node boxes: refuse rather than write that
                raise SystemExit("\n".join(lacking.values()))
            for path, reason in lacking.items():  # every example asked for: those are left as they are
                print("left", path.with_suffix(".jpg").relative_to(REPO), "as it is:", reason)
            examples = [path for path in examples if path not in lacking]
            chromium = playwright.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
            page = chromium.new_page(viewport=VIEWPORT)
            ui = Frontend(page, server.url).open()
            ui.evaluate("() => app.extensionManager.setting.set('Comfy.Minimap.Visible', false)")
            for path in examples:
                ui.evaluate("(flow) => app.loadGraphData(flow)", json.loads(path.read_text()))
                ui.fit_view()
                page.wait_for_timeout(500)
                shot = Image.open(io.BytesIO(ui.screenshot_of_nodes())).convert("RGB")
                shot.thumbnail(SIZE)
                target = path.with_suffix(".jpg")
                shot.save(target, quality=85)
                print("wrote", target.relative_to(REPO))
            chromium.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
