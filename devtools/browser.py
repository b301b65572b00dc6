"""Drive the real ComfyUI frontend in headless Chromium (Playwright), as a user would: used by
the browser tests and by ``make_thumbnails.py``.

Playwright cannot download its own browser here, so it drives the system's Chromium
(Debian's ``chromium`` package); ``chromium_path()`` installs it with apt-get when it is missing
and this process may (root), and otherwise says how.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
OUR_EXTENSION = "TokenReduce.NodeOverlay"
PACK_TEMPLATES = "ComfyUI-TokenReduce"  # the pack's folder name, under which the template browser lists it
# Records every string drawn on a canvas, so tests can tell what the overlay actually drew.
RECORD_CANVAS_TEXT = """
(() => {
  const fillText = CanvasRenderingContext2D.prototype.fillText;
  window.__drawnTexts = new Set();
  CanvasRenderingContext2D.prototype.fillText = function (text, ...rest) {
    window.__drawnTexts.add(String(text));
    return fillText.call(this, text, ...rest);
  };
})();
"""


def chromium_path() -> str:
    """The system Chromium; installed with apt-get (Debian's ``chromium``) if missing and root."""
    explicit = os.environ.get("TOKENREDUCE_CHROMIUM")
    if explicit:
        return explicit
    found = next((shutil.which(name) for name in CANDIDATES if shutil.which(name)), None)
    if found:
        return found
    if shutil.which("apt-get") and hasattr(os, "geteuid") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", "chromium"]
        if subprocess.run(install, env=env).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, check=True)
            subprocess.run(install, env=env, check=True)
        found = shutil.which("chromium")
        if found:
            return found
    raise RuntimeError("The browser tests need Chromium: install Debian's `chromium` package (apt-get install "
                       "chromium) or set TOKENREDUCE_CHROMIUM to a Chromium or Chrome executable.")


def returning_user(base: Path) -> None:
    """Settings of a user who has used ComfyUI before (written before the server starts): no
    first-run template dialog over the canvas."""
    settings = base / "user" / "default" / "comfy.settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    current = json.loads(settings.read_text()) if settings.exists() else {}
    settings.write_text(json.dumps({**current, "Comfy.TutorialCompleted": True}))


