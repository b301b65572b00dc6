"""Configurations under ``torch.compile`` the way ComfyUI's TorchCompileModel node applies it:
``comfy_api.torch_helpers.set_torch_compile_wrapper`` on a clone of the (patched) model."""

from __future__ import annotations

PREFIX = "compiled "


def name_of(config_name: str) -> str:
    return PREFIX + config_name


def eager_name(name: str) -> str | None:
    """The eager configuration a compiled row's name refers to, or None for an eager row."""
    return name[len(PREFIX):] if name.startswith(PREFIX) else None


def compiled(model, backend: str):
    """A clone of ``model`` whose diffusion model runs compiled with ``backend``."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    clone = model.clone()
    set_torch_compile_wrapper(clone, backend=backend)
    return clone


def make_room(models: int) -> None:
    """Start from an empty dynamo cache with room for every configuration's graphs: all
    compiled clones share the diffusion model's code, and past dynamo's recompile limit (8
    per code object) it would quietly run the rest eagerly."""
    import torch._dynamo

    torch._dynamo.reset()
    config = torch._dynamo.config
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, limit):
            setattr(config, limit, max(getattr(config, limit), 8 * models))
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 64 * models)
