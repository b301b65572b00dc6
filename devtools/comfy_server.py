"""Run the pinned ComfyUI as a server with this pack installed, and talk to its HTTP API.

Everything the server writes (models folder, custom_nodes, user data, outputs) lives under a
base directory of the caller's choosing, so the cached host stays untouched. The pack is
installed the way a user installs it: a folder in ``custom_nodes/`` (here a symlink to the
repo). Used by the end-to-end tests and the demo.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import requests

from host import cache_base

REPO = Path(__file__).resolve().parent.parent
PACK_FOLDER = "ComfyUI-TokenReduce"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PromptRejected(Exception):
    """POST /prompt answered 400: the prompt failed validation."""

    def __init__(self, body: dict):
        super().__init__(json.dumps(body)[:2000])
        self.body = body


class ComfyServer:
    def __init__(self, comfyui: Path, python: Path | str, base: Path, checkpoints: dict[str, Path] | None = None,
                 extra_args: list[str] | None = None):
        self.comfyui = Path(comfyui)
        self.python = str(python)
        self.base = Path(base)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.client_id = uuid.uuid4().hex
        self.output = self.base / "output"
        self.log_path = self.base / "server.log"
        self._prepare(checkpoints or {})
        self.extra_args = extra_args or []
        self.process: subprocess.Popen | None = None

    def _prepare(self, checkpoints: dict[str, Path]) -> None:
        nodes_dir = self.base / "custom_nodes"
        nodes_dir.mkdir(parents=True, exist_ok=True)
        link = nodes_dir / PACK_FOLDER
        if not link.exists():
            link.symlink_to(REPO, target_is_directory=True)
        ckpt_dir = self.base / "models" / "checkpoints"
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for name, path in checkpoints.items():
            target = ckpt_dir / name
            if not target.exists():
                target.symlink_to(Path(path).resolve())
        self.output.mkdir(parents=True, exist_ok=True)

    def start(self, timeout: float = 240.0) -> "ComfyServer":
        cmd = [self.python, "main.py", "--listen", "127.0.0.1", "--port", str(self.port), "--disable-auto-launch",
               "--base-directory", str(self.base), "--output-directory", str(self.output), *self.extra_args]
        try:
            import torch  # only to tell whether this machine has a GPU
            gpu = torch.cuda.is_available()
        except ImportError:
            gpu = False
        if not gpu:
            cmd.append("--cpu")
        self._log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(cmd, cwd=self.comfyui, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                if requests.get(f"{self.url}/object_info/KSampler", timeout=5).ok:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"ComfyUI did not answer within {timeout:.0f} s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> "ComfyServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # --- API -------------------------------------------------------------------------------
    def get(self, path: str, **kwargs):
        response = requests.get(f"{self.url}{path}", timeout=60, **kwargs)
        response.raise_for_status()
        return response.json()

    def object_info(self, node: str | None = None) -> dict:
        return self.get(f"/object_info/{node}" if node else "/object_info")

    def queue(self, prompt: dict) -> str:
        response = requests.post(f"{self.url}/prompt", json={"prompt": prompt, "client_id": self.client_id}, timeout=60)
        if response.status_code == 400:
            raise PromptRejected(response.json())
        response.raise_for_status()
        return response.json()["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 900.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            history = self.get(f"/history/{prompt_id}")
            if prompt_id in history and history[prompt_id].get("status", {}).get("completed") is not None:
                entry = history[prompt_id]
                if entry["status"].get("status_str") in ("success", "error"):
                    return entry
            time.sleep(0.25)
        raise TimeoutError(f"prompt {prompt_id} did not finish within {timeout:.0f} s")

    def run(self, prompt: dict, timeout: float = 900.0) -> dict:
        entry = self.wait(self.queue(prompt), timeout)
        if entry["status"]["status_str"] != "success":
            raise RuntimeError(f"prompt failed: {json.dumps(entry['status'])[:4000]}")
        return entry

    def _follow(self, prompt: dict, handle, raise_errors: bool = True) -> str:
        """Queue a prompt and pass each websocket message about it to ``handle(type, data)``
        until the prompt finishes or ``handle`` returns True. Returns the prompt id; raises
        if the prompt fails with an execution error (unless ``raise_errors`` is off)."""
        import asyncio

        import aiohttp

        async def follow() -> str:
            async with aiohttp.ClientSession() as session:
                async with session.ws_connect(f"ws://127.0.0.1:{self.port}/ws?clientId={self.client_id}") as ws:
                    prompt_id = self.queue(prompt)
                    async for message in ws:
                        if message.type != aiohttp.WSMsgType.TEXT:
                            continue
                        event = json.loads(message.data)
                        data = event.get("data", {})
                        if data.get("prompt_id") != prompt_id:
                            continue
                        if handle(event["type"], data):
                            break
                        if event["type"] == "execution_error":
                            if raise_errors:
                                raise RuntimeError(data.get("exception_message"))
                            break  # the prompt ends here
                        if event["type"] == "executing" and data.get("node") is None:
                            break
                    return prompt_id

        return asyncio.run(asyncio.wait_for(follow(), timeout=3600))

    def queue_and_follow(self, prompt: dict, node: str, on_progress) -> str:
        """Queue a prompt and follow it until it finishes. ``on_progress`` gets each progress
        value of ``node``; if it returns True, following stops there. Returns the prompt id."""
        return self._follow(prompt, lambda kind, data: kind == "progress" and data.get("node") == node
                            and bool(on_progress(data["value"])))

    def run_collecting(self, prompt: dict, kinds: set[str], raise_errors: bool = True) -> tuple[str, list]:
        """Run a prompt to its end; returns its id and the websocket messages ``(type, data)``
        of those kinds that the server sent about it, in order."""
        seen: list[tuple[str, dict]] = []
        prompt_id = self._follow(prompt, lambda kind, data: seen.append((kind, data)) if kind in kinds else None,
                                 raise_errors)
        return prompt_id, seen

    def interrupt(self) -> None:
        requests.post(f"{self.url}/interrupt", json={}, timeout=30).raise_for_status()

    def cancel_all(self) -> None:
        """Drop the queued prompts and stop the running one (by its id), so that the next
        prompt starts at once."""
        queue = self.get("/queue")
        if queue.get("queue_pending"):
            requests.post(f"{self.url}/queue", json={"clear": True}, timeout=30).raise_for_status()
        for item in queue.get("queue_running", []):
            requests.post(f"{self.url}/interrupt", json={"prompt_id": item[1]}, timeout=30).raise_for_status()

    def free(self) -> None:
        """Unload models and drop the execution cache: the next prompt re-executes every node."""
        requests.post(f"{self.url}/free", json={"unload_models": True, "free_memory": True},
                      timeout=30).raise_for_status()
        # The worker reads the flags after its next queue wake-up; a prompt queued right now
        # could run first, from the old cache. It is single-threaded and frees before it takes
        # the next item, so once a throwaway prompt has finished, the free has happened.
        self.run({"1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": 0}},
                  "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}}})

    def images(self, entry: dict) -> list[Path]:
        paths = []
        for output in entry["outputs"].values():
            for image in output.get("images", []):
                paths.append(self.output / image.get("subfolder", "") / image["filename"])
        return paths

    def execution_seconds(self, entry: dict) -> float:
        """Wall time from execution_start to execution_success, from the history's messages."""
        stamps = {name: data.get("timestamp") for name, data in entry["status"].get("messages", [])}
        return (stamps["execution_success"] - stamps["execution_start"]) / 1000.0


