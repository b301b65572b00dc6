"""Random-weight GGUF diffusion models, in the layout city96's ComfyUI-GGUF loader reads, for the
tests that run our nodes on GGUF models (tests/test_gguf_inprocess.py, with ``--gguf PATH``).

A GGUF file holds the diffusion model's own keys (as a UNETLoader file), ``general.architecture``
(what the loader checks: "wan", "flux", "sdxl", "sd1", ...) and per tensor its type. No trained
weights exist here, so nothing is quantised: each weight whose rows fit the type's blocks is
written directly as *random valid blocks* of that type (Q8_0: an fp16 scale and 32 int8 values;
Q4_K: fp16 ``d`` and ``dmin``, twelve bytes of 6-bit scales and mins, 128 bytes of 4-bit values
per 256), with scales that keep the weights in the range of the float model's own initialisation;
every other tensor (biases, norms, weights whose rows do not fit) is written as F16 or F32, as
city96's converter leaves them. The loader dequantises these blocks as it would a real file's.
Needs the ``gguf`` package (PyPI), which ComfyUI-GGUF needs too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

QUANT_TYPES = ("Q8_0", "Q4_K")
ARCH = {"wan21_t2v": "wan", "flux_dev": "flux", "SDXL": "sdxl", "SD15": "sd1"}


def _float_values(key: str, tensor: torch.Tensor, generator: torch.Generator) -> np.ndarray:
    """A tensor's values; for a shape-only (meta) tensor, random ones as PyTorch's default init
    gives them (see random_models.randomize_)."""
    if not tensor.is_meta:
        return tensor.detach().float().cpu().numpy()
    if tensor.dim() >= 2:
        bound = 1 / float(np.sqrt(np.prod(tensor.shape[1:])))
        return ((torch.rand(tensor.shape, generator=generator) * 2 - 1) * bound).numpy()
    return np.zeros(tensor.shape, np.float32) if key.endswith("bias") else np.ones(tensor.shape, np.float32)


def _q8_0(rows: int, cols: int, bound: float, rng: np.random.Generator) -> np.ndarray:
    """Random Q8_0 blocks for a [rows, cols] weight with values in [-bound, bound]."""
    blocks = np.empty((rows, cols // 32, 34), np.uint8)
    blocks[..., :2] = np.frombuffer(np.float16(bound / 127).tobytes(), np.uint8)
    blocks[..., 2:] = rng.integers(-127, 128, size=(rows, cols // 32, 32), dtype=np.int8).view(np.uint8)
    return blocks.reshape(rows, -1)


def _q4_k(rows: int, cols: int, bound: float, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K super-blocks for a [rows, cols] weight, centred and within about [-bound, bound]:
    a value is d * scale * q - dmin * min with 6-bit scale and min and 4-bit q; their means are
    about 31.5 and 7.5, so dmin = d * 7.5 centres it."""
    d = bound / (63 * 15)
    blocks = np.empty((rows, cols // 256, 144), np.uint8)
    blocks[..., 0:2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    blocks[..., 2:4] = np.frombuffer(np.float16(d * 7.5).tobytes(), np.uint8)
    blocks[..., 4:] = rng.integers(0, 256, size=(rows, cols // 256, 140), dtype=np.uint8)
    return blocks.reshape(rows, -1)


BLOCK = {"Q8_0": (32, _q8_0), "Q4_K": (256, _q4_k)}


def write_gguf(path: Path, state_dict: dict, arch: str, quant: str, seed: int = 0) -> dict:
    """Write ``state_dict`` (a diffusion model's, float) as a GGUF file with weights as random
    ``quant`` blocks where their rows fit. Returns {tensor type name: count}."""
    import gguf

    block, make = BLOCK[quant]
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    counts: dict = {}
    for key, tensor in state_dict.items():
        if key.endswith(".weight") and tensor.ndim == 2 and tensor.shape[1] % block == 0:
            bound = (1 / float(np.sqrt(tensor.shape[1])) if tensor.is_meta else
                     max(float(tensor.detach().abs().max()), 1e-4))
            data = make(tensor.shape[0], tensor.shape[1], bound, rng)
            writer.add_tensor(key, data, raw_shape=data.shape, raw_dtype=qtype)
            kind = quant
        elif tensor.ndim <= 1:
            writer.add_tensor(key, _float_values(key, tensor, generator).astype(np.float32))
            kind = "F32"
        else:
            writer.add_tensor(key, _float_values(key, tensor, generator).astype(np.float16))
            kind = "F16"
        counts[kind] = counts.get(kind, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def float_state_dict(model: str, seed: int = 0) -> dict:
    """The state dict a GGUF test model is made from: the smallest Wan 2.1 t2v and Flux.1 [dev]
    files ComfyUI's loader detects (devtools/random_dits.py), or a full-size SD1.5 / SDXL UNet as
    shapes only (meta tensors: a UNet is detected by its real widths; the writer draws the values)."""
    import random_dits
    import random_models

    if model == "wan21_t2v":
        return random_dits.wan_file_state_dict("t2v", seed, torch.float32)
    if model == "flux_dev":
        return random_dits.flux_file_state_dict(seed, torch.float32)
    import comfy.ldm.modules.diffusionmodules.openaimodel as openaimodel
    import comfy.ops

    config = random_models._model_config(model, random_models.unet_config(model, tiny=False))
    unet = openaimodel.UNetModel(**config.unet_config, device="meta", operations=comfy.ops.disable_weight_init)
    return unet.state_dict()


def ensure_gguf(folder: Path, model: str, quant: str, seed: int = 0) -> str:
    """A cached random GGUF file of ``model`` in ``quant`` under ``folder``; returns its name."""
    name = f"tokenreduce_random_{model.lower()}_{quant.lower()}_seed{seed}.gguf"
    path = folder / name
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_gguf(partial, float_state_dict(model, seed), ARCH[model], quant, seed)
        partial.rename(path)
    return name