class Frontend:
    """One page of the ComfyUI frontend, with the steps a user takes."""

    def __init__(self, page, url: str):
        self.page = page
        self.url = url
        self.responses: dict[str, int] = {}  # path -> HTTP status of what the page fetched
        page.on("response", lambda response: self.responses.__setitem__(
            response.url.removeprefix(url), response.status))

    def open(self) -> "Frontend":
        self.page.add_init_script(RECORD_CANVAS_TEXT)
        self.page.goto(self.url)
        self.page.wait_for_function(
            f"window.app?.graph && window.app.extensionManager?.setting && "
            f"window.app.extensions?.some(e => e.name === {json.dumps(OUR_EXTENSION)})", timeout=180_000)
        return self

    def evaluate(self, script: str, arg=None):
        return self.page.evaluate(script, arg)

    # --- workflows ------------------------------------------------------------------------
    def open_templates(self):
        """The template browser, on this pack's category; returns the dialog."""
        self.page.get_by_role("button", name="Templates").click()
        dialog = self.page.get_by_role("dialog").filter(has=self.page.get_by_text(PACK_TEMPLATES, exact=True))
        dialog.get_by_text(PACK_TEMPLATES, exact=True).click()
        return dialog

    def thumbnails(self, dialog, names: list[str], timeout_ms: int = 30_000) -> dict[str, int]:
        """Natural width of the picture on each template's card (0: none loaded within the
        timeout). The browser fetches thumbnails itself and shows them as blob URLs, so the
        picture is found by its card's title."""
        widths = """(names) => Object.fromEntries(names.map(name => {
            let card = [...document.querySelectorAll('[role=dialog] *')]
                .find(e => e.children.length === 0 && e.textContent.trim() === name);
            while (card && card.querySelectorAll('img').length === 0) card = card.parentElement;
            const images = card ? card.querySelectorAll('img') : [];
            return [name, images.length === 1 && images[0].complete ? images[0].naturalWidth : 0];
        }))"""
        for name in names:
            dialog.get_by_text(name, exact=True).first.wait_for()
        try:
            self.page.wait_for_function(f"(names) => Object.values(({widths})(names)).every(w => w > 0)",
                                        arg=names, timeout=timeout_ms)
        except Exception:  # noqa: BLE001 - the caller asserts on the widths it gets
            pass
        return self.evaluate(widths, names)

    def load_template(self, name: str) -> None:
        """Load one of this pack's example workflows through the template browser."""
        dialog = self.open_templates()
        dialog.get_by_text(name, exact=True).first.click()
        self.page.wait_for_function("() => app.graph.nodes.some(n => n.type?.startsWith('TokenReduce'))")
        dialog.wait_for(state="hidden")

    def set_widget(self, node_id: int, name: str, value) -> None:
        self.evaluate("""([id, name, value]) => {
            const widget = app.graph.getNodeById(id).widgets.find(w => w.name === name);
            widget.value = value;
            widget.callback?.(value);
        }""", [node_id, name, value])

    def widget_values(self, node_id: int) -> list:
        """What the node's widgets hold now (``widgets_values`` is only what was loaded)."""
        return self.evaluate("(id) => app.graph.getNodeById(id).widgets.map(w => w.value)", node_id)

    def exported(self) -> dict:
        """The workflow as Save / Export write it."""
        return self.evaluate("async () => (await app.graphToPrompt()).workflow")

    def run(self) -> None:
        """Queue the workflow with the Run button."""
        self.page.get_by_role("button", name="Run", exact=True).click()

    def fit_view(self) -> None:
        self.page.get_by_role("button", name="Fit View (.)").click()

    def screenshot_of_nodes(self, node_ids: list[int] | None = None, below: int = 0, margin: int = 16,
                            path: Path | None = None) -> bytes:
        """A PNG of the page around these nodes (all by default, titles included), with
        ``below`` graph units more under them (room for the overlay)."""
        box = self.evaluate("""([ids, below]) => {
            const nodes = ids ? ids.map(id => app.graph.getNodeById(id)) : app.graph.nodes;
            const left = Math.min(...nodes.map(n => n.pos[0]));
            const right = Math.max(...nodes.map(n => n.pos[0] + n.size[0]));
            const top = Math.min(...nodes.map(n => n.pos[1] - LiteGraph.NODE_TITLE_HEIGHT));
            const bottom = Math.max(...nodes.map(n => n.pos[1] + n.size[1])) + below;
            const [x0, y0] = app.canvas.ds.convertOffsetToCanvas([left, top]);
            const [x1, y1] = app.canvas.ds.convertOffsetToCanvas([right, bottom]);
            const rect = app.canvas.canvas.getBoundingClientRect();
            return {x: rect.left + x0, y: rect.top + y0, width: x1 - x0, height: y1 - y0};
        }""", [node_ids, below])
        clip = {"x": box["x"] - margin, "y": box["y"] - margin,
                "width": box["width"] + 2 * margin, "height": box["height"] + 2 * margin}
        return self.page.screenshot(clip=clip, path=str(path) if path else None)

    # --- the overlay ----------------------------------------------------------------------
    def overlay(self, node_id: int) -> dict | None:
        return self.evaluate("(id) => app.graph.getNodeById(id).tokenreduce ?? null", node_id)

    def wait_for_overlay(self, node_id: int, condition: str, timeout_ms: int = 900_000) -> dict:
        """Wait until the node's overlay state satisfies ``condition`` (a JS expression over
        ``state``, e.g. ``state.lines.length >= 3``)."""
        self.page.wait_for_function(f"""(id) => {{
            const state = app.graph.getNodeById(id).tokenreduce;
            return Boolean(state && ({condition}));
        }}""", arg=node_id, timeout=timeout_ms)
        return self.overlay(node_id)

    def drawn_texts(self) -> list[str]:
        """Every string the canvas draws in one full redraw."""
        return self.evaluate("""() => {
            window.__drawnTexts.clear();
            app.canvas.draw(true, true);
            return [...window.__drawnTexts];
        }""")

    def set_overlay_setting(self, shown: bool) -> None:
        """Flip the pack's setting in ComfyUI's settings dialog, as a user does."""
        self.page.keyboard.press("Control+Comma")
        dialog = self.page.get_by_role("dialog").filter(has=self.page.get_by_placeholder("Search Settings..."))
        dialog.get_by_text("TokenReduce", exact=True).click()
        switch = dialog.get_by_role("switch")
        if switch.is_checked() != shown:
            switch.click()
        self.page.wait_for_function(f"app.extensionManager.setting.get('TokenReduce.Overlay.Show') === {json.dumps(shown)}")
        self.page.keyboard.press("Escape")
        dialog.wait_for(state="hidden")
