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
