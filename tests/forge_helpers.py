"""Helpers of the Forge tests: a Forge server with this repository as an extension and a
random-weight checkpoint, and requests to its API.

The Forge tree is named by ``devtools/run_tests.py --forge PATH [--forge-python PY]`` (which
passes ``TOKENREDUCE_FORGE`` / ``TOKENREDUCE_FORGE_PYTHON``); without it the Forge tests are
skipped, saying so. Checkpoints are the random full-size SD1.5 / SDXL files the ComfyUI tests
write (cached outside the clone; Forge loads them like any LDM checkpoint)."""

from __future__ import annotations

import base64
import io
import json
import sys
import time
from dataclasses import dataclass

import numpy as np
import pytest
from PIL import Image

from comfy_server import ensure_checkpoint
from conftest import comfyui_dir
from forge_server import FLAG_HELP, ForgeError, ForgeServer, check_tree, forge_python, forge_tree
from tokenreduce_forge.settings import ARGS, TITLE

API_NAME = TITLE.lower()
PROMPT = {"prompt": "a photo of a cat", "negative_prompt": "blurry", "seed": 1234, "width": 256, "height": 256,
          "steps": 2, "sampler_name": "Euler", "scheduler": "Karras", "cfg_scale": 5}
# Live previews decode with an approximation model this Forge downloads for SDXL: off.
OPTIONS = {"live_previews_enable": False}
HIRES = {"enable_hr": True, "hr_scale": 1.5, "hr_upscaler": "Latent", "hr_second_pass_steps": 2,
         "denoising_strength": 0.6,
         # This Forge's API fails after the first pass without it (processing.py:1405).
         "hr_additional_modules": ["Use same choices"]}


def skip_without_forge() -> None:
    if forge_tree() is None:
        pytest.skip(f"the Forge tests need a Stable Diffusion WebUI Forge tree: {FLAG_HELP}", allow_module_level=True)


def checkpoint_name(family: str) -> str:
    return f"tokenreduce-random-{family.lower()}.safetensors"


def start_forge(base, family: str, args=()) -> ForgeServer:
    tree = forge_tree()
    check_tree(tree)
    checkpoint = ensure_checkpoint(comfyui_dir(), sys.executable, family)
    return ForgeServer(tree, forge_python(tree), base, {checkpoint_name(family): checkpoint}, args).start()


@dataclass
class Result:
    info: dict  # the API's info: infotexts, extra_generation_params, ...
    images: list  # decoded RGB pixels of every returned image

    @property
    def pixels(self) -> np.ndarray:
        return self.images[0]

    @property
    def infotext(self) -> str:
        return self.info["infotexts"][0]

    @property
    def params(self) -> dict:
        return self.info["extra_generation_params"]

    def ours(self) -> dict:
        return {k: v for k, v in self.params.items() if k.startswith(TITLE)}


def _decode(image: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(image))).convert("RGB"))


def generate(server: ForgeServer, args=None, *, hires: bool = False, endpoint: str = "txt2img", **fields) -> Result:
    """A txt2img (or img2img) request with TokenReduce's ``args`` (None: not sent)."""
    body = {**PROMPT, **(HIRES if hires else {}), **fields}
    body["override_settings"] = {**OPTIONS, **fields.get("override_settings", {})}
    if args is not None:
        body["alwayson_scripts"] = {API_NAME: {"args": args}}
    out = server.post(f"/sdapi/v1/{endpoint}", body)
    return Result(json.loads(out["info"]), [_decode(image) for image in out["images"]])


def refused(server: ForgeServer, args, **fields) -> str:
    """The message of a request the extension refuses (HTTP 500 with its exception)."""
    with pytest.raises(ForgeError) as error:
        generate(server, args, **fields)
    assert error.value.status == 500 and error.value.body.get("error") == "Refused", error.value.body
    return error.value.body["message"]


def positional(**named) -> list:
    """The script's arguments with some set by name ("ToMe ratio" as ToMe__ratio, "hires ToMe"
    as hires_ToMe), the rest at their defaults, as the UI sends them."""
    values = [arg.default for arg in ARGS]
    index = {arg.name: i for i, arg in enumerate(ARGS)}
    for name, value in named.items():
        name = name.replace("__", " ")
        values[index["hires " + name[6:] if name.startswith("hires_") else name]] = value
    return values


def png(pixels: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def reload_ui(server: ForgeServer, page, timeout: float = 600) -> None:
    """Settings → "Reload UI" in ``page`` (Playwright), as a user does after changing a setting
    that needs it (the page's localization, say, which Forge bakes into the page's head when it
    builds the UI): the same server builds its UI anew. Waits until the server's log says the new
    UI is up (it starts the API before), then leaves ``page`` on the new page, not yet loaded."""
    page.goto(server.url, timeout=timeout * 1000)
    button = page.locator("#settings_restart_gradio")
    button.wait_for(state="attached", timeout=timeout * 1000)
    restarts, started = server.log().count("Restarting UI..."), server.log().count("Startup time:")
    page.evaluate("() => gradioApp().getElementById('settings_restart_gradio').click()")
    deadline = time.time() + timeout
    for line, before in (("Restarting UI...", restarts), ("Startup time:", started)):
        while server.log().count(line) <= before:
            if server.process.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"Forge did not come back from Reload UI (waiting for {line!r}):\n"
                                   f"{server.log_tail()}")
            time.sleep(1)
        # The old page reloads itself once the server answers: leave it, the log says when.
        page.goto("about:blank")
    page.goto(server.url, timeout=timeout * 1000)
