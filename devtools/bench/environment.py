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
    auto_measures: bool  # whether reduce_when auto times calls here (a GPU, or --measure-cpu)


def load(comfyui: Path, measure_cpu: bool = False) -> Host:
    import torch

    sys.path.insert(0, str(comfyui))
    from comfy.cli_args import args

    args.cpu = not torch.cuda.is_available()
    import comfy.model_management

    if PACK not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACK, REPO / "__init__.py", submodule_search_locations=[str(REPO)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACK] = module
        spec.loader.exec_module(module)
    from comfy_extras.nodes_tomesd import TomePatchModel

    tome = importlib.import_module(f"{PACK}.nodes.tome_node").ToMePatchNode
    todo = importlib.import_module(f"{PACK}.nodes.todo_node").ToDoPatchNode
    layout = importlib.import_module(f"{PACK}.tokenreduce.layout")
    pays = importlib.import_module(f"{PACK}.tokenreduce.pays")
    # Every node the benchmark applies gets a decisions store of its own, in memory: each
    # configuration's auto rule measures for itself (and says what that cost), nothing is kept
    # between benchmark runs, nothing is written into the ComfyUI tree.
    importlib.import_module(f"{PACK}.nodes.common").decisions = lambda: pays.Decisions(None, measure_cpu=measure_cpu)
    device = comfy.model_management.get_torch_device()

    return Host(
        appliers={TOME_NODE: partial(_run_node, tome), TODO_NODE: partial(_run_node, todo),
                  BUILTIN_NODE: partial(_run_node, TomePatchModel)},
        sessions_of=importlib.import_module(f"{PACK}.nodes.session").sessions_of,
        model_layout=layout.model_layout,
        unet_kind=layout.UNET,
        auto_measures=pays.Decisions(None, measure_cpu=measure_cpu).measures(device),
    )


def _run_node(node, model, settings: dict):
    """A V3 node's MODEL output, executed as ComfyUI does."""
    return node.execute(model, **settings).result[0]


def auto_log(model, sessions_of: Callable) -> list:
    """What the auto rule of a patched model's nodes measured: (site, Decision) in order."""
    return [entry for session in sessions_of(model) if session.patch.rule is not None
            for entry in session.patch.rule.decisions.log]


def attention_backends(names: list[str]) -> dict[str, Callable]:
    import comfy.ldm.modules.attention as attention

    available = {"sub-quad": attention.attention_sub_quad, "sdpa": attention.attention_pytorch,
                 "split": attention.attention_split}
    if getattr(attention, "SAGE_ATTENTION_IS_AVAILABLE", False):
        available["sage"] = attention.attention_sage  # ComfyUI's own call of SageAttention's kernel
    missing = [name for name in names if name not in available]
    if missing:
        raise SystemExit(f"--attention {' '.join(missing)}: not available here (sage needs the sageattention "
                         "package, which needs CUDA and Triton: pip install sageattention)")
    return {name: available[name] for name in names}


def with_attention(model, backend: Callable):
    """A clone whose every attention call goes to ``backend``, through ComfyUI's own
    ``optimized_attention_override`` hook; where a model's blocks get no transformer_options (Wan
    S2V on ComfyUI 0.3.75), handed on to them as the ToDo node does, so unpatched and patched
    models run the same backend."""
    clone = model.clone()
    clone.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = (
        lambda func, *args, **kwargs: backend(*args, **kwargs))
    importlib.import_module(f"{PACK}.nodes.host").hand_options_to_blocks(clone, clone.get_model_object("diffusion_model"))
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
