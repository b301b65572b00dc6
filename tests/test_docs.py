"""The docs (issue #34): a short README, nothing of the old README lost, every command shown real.

Fast (seconds, no host server): the markdown is parsed here, the scripts' ``--help`` runs with the
Python running the tests.

- The README is a front page: under ``README_MAX_LINES`` lines, the two commands for a fresh
  machine in its first ``COMMANDS_WITHIN`` lines.
- Every heading of the README as it was before the split (``OLD_README_HEADINGS``, recorded from
  commit b0b6a36) is a heading of the same name in the README, in ``docs/*.md`` or in
  ``CONTRIBUTING.md``: no subject was lost.
- Every ``python3 devtools/X.py ...`` command in the README, ``docs/*.md`` and ``CONTRIBUTING.md``
  (inline or in a code block, with ``\\`` continuations) names a script that exists, and each
  ``--flag`` it shows appears in that script's ``--help`` (for ``run_tests.py``, which passes the
  rest to pytest, also the options ``tests/conftest.py`` adds).
- Local links and ``#anchors`` in our markdown resolve (GitHub's heading anchors).
- ``docs/nodes.md`` lists every input of both nodes with the default and range declared in
  ``tokenreduce/methods.py``.
- ``.github/workflows/tests.yml`` and ``publish.yml`` parse as YAML; tests runs the README's test
  command; publish uses the Comfy registry's action and runs only after tests passed on main.
- ``CHANGELOG.md`` has *Unreleased* on top and a section for the version in ``pyproject.toml``.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_MAX_LINES = 260
COMMANDS_WITHIN = 60
FRESH_MACHINE_COMMANDS = ("python3 devtools/demo.py", "python3 devtools/run_tests.py")

# The headings of README.md before issue #34 moved its reference into docs/ (commit b0b6a36).
OLD_README_HEADINGS = (
    "TokenReduce for ComfyUI and Stable Diffusion WebUI Forge",
    "Install into an existing ComfyUI",
    "The node: Token Merging (ToMe, TokenReduce)",
    "Reproducibility",
    "Where it works",
    "The node: Token Downsampling (ToDo, TokenReduce)",
    "ToDo on DiT models",
    "Both together, and with other patches",
    "With other speed-ups",
    "Multiple GPUs and long videos",
    "Which one when",
    "reduce_when auto: measured on your device",
    "What the node shows",
    "In your language, and the help page",
    "Stable Diffusion WebUI Forge",
    "Install into Forge",
    "The accordion",
    "What it says",
    "API",
    "X/Y/Z plot",
    "How it runs in Forge, and what differs from ComfyUI",
    "The Forge tests",
    "Tested with",
    "Run it on a fresh machine",
    "Tests",
    "Layout",
    "Credits",
)



def _docs() -> list[Path]:
    return [README, REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _prose_and_code(text: str) -> tuple[list[str], list[str]]:
    """The lines outside fenced code blocks, and the lines inside them."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        (code if fenced else prose).append(line)
    return prose, code


