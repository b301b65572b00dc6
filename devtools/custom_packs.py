"""Other ComfyUI custom-node packs the tests run ours beside, from trees the tester names (never
part of this repository, never copied into it): city96's ComfyUI-GGUF (``--gguf PATH``) and
kijai's ComfyUI-KJNodes (``--kjnodes PATH``) of ``devtools/run_tests.py``. Without the flag the
tests that need a pack are skipped, saying which flag runs them. Loaded in-process the way
ComfyUI loads a custom node: the package from its folder (its own relative imports work), or one
module of it where importing the whole pack would need what the tests do not use."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import NamedTuple


class Pack(NamedTuple):
    variable: str  # the environment variable run_tests.py sets from the flag
    flag: str
    name: str  # as its author publishes it
    requirements: tuple[str, ...]  # Python packages it needs beyond ComfyUI's (installed by run_tests.py)


PACKS = {
    "gguf": Pack("TOKENREDUCE_GGUF", "--gguf", "city96/ComfyUI-GGUF", ("gguf",)),
    "kjnodes": Pack("TOKENREDUCE_KJNODES", "--kjnodes", "kijai/ComfyUI-KJNodes", ()),
}


def tree(pack: str) -> Path | None:
    value = os.environ.get(PACKS[pack].variable)
    return Path(value).expanduser().resolve() if value else None


def skip_reason(pack: str) -> str:
    spec = PACKS[pack]
    return (f"needs a {spec.name} tree: python3 devtools/run_tests.py {spec.flag} PATH (or {spec.variable}=PATH); "
            f"CI runs without it")


def load_package(pack: str):
    """The pack's package, imported from its tree as ComfyUI imports a custom node folder."""
    folder = tree(pack)
    name = f"tokenreduce_test_{pack}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def load_module(pack: str, relative: str):
    """One module of the pack (``relative``: its path in the tree), imported on its own."""
    name = f"tokenreduce_test_{pack}_{Path(relative).stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, tree(pack) / relative)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def commit(pack: str) -> str:
    """The tree's git commit where it has one (the report names what was tested)."""
    head = tree(pack) / ".git" / "HEAD"
    return head.read_text().strip() if head.exists() else "(no .git)"
