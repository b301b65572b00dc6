"""What the hosts show of each node, in English: its permanent id, title, description, the
model input's and the outputs' tooltips, and its method's declared inputs.

The ComfyUI schema (``nodes/``) and the translation tables (``tokenreduce.locales``, the
``locales/`` folder) are both built from here, so a text changed here is a translation that the
tests call out of date.
"""

from __future__ import annotations

from dataclasses import dataclass

from .inputs import Method
from .methods import TODO, TOME


@dataclass(frozen=True)
class Output:
    name: str  # as the node shows it
    tooltip: str


@dataclass(frozen=True)
class NodeText:
    node_id: str  # public and permanent: saved workflows refer to it
    title: str
    description: str
    model_tooltip: str
    method: Method


OUTPUTS = (
    Output("MODEL", "The patched model (a clone)."),
    Output("info", "What was patched, and any warning about settings that do nothing."),
)

TOME_NODE = NodeText(
    "TokenReduceToMe", "Token Merging (ToMe, TokenReduce)",
    "Speeds up sampling by merging similar tokens and unmerging after (ToMe for SD): before the attention of SD1.x, "
    "SD2.x and SDXL UNets, and before whole blocks of most DiTs (Flux.1, Qwen-Image, SD3 / SD3.5, Wan 2.1 / 2.2, "
    "HunyuanVideo, ...); reports what it patched.",
    "The diffusion model (UNet or DiT) to patch. The input model is never changed.",
    TOME)

TODO_NODE = NodeText(
    "TokenReduceToDo", "Token Downsampling (ToDo, TokenReduce)",
    "Speeds up sampling by letting self-attention read keys and values downsampled on the token grid (ToDo); "
    "every query stays. No matching, nothing to unmerge, deterministic. Works on SD1.x, SD2.x and SDXL UNets and "
    "on DiTs (Flux, Wan, Qwen-Image, Lumina 2 / Z-Image, SD3, HunyuanVideo); reports what it patched.",
    "The diffusion model (UNet or DiT) to patch. The input model is never changed.",
    TODO)

NODES = (TOME_NODE, TODO_NODE)
