"""Examples say what they need (issue #46, point 5): every node type of every example in
``example_workflows/`` is known to the ComfyUI the tests run on (the pinned 0.3.75, or the tree
named with ``--comfyui``) once it has loaded its nodes as its server does, or named by a Note
node of that example that says which ComfyUI version (or package) it needs and why. The LTX-2
example opened on 0.3.75 showed seven unknown node types and no word why."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import make_examples
import workflow
from conftest import REPO, comfyui_dir

EXAMPLES = sorted((REPO / "example_workflows").glob("*.json"))
REQUIREMENT = re.compile(r"^Needs (ComfyUI \d+\.\d+[^:]*|[A-Za-z][\w.-]*): (.+)\. Without it these nodes show as "
                         r"missing: ([^.]+)\.$", re.DOTALL)


@pytest.fixture(scope="module")
def host_nodes() -> set[str]:
    """The node types of the ComfyUI under test, with this pack loaded (a process of its own)."""
    script = Path(__file__).with_name("host_nodes_process.py")
    done = subprocess.run([sys.executable, str(script), str(comfyui_dir())], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def declared(flow: dict) -> dict[str, str]:
    """Node type -> what the example's Note says it needs, for every node type its Notes name."""
    found = {}
    for node in flow["nodes"]:
        if node["type"] == "Note" and node.get("title") == make_examples.NEEDS_TITLE:
            (text,) = node["widgets_values"]
            match = REQUIREMENT.match(text)
            assert match, f"a Needs note that does not say what, why and which nodes: {text!r}"
            found.update({name.strip(): match[1] for name in match[3].split(",")})
    return found


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_node_type_of_an_example_is_known_to_this_comfyui_or_declared_by_a_note(host_nodes, path):
    flow = workflow.load(path)
    unknown = workflow.node_types(flow) - host_nodes
    undeclared = sorted(unknown - set(declared(flow)))
    assert not undeclared, (f"{path.name}: this ComfyUI has no {undeclared} and no Note of the example says what "
                            f"they need (devtools/make_examples.py: NEEDS)")


@pytest.mark.parametrize("name", sorted(make_examples.NEEDS))
def test_each_need_is_a_note_in_its_example(name):
    """What the generator declares is what the example's Notes say, node for node, with a version
    or a package and a reason; ``lacking_nodes`` (the skip reason of the server and browser tests)
    reads the same declarations."""
    flow = workflow.load(REPO / "example_workflows" / name)
    said = declared(flow)
    for needs in make_examples.NEEDS[name]:
        assert {node: said.get(node) for node in needs.nodes} == {node: needs.what for node in needs.nodes}
        assert make_examples.lacking_nodes(name, lambda node, gone=needs.nodes[0]: node != gone) == (
            f"this ComfyUI has no {needs.nodes[0]}: the example needs {needs.what}; run with --comfyui of such a tree")
    assert make_examples.lacking_nodes(name, lambda node: True) is None


def test_the_ltx2_example_says_it_needs_comfyui_033():
    flow = workflow.load(REPO / "example_workflows" / "ltx2_t2v_audio_todo.json")
    said = declared(flow)
    assert said["LTXVConcatAVLatent"].startswith("ComfyUI 0.33") and said["PreviewAudio"] == "torchaudio"
