"""Where ComfyUI versions differ for this pack, in one place.

- The attention override (``transformer_options["optimized_attention_override"]``, every
  version since 0.3.6x): one slot that attention-backend and SageAttention-style nodes use too.
  We keep whatever was there and call it with our keys (our patch's ``previous``), so both act.
  0.33 adds ``ModelPatcher.set_model_optimized_attention`` and may hand attention functions
  ``AttentionTensorContainer`` objects: it unwraps them into tensors before calling an override
  that, like ours, declares no ``container_function``; setting the slot directly works in both.
- Other devices' copies of a model: 0.33's multi-GPU split (``MultiGPU_WorkUnits``) runs each
  extra device's work on a copy loaded afresh from the model's loader; an object patch bound to a
  module of the first copy must be bound again to each copy's own module. 0.33 calls
  ``ON_MATCH_MULTIGPU_CLONES`` callbacks when it makes the copies; 0.3.75 has no such split.
- The dtype a model computes in: 0.33 names it (``BaseModel.get_dtype_inference``); 0.3.75
  computes it inline in ``_apply_model`` (the manual-cast dtype, else the weights' dtype).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..tokenreduce.run import OVERRIDE
ATTENTION_MODULE = "comfy.ldm.modules.attention"
COMPILE_KEY = "torch.compile"  # comfy_api.torch_helpers' key of the compiling wrapper


def bind_to_device_copies(patcher, key: str, bind) -> None:
    """Have ``bind(copy)`` applied to every other-device copy of ``patcher``'s model: now, where the
    multi-GPU split was applied before this node (its copies are made again from ``patcher``), and
    whenever the host makes them later. Nothing where the host has no multi-GPU split."""
    from comfy.patcher_extension import CallbacksMP

    event = getattr(CallbacksMP, "ON_MATCH_MULTIGPU_CLONES", None)
    if event is None:
        return
    patcher.add_callback_with_key(event, key, lambda main, copy: bind(copy))
    if patcher.get_additional_models_with_key("multigpu"):
        patcher.match_multigpu_clones()


def compute_dtype(base_model) -> torch.dtype | None:
    """The dtype a model's activations have inside its diffusion model (what the auto rule times in)."""
    inference = getattr(base_model, "get_dtype_inference", None)
    if inference is not None:
        return inference()
    get_dtype = getattr(base_model, "get_dtype", None)
    cast = getattr(base_model, "manual_cast_dtype", None)
    return cast if cast is not None else (get_dtype() if get_dtype is not None else None)


def attention_entry():
    """The attention function ComfyUI's models call (the backend chosen at start-up, behind the
    override slot): the auto rule times DiT attention calls through it. Read per call: it is a
    module global that start-up options set."""
    module = sys.modules.get(ATTENTION_MODULE)
    return getattr(module, "optimized_attention", None)


def decisions_file() -> Path:
    """Where the auto rule keeps its measured decisions: ComfyUI's user directory (per machine, not per user)."""
    import folder_paths

    return Path(folder_paths.get_user_directory()) / "tokenreduce" / "auto_decisions.json"


def host_environment() -> tuple:
    """What of ComfyUI decides how fast a call runs, for the auto rule's keys: its version."""
    version = getattr(sys.modules.get("comfyui_version"), "__version__", None)
    if version is None:
        try:
            import comfyui_version

            version = comfyui_version.__version__
        except ImportError:  # a ComfyUI too old to name its version
            version = "unknown"
    return (f"ComfyUI {version}",)


def compiled(options: dict) -> bool:
    """Whether this model call runs compiled: ComfyUI's TorchCompileModel adds an APPLY_MODEL
    wrapper under this key (kept in the call's options)."""
    from comfy.patcher_extension import WrappersMP

    return COMPILE_KEY in options.get("wrappers", {}).get(WrappersMP.APPLY_MODEL, {})


def install_attention_override(patcher, patch) -> None:
    """Make ``patch.override`` the clone's attention override, chained to the one it replaces."""
    options = patcher.model_options.setdefault("transformer_options", {})
    patch.previous = options.get(OVERRIDE)
    options[OVERRIDE] = patch.override


def install_block_replacements(patcher, patch) -> None:
    """Put ``patch``'s block replacements into the clone's ``patches_replace["dit"]`` (undone with
    the clone), each chained to the replacement that was there before (called as its inner block)."""
    found = patcher.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    for block, (kind, number) in patch.replace_keys().items():
        patcher.set_model_patch_replace(patch.replacement(kind, block, found.get((kind, number))), "dit", kind, number)
