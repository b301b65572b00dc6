"""The pack in the real ComfyUI frontend, driven in headless Chromium as a user would: example
workflows from the template browser, the Run button, what our nodes show after a run, the
settings dialog.

A matrix of frontends (devtools/frontends.py: the host's own, the one the newest ComfyUI pins,
the newest on PyPI) and node renderers (the classic LiteGraph canvas, and Nodes 2.0 where the
frontend has it). Every test runs on the host's own frontend with the classic canvas; the tests
marked ``matrix`` (run from the template browser, the report, a no-op warning, the setting, a
validation error, export, the seed's control) also run on every other (frontend, renderer).
One server at a time, started per frontend. Screenshots go to
test-artifacts/browser/<frontend version>-<renderer>/."""

from __future__ import annotations

import itertools
import re
import signal
from dataclasses import dataclass

import pytest

import frontends
import make_examples
import make_locales
import workflow
from browser import (CLASSIC, LOCALE_SETTING, MODES, PACK_TEMPLATES, REPORT_WIDGET, VUE, VUE_NODES_SETTING, Frontend, Unsupported,
                     chromium_path, returning_user, save_user_setting)
from conftest import REPO
from server_helpers import checkpoint_name, start_server

ARTIFACTS = REPO / "test-artifacts" / "browser"
EXAMPLES = sorted(p.stem for p in (REPO / "example_workflows").glob("*.json"))
# The checkpoint examples run here on random checkpoints; the DiT ones (separate model, text
# encoder and VAE files) and the A/B ones (two samplers) are loaded and exported here and run
# through the server (test_comfy_server_dit.py, test_comfy_server.py, test_comfy_server_sdxl.py).
CHECKPOINT_EXAMPLES = [name for name in EXAMPLES if name.startswith(("sd15_", "sdxl_")) and "_ab_" not in name]
DIT_EXAMPLES = [name for name in EXAMPLES if name not in CHECKPOINT_EXAMPLES]
LOADER, PATCH, LATENT, SAMPLER = make_examples.LOADER, make_examples.PATCH, make_examples.LATENT, make_examples.SAMPLER
OVERLAY_DONE = "state.lines.length >= 3"  # header, a level, the steps: a run's report arrived
# A new sampler seed for every run: the server caches a prompt it has run, and a prompt that
# runs nothing sends no run report (two tests in a row may queue the same graph).
SAMPLER_SEEDS = itertools.count(1)


@dataclass(frozen=True)
class Target:
    """Where a test runs: a frontend of the matrix and a node renderer."""

    frontend: str  # frontends.HOST (the host's own) or a version pinned in devtools/frontends.py
    mode: str  # browser.CLASSIC or browser.VUE

    def __str__(self) -> str:
        return f"{self.frontend}-{self.mode}"


TARGETS = [Target(frontend, mode) for frontend in frontends.MATRIX for mode in MODES]
FULL_SET = Target(frontends.HOST, CLASSIC)  # where every test runs
HOST_FRONTEND = frontends.installed_version()


def pytest_generate_tests(metafunc):
    """Unmarked tests run on FULL_SET; ``@pytest.mark.matrix`` ones on every target
    (``beside_full_set=True``: on every other target, where the full set has its own test;
    ``modes=(...)``: in these renderers only; ``frontends=(...)``: on these frontends only)."""
    if "target" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("matrix")
    if marker is None:
        targets = [FULL_SET]
    else:
        modes = marker.kwargs.get("modes", MODES)
        versions = marker.kwargs.get("frontends", frontends.MATRIX)
        targets = [t for t in TARGETS if t.mode in modes and t.frontend in versions
                   and not (marker.kwargs.get("beside_full_set") and t == FULL_SET)]
    metafunc.parametrize("target", targets, ids=str, scope="module")  # grouped: one server per frontend


@pytest.fixture(scope="module")
def target() -> Target:
    return FULL_SET  # replaced by pytest_generate_tests


