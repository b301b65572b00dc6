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


def a14b_experts(comfy, core_nodes, **todo_settings):
    """Wan 2.2 A14B's two experts as its template wires them (scaled-fp8 file, its 4-step LoRA,
    ModelSamplingSD3 shift 5), each with its own ToDo node: two Wan files of other weights."""
    from comfy_extras.nodes_model_advanced import ModelSamplingSD3

    experts = []
    for model_file, lora_file in (("wan21_t2v_fp8_scaled", "wan21_t2v_lora"), ("wan22_low_noise", "wan22_low_noise_lora")):
        model = load(core_nodes, model_file)
        with torch.inference_mode():
            model = core_nodes.LoraLoaderModelOnly().load_lora_model_only(model, file_name(lora_file), 1.0)[0]
        model = ModelSamplingSD3().patch(model, 5.0)[0]
        experts.append(apply(comfy, "todo", model, **ALL_FILE_BLOCKS, **todo_settings).result[0])
    return experts


def a14b_inputs():
    """Text as the real encoder gives it (T5-XXL, 4096 wide) and the latent: 128 px, 9 frames."""
    import random_dits

    size = dict(height_px=128, width_px=128, frames=9)
    positive, negative = random_dits.conditioning("wan21_t2v", text_dim=4096, **size)
    return positive, negative, {"samples": random_dits.latent("wan21_t2v", **size)}


def sample_split(core_nodes, high, low, steps: int = 4, switch: int = 2):
    """The template's split schedule: KSamplerAdvanced on the high-noise expert for steps 0-switch
    (adds the noise, returns the leftover noise), then on the low-noise expert to the end; CFG 1."""
    positive, negative, latent = a14b_inputs()
    sampler = core_nodes.KSamplerAdvanced()
    with torch.inference_mode():
        latent = sampler.sample(high, "enable", 42, steps, 1.0, "euler", "simple", positive, negative, latent, 0, switch,
                                "enable")[0]
        return sampler.sample(low, "disable", 42, steps, 1.0, "euler", "simple", positive, negative, latent, switch,
                              steps, "disable")[0]["samples"]


def test_wan22_a14b_experts_are_decided_once_per_kind_and_reported_separately(comfy, core_nodes, measuring):
    """Both experts patched, each reporting its own sampler's steps. Their grid calls are one kind
    (same family, grid, heads, dtype, backend, reduction: the weights are not part of it), so the
    auto rule times it once, in the high-noise expert's first call; the low-noise expert finds the
    decision kept. A second run measures nothing and repeats the latent bit for bit."""
    store = measuring((10.0, 5.0))
    high, low = a14b_experts(comfy, core_nodes)
    latent = sample_split(core_nodes, high, low)
    assert store.measurements == 1
    reports = {name: session_of(model).last_report for name, model in (("high", high), ("low", low))}
    assert [d.source for _, d in reports["high"].decisions] == ["measured"]
    assert [d.source for _, d in reports["low"].decisions] == ["kept"]
    for report in reports.values():
        assert report.levels and report.active_steps == (1, 2) and report.steps == 2 and not report.warnings
        assert all(d.reduce for _, d in report.decisions)
    assert torch.equal(sample_split(core_nodes, high, low), latent) and store.measurements == 1
    assert [d.source for _, d in session_of(high).last_report.decisions] == ["kept"]


def test_wan22_a14b_a_window_in_percent_means_the_same_on_both_samplers(comfy, core_nodes):
    """start_percent 0.2 / end_percent 0.7 are sigma 0.952 / 0.682 at shift 5; the 4 steps run at
    sigma 1, 0.9375, 0.833, 0.625: steps 2 and 3 are inside, the high-noise sampler's second step
    and the low-noise sampler's first, as one sampler running all 4 steps acts in steps 2-3."""
    high, low = a14b_experts(comfy, core_nodes, start_percent=0.2, end_percent=0.7)
    sample_split(core_nodes, high, low)
    assert session_of(high).last_report.active_steps == (2,) and session_of(low).last_report.active_steps == (1,)
    positive, negative, latent = a14b_inputs()
    with torch.inference_mode():
        core_nodes.KSamplerAdvanced().sample(high, "enable", 42, 4, 1.0, "euler", "simple", positive, negative, latent,
                                             0, 4, "disable")
    assert session_of(high).last_report.active_steps == (2, 3)
