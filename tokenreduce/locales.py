"""The translation tables ComfyUI serves from ``locales/<lang>/`` (``nodeDefs.json``,
``settings.json``, ``main.json``), in English, built from what the nodes declare
(``tokenreduce.catalog``) and what the front-end extension declares (its setting).

A translation is kept beside each table as ``translated_from.json``: for every text it
translates, a digest of the English it was made from. ``stale_or_missing`` compares a language
with the English of today: a text without translation, a translation of a text that no longer
exists, and one made from English that has changed since are all named, so none ships unnoticed.
"""

from __future__ import annotations

import hashlib

from .catalog import NODES, OUTPUTS, TOOLS

LANGUAGES = ("en", "zh", "ja", "ko")  # shipped; en is the source
TABLES = ("nodeDefs", "settings", "main")  # locales/<lang>/<table>.json that ComfyUI serves
# Other tables translated the same way (the WebUI extension's own words, ``forge.json``) are given
# to ``stale_or_missing`` by who owns them: the core does not know its hosts.
DIGESTS = "translated_from"  # locales/<lang>/translated_from.json: key -> digest of its English
# locales/<lang>/help_translated_from.json: node id -> digest of the English help page it was translated from
HELP_DIGESTS = "help_translated_from"

# The front-end extension's setting (js/tokenreduce.js declares it; a test compares the two).
SETTING_ID = "TokenReduce.Overlay.Show"
SETTING_NAME = "Show what TokenReduce did on its nodes"
SETTING_TOOLTIP = ("After a run, draw under each TokenReduce node the patched levels, tokens before and after, the "
                   "active steps, the sampling time and any warning.")
SETTING_CATEGORIES = ("TokenReduce", "Overlay")  # the setting's category path, as the settings dialog shows it


def i18n_key(name: str) -> str:
    """A name as the frontend looks it up in the tables (it replaces dots: they nest keys)."""
    return name.replace(".", "_")


def _node_entry(title: str, description: str, inputs, outputs) -> dict:
    """One node's entry: ``inputs`` as (name, tooltip) pairs in order, ``outputs`` as ``Output``s (by index)."""
    return {
        "display_name": title,
        "description": description,
        "inputs": {name: {"name": name, "tooltip": tooltip} for name, tooltip in inputs},
        "outputs": {str(i): {"name": out.name, "tooltip": out.tooltip} for i, out in enumerate(outputs)},
    }


def node_defs() -> dict:
    """nodeDefs.json in English: per node its title, description, inputs and outputs (by index)."""
    table = {}
    for node in NODES:
        inputs = [("model", node.model_tooltip), *((spec.name, spec.tooltip) for spec in node.method.inputs)]
        table[node.node_id] = _node_entry(node.title, node.description, inputs, OUTPUTS)
    for tool in TOOLS:
        table[tool.node_id] = _node_entry(tool.title, tool.description, ((s.name, s.tooltip) for s in tool.inputs),
                                          tool.outputs)
    return table


def english() -> dict[str, dict]:
    """Every table in English, by table name."""
    return {
        "nodeDefs": node_defs(),
        "settings": {i18n_key(SETTING_ID): {"name": SETTING_NAME, "tooltip": SETTING_TOOLTIP}},
        "main": {"settingsCategories": {i18n_key(c): c for c in SETTING_CATEGORIES}},
    }


def flat(tables: dict, prefix: str = "") -> dict[str, str]:
    """Nested tables as {"table.key.key": text}."""
    out = {}
    for key, value in tables.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, path + "."))
        else:
            out[path] = value
    return out


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def digests_of(tables: dict) -> dict[str, str]:
    """What ``translated_from.json`` records when a translation of ``tables`` is made from today's English."""
    return {key: digest(text) for key, text in sorted(flat(tables).items())}


def stale_help_pages(lang: str, recorded: dict[str, str], english_pages: dict[str, str]) -> list[str]:
    """The help pages of a language not translated from today's English page (``english_pages``:
    node id -> the English page's text), one line each naming the page."""
    problems = []
    for node, text in sorted(english_pages.items()):
        page = f"js/docs/{node}/{lang}.md"
        if node not in recorded:
            problems.append(f"{lang}: {page} has no record of the English page it was translated from")
        elif recorded[node] != digest(text):
            problems.append(f"{lang}: {page} was translated from another js/docs/{node}.md than today's")
    problems += [f"{lang}: help page {node} is recorded but has no English page" for node in recorded
                 if node not in english_pages]
    return problems


def stale_or_missing(lang: str, translated: dict, recorded: dict[str, str], source_tables: dict | None = None
                     ) -> list[str]:
    """What is wrong with a language's tables against today's English (``english()`` unless
    ``source_tables`` are given), one line each (empty: all good)."""
    source, theirs = flat(english() if source_tables is None else source_tables), flat(translated)
    problems = [f"{lang}: {key} has no translation" for key in source if not str(theirs.get(key, "")).strip()]
    problems += [f"{lang}: {key} translates something that no longer exists" for key in theirs if key not in source]
    problems += [f"{lang}: {key} was translated from other English (now: {source[key]!r})"
                 for key in source if key in theirs and recorded.get(key) != digest(source[key])]
    return problems
