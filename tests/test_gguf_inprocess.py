"""Our nodes on GGUF models loaded by city96's ComfyUI-GGUF loader (``UnetLoaderGGUF``), from a
ComfyUI-GGUF tree named with ``python3 devtools/run_tests.py --gguf PATH`` (skipped without it).

The models are random-weight GGUF files written in quantised form (devtools/random_gguf.py: Q8_0
and Q4_K blocks for every weight whose rows fit, F16/F32 for the rest) of the smallest Wan 2.1
and Flux.1 files ComfyUI detects and of a full-size SD1.5 UNet (a UNet is detected by its real
widths; SDXL goes through the same loader path and is not written: 2.7 GB), cached beside the
other test models.
Each: the node acts (its report shows reduced tokens), reruns are bit-identical, and the result
stays near the same GGUF model unpatched."""

from __future__ import annotations

import pytest
import torch

import custom_packs
import random_gguf
from comfy_helpers import check_todo_on_file_model, patched, rel_error, sample, session_of
from conftest import comfyui_dir

pytestmark = pytest.mark.skipif(custom_packs.tree("gguf") is None, reason=custom_packs.skip_reason("gguf"))



@pytest.fixture(scope="module")
def load_gguf(comfy):
    """load_gguf(model, quant) -> the MODEL UnetLoaderGGUF gives for that random GGUF file."""
    import folder_paths
    from comfy_server import model_cache

    folder = model_cache(comfyui_dir()) / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    folder_paths.add_model_folder_path("diffusion_models", str(folder))
    loader = custom_packs.load_package("gguf").NODE_CLASS_MAPPINGS["UnetLoaderGGUF"]
    loaded = {}

    def load(model: str, quant: str):
        if (model, quant) not in loaded:
            name = random_gguf.ensure_gguf(folder, model, quant)
            loaded[(model, quant)] = loader().load_unet(name)[0]
        return loaded[(model, quant)]

    return load


def _quantised(model) -> set:
    """The GGUF tensor types of the loaded model's weights (the loader keeps them quantised)."""
    return {getattr(p, "tensor_type", None).name for p in model.model.diffusion_model.parameters()
            if getattr(p, "tensor_type", None) is not None}


@pytest.mark.parametrize("quant", random_gguf.QUANT_TYPES)
@pytest.mark.parametrize("variant", ["wan21_t2v", "flux_dev"])
def test_todo_on_a_gguf_dit(comfy, load_gguf, variant, quant):
    model = load_gguf(variant, quant)
    assert quant in _quantised(model)
    check_todo_on_file_model(comfy, model, variant)


@pytest.mark.parametrize("quant", random_gguf.QUANT_TYPES)
@pytest.mark.parametrize("node", ["todo", "tome"])
def test_both_nodes_on_a_gguf_sd15_unet(comfy, load_gguf, node, quant):
    model = load_gguf("SD15", quant)
    assert quant in _quantised(model)
    conds = dict(positive=comfy.models.conditioning("SD15", False, seed=1),
                 negative=comfy.models.conditioning("SD15", False, seed=2))
    base = sample(comfy, model, "SD15", **conds)
    ours = patched(comfy, node, model)
    first, second = sample(comfy, ours, "SD15", **conds), sample(comfy, ours, "SD15", **conds)
    assert torch.equal(first, second) and torch.isfinite(first).all()
    report = session_of(ours).last_report
    assert [level.downsample for level in report.levels] == [1] and not report.warnings
    assert 0 < rel_error(first, base) < 0.3
