"""The design card's inputs first (issue #46): ToMe and ToDo show what a user sets first (ToMe's
ratio, strides and max_downsample, ToDo's factor, both nodes' step window and reduce_when) and
mark the rest ``advanced``, which a ComfyUI that can fold inputs (0.33: ``advanced=True`` on its
V3 inputs, ``"advanced": true`` in object_info) shows on request. On a host without it (the pinned
0.3.75) the nodes' object_info is what it was: no input carries the mark. Names and order never
change. In-process, on the real host's V3 schema (what the server sends as object_info).

The folding itself, in the frontend ComfyUI 0.33 pins: tests/test_browser_advanced_inputs.py.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from conftest import PACK_MODULE, REPO
from server_helpers import OPTIONAL_INPUTS, PUBLIC_INPUTS
from tokenreduce.methods import TODO, TOME

SHOWN = {  # the design card: everything else is advanced
    "ToMe": ["ratio", "stride_x", "stride_y", "max_downsample", "start_percent", "end_percent", "reduce_when"],
    "ToDo": ["factor", "start_percent", "end_percent", "reduce_when"],
}


@pytest.mark.parametrize("method", [TOME, TODO], ids=lambda m: m.name)
def test_the_design_cards_inputs_are_shown_and_the_rest_are_advanced(method):
    assert [spec.name for spec in method.inputs if not spec.advanced] == SHOWN[method.name]


@pytest.mark.parametrize("method", [TOME, TODO], ids=lambda m: m.name)
def test_the_node_reference_names_the_shown_and_the_advanced_inputs(method):
    text = (REPO / "docs" / "nodes.md").read_text(encoding="utf-8")
    section = text.split("## The design card's inputs first: advanced inputs\n", 1)[1].split("\n## ", 1)[0]
    (row,) = [line for line in section.splitlines() if line.startswith(f"| {method.name} |")]
    shown, advanced = ([name.strip("` ") for name in cell.split(",")] for cell in row.strip("|").split(" | ")[1:])
    assert shown == [spec.name for spec in method.inputs if not spec.advanced]
    assert advanced == [spec.name for spec in method.inputs if spec.advanced]


@pytest.fixture(scope="module")
def pack(comfy):
    """The pack's schema and host modules and its two nodes, as the real host loaded them."""
    module = lambda name: importlib.import_module(f"{PACK_MODULE}.nodes.{name}")  # noqa: E731
    return dict(schema=module("schema"), host=module("host"),
                nodes=(module("tome_node").ToMePatchNode, module("todo_node").ToDoPatchNode))


def test_the_pinned_host_cannot_fold_inputs(pack):
    host = pack["host"]
    if host.host_version() != "0.3.75":
        pytest.skip(f"ComfyUI {host.host_version()}: the seam's answer there is checked by the next test")
    assert host.supports_advanced_inputs() is False  # its V3 inputs refuse the keyword


@pytest.mark.parametrize("node", [0, 1], ids=["ToMe", "ToDo"])
def test_object_info_marks_exactly_the_advanced_inputs_where_the_host_folds_them(pack, node):
    """What the server sends for our node: on a host that folds inputs, each advanced input's
    options gain ``"advanced": true`` and nothing else changes; elsewhere (0.3.75) every input is
    exactly as an unmarked declaration gives it. Input names and order stay those saved workflows
    use."""
    cls = pack["nodes"][node]
    folds = pack["host"].supports_advanced_inputs()
    info = cls.GET_NODE_INFO_V1()
    assert info["input_order"]["required"] == PUBLIC_INPUTS[cls.NODE_ID]
    assert info["input_order"].get("optional", []) == OPTIONAL_INPUTS[cls.NODE_ID]
    for spec in cls.METHOD.inputs:
        _, options = info["input"]["optional" if spec.optional else "required"][spec.name]
        plain = pack["schema"].v3_input(dataclasses.replace(spec, advanced=False)).as_dict()
        plain.pop("optional", None)  # object_info says it by the section
        expected = {**plain, "advanced": True} if spec.advanced and folds else plain
        assert options == expected, spec.name
