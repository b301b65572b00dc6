"""The auto rule's margin is one constant (``pays.MARGIN``): every text that states it, the report's
warning, the help pages in every language, the tooltips, the README and docs/, says that number."""

from __future__ import annotations

import re
from pathlib import Path

from tokenreduce import describe, pays
from tokenreduce.run import RunState
from tokenreduce.window import SigmaWindow

REPO = Path(__file__).resolve().parents[1]
NUMBER = r"(\d+(?:\.\d+)?) ?%"
# How each language states the margin ("at least 3 % faster", "a 3 % margin", 至少快 3 %, ...).
PHRASES = [rf"at least {NUMBER} faster", rf"{NUMBER} margin", rf"margin of {NUMBER}", rf"margin \({NUMBER}\)",
           rf"至少快 ?{NUMBER}", rf"{NUMBER} ?以上速", rf"{NUMBER} ?이상 빠"]


def stated_margins(text: str) -> list[str]:
    return [match for phrase in PHRASES for match in re.findall(phrase, text)]


def texts() -> dict[Path, str]:
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "js" / "docs").rglob("*.md")),
             *sorted((REPO / "locales").rglob("*.json")), *sorted((REPO / "localizations").glob("*.json"))]
    return {path: path.read_text(encoding="utf-8") for path in paths if path.is_file()}


def test_every_text_that_states_the_margin_states_the_constant():
    expected = f"{pays.MARGIN * 100:g}"
    found = {path.relative_to(REPO).as_posix(): stated_margins(text) for path, text in texts().items()}
    wrong = {path: numbers for path, numbers in found.items() if any(n != expected for n in numbers)}
    assert not wrong, f"these state a margin other than pays.MARGIN ({expected} %): {wrong}"
    assert all(found.get(page) for page in ("js/docs/TokenReduceToMe.md", "locales/en/nodeDefs.json"))


def test_the_scan_would_see_another_number():
    assert stated_margins("reduced only where that is at least 5 % faster") == ["5"]
    assert stated_margins("仅当缩减至少快 5 % 时才缩减") == ["5"]


def test_the_report_words_the_margin_from_the_constant(monkeypatch):
    monkeypatch.setattr(describe, "MARGIN", 0.05)
    run = RunState(SigmaWindow(1.0, 0.0))
    run.decisions[("downsample 1 (32×32)", "cuda:0")] = pays.Decision(False, 10.0, 9.8, pays.MEASURED)
    (warning,) = run.report("ToDo", 0.0, 1.0, 1.0, True, None).warnings
    assert "not at least 5 % faster" in warning
