"""Translations and help pages, without a host: every node, input, output and setting has a
text in every shipped language, made from today's English; no translation names something
that is gone; every node has a help page per language that covers each of its inputs; the
WebUI extension's localization files are made from the same translations and cover its
accordion. (In the browser: tests/test_browser.py, the UI language and the help page.)"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tokenreduce import locales
from tokenreduce.catalog import NODES, TOOLS
from tokenreduce_forge import localization

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "devtools"))

import make_locales  # noqa: E402  (devtools/make_locales.py)

HELP = REPO / "js" / "docs"  # served by ComfyUI as /extensions/<pack>/docs/ (the pack's web directory)


def test_the_english_tables_on_disk_are_the_ones_the_nodes_declare():
    for name, table in make_locales.english().items():
        on_disk = json.loads((make_locales.LOCALES / "en" / f"{name}.json").read_text(encoding="utf-8"))
        assert on_disk == table, f"locales/en/{name}.json is out of date: run python3 devtools/make_locales.py"


@pytest.mark.parametrize("lang", locales.LANGUAGES)
def test_every_text_is_translated_from_todays_english(lang):
    assert make_locales.problems(lang) == []


def test_the_check_names_a_missing_a_removed_and_a_stale_translation():
    translated = make_locales.tables_of("zh")
    recorded = json.loads((make_locales.LOCALES / "zh" / f"{locales.DIGESTS}.json").read_text(encoding="utf-8"))
    todo = translated["nodeDefs"]["TokenReduceToDo"]["inputs"]
    del todo["factor"]["tooltip"]
    todo["gone_input"] = {"name": "x", "tooltip": "y"}
    recorded["nodeDefs.TokenReduceToDo.inputs.method.tooltip"] = "0" * 12
    problems = "\n".join(locales.stale_or_missing("zh", translated, recorded))
    assert "nodeDefs.TokenReduceToDo.inputs.factor.tooltip has no translation" in problems
    assert "nodeDefs.TokenReduceToDo.inputs.gone_input.name translates something that no longer exists" in problems
    assert "nodeDefs.TokenReduceToDo.inputs.method.tooltip was translated from other English" in problems


def test_the_check_names_the_help_pages_translated_from_an_older_english_page(monkeypatch):
    """A changed English help page makes the check name every translated page made from the old one."""
    english = make_locales.english_help_pages()
    assert set(english) == {node.node_id for node in (*NODES, *TOOLS)}
    changed = {**english, "TokenReduceToDo": english["TokenReduceToDo"] + "\nA new paragraph.\n"}
    monkeypatch.setattr(make_locales, "english_help_pages", lambda: changed)
    for lang in locales.LANGUAGES[1:]:
        assert make_locales.problems(lang) == [
            f"{lang}: js/docs/TokenReduceToDo/{lang}.md was translated from another js/docs/TokenReduceToDo.md "
            f"than today's"]


def test_translations_are_in_their_language_and_keep_the_searchable_names():
    scripts = {"zh": r"[\u4e00-\u9fff]", "ja": r"[\u3040-\u30ff]", "ko": r"[\uac00-\ud7af]"}
    for lang, script in scripts.items():
        texts = locales.flat(make_locales.tables_of(lang))
        tooltips = [text for key, text in texts.items() if key.endswith((".tooltip", ".description"))]
        assert all(re.search(script, text) for text in tooltips), lang
        for node in NODES:  # "(ToMe, TokenReduce)": found by the same search in every language
            assert node.title[node.title.index("("):] in texts[f"nodeDefs.{node.node_id}.display_name"]


def test_the_setting_the_tables_translate_is_the_one_the_extension_declares():
    script = (REPO / "js" / "tokenreduce.js").read_text(encoding="utf-8")
    joined = re.sub(r'"\s*\+\s*"', "", script)  # string literals split over lines, joined
    assert f'const SETTING_SHOW = "{locales.SETTING_ID}"' in script
    assert f'name: "{locales.SETTING_NAME}"' in joined
    assert f'"{locales.SETTING_TOOLTIP}"' in joined
    assert f'category: [{", ".join(json.dumps(c) for c in locales.SETTING_CATEGORIES)}, "Show"]' in script


def help_pages(node_id: str) -> dict[str, Path]:
    """The help page of each shipped language: the plain file is the fallback (English)."""
    return {lang: HELP / (f"{node_id}.md" if lang == "en" else f"{node_id}/{lang}.md") for lang in locales.LANGUAGES}


@pytest.mark.parametrize("node", NODES, ids=[n.node_id for n in NODES])
def test_every_node_has_a_help_page_per_language_covering_every_input(node):
    for lang, page in help_pages(node.node_id).items():
        text = page.read_text(encoding="utf-8")
        assert text.startswith("# "), page
        assert node.title[node.title.index("("):] in text.splitlines()[0], page
        missing = [name for name in ["model", *node.method.names] if f"`{name}`" not in text]
        assert not missing, f"{page} does not explain {missing}"
        for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
            assert (HELP / image).is_file(), f"{page}: {image} (relative to the docs folder, as the frontend reads it)"


@pytest.mark.parametrize("tool", TOOLS, ids=[t.node_id for t in TOOLS])
def test_every_tool_node_has_a_help_page_per_language_covering_its_inputs_and_outputs(tool):
    """The nodes that patch no model (the image compare): the same as the patch nodes' pages."""
    for lang, page in help_pages(tool.node_id).items():
        text = page.read_text(encoding="utf-8")
        assert text.startswith("# ") and tool.title[tool.title.index("("):] in text.splitlines()[0], page
        missing = [port.name for port in (*tool.inputs, *tool.outputs) if f"`{port.name}`" not in text]
        assert not missing, f"{page} does not explain {missing}"