class Servers:
    """One ComfyUI server (with random SD1.5 and SDXL checkpoints) at a time, serving the
    frontend that the running test asks for."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.frontend: str | None = None
        self.server = None

    def get(self, frontend: str):
        self.check()
        if frontend != self.frontend:
            self.stop()
            if frontend != frontends.HOST and frontend == HOST_FRONTEND:
                pytest.skip(f"frontend {frontend} is the host's own: tested as the host's")
            base = self.tmp_path_factory.mktemp(f"comfy-browser-{frontend}")
            returning_user(base)
            # Classic caching (0.3.75's default): 0.33's default RAM-pressure cache kept SD1.5 and SDXL
            # loaded to 19 GB, and with the suite's other worker the kernel killed the server (OOM).
            self.server = start_server(base, ["SD15", "SDXL"], [*frontends.server_args(frontend), "--cache-classic"])
            self.frontend = frontend
        return self.server

    def check(self) -> None:
        """Fail (once) if the server has exited, saying how and where its log is; the next test
        starts a new one. A server that died (e.g. killed by the kernel's OOM killer while the
        suite's other worker held memory too) would otherwise refuse every later test's
        connections, each a bare "connection refused"."""
        if self.server is None or self.server.process is None or self.server.process.poll() is None:
            return
        code = self.server.process.returncode
        how = f"exit code {code}"
        if code < 0:
            how = f"killed by {signal.Signals(-code).name}" + (
                ", as the kernel's OOM killer does: see dmesg" if code == -signal.SIGKILL else "")
        frontend = HOST_FRONTEND if self.frontend == frontends.HOST else self.frontend
        tail = "\n".join(self.server.log().splitlines()[-15:])
        self.stop()  # keeps its log in ARTIFACTS
        pytest.fail(f"the ComfyUI server of frontend {frontend} had stopped ({how}); its log: "
                    f"{ARTIFACTS / f'server-{frontend}.log'}; its last lines:\n{tail}", pytrace=False)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            version = HOST_FRONTEND if self.frontend == frontends.HOST else self.frontend
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            (ARTIFACTS / f"server-{version}.log").write_text(self.server.log())
        self.server, self.frontend = None, None


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    running = Servers(tmp_path_factory)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        yield chromium
        chromium.close()


def _artifact_name(request) -> str:
    """The test's name with its parameters other than the target (which names the folder)."""
    params = [str(v) for k, v in request.node.callspec.params.items() if k != "target"]
    return request.node.originalname + (f"[{'-'.join(params)}]" if params else "")


def _ours(text: str, url: str, server_url: str) -> bool:
    """Whether a page error or console error comes from this pack: our extension's script, our
    files on the server, or a message naming us. The frontend's own failed requests elsewhere
    (e.g. the node registry at api.comfy.org, asked about our node types) are not ours."""
    if "tokenreduce" not in f"{text} {url}".lower():
        return False
    if text.startswith("Failed to load resource") and re.search(r"/docs/TokenReduce\w+/[\w-]+\.md$", url):
        return False  # a help page in a language we do not ship: the frontend then reads the plain page
    return not (text.startswith("Failed to load resource") and not url.startswith(server_url))


@pytest.fixture
def ui(servers, browser, target, request):
    server = servers.get(target.frontend)
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    errors = []  # (text, where): uncaught exceptions and console errors
    page.on("pageerror", lambda error: errors.append((f"{error.message}\n{error.stack or ''}", "")))
    page.on("console", lambda message: errors.append((message.text, message.location.get("url", "")))
            if message.type == "error" else None)
    frontend = Frontend(page, server.url, target.mode)
    try:
        frontend.open()
    except Unsupported as reason:
        page.close()
        pytest.skip(f"frontend {target.frontend}: {reason}")
    version = HOST_FRONTEND if target.frontend == frontends.HOST else target.frontend
    frontend.artifacts = ARTIFACTS / f"{version}-{target.mode}"
    frontend.artifacts.mkdir(parents=True, exist_ok=True)
    yield frontend
    name = _artifact_name(request)
    page.screenshot(path=str(frontend.artifacts / f"{name}.png"))
    page.close()
    if errors:  # the frontend's own errors (e.g. requests to the internet), kept for reading
        (frontend.artifacts / f"{name}.errors.txt").write_text("\n".join(f"{t} @ {u}" for t, u in errors) + "\n")
    servers.check()  # a server that died during the test: said here, not as the next test's refused connection
    server.cancel_all()  # what the test left running would only delay the next one
    ours = [f"{text} @ {url}" for text, url in errors if _ours(text, url, server.url)]
    assert not ours, ours


def _small_run(ui: Frontend, family: str, size=128, steps=2) -> None:
    """What a user changes before running an example here: the checkpoint they have (a random
    one), and a size and step count that a CPU runs in seconds (128 px: a 16x16 latent, which
    every example's strides, factors and levels divide), and our node's quality budget off: at
    that size a random checkpoint's blocks change by more than the default budget on their own
    inputs, and auto would leave them alone (the budget has tests of its own)."""
    ui.set_widget(PATCH, "max_change", 0.0)
    ui.set_widget(LOADER, "ckpt_name", checkpoint_name(family))
    ui.set_widget(LATENT, "width", size)
    ui.set_widget(LATENT, "height", size)
    ui.set_widget(SAMPLER, "steps", steps)
    ui.set_widget(SAMPLER, "seed", next(SAMPLER_SEEDS))


def _file_widgets(name: str) -> list:
    flow = workflow.load(REPO / "example_workflows" / f"{name}.json")
    (ours,) = [n for n in flow["nodes"] if n["id"] == PATCH]
    return ours["widgets_values"]


def _run_widgets(name: str) -> list:
    """The example's widgets of our node after ``_small_run``: max_change set to 0 (ToDo's last
    widget; ToMe's third from last, before min_similarity and correct_from_whole)."""
    widgets = list(_file_widgets(name))
    widgets[-3 if "_tome" in name else -1] = 0.0
    return widgets


def test_the_template_browser_shows_every_example_with_its_thumbnail(ui):
    dialog = ui.open_templates()
    widths = ui.thumbnails(dialog, EXAMPLES)
    missing = {name: width for name, width in widths.items() if not (isinstance(width, int) and width > 0)}
    assert not missing, missing
    for name in EXAMPLES:  # each card shows the example's own picture, served from the pack
        assert ui.responses.get(f"/api/workflow_templates/ComfyUI-TokenReduce/{name}.jpg") == 200, name


@pytest.mark.parametrize("name", DIT_EXAMPLES)
def test_a_dit_example_loads_and_exports_with_every_widget_value_of_our_node(ui, name):
    # On a ComfyUI without the example's nodes the frontend loads it under its missing-nodes dialog.
    if reason := make_examples.lacking_nodes(f"{name}.json", lambda node: ui.evaluate(
            "(type) => type in LiteGraph.registered_node_types", node)):
        pytest.skip(reason)
    ui.load_template(name)
    expected = _file_widgets(name)
    assert ui.widget_values(PATCH) == expected  # loaded as saved (no shifted values)
    (ours,) = [n for n in ui.exported()["nodes"] if n["id"] == PATCH]
    assert ours["widgets_values"] == expected


@pytest.mark.parametrize("name", CHECKPOINT_EXAMPLES)
def test_an_example_loads_runs_and_exports_with_every_widget_value_of_our_node(ui, name):
    ui.load_template(name)
    expected = _file_widgets(name)
    assert ui.widget_values(PATCH) == expected  # loaded as saved (no shifted values)
    family = name.split("_")[0].upper()
    _small_run(ui, family, steps=1 if family == "SDXL" else 2)
    ui.run()
    state = ui.wait_for_overlay(PATCH, OVERLAY_DONE)
    assert not state["warnings"], state
    (ours,) = [n for n in ui.exported()["nodes"] if n["id"] == PATCH]
    assert ours["widgets_values"] == _run_widgets(name)  # a run changes none of them (the seed stays fixed)


# Right after the SDXL examples above: on the full set the server still holds their SDXL checkpoint
# (the execution cache keeps what the next prompt uses), elsewhere it loads SDXL once per target
# before the SD1.5 tests, instead of between them.
@pytest.mark.matrix
def test_sdxl_with_max_downsample_one_warns_on_the_node(ui):
    ui.load_template("sdxl_txt2img_tome")
    _small_run(ui, "SDXL", steps=1)
    # The warning comes with our node's own output when it executes. A new ToMe seed each time:
    # the server would otherwise take our node from its cache (the same graph on the same server,
    # the previous target's test) and send the newly opened page nothing.
    ui.set_widget(PATCH, "seed", next(SAMPLER_SEEDS))
    ui.set_widget(PATCH, "max_downsample", "1")
    ui.run()
    state = ui.wait_for_overlay(PATCH, "state.warnings.length > 0")
    (warning,) = state["warnings"]
    assert "ToMe does nothing on this SDXL model with max_downsample 1" in warning
    ui.look_at(PATCH)
    drawn = ui.shown_texts(PATCH)  # classic: what the canvas draws; Nodes 2.0: the node's lines
    # The warning is wrapped to the node's width: its first line starts with the warning sign.
    assert any(text.startswith("⚠ WARNING: ToMe does nothing") for text in drawn), drawn
    ui.screenshot_of_nodes([LOADER, PATCH, SAMPLER], below=80, path=ui.artifacts / "overlay_sdxl_noop_warning.png")


@pytest.mark.matrix(beside_full_set=True)
def test_an_example_from_the_template_browser_runs_shows_its_report_and_exports(ui):
    """On every other frontend and renderer: the SD1.5 ToMe example from the template browser,
    run with the Run button, shows its report on the node and exports unchanged."""
    name = "sd15_txt2img_tome"
    ui.load_template(name)
    expected = _file_widgets(name)
    assert ui.widget_values(PATCH) == expected
    _small_run(ui, "SD15", steps=1)
    ui.run()
    state = ui.wait_for_overlay(PATCH, OVERLAY_DONE)
    assert not state["warnings"], state
    assert state["lines"][:2] == ["ToMe · SD15 · 5 of 16 blocks at downsample 1",
                                  "ds 1 · 16×16 · q 256→128 · k/v 256→128"]
    ui.look_at(PATCH)
    shown = ui.shown_texts(PATCH)
    assert all(line in shown for line in state["lines"]), (state["lines"], shown)
    ui.screenshot_of_nodes([LOADER, PATCH, SAMPLER], below=80, path=ui.artifacts / "overlay_sd15_tome.png")
    (ours,) = [n for n in ui.exported()["nodes"] if n["id"] == PATCH]
    assert ours["widgets_values"] == _run_widgets(name)


def test_after_a_run_the_node_shows_levels_tokens_and_steps(ui):
    ui.load_template("sd15_txt2img_tome")
    _small_run(ui, "SD15")
    ui.run()
    state = ui.wait_for_overlay(PATCH, OVERLAY_DONE)
    assert state["lines"][0] == "ToMe · SD15 · 5 of 16 blocks at downsample 1"
    assert state["lines"][1] == "ds 1 · 16×16 · q 256→128 · k/v 256→128"
    assert state["lines"][2].startswith("steps 1-2 of 2 · ") and state["lines"][2].endswith(" s sampling")
    ui.fit_view()
    drawn = ui.drawn_texts()
    assert all(line in drawn for line in state["lines"]), (state["lines"], drawn)
    ui.screenshot_of_nodes([LOADER, PATCH, SAMPLER], below=80, path=ui.artifacts / "overlay_sd15_tome.png")


def test_todo_shows_pooled_keys_and_the_full_queries(ui):
    ui.load_template("sd15_txt2img_todo")
    _small_run(ui, "SD15")
    ui.run()
    state = ui.wait_for_overlay(PATCH, OVERLAY_DONE)
    assert state["lines"][:2] == ["ToDo · SD15 · 5 of 16 blocks at downsample 1",
                                  "ds 1 · 16×16 · q 256→256 · k/v 256→64"]
    ui.fit_view()
    assert state["lines"][1] in ui.drawn_texts()


@pytest.mark.matrix
def test_the_setting_hides_and_shows_the_overlay(ui):
    ui.load_template("sd15_txt2img_todo")
    _small_run(ui, "SD15", steps=1)
    ui.run()
    state = ui.wait_for_overlay(PATCH, OVERLAY_DONE)
    ui.look_at(PATCH)
    assert state["lines"][0] in ui.shown_texts(PATCH)
    ui.set_overlay_setting(False)
    drawn = ui.shown_texts(PATCH)
    assert drawn and not any(line in drawn for line in state["lines"])  # the node is drawn, our report not
    ui.set_overlay_setting(True)
    assert state["lines"][0] in ui.shown_texts(PATCH)


@pytest.mark.matrix
def test_a_ratio_above_the_stride_cap_is_shown_on_the_node(ui):
    ui.load_template("sd15_txt2img_tome")
    _small_run(ui, "SD15", steps=1)
    ui.set_widget(PATCH, "ratio", 0.9)
    ui.run()
    ui.page.wait_for_function(f"app.lastNodeErrors?.[{PATCH}]")
    ui.page.keyboard.press("Escape")  # the host's own error dialog
    ui.look_at(PATCH)
    drawn = ui.shown_texts(PATCH)
    # The message wraps with the node's width: read the drawn lines as one text.
    assert any(text.startswith("⚠ ") for text in drawn), drawn
    assert "ratio 0.9 cannot be" in " ".join(" ".join(drawn).split()), drawn
    ui.screenshot_of_nodes([LOADER, PATCH, SAMPLER], below=80, path=ui.artifacts / "validation_error.png")


@pytest.mark.matrix(modes=(CLASSIC,))
def test_switching_to_nodes_2_and_back_keeps_the_report_on_the_node(ui):
    """A user who turns Nodes 2.0 on after a run sees the report inside the node; back on the
    classic canvas it is drawn under the node again, the node has its own widgets only and the
    workflow exports as it was loaded."""
    if not ui.has_setting(VUE_NODES_SETTING):
        pytest.skip(f"this frontend has no Nodes 2.0 (no setting {VUE_NODES_SETTING})")
    name = "sd15_txt2img_todo"
    ui.load_template(name)
    _small_run(ui, "SD15", steps=1)
    ui.run()
    state = ui.wait_for_overlay(PATCH, OVERLAY_DONE)
    ui.switch_mode(VUE)
    ui.look_at(PATCH)
    shown = ui.shown_texts(PATCH)
    assert all(line in shown for line in state["lines"]), (state["lines"], shown)
    ui.screenshot_of_nodes([PATCH], path=ui.artifacts / "switched_to_nodes_2.png")
    ui.switch_mode(CLASSIC)
    ui.fit_view()
    drawn = ui.drawn_texts()
    assert all(line in drawn for line in state["lines"]), (state["lines"], drawn)
    names = ui.evaluate(f"() => app.graph.getNodeById({PATCH}).widgets.map(w => w.name)")
    assert REPORT_WIDGET not in names, names
    (ours,) = [n for n in ui.exported()["nodes"] if n["id"] == PATCH]
    assert ours["widgets_values"] == _run_widgets(name)


def test_our_node_applied_twice_shows_the_error_on_the_node(ui, servers):
    """A second ToMe node between the loader and the example's ToMe: the example's node is
    refused when it runs (it would see tokens the first one merged), and says so on itself."""
    ui.load_template("sd15_txt2img_tome")
    _small_run(ui, "SD15", steps=1)
    ui.evaluate(f"""() => {{
        const first = LiteGraph.createNode('TokenReduceToMe');
        first.pos = [480, 620];
        app.graph.add(first);
        app.graph.getNodeById({LOADER}).connect(0, first, 0);
        first.connect(0, app.graph.getNodeById({PATCH}), 0);
    }}""")
    ui.run()
    state = ui.wait_for_overlay(PATCH, "state.warnings.length > 0")
    assert "TokenReduceToMe is already applied to this model" in state["warnings"][0]
    ui.page.keyboard.press("Escape")  # the host's own error dialog
    ui.fit_view()
    assert any(text.startswith("⚠ TokenReduceToMe is already applied") for text in ui.drawn_texts())
    # The server caches this graph's outputs, the added ToMe's patched model among them. A later
    # graph whose ToMe has the same inputs gets that cached model, whose report names the node
    # that made it (id 11, absent there): its own node would show nothing. Start the next clean.
    servers.server.free()


@pytest.mark.matrix
def test_a_new_tome_node_keeps_its_seed_fixed(ui):
    """The frontend gives every INT input named seed a 'control after generate' widget that
    starts on randomize; on our node that would change the image on every run."""
    controls = ui.evaluate("""() => {
        const node = LiteGraph.createNode('TokenReduceToMe');
        app.graph.add(node);
        return node.widgets.filter(w => w.name === 'control_after_generate').map(w => w.value);
    }""")
    assert controls == ["fixed"]


@pytest.mark.parametrize("name", ["sd15_txt2img_tome", "sd15_txt2img_todo"])
def test_example_widget_values_follow_the_frontends_layout(ui, name):
    """The example files hold widget values in the frontend's own layout (ToMe's seed followed
    by its control value): a node made in the UI has a widget of the same kind at each place."""
    node_type = "TokenReduceToMe" if name.endswith("tome") else "TokenReduceToDo"
    values = ui.evaluate("""(type) => {
        const node = LiteGraph.createNode(type);
        app.graph.add(node);
        return node.widgets.map(w => w.value);
    }""", node_type)
    kind = lambda v: "bool" if isinstance(v, bool) else "number" if isinstance(v, (int, float)) else type(v).__name__
    assert [kind(v) for v in values] == [kind(v) for v in _file_widgets(name)]


# --- the UI language and the help pages ----------------------------------------------------------

def _expected(lang: str) -> dict:
    """What the UI should show of ToDo in ``lang``: from the pack's own tables and help page."""
    node = make_locales.tables_of(lang)["nodeDefs"]["TokenReduceToDo"]
    page = REPO / "js" / "docs" / ("TokenReduceToDo.md" if lang == "en" else f"TokenReduceToDo/{lang}.md")
    return {"title": node["display_name"], "label": node["inputs"]["factor"]["name"],
            "tooltip": node["inputs"]["factor"]["tooltip"],
            "heading": page.read_text(encoding="utf-8").splitlines()[0].removeprefix("# ")}


# Custom-node help pages and the node library's help came with later frontends than the host's
# 1.32.9: tested on the current ones (1.49.6, what ComfyUI 0.33 pins, and newer).
@pytest.mark.matrix(modes=(CLASSIC,), frontends=tuple(frontends.PINNED))
@pytest.mark.parametrize("lang", ["zh", "en"])
def test_the_node_speaks_the_users_language_and_opens_its_help_page(ui, lang):
    expected = _expected(lang)
    try:
        ui.use_language(lang)
        node = ui.add_node("TokenReduceToDo")
        shown = ui.evaluate("(id) => { const n = app.graph.getNodeById(id); "
                            "return [n.title, n.widgets.find(w => w.name === 'factor').label ?? 'factor']; }", node)
        assert shown == [expected["title"], expected["label"]]
        tooltip = ui.hover_widget(node, "factor")
        ui.page.screenshot(path=str(ui.artifacts / f"language_{lang}_tooltip.png"))
        assert tooltip.strip() == expected["tooltip"]
        help_page = ui.open_help(node)
        ui.page.screenshot(path=str(ui.artifacts / f"language_{lang}_help.png"))
        assert help_page["heading"] == expected["heading"]
        assert help_page["pictures"] and all(width > 0 for width in help_page["pictures"].values()), help_page
        suffix = "TokenReduceToDo.md" if lang == "en" else f"TokenReduceToDo/{lang}.md"
        assert ui.responses.get(f"/extensions/{PACK_TEMPLATES}/docs/{suffix}") == 200
    finally:
        save_user_setting(ui.url, LOCALE_SETTING, "en")  # the next test on this server reads English
