"""Turn a UI-format workflow (what ComfyUI saves and its template browser serves) into the
API format that ``POST /prompt`` takes, using the server's ``/object_info`` to map each
node's ``widgets_values`` onto its input names."""

from __future__ import annotations

import json
from pathlib import Path

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
ACTIVE_MODE = 0  # 2 = muted, 4 = bypassed
# Node types only the frontend has (never in /object_info, never sent with a prompt): notes.
FRONTEND_ONLY = {"Note", "MarkdownNote"}
_MISSING = object()


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def node_types(workflow: dict) -> set[str]:
    """The node types a server must have to run the workflow (notes are the frontend's own)."""
    return {node["type"] for node in workflow["nodes"]} - FRONTEND_ONLY


def _is_widget(spec: list) -> bool:
    kind = spec[0]  # an input of several types (ComfyUI 0.33's MultiType) is the widget it names
    return isinstance(kind, list) or kind in WIDGET_TYPES or (len(spec) > 1 and spec[1].get("widgetType") in WIDGET_TYPES)


def _widget_default(spec: list):
    """What a fresh widget of this input holds: its declared default, else a list's first choice."""
    kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
    if "default" in options:
        return options["default"]
    choices = kind if isinstance(kind, list) else options.get("options") if kind == "COMBO" else None
    return choices[0] if choices else _MISSING


def _input_specs(info: dict) -> list[tuple[str, list]]:
    specs = []
    for section in ("required", "optional"):
        entries = info["input"].get(section, {})
        for name in info.get("input_order", {}).get(section, list(entries)):
            specs.append((name, entries[name]))
    return specs


def to_api(workflow: dict, object_info: dict) -> dict:
    links = {link[0]: link for link in workflow.get("links", [])}
    prompt = {}
    for node in workflow["nodes"]:
        if node.get("mode", ACTIVE_MODE) != ACTIVE_MODE or node["type"] in FRONTEND_ONLY:
            continue
        info = object_info[node["type"]]
        linked = {inp["name"]: inp["link"] for inp in node.get("inputs", []) if inp.get("link") is not None}
        values = iter(node.get("widgets_values", []))
        inputs = {}
        for name, spec in _input_specs(info):
            if _is_widget(spec):
                value = next(values, _MISSING)
                if len(spec) > 1 and spec[1].get("control_after_generate"):
                    next(values, None)  # the "fixed/randomize" companion value the UI stores after it
                if value is _MISSING and name in info["input"].get("required", {}):
                    # A workflow saved before a required input was added (ComfyUI 0.33's
                    # context window nodes gained three) has no value for it: the UI's widget
                    # keeps its default and the UI sends that. A missing optional input is
                    # left out, as an API prompt saved back then has it, and the node's
                    # default applies.
                    value = _widget_default(spec)
                if name not in linked and value is not _MISSING:
                    inputs[name] = value
            if name in linked:
                _, from_node, from_slot, *_ = links[linked[name]]
                inputs[name] = [str(from_node), from_slot]
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


def find(prompt: dict, class_type: str) -> dict:
    """The inputs of the single node of that type in an API prompt."""
    (inputs,) = [node["inputs"] for node in prompt.values() if node["class_type"] == class_type]
    return inputs
