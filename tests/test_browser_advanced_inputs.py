"""The design card's inputs first (issue #46), in the frontend ComfyUI 0.33 pins (1.49.6, headless
Chromium): with our expert inputs marked ``advanced`` in object_info, Nodes 2.0 shows ToMe's and
ToDo's design-card inputs and folds the rest behind the node's "Show advanced inputs"; a saved
workflow loads and exports with every widget value in its place, folded or not.

The backend is the pinned ComfyUI 0.3.75, whose V3 inputs take no ``advanced`` (there our
object_info stays as it was: tests/test_comfy_advanced_inputs_inprocess.py). So the page is given
the object_info that a host taking it sends: the server's own, with ``"advanced": true`` added to
the options of exactly the inputs our declaration marks (what ComfyUI 0.33's ``Input.as_dict``
adds for ``advanced=True``; nothing else differs). A screenshot for the docs goes to
test-artifacts/browser/1.49.6-vue/advanced_inputs.png (docs/img/advanced_inputs.png is a copy).
"""

from __future__ import annotations

import pytest

import frontends
import make_examples
import workflow
from browser import VUE, Frontend, chromium_path, returning_user
from conftest import REPO
from server_helpers import start_server
from tokenreduce.methods import TODO, TOME

FRONTEND = "1.49.6"  # what ComfyUI 0.33 pins (devtools/frontends.py)
METHODS = {"TokenReduceToMe": TOME, "TokenReduceToDo": TODO}
EXAMPLE = "sd15_txt2img_tome"
PATCH = make_examples.PATCH  # the example's ToMe node
SHOW_ADVANCED = "Show advanced inputs"  # the node's footer button in 1.49.6 (Nodes 2.0)
HIDE_ADVANCED = "Hide advanced inputs"  # the same button while they are shown
ARTIFACTS = REPO / "test-artifacts" / "browser" / f"{FRONTEND}-{VUE}"


def marked(info: dict) -> dict:
    """``info`` as a host that takes ``advanced`` sends it for our nodes."""
    for node, method in METHODS.items():
        for spec in method.inputs:
            if spec.advanced:
                info[node]["input"]["optional" if spec.optional else "required"][spec.name][1]["advanced"] = True
    return info


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("comfy-advanced-inputs")
    returning_user(base)
    running = start_server(base, [], frontends.server_args(FRONTEND))
    yield running
    running.stop()


@pytest.fixture
def ui(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        page = chromium.new_page(viewport={"width": 1600, "height": 1000})
        page.route("**/object_info", _serve_marked)
        yield Frontend(page, server.url, VUE).open()
        chromium.close()


def _serve_marked(route) -> None:
    response = route.fetch()
    route.fulfill(response=response, json=marked(response.json()))


def _labels(ui: Frontend, node_id: int) -> set[str]:
    return set(ui.shown_texts(node_id))


def _assert_folded(ui: Frontend, node_id: int, method) -> None:
    shown = _labels(ui, node_id)
    assert {s.name for s in method.inputs if not s.advanced} <= shown, shown
    assert not {s.name for s in method.inputs if s.advanced} & shown, shown


def _room_left_empty(ui: Frontend, node_id: int) -> float:
    """How much taller (px) the node's element is than its content: its height, less the height
    it takes with no least height (``--node-height`` 0, as the frontend measures a node's content
    when it is resized)."""
    return ui.evaluate("""(id) => {
        const element = document.querySelector(`.lg-node[data-node-id="${id}"]`);
        const height = () => element.getBoundingClientRect().height;
        const shown = height(), least = element.style.getPropertyValue('--node-height');
        element.style.setProperty('--node-height', '0px');
        const content = height();
        element.style.setProperty('--node-height', least);
        return shown - content;
    }""", node_id)


def test_nodes_2_folds_the_advanced_inputs_and_saved_workflows_keep_their_values(ui):
    # New nodes, as a user adds them: the design card's inputs, the rest folded.
    tome = ui.add_node("TokenReduceToMe", pos=(40, 60))
    todo = ui.evaluate("""() => {
        const node = LiteGraph.createNode('TokenReduceToDo');
        node.pos = [420, 60];
        app.graph.add(node);
        return node.id;
    }""")
    ui.look_at(tome)
    ui.evaluate("() => { app.canvas.ds.offset[1] += 60; app.canvas.setDirty(true, true); }")  # clear of the Run bar
    ui.settle()
    _assert_folded(ui, tome, TOME)
    _assert_folded(ui, todo, TODO)
    # As tall as what they show: no empty area where the folded inputs would be (issue #52).
    assert _room_left_empty(ui, tome) < 1 and _room_left_empty(ui, todo) < 1
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    ui.screenshot_of_nodes([tome, todo], path=ARTIFACTS / "advanced_inputs.png")
    # The ToMe node unfolded and folded again: as tall as its content each time.
    node = ui.page.locator(f'.lg-node[data-node-id="{tome}"]')
    for label in (SHOW_ADVANCED, HIDE_ADVANCED):
        node.get_by_text(label).click()
        ui.settle()
        assert _room_left_empty(ui, tome) < 1, label

    # A saved workflow: loaded with every value in its place, folded; unfolded on request; exported as saved.
    saved = workflow.load(REPO / "example_workflows" / f"{EXAMPLE}.json")
    (ours,) = [n for n in saved["nodes"] if n["id"] == PATCH]
    values = ours["widgets_values"]  # inputs added after the file was saved follow, at their defaults
    ui.evaluate("(flow) => app.loadGraphData(flow)", saved)
    ui.look_at(PATCH)
    _assert_folded(ui, PATCH, TOME)
    assert ui.widget_values(PATCH)[:len(values)] == values
    ui.page.locator(f'.lg-node[data-node-id="{PATCH}"]').get_by_text(SHOW_ADVANCED).click()
    ui.settle()
    assert {s.name for s in TOME.inputs} <= _labels(ui, PATCH)
    (exported,) = [n for n in ui.exported()["nodes"] if n["id"] == PATCH]
    assert exported["widgets_values"][:len(values)] == values
