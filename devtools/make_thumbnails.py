"""Write the template-browser thumbnails of the example workflows: ``example_workflows/<name>.jpg``,
a picture of each graph as ComfyUI's own frontend draws it.

    python3 devtools/make_thumbnails.py                     # every example
    python3 devtools/make_thumbnails.py wan21_t2v_todo      # only those named (without .json)

Serves the pinned ComfyUI with this pack, loads each example in headless Chromium (see
browser.py), fits the view and saves a JPEG. ComfyUI's template browser shows
``<name>.jpg`` beside ``<name>.json`` for custom-node templates.
"""

from __future__ import annotations

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


def main() -> int:
    comfyui = host.run_inside_host(__file__).comfyui
    from PIL import Image
    from playwright.sync_api import sync_playwright

    from browser import Frontend, chromium_path, returning_user
    from comfy_server import ComfyServer

    names = set(sys.argv[1:])
    examples = [path for path in sorted((REPO / "example_workflows").glob("*.json")) if not names or path.stem in names]
    if names - {path.stem for path in examples}:
        raise SystemExit(f"no example named {', '.join(sorted(names - {path.stem for path in examples}))}")
    with tempfile.TemporaryDirectory() as base:
        returning_user(Path(base))
        with ComfyServer(comfyui, sys.executable, Path(base)) as server, sync_playwright() as playwright:
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