def comfyui_version(comfyui: Path) -> str:
    """The version a ComfyUI tree says it is (``comfyui_version.py``), or "unknown"."""
    found = re.search(r'__version__\s*=\s*"([^"]+)"', (Path(comfyui) / "comfyui_version.py").read_text()) \
        if (Path(comfyui) / "comfyui_version.py").exists() else None
    return found.group(1) if found else "unknown"


def model_cache(comfyui: Path) -> Path:
    """Where the random-weight model files written with a ComfyUI tree's classes are cached:
    outside the clone and outside the tree (which may be the user's own), keyed by the tree's
    version and location."""
    tree = Path(comfyui).resolve()
    digest = hashlib.sha256(str(tree).encode()).hexdigest()[:8]
    return cache_base() / "models" / f"comfyui-{comfyui_version(tree)}-{digest}"


def checkpoint_path(comfyui: Path, family: str = "SD15", seed: int = 0) -> Path:
    return model_cache(comfyui) / f"tokenreduce-random-{family.lower()}-seed{seed}-v2.safetensors"


def ensure_checkpoint(comfyui: Path, python: str | Path = sys.executable, family: str = "SD15", seed: int = 0) -> Path:
    """Write (once) a full-size random-weight checkpoint with that ComfyUI tree's classes."""
    return _ensure(checkpoint_path(comfyui, family, seed), comfyui, python,
                   f"random_models.write_checkpoint(path, {family!r}, {seed})")


