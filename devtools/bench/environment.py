"""ComfyUI and this pack, loaded in this process the way ComfyUI loads a custom node pack:
the patch nodes the configurations apply, the model layouts, the attention backends and a
description of the machine."""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from . import PACK, REPO
from .configs import BUILTIN_NODE, TODO_NODE, TOME_NODE


@dataclass(frozen=True)
class Host:
    appliers: dict[str, Callable]  # node kind -> (model, settings) -> patched model
    sessions_of: Callable  # patched model -> its TokenReduce sessions (plan-time profiling)
    model_layout: Callable  # diffusion model -> the pack's Layout, or None
    unet_kind: str  # Layout.kind of UNets (the only layout the Amdahl breakdown knows)


def load(comfyui: Path) -> Host:
    import torch

    sys.path.insert(0, str(comfyui))
    from comfy.cli_args import args

    args.cpu = not torch.cuda.is_available()
    import comfy.model_management  # noqa: F401

    if PACK not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACK, REPO / "__init__.py", submodule_search_locations=[str(REPO)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACK] = module
        spec.loader.exec_module(module)
    from comfy_extras.nodes_tomesd import TomePatchModel

    tome = importlib.import_module(f"{PACK}.nodes.tome_node").ToMePatchNode
    todo = importlib.import_module(f"{PACK}.nodes.todo_node").ToDoPatchNode
    layout = importlib.import_module(f"{PACK}.tokenreduce.layout")

    return Host(
        appliers={TOME_NODE: partial(_run_node, tome), TODO_NODE: partial(_run_node, todo),
                  BUILTIN_NODE: partial(_run_node, TomePatchModel)},
        sessions_of=importlib.import_module(f"{PACK}.nodes.session").sessions_of,
        model_layout=layout.model_layout,
        unet_kind=layout.UNET,
    )


def _run_node(node, model, settings: dict):
    """A V3 node's MODEL output, executed as ComfyUI does."""
    return node.execute(model, **settings).result[0]


def attention_backends(names: list[str]) -> dict[str, Callable]:
    import comfy.ldm.modules.attention as attention

    available = {"sub-quad": attention.attention_sub_quad, "sdpa": attention.attention_pytorch,
                 "split": attention.attention_split}
    return {name: available[name] for name in names}


def with_attention(model, backend: Callable):
    """A clone whose every attention call goes to ``backend``, through ComfyUI's own
    ``optimized_attention_override`` hook."""
    clone = model.clone()
    clone.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = (
        lambda func, *args, **kwargs: backend(*args, **kwargs))
    return clone


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
