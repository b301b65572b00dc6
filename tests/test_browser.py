"""The pack in the real ComfyUI frontend (the one the pinned ComfyUI serves), driven in headless
Chromium as a user would: example workflows from the template browser, the Run button, the
overlay drawn on our nodes, the settings dialog. Screenshots go to test-artifacts/browser/."""

from __future__ import annotations

import pytest

import make_examples
import workflow
from browser import Frontend, chromium_path, returning_user
from conftest import REPO
from server_helpers import checkpoint_name, start_server

ARTIFACTS = REPO / "test-artifacts" / "browser"
EXAMPLES = sorted(p.stem for p in (REPO / "example_workflows").glob("*.json"))
LOADER, PATCH, LATENT, SAMPLER = make_examples.LOADER, make_examples.PATCH, make_examples.LATENT, make_examples.SAMPLER
OVERLAY_DONE = "state.lines.length >= 3"  # header, a level, the steps: a run's report arrived


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("comfy-browser")
    returning_user(base)
    srv = start_server(base, ["SD15", "SDXL"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture
def ui(server, browser, request):
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    frontend = Frontend(page, server.url).open()
    yield frontend
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"))
    page.close()
    assert not [e for e in errors if "tokenreduce" in e.lower()], errors


def _small_run(ui: Frontend, family: str, size=256, steps=2) -> None:
    """What a user changes before running an example here: the checkpoint they have (a random
    one), and a size and step count that a CPU runs in seconds."""
    ui.set_widget(LOADER, "ckpt_name", checkpoint_name(family))
    ui.set_widget(LATENT, "width", size)
    ui.set_widget(LATENT, "height", size)
    ui.set_widget(SAMPLER, "steps", steps)


def _file_widgets(name: str) -> list:
    flow = workflow.load(REPO / "example_workflows" / f"{name}.json")
    (ours,) = [n for n in flow["nodes"] if n["id"] == PATCH]
    return ours["widgets_values"]


def test_the_template_browser_shows_every_example_with_its_thumbnail(ui):
    dialog = ui.open_templates()
    widths = ui.thumbnails(dialog, EXAMPLES)
    assert all(width > 0 for width in widths.values()), widths
    for name in EXAMPLES:  # each card shows the example's own picture, served from the pack
        assert ui.responses.get(f"/api/workflow_templates/ComfyUI-TokenReduce/{name}.jpg") == 200, name


@pytest.mark.parametrize("name", EXAMPLES)
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
    assert ours["widgets_values"] == expected  # a run changes none of them (the seed stays fixed)


def test_after_a_run_the_node_shows_levels_tokens_and_steps(ui):
    ui.load_template("sd15_txt2img_tome")
    _small_run(ui, "SD15")
    ui.run()
    state = ui.wait_for_overlay(PATCH, OVERLAY_DONE)
    assert state["lines"][0] == "ToMe · SD15 · 5 of 16 blocks at downsample 1"
    assert state["lines"][1] == "ds 1 · 32×32 · q 1024→512 · k/v 1024→512"
    assert state["lines"][2].startswith("steps 1-2 of 2 · ") and state["lines"][2].endswith(" s sampling")
    ui.fit_view()
    drawn = ui.drawn_texts()
    assert all(line in drawn for line in state["lines"]), (state["lines"], drawn)
    ui.screenshot_of_nodes([LOADER, PATCH, SAMPLER], below=80, path=_artifact("overlay_sd15_tome.png"))


def test_todo_shows_pooled_keys_and_the_full_queries(ui):
    ui.load_template("sd15_txt2img_todo")
    _small_run(ui, "SD15")
    ui.run()
    state = ui.wait_for_overlay(PATCH, OVERLAY_DONE)
    assert state["lines"][:2] == ["ToDo · SD15 · 5 of 16 blocks at downsample 1",
                                  "ds 1 · 32×32 · q 1024→1024 · k/v 1024→256"]
    ui.fit_view()
    assert state["lines"][1] in ui.drawn_texts()


def test_sdxl_with_max_downsample_one_warns_on_the_node(ui):
    ui.load_template("sdxl_txt2img_tome")
    _small_run(ui, "SDXL", steps=1)
    ui.set_widget(PATCH, "max_downsample", "1")
    ui.run()
    state = ui.wait_for_overlay(PATCH, "state.warnings.length > 0")
    (warning,) = state["warnings"]
    assert "ToMe does nothing on this SDXL model with max_downsample 1" in warning
    ui.fit_view()
    drawn = ui.drawn_texts()
    # The warning is wrapped to the node's width: its first line starts with the warning sign.
    assert any(text.startswith("⚠ WARNING: ToMe does nothing") for text in drawn), drawn
    ui.screenshot_of_nodes([LOADER, PATCH, SAMPLER], below=80, path=_artifact("overlay_sdxl_noop_warning.png"))


def test_the_setting_hides_and_shows_the_overlay(ui):
    ui.load_template("sd15_txt2img_todo")
    _small_run(ui, "SD15", steps=1)
    ui.run()
    state = ui.wait_for_overlay(PATCH, OVERLAY_DONE)
    ui.fit_view()
    assert state["lines"][0] in ui.drawn_texts()
    ui.set_overlay_setting(False)
    drawn = ui.drawn_texts()
    assert drawn and not any(line in drawn for line in state["lines"])  # the canvas draws, our overlay not
    ui.set_overlay_setting(True)
    assert state["lines"][0] in ui.drawn_texts()


def test_a_ratio_above_the_stride_cap_is_shown_on_the_node(ui):
    ui.load_template("sd15_txt2img_tome")
    _small_run(ui, "SD15", steps=1)
    ui.set_widget(PATCH, "ratio", 0.9)
    ui.run()
    ui.page.wait_for_function(f"app.lastNodeErrors?.[{PATCH}]")
    ui.page.keyboard.press("Escape")  # the host's own error dialog
    ui.fit_view()
    drawn = ui.drawn_texts()
    assert any(text.startswith("⚠ ") and "ratio 0.9 cannot be" in text for text in drawn), drawn


def test_our_node_applied_twice_shows_the_error_on_the_node(ui):
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


def test_a_new_tome_node_keeps_its_seed_fixed(ui):
    """The frontend gives every INT input named seed a 'control after generate' widget that
    starts on randomize; on our node that would change the image on every run."""
    controls = ui.evaluate("""() => {
        const node = LiteGraph.createNode('TokenReduceToMe');
        app.graph.add(node);
        return node.widgets.filter(w => w.name === 'control_after_generate').map(w => w.value);
    }""")
    assert controls == ["fixed"]


def _artifact(name: str):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS / name


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