EXTRA_MODELS = {  # kind -> (ComfyUI model folder, writer "module.function" in devtools/ or a call of it, version)
    "dit": ("diffusion_models", "random_models.write_dit", 2),  # tiny SD3; v2: its position table is filled
    "lora": ("loras", "random_models.write_lora", 1),
    "controlnet": ("controlnet", "random_models.write_controlnet", 1),
    "flux": ("diffusion_models", "random_dits.write_flux_diffusion_model", 1),  # Flux.1 dev, ~0.8 GB
    "wan21_t2v": ("diffusion_models", "random_dits.write_wan_diffusion_model", 1),
    "unsupported_dit": ("diffusion_models", "random_dits.write_unsupported_dit", 2),  # v2: Hunyuan 3D 2.0
    "wan21_t2v_lora": ("loras", "random_dits.write_attention_lora", 1),  # on the Wan file above
    "wan21_t2v_fp8_scaled": ("diffusion_models", "random_dits.write_wan_scaled_fp8", 1),
    "wan21_vace": ("diffusion_models", "random_dits.write_wan_vace_diffusion_model", 1),
    "ltxv": ("diffusion_models", "random_dits.write_ltxv_diffusion_model", 1),
    "ltx2": ("diffusion_models", "random_dits.write_ltx2_diffusion_model", 1),  # LTXAV: ComfyUI 0.33 only
    # Wan 2.2 A14B's second expert and its LoRA beside the scaled-fp8 Wan file and the LoRA above:
    # the same architecture, other weights (a writer with arguments is called as written).
    "wan22_low_noise": ("diffusion_models", "random_dits.write_wan_scaled_fp8(path, seed=1)", 1),
    "wan22_low_noise_lora": ("loras", "random_dits.write_attention_lora(path, seed=1)", 1),
}


def ensure_extra_model(comfyui: Path, kind: str, python: str | Path = sys.executable) -> tuple[str, Path]:
    """Write (once) a random-weight model file of ``kind`` (see EXTRA_MODELS) with that tree's
    classes; returns its ComfyUI model folder and path."""
    folder, writer, version = EXTRA_MODELS[kind]
    path = model_cache(comfyui) / f"tokenreduce-random-{kind}-seed0-v{version}.safetensors"
    return folder, _ensure(path, comfyui, python, writer if writer.endswith(")") else f"{writer}(path)")


def _ensure(path: Path, comfyui: Path, python: str | Path, call: str) -> Path:
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Two test workers (or a test and the demo) may ask for the same file at once: one writes it,
    # the other waits for it instead of writing the same .partial beside it.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path
        partial = path.with_suffix(".partial")
        code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; path = sys.argv[3]\n"
                "import torch\nfrom comfy.cli_args import args\nargs.cpu = not torch.cuda.is_available()\n"
                f"import {call.split('.')[0]}\n{call}\n")
        subprocess.run([str(python), "-c", code, str(comfyui), str(REPO / "devtools"), str(partial)], check=True,
                       cwd=comfyui)
        partial.rename(path)
    return path
