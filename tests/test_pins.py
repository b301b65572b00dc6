"""Pinned outputs: what each node computes on the tiny models, bit for bit, so that a change of
the code's structure (not of its behaviour) is proven to change nothing.

``tests/data/pins.json`` holds, per case, the SHA-256 of the sampled latent and of the node's
``info`` text, written by ``python3 devtools/run_tests.py tests/test_pins.py --write-pins``
from the code as it was before a refactor. Float results can differ between machines (BLAS
kernels per CPU type, a GPU); the unpatched model's latents are pinned too, and where they
differ on this machine the patched latents are not comparable and are skipped, saying so. The
``info`` texts depend on no arithmetic and are compared everywhere
(``--write-pins --pins-info-only`` rewrites only them, after a deliberate change of wording).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from comfy_helpers import apply, sample

PINS = Path(__file__).parent / "data" / "pins.json"
QUERIES = "queries only (ComfyUI built-in)"
CASES = {  # name -> (family, [(node, settings), ...] applied in order, sample kwargs)
    "sd15 unpatched": ("SD15", [], {}),
    "sdxl unpatched": ("SDXL", [], {}),
    "sd15 tome defaults": ("SD15", [("tome", {})], {}),
    "sd15 tome queries 3x3 shared": ("SD15", [("tome", dict(mode=QUERIES, matching="3x3 cells", share_plans=True,
                                                            seed=7))], {}),
    "sd15 tome all stages top-left ds2": ("SD15", [("tome", dict(merge_crossattn=True, merge_mlp=True, use_rand=False,
                                                                 max_downsample="2", ratio=0.6))], {}),
    "sd15 tome 5x5 window": ("SD15", [("tome", dict(matching="5x5 cells", start_percent=0.2, end_percent=0.7,
                                                    stride_x=3, ratio=0.4))], dict(steps=4)),
    "sd15 todo defaults": ("SD15", [("todo", {})], {}),
    "sd15 todo 3 next 2 average": ("SD15", [("todo", dict(factor=3.0, factor_next=2.0, method="average"))], {}),
    "sd15 todo bilinear window": ("SD15", [("todo", dict(factor=2.5, method="bilinear", start_percent=0.3))],
                                  dict(steps=4)),
    "sd15 todo then tome": ("SD15", [("todo", {}), ("tome", dict(mode=QUERIES))], {}),
    "sdxl tome defaults": ("SDXL", [("tome", {})], {}),
    "sdxl todo next 2 bicubic": ("SDXL", [("todo", dict(factor_next=2.0, method="bicubic"))], {}),
    "sd15 odd size batch 2": ("SD15", [("todo", {}), ("tome", dict(mode=QUERIES, matching="3x3 cells"))],
                              dict(size=(33, 47), batch=2)),
}


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()).hexdigest()


def _applied(comfy, models, name: str) -> tuple:
    """The case's model with its nodes applied, and the digest of their info texts."""
    family, chain, _ = CASES[name]
    model, infos = models[family], []
    for node, settings in chain:
        output = apply(comfy, node, model, **settings)
        model = output.result[0]
        infos.append(output.result[1])
    return model, hashlib.sha256("\n".join(infos).encode()).hexdigest()


def _run(comfy, models, name: str) -> dict:
    family, _, kwargs = CASES[name]
    model, info = _applied(comfy, models, name)
    latent = sample(comfy, model, family, steps=kwargs.get("steps", 2), size=kwargs.get("size", (32, 32)),
                    batch=kwargs.get("batch", 1))
    return {"latent": _digest(latent), "info": info}


@pytest.fixture(scope="module")
def pins(request):
    if request.config.getoption("--write-pins"):
        return None
    return json.loads(PINS.read_text())


@pytest.fixture(scope="module")
def comparable(comfy, models, pins):
    """Whether this machine computes the unpatched pins bit for bit."""
    if pins is None:
        return True
    return all(_run(comfy, models, name)["latent"] == pins[name]["latent"] for name in CASES if "unpatched" in name)


def _info(comfy, models, name: str) -> str:
    return _applied(comfy, models, name)[1]


def test_pins(comfy, models, pins, comparable, request):
    if pins is None:
        PINS.parent.mkdir(exist_ok=True)
        if request.config.getoption("--pins-info-only"):
            written = json.loads(PINS.read_text())
            for name in CASES:
                written[name]["info"] = _info(comfy, models, name)
        else:
            written = {name: _run(comfy, models, name) for name in CASES}
        PINS.write_text(json.dumps(written, indent=1) + "\n")
        pytest.skip(f"pins written to {PINS}")
    changed_info = sorted(name for name in CASES if _info(comfy, models, name) != pins[name]["info"])
    assert not changed_info, f"info texts changed: {changed_info}"
    if not comparable:
        pytest.skip("this machine's arithmetic differs from the one the pins were written on (the unpatched "
                    "latents differ): the info texts match; the patched latents cannot be compared here")
    changed = {name: pin for name in CASES if (pin := _run(comfy, models, name)) != pins[name]}
    assert not changed, f"outputs changed: {sorted(changed)}"
