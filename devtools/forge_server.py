"""Run a Stable Diffusion WebUI Forge server with this repository installed as an extension,
for the Forge tests (tests/test_forge_server*.py), against a Forge tree the user names.

The Forge tree is never modified: the server runs with ``--data-dir`` in a folder of the
caller's choosing, whose ``extensions/`` holds only a symlink to this repository and whose
settings, outputs and caches stay there; checkpoints come from ``--ckpt-dir`` (symlinks); no
bytecode is written (``PYTHONDONTWRITEBYTECODE``). ``--skip-prepare-environment`` keeps the
launcher from cloning, fetching and installing (a test checks ``install.py`` under Forge's
own installer call instead). Stdlib only: the tests' Python need not be Forge's.

Environment: ``TOKENREDUCE_FORGE`` (the tree), ``TOKENREDUCE_FORGE_PYTHON`` (its Python; default
``TREE/venv/bin/python``), ``TOKENREDUCE_FORGE_ARGS`` (extra launch arguments, e.g. for a GPU:
by default the server runs on the CPU unless the tests' torch sees CUDA).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXTENSION_NAME = "sd-webui-tokenreduce"  # the folder name in extensions/ (a clone's name is the user's choice)
FLAG_HELP = "--forge PATH [--forge-python PY] (devtools/run_tests.py), or TOKENREDUCE_FORGE / TOKENREDUCE_FORGE_PYTHON"


def forge_tree() -> Path | None:
    value = os.environ.get("TOKENREDUCE_FORGE")
    return Path(value).expanduser().resolve() if value else None


def forge_python(tree: Path) -> str:
    explicit = os.environ.get("TOKENREDUCE_FORGE_PYTHON")
    if explicit:
        return explicit
    for candidate in (tree / "venv" / "bin" / "python", tree / "venv" / "Scripts" / "python.exe"):
        if candidate.exists():
            return str(candidate)
    raise RuntimeError(f"no Python for the Forge tree {tree}: name it with --forge-python "
                       f"(TOKENREDUCE_FORGE_PYTHON)")


def check_tree(tree: Path) -> None:
    if not (tree / "launch.py").exists() or not (tree / "modules" / "launch_utils.py").exists() \
            or not (tree / "backend").is_dir():
        raise RuntimeError(f"{tree} is not a Stable Diffusion WebUI Forge tree (launch.py, modules/, backend/)")


def forge_version(tree: Path, python: str) -> str:
    """What the tree says it is (its version string, and its commit where it is a git checkout)."""
    code = ("import sys; sys.path.insert(0, '.'); sys.argv = ['x']\n"
            "from modules_forge import forge_version\nprint(forge_version.version)")
    done = subprocess.run([python, "-c", code], cwd=tree, capture_output=True, text=True,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    version = done.stdout.strip() or "unknown version"
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"{version} ({commit.stdout.strip()})" if commit.returncode == 0 else version


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device_args() -> list[str]:
    extra = os.environ.get("TOKENREDUCE_FORGE_ARGS")
    if extra is not None:
        return shlex.split(extra)
    try:
        import torch

        if torch.cuda.is_available():
            return []
    except ImportError:
        pass
    return ["--always-cpu", "--skip-torch-cuda-test"]


class ForgeError(RuntimeError):
    """An API call answered with an error; ``status`` and ``body`` say which."""

    def __init__(self, status: int, body: dict):
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


class ForgeServer:
    """``launch.py`` on 127.0.0.1 in its own data dir, API and UI."""

    def __init__(self, tree: Path, python: str, base: Path, checkpoints: dict[str, Path], args=()):
        self.tree, self.python, self.base = tree, python, base
        self.data = base / "data"
        self.checkpoints = checkpoints
        self.args = list(args)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = base / "server.log"
        self.process: subprocess.Popen | None = None
        self._log = None

    @property
    def extension(self) -> Path:
        return self.data / "extensions" / EXTENSION_NAME

    def start(self, timeout: float = 900) -> "ForgeServer":
        (self.data / "extensions").mkdir(parents=True, exist_ok=True)
        if not self.extension.exists():
            self.extension.symlink_to(REPO, target_is_directory=True)
        ckpt = self.base / "checkpoints"
        ckpt.mkdir(exist_ok=True)
        for name, path in self.checkpoints.items():
            if not (ckpt / name).exists():
                (ckpt / name).symlink_to(path)
        cmd = [self.python, "launch.py", "--skip-prepare-environment", "--skip-install", "--api",
               "--server-name", "127.0.0.1", "--port", str(self.port), "--data-dir", str(self.data),
               "--ckpt-dir", str(ckpt),
               # The UI's own scripts live in the tree, outside the data dir: allow serving them.
               "--gradio-allowed-path", str(self.tree), *_device_args(), *self.args]
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "COMMANDLINE_ARGS": ""}
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(cmd, cwd=self.tree, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"Forge exited with {self.process.returncode} while starting:\n{self.log_tail()}")
            try:
                self.get("/sdapi/v1/sd-models", timeout=5)
                return self
            except (OSError, ForgeError):
                time.sleep(2)
        self.stop()
        raise RuntimeError(f"Forge did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self._log is not None:
            self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def _request(self, method: str, path: str, body=None, timeout: float = 3600):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            raw = error.read()
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                body = {"raw": raw.decode(errors="replace")}
            raise ForgeError(error.code, body) from None

    def get(self, path: str, timeout: float = 60):
        return self._request("GET", path, timeout=timeout)

    def post(self, path: str, body, timeout: float = 3600):
        return self._request("POST", path, body, timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
