"""Drive the real ComfyUI frontend in headless Chromium (Playwright), as a user would: used by
the browser tests and by ``make_thumbnails.py``.

Playwright cannot download its own browser here, so it drives the system's Chromium
(Debian's ``chromium`` package); ``chromium_path()`` installs it with apt-get when it is missing
and this process may (root), and otherwise says how.

The frontend changes from release to release (``devtools/frontends.py`` serves several of them),
so each step uses what has stayed put: a user's control found by a precise locator (the Run
button's ``data-testid``, a dialog told apart by what it holds), then the frontend's own command
(``app.extensionManager.command.execute``) when the control is not there; the page is read
through ``app``/``LiteGraph``. Two node renderers: ``classic`` (the LiteGraph canvas, where our
report is drawn under the node) and ``vue`` ("Modern Node Design", Nodes 2.0: nodes are DOM
elements and our report is a DOM widget inside the node).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
OUR_EXTENSION = "TokenReduce.NodeOverlay"
PACK_TEMPLATES = "ComfyUI-TokenReduce"  # the pack's folder name, under which the template browser lists it
CLASSIC, VUE = "classic", "vue"  # node renderers: the LiteGraph canvas, and Nodes 2.0 (Vue components)
MODES = (CLASSIC, VUE)
VUE_NODES_SETTING = "Comfy.VueNodes.Enabled"
LOCALE_SETTING = "Comfy.Locale"  # the UI language: en, zh, ja, ko, ...
OVERLAY_SETTING = "TokenReduce.Overlay.Show"
OVERLAY_SETTING_NAME = "Show what TokenReduce did on its nodes"
REPORT_CLASS = "tokenreduce-report"  # our report's element in Nodes 2.0 (js/tokenreduce.js)
REPORT_WIDGET = "tokenreduce_report"  # the DOM widget that holds it
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


def _may_apt() -> bool:
    return bool(shutil.which("apt-get")) and hasattr(os, "geteuid") and os.geteuid() == 0


def _apt_install(*packages: str, check: bool = True) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", *packages]
    if subprocess.run(install, env=env).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, check=check)
        subprocess.run(install, env=env, check=check)


def chromium_path() -> str:
    """The system Chromium; installed with apt-get (Debian's ``chromium``) if missing and root.
    Also a font with Chinese, Japanese and Korean glyphs (Debian's ``fonts-wqy-microhei``, 5 MB)
    where there is none, so that screenshots of a translated UI show text, not boxes."""
    explicit = os.environ.get("TOKENREDUCE_CHROMIUM")
    if explicit:
        return explicit
    if _may_apt() and shutil.which("fc-list") and not subprocess.run(
            ["fc-list", ":lang=zh"], capture_output=True, text=True).stdout.strip():
        _apt_install("fonts-wqy-microhei", check=False)  # screenshots only: the tests read text, not pixels
    found = next((shutil.which(name) for name in CANDIDATES if shutil.which(name)), None)
    if found:
        return found
    if _may_apt():
        _apt_install("chromium", "fonts-wqy-microhei")
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


def save_user_setting(url: str, key: str, value) -> None:
    """Store one of the user's settings on the server (what the page reads when it loads)."""
    import requests

    requests.post(f"{url}/settings/{key}", json=value, timeout=30).raise_for_status()


class Unsupported(Exception):
    """This frontend lacks what was asked of it (e.g. Nodes 2.0)."""


class Frontend:
    """One page of the ComfyUI frontend, with the steps a user takes, in one node renderer."""

    def __init__(self, page, url: str, mode: str = CLASSIC):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.page = page
        self.url = url
        self.mode = mode
        self.responses: dict[str, int] = {}  # path -> HTTP status of what the page fetched
        self._recording = False
        page.on("response", lambda response: self.responses.__setitem__(
            response.url.removeprefix(url), response.status))

    def open(self) -> "Frontend":
        """Load the page in this renderer (the setting is stored before the page loads, as for a
        user who switched it earlier). Raises ``Unsupported`` for Nodes 2.0 on a frontend
        without it."""
        save_user_setting(self.url, VUE_NODES_SETTING, self.mode == VUE)
        if not self._recording:
            self.page.add_init_script(RECORD_CANVAS_TEXT)  # on every later load of the page too
            self._recording = True
        self.page.goto(self.url)
        self.page.wait_for_function(
            f"window.app?.graph && window.app.extensionManager?.setting && "
            f"window.app.extensions?.some(e => e.name === {json.dumps(OUR_EXTENSION)})", timeout=180_000)
        if self.mode == VUE and not self.has_setting(VUE_NODES_SETTING):
            raise Unsupported(f"this frontend has no Nodes 2.0 (no setting {VUE_NODES_SETTING})")
        self.page.wait_for_function(f"(LiteGraph.vueNodesMode === true) === {json.dumps(self.mode == VUE)}")
        return self

    def switch_mode(self, mode: str) -> None:
        """Turn Nodes 2.0 on or off in the open page (the setting a user flips)."""
        self.evaluate("([key, on]) => app.extensionManager.setting.set(key, on)", [VUE_NODES_SETTING, mode == VUE])
        self.page.wait_for_function(f"(LiteGraph.vueNodesMode === true) === {json.dumps(mode == VUE)}")
        self.mode = mode
        self.page.wait_for_timeout(300)  # the other renderer takes over on the next frames
        self.settle()

    def has_setting(self, key: str) -> bool:
        return self.evaluate("(key) => Boolean(app.extensionManager.setting.settings?.[key])", key)

    def command(self, command_id: str) -> None:
        """Start one of the frontend's commands (what its buttons, menus and keys run). Not
        awaited: some only settle when the dialog they open is closed."""
        self.evaluate("(id) => { app.extensionManager.command.execute(id); }", command_id)

    def _click_if_there(self, locator, timeout_ms: int = 2_000) -> bool:
        """Click the control if exactly one is shown (within a short wait); False otherwise."""
        try:
            locator.first.wait_for(state="visible", timeout=timeout_ms)
        except Exception:  # noqa: BLE001 - not in this frontend: the caller falls back
            return False
        if locator.count() != 1:
            return False
        locator.click()
        return True

    def evaluate(self, script: str, arg=None):
        return self.page.evaluate(script, arg)

    # --- workflows ------------------------------------------------------------------------
    def open_templates(self):
        """The template browser, on this pack's category; returns the dialog."""
        if not self._click_if_there(self.page.get_by_role("button", name="Templates", exact=True), timeout_ms=5_000):
            self.command("Comfy.BrowseTemplates")
        dialog = self.page.get_by_role("dialog").filter(has=self.page.get_by_text(PACK_TEMPLATES, exact=True))
        dialog.get_by_text(PACK_TEMPLATES, exact=True).click()
        return dialog

    def thumbnails(self, dialog, names: list[str], timeout_ms: int = 120_000, attempts: int = 3) -> dict[str, object]:
        """Natural width of the picture on each template's card, or what the card shows instead
        (a string: no picture, two pictures, one not loaded). The browser fetches thumbnails
        itself and shows them as blob URLs, so the picture is found by its card's title. Each
        card is scrolled into view first: the dialog loads a card's picture only once it is
        shown (more cards than fit in it). The title goes to the bottom of the dialog's scrolled
        area, so that the picture above it is inside that area too: 1.49's cards load their
        picture only once a tenth of it is visible there (its LazyImage); a title scrolled in
        just far enough, at the area's top edge, left the picture above the edge, never loaded.

        A card that has not shown its picture within its share of the timeout is hidden for a
        second and shown again, up to ``attempts`` times. The frontends' LazyImage shares one
        cached blob between a card's mounts; when the dialog re-renders a card while its
        picture loads, the new mount can get a URL the old one has just revoked: the picture
        fails, the card shows the fallback beside the broken one, and it retries only once it
        has left the view, which a card kept in view never does (CI of stops 56 and 58: three
        cards at 0 for 120 s each, while they loaded in 3 s in a run alone). Hidden, the card
        has left the view: its picture is released and fetched again when it is shown."""
        title = """((name) => [...document.querySelectorAll('[role=dialog] *')]
            .find(e => e.children.length === 0 && e.textContent.trim() === name))"""
        card = f"""((name) => {{
            let card = {title}(name);
            while (card && card.querySelectorAll('img').length === 0) card = card.parentElement;
            return card; }})"""
        widths = f"""(names) => Object.fromEntries(names.map(name => {{
            const card = {card}(name);
            if (!card) return [name, 'no card or no picture'];
            const images = [...card.querySelectorAll('img')];
            if (images.length !== 1) return [name, `${{images.length}} pictures`];
            return [name, images[0].complete ? images[0].naturalWidth || 'broken' : 'loading'];
        }}))"""
        scroll_to = f"((name) => {title}(name)?.scrollIntoView({{block: 'end', inline: 'nearest'}}))"
        found = {}
        for name in names:
            # The widths are those of the evaluation that saw them loaded: a second read after a
            # successful wait found two cards at 0 (CI of stop 54 and once here, in 15 s, so no
            # wait had timed out): the dialog can swap a card's picture between two reads. The
            # title is scrolled into view at every poll, not once: the dialog can reorder its
            # cards after the scroll (CI of stop 56, and 1 in 5 here on 1.32.9: the first card
            # scrolled to, moved to the grid's last row out of view, its picture never loaded).
            for attempt in range(attempts):
                dialog.get_by_text(name, exact=True).first.wait_for()
                if attempt:  # the card leaves the view and comes back: its picture starts anew
                    self.evaluate(f"async (name) => {{ const card = {card}(name); if (!card) return; "
                                  "card.style.display = 'none'; await new Promise(r => setTimeout(r, 1000)); "
                                  "card.style.display = ''; }", name)
                try:
                    loaded = self.page.wait_for_function(
                        f"(names) => {{ {scroll_to}(names[0]); const w = ({widths})(names); "
                        "return Object.values(w).every(v => v > 0) ? w : false; }",
                        arg=[name], timeout=timeout_ms // attempts, polling=250)
                    found.update(loaded.json_value())
                    break
                except Exception:  # noqa: BLE001 - the caller asserts on the widths it gets
                    found.update(self.evaluate(widths, [name]))
        return found

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
        """What the node's saved widgets hold now (``widgets_values`` is only what was loaded);
        widgets that are never saved (our report in Nodes 2.0) are left out."""
        return self.evaluate("(id) => app.graph.getNodeById(id).widgets.filter(w => w.serialize !== false)"
                             ".map(w => w.value)", node_id)

    def exported(self) -> dict:
        """The workflow as Save / Export write it."""
        return self.evaluate("async () => (await app.graphToPrompt()).workflow")

    def run(self) -> None:
        """Queue the workflow with the Run button (found by its test id: from 1.49 its mode menu
        is a second button named "Run"), or with the command that button runs where there is
        no such button. Returns once the page has posted the prompt; a click that posted
        nothing (it met the button while the page re-rendered it) is made once more."""
        def posted_prompt(request) -> bool:
            return request.method == "POST" and request.url.split("?")[0].endswith("/prompt")

        for attempt in range(2):
            try:
                with self.page.expect_request(posted_prompt, timeout=20_000):
                    if not (self._click_if_there(self.page.get_by_test_id("queue-button"))
                            or self._click_if_there(self.page.get_by_role("button", name="Run", exact=True),
                                                    timeout_ms=500)):
                        self.command("Comfy.QueuePrompt")
                return
            except Exception as error:  # noqa: BLE001 - Playwright's timeout: nothing was posted
                if attempt or "Timeout" not in type(error).__name__:
                    raise AssertionError("Run posted no prompt to the server") from error
                print("Run: the click posted no prompt within 20 s; clicking again")

    def fit_view(self) -> None:
        """Fit the whole graph into the view (the frontend's Fit View command)."""
        self.command("Comfy.Canvas.FitView")
        self.settle()

    def look_at(self, node_id: int) -> None:
        """Bring a node into view, its text legible. Classic canvas: fit the whole graph (the
        canvas draws text at any zoom). Nodes 2.0: zoom 1, the node at the top of the window,
        centred (zoomed out as far as Fit View goes here, 1.32 hides the text of Vue nodes:
        its LOD)."""
        if self.mode == CLASSIC:
            self.fit_view()
            return
        self.evaluate("""(id) => {
            const canvas = app.canvas, node = app.graph.getNodeById(id);
            const width = canvas.canvas.getBoundingClientRect().width;
            canvas.ds.scale = 1;
            canvas.ds.offset = [width / 2 - node.pos[0] - node.size[0] / 2,
                                2 * LiteGraph.NODE_TITLE_HEIGHT + 60 - node.pos[1]];
            canvas.setDirty(true, true);
        }""", node_id)
        self.page.wait_for_timeout(300)  # the view's transform reaches the Vue layer on the next frames
        self.settle()

    def settle(self) -> None:
        """Let the page draw what has changed (two animation frames; Vue renders in between)."""
        self.evaluate("""() => new Promise(done => {
            requestAnimationFrame(() => requestAnimationFrame(done));
            setTimeout(done, 2000);  // no frames (a page in the background): do not wait forever
        })""")

    def screenshot_of_nodes(self, node_ids: list[int] | None = None, below: int = 0, margin: int = 16,
                            path: Path | None = None) -> bytes:
        """A PNG of the page around these nodes (all by default, titles included), with
        ``below`` graph units more under them (room for the overlay on the classic canvas)."""
        if self.mode == VUE:
            return self._screenshot_of_vue_nodes(node_ids, margin, path)
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

    def _screenshot_of_vue_nodes(self, node_ids, margin, path) -> bytes:
        self.settle()
        box = self.evaluate("""(ids) => {
            const rects = (ids ?? app.graph.nodes.map(n => n.id))
                .map(id => document.querySelector(`.lg-node[data-node-id="${id}"]`))
                .filter(Boolean).map(e => e.getBoundingClientRect());
            const left = Math.min(...rects.map(r => r.left)), top = Math.min(...rects.map(r => r.top));
            return {x: left, y: top, width: Math.max(...rects.map(r => r.right)) - left,
                    height: Math.max(...rects.map(r => r.bottom)) - top};
        }""", node_ids)
        viewport = self.page.viewport_size
        x0, y0 = max(0, box["x"] - margin), max(0, box["y"] - margin)  # what of it is in the window
        x1 = min(viewport["width"], box["x"] + box["width"] + margin)
        y1 = min(viewport["height"], box["y"] + box["height"] + margin)
        clip = {"x": x0, "y": y0, "width": x1 - x0, "height": y1 - y0}
        return self.page.screenshot(clip=clip, path=str(path) if path else None)

    # --- the overlay ----------------------------------------------------------------------
    def overlay(self, node_id: int) -> dict | None:
        return self.evaluate("(id) => app.graph.getNodeById(id).tokenreduce ?? null", node_id)

    def wait_for_overlay(self, node_id: int, condition: str, timeout_ms: int = 300_000) -> dict:
        """Wait until the node's overlay state satisfies ``condition`` (a JS expression over
        ``state``, e.g. ``state.lines.length >= 3``)."""
        try:
            self.page.wait_for_function(f"""(id) => {{
                const state = app.graph.getNodeById(id).tokenreduce;
                return Boolean(state && ({condition}));
            }}""", arg=node_id, timeout=timeout_ms)
        except Exception as error:  # noqa: BLE001 - say what the node holds instead
            raise AssertionError(f"node {node_id} never got an overlay with {condition}: "
                                 f"it holds {self.overlay(node_id)}") from error
        return self.overlay(node_id)

    def drawn_texts(self) -> list[str]:
        """Every string the canvas draws in one full redraw."""
        return self.evaluate("""() => {
            window.__drawnTexts.clear();
            app.canvas.draw(true, true);
            return [...window.__drawnTexts];
        }""")

    def shown_texts(self, node_id: int) -> list[str]:
        """What a user sees of a node's text. Classic canvas: every string the canvas draws (our
        overlay is drawn there). Nodes 2.0: the lines of the node's element; our report's lines
        only where the report is really on screen (inside the node and the window, on top)."""
        if self.mode == CLASSIC:
            return self.drawn_texts()
        self.settle()
        return self.evaluate("""([id, reportClass]) => {
            const node = document.querySelector(`.lg-node[data-node-id="${id}"]`);
            if (!node) return [];
            const lines = (element) => element.innerText.split('\\n').map(s => s.trim()).filter(Boolean);
            const all = lines(node);
            const report = node.querySelector(`.${reportClass}`);
            if (!report || !report.innerText.trim()) return all;
            const r = report.getBoundingClientRect(), n = node.getBoundingClientRect();
            // Its part inside the window (a long report may run past the window's edge).
            const top = Math.max(r.top, 0), bottom = Math.min(r.bottom, window.innerHeight);
            const left = Math.max(r.left, 0), right = Math.min(r.right, window.innerWidth);
            const inside = bottom > top && right > left && r.top >= n.top - 1 && r.bottom <= n.bottom + 1;
            // On top: hit-tested at the centre of that part (made hit-testable for the test: the
            // frontend turns pointer events off on parts of a node).
            const pointerEvents = report.style.pointerEvents;
            report.style.pointerEvents = 'auto';
            const onTop = report.contains(document.elementFromPoint((left + right) / 2, (top + bottom) / 2));
            report.style.pointerEvents = pointerEvents;
            const visible = report.checkVisibility({opacityProperty: true, visibilityProperty: true});
            if (onTop && inside && visible) return all;
            const hidden = new Set(lines(report));
            return all.filter(line => !hidden.has(line));
        }""", [node_id, REPORT_CLASS])

    # --- language and help ------------------------------------------------------------------
    def use_language(self, lang: str) -> None:
        """Switch the UI language (the frontend's setting ``Comfy.Locale``, as chosen in its
        settings) and load the page again, as the frontend does after the switch."""
        save_user_setting(self.url, LOCALE_SETTING, lang)
        self.open()

    def add_node(self, node_type: str, pos=(200, 200), attempts: int = 3) -> int:
        """A new node on an empty graph at zoom 1 (the canvas's origin at the window's corner),
        drawn once; returns its id. Added again where it is gone once drawn: on a busy machine a
        newer frontend (1.58.1, 2026-11-29) can finish loading its startup workflow after the page
        is ready, over the graph the node was added to."""
        for _ in range(attempts):
            self.page.keyboard.press("Escape")  # a dialog the frontend opened on load
            node_id = self.evaluate("""([type, pos]) => {
                app.graph.clear();
                const node = LiteGraph.createNode(type);
                node.pos = pos;
                app.graph.add(node);
                app.canvas.ds.scale = 1;
                app.canvas.ds.offset = [0, 0];
                app.canvas.setDirty(true, true);
                return node.id;
            }""", [node_type, list(pos)])
            self.page.wait_for_timeout(500)  # drawn: widgets know where they are
            if self.evaluate("(id) => app.graph.getNodeById(id) != null", node_id):
                return node_id
        raise AssertionError(f"{node_type}: added {attempts} times, each time the frontend replaced the graph")

    def hover_widget(self, node_id: int, name: str, timeout_ms: int = 10_000) -> str:
        """Rest the mouse on a widget of a node (classic canvas) and return the tooltip the
        frontend shows for it."""
        x, y = self.evaluate("""([id, name]) => {
            const node = app.graph.getNodeById(id), ds = app.canvas.ds;
            const widget = node.widgets.find(w => w.name === name);
            const box = app.canvas.canvas.getBoundingClientRect();
            return [box.left + (node.pos[0] + node.size[0] / 2 + ds.offset[0]) * ds.scale,
                    box.top + (node.pos[1] + widget.y + LiteGraph.NODE_WIDGET_HEIGHT / 2 + ds.offset[1]) * ds.scale];
        }""", [node_id, name])
        self.page.mouse.move(x - 5, y)
        self.page.mouse.move(x, y)  # the frontend waits for the mouse to rest, then shows it
        tooltip = self.page.locator(".node-tooltip")
        tooltip.wait_for(state="visible", timeout=timeout_ms)
        return tooltip.inner_text()

    def open_help(self, node_id: int) -> dict:
        """Select the node and open its help page with the selection toolbox's info button; returns
        the page's first heading and the pictures it shows (src -> natural width, 0: not loaded)."""
        self.evaluate("(id) => { app.canvas.selectNode(app.graph.getNodeById(id)); app.canvas.setDirty(true, true); }",
                      node_id)
        self.page.get_by_test_id("info-button").click()
        heading = self.page.locator("h1").first
        heading.wait_for(state="visible", timeout=30_000)
        self.page.wait_for_function("[...document.querySelectorAll('img')].every(i => i.complete)")
        return {"heading": heading.inner_text(),
                "pictures": self.evaluate("() => Object.fromEntries([...document.querySelectorAll('img')]"
                                          ".filter(i => i.src.includes('/docs/')).map(i => [i.src, i.naturalWidth]))")}

    def set_overlay_setting(self, shown: bool) -> None:
        """Flip the pack's setting in ComfyUI's settings dialog, as a user does (Ctrl+, or the
        frontend's command where the key does not open it)."""
        search = self.page.get_by_placeholder(re.compile("^Search Settings"))
        dialog = self.page.get_by_role("dialog").filter(has=search)
        self.page.keyboard.press("Control+Comma")
        try:
            dialog.wait_for(timeout=5_000)
        except Exception:  # noqa: BLE001 - the key is bound differently here
            self.command("Comfy.ShowSettingsDialog")
        dialog.get_by_text("TokenReduce", exact=True).click()
        switch = dialog.get_by_role("switch")
        if switch.count() != 1:  # other settings beside ours: the switch on our setting's row
            row = dialog.locator("div").filter(has=self.page.get_by_text(OVERLAY_SETTING_NAME, exact=True))
            switch = row.filter(has=self.page.get_by_role("switch")).last.get_by_role("switch")
        if switch.is_checked() != shown:
            switch.click()
        self.page.wait_for_function(
            f"app.extensionManager.setting.get({json.dumps(OVERLAY_SETTING)}) === {json.dumps(shown)}")
        self.page.keyboard.press("Escape")
        dialog.wait_for(state="hidden")
