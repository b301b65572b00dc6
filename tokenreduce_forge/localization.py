"""The accordion in the WebUI's language, through the WebUI's own mechanism.

Forge (as AUTOMATIC1111's WebUI) translates its page with ``localizations/<name>.json`` files:
flat maps from an English text shown to its translation, collected from the WebUI's folder and
from every extension's, merged by name (a user's language pack of the same name wins where both
translate the same text, as it loads later), and applied by the page's script to text nodes and
to tooltips (``title``). The user picks one name in Settings → User interface → Localization.

We ship the usual names of the language packs (``zh_CN``, ``ja_JP``, ``ko_KR``), generated from
the same translations as the ComfyUI nodes (``locales/<lang>/nodeDefs.json``) plus the few words
only the accordion has (``locales/<lang>/forge.json``). Only texts specific to this extension
are keys: a bare word such as "off" or "hires" would also translate the WebUI's own controls.
Not translated: the options of a dropdown (their values are what the infotext records), and the
"About these settings" list (Markdown, cut by the page into fragments).

Pure Python.
"""

from __future__ import annotations

from tokenreduce.catalog import NODES

from .settings import FIRST, HIRES, HIRES_OWN, HIRES_SAME, METHOD_TITLES, METHODS, input_arg, method_arg, webui_inputs
from .texts import ABOUT, HIRES_INFO, HIRES_PASS, INTRO, INTRO_METHODS, METHOD_INFO

FILES = {"zh": "zh_CN", "ja": "ja_JP", "ko": "ko_KR"}  # our language -> the name of the WebUI's localization


def english() -> dict:
    """``locales/en/forge.json``: the accordion's own words, in English."""
    return {
        "intro": INTRO,
        "intro_methods": dict(INTRO_METHODS),
        "hires_pass": HIRES_PASS,
        "about": ABOUT,
        "hires_word": HIRES,
        "hires_info": HIRES_INFO,
        "hires_modes": {"same": HIRES_SAME, "own": HIRES_OWN},
        "method_titles": dict(METHOD_TITLES),
        "method_info": dict(METHOD_INFO),
    }


def _node_of(method: str):
    (node,) = [node for node in NODES if node.method is METHODS[method]]
    return node


def table(node_defs: dict, forge: dict) -> dict[str, str]:
    """English text shown in the accordion -> its translation, from one language's tables.
    Raises where one English text would get two translations (the page has one key per text)."""
    out: dict[str, str] = {}

    def put(english_text: str, translated: str) -> None:
        if out.get(english_text, translated) != translated:
            raise ValueError(f"{english_text!r} is translated two ways: {out[english_text]!r}, {translated!r}")
        if translated != english_text:
            out[english_text] = translated

    put(INTRO, forge["intro"])
    put(HIRES_PASS, forge["hires_pass"])
    put(ABOUT, forge["about"])
    put(HIRES_INFO, forge["hires_info"])
    put(HIRES_SAME, forge["hires_modes"]["same"])
    put(HIRES_OWN, forge["hires_modes"]["own"])
    for method in METHODS:
        inputs = node_defs[_node_of(method).node_id]["inputs"]
        title, info = forge["method_titles"][method], forge["method_info"][method]
        put(INTRO_METHODS[method], forge["intro_methods"][method])
        put(f"{METHOD_TITLES[method]}: {METHOD_INFO[method]}", f"{title}: {info}")  # the switch's tooltip
        put(method_arg(HIRES, method), f"{forge['hires_word']} {method}")
        for spec in webui_inputs(METHODS[method]):
            name = inputs[spec.name]["name"]
            put(input_arg(FIRST, method, spec.name), f"{method} {name}")
            put(input_arg(HIRES, method, spec.name), f"{forge['hires_word']} {method} {name}")
            put(spec.tooltip, inputs[spec.name]["tooltip"])
    return dict(sorted(out.items()))


def shown() -> set[str]:
    """Every text of the accordion a translation must cover (what ``table`` keys)."""
    texts = {INTRO, HIRES_PASS, ABOUT, HIRES_INFO, HIRES_SAME, HIRES_OWN}
    for method in METHODS:
        texts |= {f"{METHOD_TITLES[method]}: {METHOD_INFO[method]}", method_arg(HIRES, method), INTRO_METHODS[method]}
        for spec in webui_inputs(METHODS[method]):
            texts |= {input_arg(FIRST, method, spec.name), input_arg(HIRES, method, spec.name), spec.tooltip}
    return texts