def headings(path: Path) -> list[str]:
    prose, _ = _prose_and_code(path.read_text(encoding="utf-8"))
    return [m.group(2).strip() for line in prose if (m := re.match(r"(#{1,6})\s+(.*)", line))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(path):
        base = slug(heading)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


# --- the README as a front page ------------------------------------------------------------

def test_readme_is_a_front_page_with_the_two_commands_near_the_top():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines, the limit is {README_MAX_LINES}"
    for command in FRESH_MACHINE_COMMANDS:
        at = next((i + 1 for i, line in enumerate(lines) if line.strip().startswith(command)), None)
        assert at is not None, f"README.md does not show `{command}` as a command"
        assert at <= COMMANDS_WITHIN, f"`{command}` is on line {at} of README.md, not in the first {COMMANDS_WITHIN}"


def test_no_subject_of_the_old_readme_is_lost():
    found = {h for path in _docs() for h in headings(path)}
    missing = [h for h in OLD_README_HEADINGS if h not in found]
    assert not missing, f"headings of the old README found nowhere (README.md, docs/*.md, CONTRIBUTING.md): {missing}"


# --- every command shown exists with its flags -----------------------------------------------

COMMAND = re.compile(r"python3?\s+(devtools/[\w/.-]+\.py)((?:\s+[^\s`]+)*)")


def commands(path: Path) -> list[tuple[str, str]]:
    """(script, its arguments) of each ``python3 devtools/X.py ...`` in a markdown file."""
    prose, code = _prose_and_code(path.read_text(encoding="utf-8"))
    found = []
    for span in re.findall(r"`([^`\n]*devtools/[^`\n]*)`", "\n".join(prose)):
        found.extend((m.group(1), m.group(2)) for m in COMMAND.finditer(span))
    joined = re.sub(r"\\\n\s*", " ", "\n".join(code))  # continuation lines
    for line in joined.splitlines():
        line = re.sub(r"\s#\s.*$", "", line)  # a trailing comment
        found.extend((m.group(1), m.group(2)) for m in COMMAND.finditer(line))
    return found


def _all_commands() -> list[tuple[str, str, str]]:
    return [(_rel(path), script, args) for path in _docs() for script, args in commands(path)]


@functools.lru_cache(maxsize=None)
def help_text(script: str) -> str:
    done = subprocess.run([sys.executable, str(REPO / script), "--help"], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, f"{script} --help failed:\n{done.stderr[-2000:]}"
    text = done.stdout
    if script == "devtools/run_tests.py":  # the rest goes to pytest: our conftest's options count too
        text += (REPO / "tests" / "conftest.py").read_text(encoding="utf-8")
    return text


def test_the_docs_show_commands():
    shown = {(doc, script) for doc, script, _ in _all_commands()}
    assert ("README.md", "devtools/demo.py") in shown and ("README.md", "devtools/run_tests.py") in shown
    assert ("CONTRIBUTING.md", "devtools/benchmark.py") in shown


def test_every_command_in_the_docs_exists_with_the_flags_shown():
    problems = []
    for doc, script, args in _all_commands():
        if not (REPO / script).is_file():
            problems.append(f"{doc}: {script} does not exist")
            continue
        flags = re.findall(r"(?<![\w-])(--[a-z][\w-]*)", args)
        text = help_text(script)
        problems.extend(f"{doc}: {script} has no {flag} (not in its --help)" for flag in flags
                        if not re.search(re.escape(flag) + r"(?![\w-])", text))
    assert not problems, "\n".join(problems)


OPTION_TABLES = (  # (file, heading, script): a table whose first column names that script's flags
    ("CONTRIBUTING.md", "Other hosts, by flag", "devtools/run_tests.py"),
    ("CONTRIBUTING.md", "The benchmark", "devtools/benchmark.py"),
)


@pytest.mark.parametrize("doc, heading, script", OPTION_TABLES)
def test_every_flag_of_an_option_table_exists(doc, heading, script):
    text = (REPO / doc).read_text(encoding="utf-8")
    section = re.split(r"^#+ " + re.escape(heading) + r"\n", text, maxsplit=1, flags=re.M)[1]
    section = re.split(r"^#+ ", section, maxsplit=1, flags=re.M)[0]
    firsts = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")]
    flags = [flag for cell in firsts for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", cell)]
    assert len(flags) >= 5, f"{doc}, {heading}: no option table found"
    missing = [flag for flag in flags if not re.search(re.escape(flag) + r"(?![\w-])", help_text(script))]
    assert not missing, f"{doc}, {heading}: {script} --help has no {missing}"


# --- links ---------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_local_links_and_anchors_resolve():
    problems = []
    for path in [*_docs(), REPO / "CHANGELOG.md"]:
        prose, _ = _prose_and_code(path.read_text(encoding="utf-8"))
        for target in LINK.findall("\n".join(prose)):
            if re.match(r"[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = _rel(linked) if linked.is_relative_to(REPO) else str(linked)
            if not linked.exists():
                problems.append(f"{_rel(path)}: {target}: no such file")
                continue
            if anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"{_rel(path)}: {target}: no heading with that anchor in {where}")
    assert not problems, "\n".join(problems)


# --- the node reference against the declarations --------------------------------------------

def _range(spec) -> str:
    from tokenreduce.inputs import BOOL, FLOAT, INT, SEED

    if spec.kind == FLOAT:
        return f"{spec.low:g} to {spec.high:g}, step {spec.step:g}"
    if spec.kind == INT:
        return f"{spec.low:g} to {spec.high:g}"
    if spec.kind == SEED:
        return "0 to 2^64 - 1"
    if spec.kind == BOOL:
        return "on / off"
    return " / ".join(f"`{option}`" for option in spec.options)


def _default(spec) -> str:
    if isinstance(spec.default, bool):
        return "on" if spec.default else "off"
    if isinstance(spec.default, float):
        return f"{spec.default:g}"
    return str(spec.default)


@pytest.mark.parametrize("method, heading", [("TOME", "The node: Token Merging (ToMe, TokenReduce)"),
                                             ("TODO", "The node: Token Downsampling (ToDo, TokenReduce)")])
def test_the_node_reference_lists_every_declared_input(method, heading):
    from tokenreduce import methods

    text = (REPO / "docs" / "nodes.md").read_text(encoding="utf-8")
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    problems = []
    for spec in getattr(methods, method).inputs:
        row = next((r for r in rows if f"`{spec.name}`" in r.split(" | ")[0]), None)
        if row is None:
            problems.append(f"{spec.name}: no row")
            continue
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        if _default(spec) not in cells[1]:
            problems.append(f"{spec.name}: default {_default(spec)!r} not in {cells[1]!r}")
        if cells[2] != _range(spec):
            problems.append(f"{spec.name}: range {cells[2]!r}, declared {_range(spec)!r}")
    assert not problems, f"docs/nodes.md, {heading}, against tokenreduce/methods.py:\n" + "\n".join(problems)


# --- workflows ------------------------------------------------------------------------------

def _workflow(name: str) -> dict:
    yaml = pytest.importorskip("yaml")
    data = yaml.safe_load((REPO / ".github" / "workflows" / name).read_text(encoding="utf-8"))
    assert isinstance(data, dict) and data.get("jobs"), f"{name}: no jobs"
    data["on"] = data.get("on", data.get(True))  # YAML 1.1 reads the key `on` as true
    return data


def _steps(workflow: dict) -> list[dict]:
    return [step for job in workflow["jobs"].values() for step in job.get("steps", [])]


def test_the_tests_workflow_runs_the_readmes_test_command():
    workflow = _workflow("tests.yml")
    runs = " ".join(step.get("run", "") for step in _steps(workflow))
    test_command = FRESH_MACHINE_COMMANDS[1]
    assert test_command in README.read_text(encoding="utf-8")
    assert test_command in runs, f"tests.yml does not run `{test_command}`"
    assert "push" in workflow["on"] and "main" in workflow["on"]["push"]["branches"]


def test_the_publish_workflow_publishes_to_the_registry_only_after_the_tests_passed():
    tests_name = _workflow("tests.yml")["name"]
    workflow = _workflow("publish.yml")
    uses = [step["uses"] for step in _steps(workflow) if "uses" in step]
    assert any(u.startswith("Comfy-Org/publish-node-action@") for u in uses), uses
    trigger = workflow["on"].get("workflow_run")
    if trigger is not None:  # after the tests workflow, on main, only if it succeeded
        assert tests_name in trigger["workflows"] and trigger["types"] == ["completed"]
        assert trigger["branches"] == ["main"]
        for job in workflow["jobs"].values():
            assert "github.event.workflow_run.conclusion == 'success'" in job.get("if", "")
    else:  # or the tests as a job it needs
        assert any(job.get("needs") for job in workflow["jobs"].values())
    others = set(workflow["on"]) - {"workflow_run"}
    assert not others or trigger is None, f"publish.yml also runs on {others}, without the tests passing first"


def test_the_changelog_has_unreleased_on_top_and_the_current_version():
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(encoding="utf-8"), re.M).group(1)
    sections = [h for h in headings(REPO / "CHANGELOG.md") if h != "Changelog"]
    assert sections[0] == "Unreleased"
    assert any(h.split()[0] == version for h in sections[1:]), f"CHANGELOG.md has no section for {version}"


def test_every_claim_that_tome_equals_tomesd_names_its_condition():
    """tomesd draws its random merge targets from the global RNG, ToMe here from a private seeded
    generator: their outputs are the same only with random targets off (``use_rand=False``).
    Every sentence of the README, the docs and the help pages that says they are the same names
    that condition (a sentence about the plan for given targets needs none)."""
    pages = [README, *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "js" / "docs").rglob("*.md"))]
    unconditioned = []
    for page in pages:
        for paragraph in re.split(r"\n\s*\n|\n(?=\|)|\n(?=- )", page.read_text(encoding="utf-8")):
            for sentence in re.split(r"(?<=[.;:])\s(?=[A-Z(`*])", " ".join(paragraph.split())):
                claim = re.search(r"bit[- ]identical|bit for bit|exact(ly)? tomesd", sentence, re.I)
                if "tomesd" in sentence and claim and "use_rand" not in sentence and "plan is" not in sentence:
                    unconditioned.append(f"{page.relative_to(REPO)}: {sentence[:160]}")
    assert not unconditioned, "\n".join(unconditioned)
