"""The README's counts and lists of model families come from the registry that
``docs/models.md`` is generated from (``tokenreduce/families/``, ``devtools/make_model_table.py``):
the intro names every DiT family ToMe merges and the number ToDo covers, "What it fixes" gives
the same numbers, and the models table names each DiT family once, its catch-all row with the
count of the families it lists. A family added to (or dropped from) the registry fails here,
with the README's phrase as it must read (issue #46, point 6)."""

from __future__ import annotations

import re

from conftest import REPO
from tokenreduce.families import FAMILIES

README = REPO / "README.md"
MORE_ROW = re.compile(r"^\| (\d+) more DiT families: ([^|(]*?)(?: \([^|]*\))? \|", re.MULTILINE)


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def _tome_families() -> list[str]:
    return [family.name for family in FAMILIES if family.merge is not None]


def _configs() -> int:
    return sum(len(family.configs) for family in FAMILIES)


def intro_phrase() -> str:
    tome = _tome_families()
    return (f"merges whole blocks of {len(tome)} DiT families ({', '.join(tome)}); ToDo works on all "
            f"{len(FAMILIES)} DiT families in [models](docs/models.md) ({_configs()} ComfyUI model configs)")


def fixes_phrase() -> str:
    return (f"ToDo on {len(FAMILIES)} DiT families ({_configs()} ComfyUI model configs), ToMe on "
            f"{len(_tome_families())} of them")


def _model_rows(text: str) -> list[str]:
    """The first cells of the README's models table (the one headed ``| models | nodes |``)."""
    table = text[text.index("| models | nodes |"):].split("\n\n")[0]
    return [line.split("|")[1].strip() for line in table.splitlines()[2:]]


def test_the_intro_names_every_family_tome_merges_and_the_number_todo_covers():
    phrase = intro_phrase()
    assert phrase in _readme(), f"README.md's intro must say (docs/models.md's source):\n{phrase}"


def test_what_it_fixes_gives_the_registrys_numbers():
    text = _readme()
    section = text[text.index("## What it fixes"):text.index("\n## ", text.index("## What it fixes") + 3)]
    phrase = fixes_phrase()
    assert phrase in section, f"README.md's 'What it fixes' must say (docs/models.md's source):\n{phrase}"
    assert not re.search(r"\b10 DiT families|20 variants tested", text)


def test_the_models_table_names_each_dit_family_and_counts_its_catch_all_row():
    text = _readme()
    (more,) = MORE_ROW.findall(text)
    count, listed = int(more[0]), [name.strip() for name in more[1].split(",")]
    named_above = " ".join(row for row in _model_rows(text) if not MORE_ROW.match(f"| {row} |"))
    rest = [family.name for family in FAMILIES if family.name not in named_above]
    expected = f"{len(rest)} more DiT families: {', '.join(rest)}"
    assert (count, listed) == (len(rest), rest), f"README.md's models table must have a row starting:\n| {expected} |"
