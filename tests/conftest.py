"""Shared test setup.

Core tests (test_core_*.py) need only torch and tomesd. Host tests (test_comfy_*.py) run on
the real pinned ComfyUI built by devtools/host.py: in-process through the ``comfy`` fixture,
or as a server (server_helpers.py). Run everything with ``python3 devtools/run_tests.py``, which
builds the host first, or against another ComfyUI tree with ``--comfyui PATH``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PACK_MODULE = "tokenreduce_pack"  # the name the tests load the pack under, as ComfyUI would

# The diffusers adapter keeps reduce_when auto's decisions in the user's cache directory
# ($XDG_CACHE_HOME/tokenreduce): the tests (each pytest worker) keep theirs in a directory of
# their own, made anew each session, so a test never finds what an earlier session on the machine
# measured (a test passed on a machine with a filled store and failed on a fresh one) nor writes
# into the user's store.
_CACHE = tempfile.TemporaryDirectory(prefix="tokenreduce-tests-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE.name


def comfyui_dir() -> Path:
    explicit = os.environ.get("TOKENREDUCE_COMFYUI")
    if explicit:
        return Path(explicit)
    sys.path.insert(0, str(REPO / "devtools"))
    import host  # noqa: E402  (devtools/host.py: stdlib only)

    return host.host_location().comfyui


def workers() -> int:
    """How many pytest workers share this machine (devtools/run_tests.py starts two for the whole suite)."""
    return max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def threads_per_worker() -> int:
    """Torch threads for one worker: the cores shared out, so two workers on two cores do not
    each spin two threads (oversubscribed, torch's parallel regions run slower than on one)."""
    return max(1, min(4, (os.cpu_count() or 1) // workers()))


# Modules whose servers or browsers hold full-size random SDXL (several GB a process) or install
# shared tools (Chromium, frontends): run_tests.py's two workers (``--dist loadfile``: a module
# stays on one worker, so its servers start once) never run two of them at once on a 24 GB,
# 2-core machine: each holds a lock shared by the run's workers while its module runs.
ONE_AT_A_TIME = {"test_browser", "test_browser_advanced_inputs", "test_comfy_soak", "test_comfy_server_sdxl",
                 "test_forge_server", "test_forge_server_sdxl", "test_forge_flux"}


@pytest.fixture(scope="module", autouse=True)
def one_at_a_time(request):
    """Holds the run's lock while a module of ONE_AT_A_TIME runs (another worker waits for it)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None or request.module.__name__.rpartition(".")[2] not in ONE_AT_A_TIME:
        yield
        return
    import fcntl

    with open(Path(tempfile.gettempdir()) / f"tokenreduce-tests-{run}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def pytest_addoption(parser) -> None:
    parser.addoption("--write-pins", action="store_true",
                     help="test_pins.py: write tests/data/pins.json from the current code instead of comparing")
    parser.addoption("--pins-info-only", action="store_true",
                     help="with --write-pins: rewrite only the info digests (after a deliberate change of wording)")


def pytest_report_header(config) -> list[str]:
    root = comfyui_dir()
    sys.path.insert(0, str(REPO / "devtools"))
    from comfy_server import comfyui_version

    lines = [f"ComfyUI {comfyui_version(root)} at {root}; torch {torch.__version__}; Python {sys.version.split()[0]}"]
    from forge_server import FLAG_HELP, forge_python, forge_tree, forge_version

    import custom_packs

    for name, pack in custom_packs.PACKS.items():
        folder = custom_packs.tree(name)
        lines.append(f"{pack.name}: " + (f"{folder} at {custom_packs.commit(name)}" if folder else
                                         f"not named ({pack.flag} PATH): its tests are skipped"))
    tree = forge_tree()
    if tree is None:
        lines.append(f"Forge tests: skipped (no Forge tree; {FLAG_HELP})")
    else:
        try:
            python = forge_python(tree)
            lines.append(f"Forge {forge_version(tree, python)} at {tree}; its Python {python}")
        except RuntimeError as problem:
            lines.append(f"Forge at {tree}: {problem}")
    return lines


@pytest.fixture(scope="session")
def comfy() -> types.SimpleNamespace:
    """The real ComfyUI, imported in this process (CPU unless a GPU is present), and this pack
    loaded as a package the way ComfyUI loads custom nodes."""
    root = comfyui_dir()
    if not (root / "comfy").is_dir():
        pytest.fail(f"no ComfyUI at {root}: run `python3 devtools/run_tests.py`, which builds the pinned host")
    return load_comfy(root)


def load_comfy(root: Path) -> types.SimpleNamespace:
    """Import the ComfyUI at ``root`` and this pack into this process (also used by scripts the
    tests run as separate processes)."""
    sys.path.insert(0, str(root))
    from comfy.cli_args import args

    args.cpu = not torch.cuda.is_available()
    import comfy.model_management
    import comfy.sample
    import comfy.samplers
    import random_models

    if PACK_MODULE not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACK_MODULE, REPO / "__init__.py",
                                                      submodule_search_locations=[str(REPO)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACK_MODULE] = module
        spec.loader.exec_module(module)
    torch.set_num_threads(threads_per_worker())
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        # Each pytest worker keeps the auto rule's decisions in a user directory of its own, as a
        # serial run keeps them in the host tree's: no worker reads what another measured.
        import folder_paths

        folder_paths.set_user_directory(tempfile.mkdtemp(prefix=f"tokenreduce-{worker}-user-"))
    return types.SimpleNamespace(
        root=root,
        sample=comfy.sample,
        samplers=comfy.samplers,
        model_management=comfy.model_management,
        models=random_models,
        pack=importlib.import_module(f"{PACK_MODULE}.nodes.tome_node"),
        todo=importlib.import_module(f"{PACK_MODULE}.nodes.todo_node"),
    )


@pytest.fixture(scope="session")
def models(comfy):
    """Tiny random-weight models of each UNet family, shared by the in-process tests."""
    return {family: comfy.models.make_model(family, tiny=True, seed=0) for family in ("SD15", "SD21", "SDXL")}


@pytest.fixture
def measuring(comfy, monkeypatch, tmp_path):
    """measuring(*script, path=...) -> a decisions store that measures on the CPU with a
    scripted clock, made the nodes' store."""
    common = sys.modules[f"{PACK_MODULE}.nodes.common"]

    def make(*script, path=tmp_path / "auto_decisions.json"):
        from comfy_helpers import ScriptedClock

        pays = sys.modules[f"{PACK_MODULE}.tokenreduce.pays"]
        store = pays.Decisions(path, measure_cpu=True, stopwatch=ScriptedClock(*script))
        monkeypatch.setattr(common, "decisions", lambda: store)
        return store

    return make
