"""ToDo on DiT model files as users load them with the rest of their speed stack, in the real
ComfyUI, in-process: fp8 weights through the core loader (``UNETLoader``'s weight_dtype), and a
few-step LoRA through ``LoraLoaderModelOnly`` (4 steps, a step window). The files are the
smallest random-weight Wan 2.1 and Flux.1 files the loader detects (devtools/random_dits.py),
cached beside the other test models. (Step caches: tests/test_comfy_dit_inprocess.py; GGUF and
KJNodes' SageAttention: tests/test_gguf_inprocess.py and tests/test_kjnodes_inprocess.py, with
their flags; torch.compile: tests/test_compile_inprocess.py and the DiT file.)"""

from __future__ import annotations

import pytest
import torch

from comfy_helpers import ALL_FILE_BLOCKS, apply, check_todo_on_file_model, rel_error, sample_dit_file, session_of
from comfy_server import ensure_extra_model
from conftest import comfyui_dir

FILES = {"wan21_t2v": "wan21_t2v", "flux_dev": "flux"}  # variant -> its file (EXTRA_MODELS)


@pytest.fixture(scope="module")
def core_nodes(comfy):
    """ComfyUI's nodes module, its model folders pointed at the cached test files."""
    import sys

    import folder_paths

    for kind in (*FILES.values(), "wan21_t2v_lora", "wan21_t2v_fp8_scaled"):
        folder, path = ensure_extra_model(comfyui_dir(), kind, sys.executable)
        folder_paths.add_model_folder_path(folder, str(path.parent))
    import nodes

    return nodes


def file_name(kind: str) -> str:
    return ensure_extra_model(comfyui_dir(), kind)[1].name


def load(core_nodes, kind: str, weight_dtype: str = "default"):
    """UNETLoader's MODEL, loaded as ComfyUI's executor runs a node: in inference mode (0.33 builds
    the quantised layers of a scaled fp8 file there, and cannot make them outside it)."""
    with torch.inference_mode():
        return core_nodes.UNETLoader().load_unet(file_name(kind), weight_dtype)[0]


@pytest.mark.parametrize("weight_dtype", ["fp8_e4m3fn", "fp8_e5m2"])
@pytest.mark.parametrize("variant", list(FILES))
def test_todo_on_fp8_weights(comfy, core_nodes, variant, weight_dtype):
    model = load(core_nodes, FILES[variant], weight_dtype)
    stored = {p.dtype for p in model.model.diffusion_model.parameters()}
    assert getattr(torch, {"fp8_e4m3fn": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[weight_dtype]) in stored
    check_todo_on_file_model(comfy, model, variant)


def test_todo_on_a_scaled_fp8_file(comfy, core_nodes):
    """An "fp8_scaled" Wan file (float8 weights with per-layer scales), loaded as users load one."""
    model = load(core_nodes, "wan21_t2v_fp8_scaled")
    check_todo_on_file_model(comfy, model, "wan21_t2v")


def test_todo_with_a_few_step_lora_and_a_step_window(comfy, core_nodes):
    """4 steps with a LoRA on every attention projection: ToDo acts inside its window, which means
    the same steps with or without the LoRA; reruns repeat bit for bit; the LoRA changes the result."""
    model = load(core_nodes, "wan21_t2v")
    with torch.inference_mode():
        lora = core_nodes.LoraLoaderModelOnly().load_lora_model_only(model, file_name("wan21_t2v_lora"), 1.0)[0]
    window = dict(ALL_FILE_BLOCKS, start_percent=0.0, end_percent=0.5)
    plain, with_lora = apply(comfy, "todo", model, **window).result[0], apply(comfy, "todo", lora, **window).result[0]
    out_plain = sample_dit_file(comfy, plain, "wan21_t2v", steps=4)
    out_lora, again = sample_dit_file(comfy, with_lora, "wan21_t2v", steps=4), sample_dit_file(comfy, with_lora, "wan21_t2v", steps=4)
    assert torch.equal(out_lora, again) and rel_error(out_lora, out_plain) > 1e-3
    steps = session_of(with_lora).last_report.active_steps
    assert steps == session_of(plain).last_report.active_steps and 0 < len(steps) < 4
    assert session_of(with_lora).last_report.levels