def test_the_help_pages_and_descriptions_say_where_tome_acts_and_that_the_nodes_stack():
    """What the nodes' help pages and ToMe's description say of ToMe follows the code: the ToMe
    page, in every language, names at least 8 DiT families whose blocks it merges
    (``Family.merge``; the page of UNets only named 3 in passing), its description at least one;
    no English help page, description, README or docs page says ToMe is for UNets only or that
    the two nodes are not to be used together (they stack, on UNets and DiTs)."""
    from tokenreduce.catalog import TOME_NODE
    from tokenreduce.families import FAMILIES

    merged = [family.name for family in FAMILIES if family.merge is not None]
    for page in help_pages(TOME_NODE.node_id).values():
        named = [name for name in merged if name in page.read_text(encoding="utf-8")]
        assert len(named) >= 8, f"{page} names only {named} of the DiT families ToMe merges: {merged}"
    assert any(name in TOME_NODE.description for name in merged), f"{TOME_NODE.description!r} names no DiT"
    texts = {str(page): page.read_text(encoding="utf-8") for page in [REPO / "README.md", *(REPO / "docs").glob("*.md")]}
    for node in NODES:
        texts[f"the {node.node_id} node's description"] = node.description
        texts[str(HELP / f"{node.node_id}.md")] = (HELP / f"{node.node_id}.md").read_text(encoding="utf-8")
    stale = re.compile(r"SDXL UNets only|refuses DiTs|not both|one of the two per model", re.IGNORECASE)
    found = {where: stale.findall(text) for where, text in texts.items() if stale.search(text)}
    assert not found, f"stale claims about ToMe: {found}"


# --- the WebUI extension (Forge): its accordion through the WebUI's localization files ----------

def test_the_webui_localization_files_are_made_from_the_translations():
    for name, table in make_locales.webui_tables().items():
        on_disk = json.loads((make_locales.WEBUI / f"{name}.json").read_text(encoding="utf-8"))
        assert on_disk == table, f"localizations/{name}.json is out of date: run python3 devtools/make_locales.py"


@pytest.mark.parametrize("lang", sorted(localization.FILES))
def test_every_text_of_the_accordion_has_its_translation_in_the_webui_file(lang):
    table = make_locales.webui_tables()[localization.FILES[lang]]
    assert sorted(localization.shown() - set(table)) == []
    assert not {"off", "hires", "auto", "ToDo", "ToMe"} & set(table)  # words the WebUI's own controls also show
    assert table["ToDo factor"].startswith("ToDo ") and table["ToDo factor"] != "ToDo factor"
