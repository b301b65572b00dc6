"""Run the whole test suite: ``python3 devtools/run_tests.py``.

By default on the pinned ComfyUI host, built on first use (cached outside the clone, see
devtools/host.py). ``--comfyui PATH`` runs the same suite against any other ComfyUI tree (your
own checkout after an update, say) with that tree's Python environment: ``--python`` names it,
otherwise the first of ``PATH/venv``, ``PATH/.venv`` and the Python running this script that
imports torch is taken. The suite's own test tools (pytest, playwright, tomesd, matplotlib;
diffusers and accelerate at the versions tests/requirements.txt pins) are installed into that
environment when missing; torch and everything else in it is left as it is
(``--no-install`` refuses even that). Extra arguments go to pytest (e.g. ``-k tome -x``).

``--forge PATH`` also runs the Stable Diffusion WebUI Forge tests (tests/test_forge_server*.py)
against that Forge tree, started as a server with ``--forge-python`` (default ``PATH/venv``)
in a throwaway data dir, so the tree is not modified, and tests/test_forge_flux.py, which imports
that tree's backend modules in-process (``gguf``, which they import, is installed when missing);
without it they are skipped, saying so.
``python3 devtools/run_tests.py --forge PATH tests/test_forge_*.py`` runs only the Forge tests.

``--gguf PATH`` (city96's ComfyUI-GGUF) and ``--kjnodes PATH`` (kijai's ComfyUI-KJNodes) run the
tests of our nodes beside those packs (tests/test_gguf_inprocess.py, tests/test_kjnodes_inprocess.py),
loaded from the trees named; the Python packages a pack needs (``gguf``) are installed when missing.
Without them those tests are skipped, naming the flag.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "devtools"))

import custom_packs  # noqa: E402
import host  # noqa: E402

TEST_TOOLS = {"pytest": "pytest", "xdist": "pytest-xdist", "playwright": "playwright", "tomesd": "tomesd",
              "matplotlib": "matplotlib", "requests": "requests",
              "skimage": "scikit-image==0.26.0"}  # import name -> what pip installs


def _pinned(name: str) -> str:
    """The requirement tests/requirements.txt pins for ``name`` (the diffusers adapter's tests)."""
    for line in (REPO / "tests" / "requirements.txt").read_text(encoding="utf-8").splitlines():
        requirement = line.split("#")[0].strip()
        if requirement.split("==")[0].strip() == name:
            return requirement
    return name


TEST_TOOLS.update({name: _pinned(name) for name in ("diffusers", "accelerate")})
# What Forge's backend modules import beyond the host's packages: tests/test_forge_flux.py imports
# them in-process (--forge).
FORGE_BACKEND = {"gguf": "gguf"}


def _imports(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def _python_of(comfyui: Path, explicit: str | None) -> str:
    if explicit:
        return explicit
    candidates = [comfyui / "venv" / "bin" / "python", comfyui / ".venv" / "bin" / "python",
                  comfyui / "venv" / "Scripts" / "python.exe", comfyui / ".venv" / "Scripts" / "python.exe"]
    for candidate in [*map(str, filter(Path.exists, candidates)), sys.executable]:
        if _imports(candidate, "torch"):
            return candidate
    raise SystemExit(f"no Python with torch found for {comfyui}: name it with --python")


def _prepare_other_tree(comfyui: Path, python: str, install: bool) -> None:
    if not (comfyui / "comfy").is_dir() or not (comfyui / "main.py").exists():
        raise SystemExit(f"{comfyui} is not a ComfyUI tree (no comfy/ or main.py)")
    _install_missing(python, TEST_TOOLS, install)


def _install_missing(python: str, packages: dict, install: bool) -> None:
    """Install into ``python`` the packages (import name -> what pip installs) it lacks, its torch pinned."""
    missing = [pip_name for module, pip_name in packages.items() if not _imports(python, module)]
    if not missing:
        return
    if not install:
        raise SystemExit(f"{python} lacks the test tools {', '.join(missing)}; install them "
                         f"(pip install {' '.join(missing)}) or run without --no-install")
    # Pin the torch that is there, so that nothing we install can swap it.
    torch_version = subprocess.run([python, "-c", "import torch; print(torch.__version__.split('+')[0])"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    cmd = [python, "-m", "pip", "install", "-q", "--no-input", *missing, f"torch=={torch_version}"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _worker_args(workers: int | None, named: bool, pytest_args: list[str]) -> list[str]:
    """pytest-xdist's arguments. The whole suite runs on two workers: much of it waits on a
    server, a browser or a subprocess, or runs tiny models whose Python overhead uses one core,
    so a second worker fills the other (CONTRIBUTING.md, "Tests"). Each module stays
    on one worker (``--dist loadfile``) so its servers start once; the memory-heavy ones take
    turns (tests/conftest.py, ``ONE_AT_A_TIME``)."""
    if any(arg == "-n" or arg.startswith(("-n", "--numprocesses", "--dist")) for arg in pytest_args):
        return []  # the caller chose
    if workers is None:
        workers = 1 if named or (os.cpu_count() or 1) < 2 else 2
    return ["-n", str(workers), "--dist", "loadfile"] if workers > 1 else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--comfyui", type=Path, help="a ComfyUI tree to test against (default: the pinned host)")
    parser.add_argument("--python", help="that tree's Python (default: its venv, else this Python)")
    parser.add_argument("--no-install", action="store_true", help="do not install missing test tools into --python")
    parser.add_argument("--forge", type=Path, help="a Stable Diffusion WebUI Forge tree: also run the Forge tests")
    parser.add_argument("--forge-python", help="that tree's Python (default: PATH/venv)")
    for name, pack in custom_packs.PACKS.items():
        parser.add_argument(pack.flag, type=Path, dest=f"pack_{name}", metavar="PATH",
                            help=f"a {pack.name} tree: also run our nodes beside it")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="pytest workers (pytest-xdist; default: 2 for the whole suite on 2 or more cores, "
                             "1 where test files are named; 1 = one process)")
    args, pytest_args = parser.parse_known_args()
    if args.forge_python and not args.forge:
        parser.error("--forge-python goes with --forge")
    if args.comfyui is None:
        if args.python:
            parser.error("--python goes with --comfyui")
        built = host.ensure_host()
        comfyui, python = built.comfyui, str(built.python)
    else:
        comfyui = args.comfyui.expanduser().resolve()
        python = _python_of(comfyui, args.python)
        _prepare_other_tree(comfyui, python, install=not args.no_install)
    env = {**os.environ, "TOKENREDUCE_COMFYUI": str(comfyui), "PYTHONUNBUFFERED": "1"}
    for name, pack in custom_packs.PACKS.items():
        folder = getattr(args, f"pack_{name}")
        if folder is not None:
            env[pack.variable] = str(folder.expanduser().resolve())
            _install_missing(python, {module: module for module in pack.requirements}, not args.no_install)
    if args.forge:
        env["TOKENREDUCE_FORGE"] = str(args.forge.expanduser().resolve())
        _install_missing(python, FORGE_BACKEND, not args.no_install)
        if args.forge_python:
            env["TOKENREDUCE_FORGE_PYTHON"] = args.forge_python
    # The whole suite unless test files or ids were named.
    named = any(Path(arg.split("::")[0]).exists() for arg in pytest_args if not arg.startswith("-"))
    cmd = [python, "-m", "pytest", "-c", str(REPO / "tests" / "pytest.ini"), *([] if named else [str(REPO / "tests")]),
           *_worker_args(args.workers, named, pytest_args), *pytest_args]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=REPO, env=env)


if __name__ == "__main__":
    sys.exit(main())
