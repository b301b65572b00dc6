"""ComfyUI adapter of the TokenReduce pack: the V3 nodes and their extension entry point.

Imported by the pack's top-level ``__init__.py`` only; always relative (ComfyUI owns a
top-level module named ``nodes``).
"""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .compare_node import ImageCompareNode
from .todo_node import ToDoPatchNode
from .tome_node import ToMePatchNode


class TokenReduceExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [ToMePatchNode, ToDoPatchNode, ImageCompareNode]


async def comfy_entrypoint() -> TokenReduceExtension:
    return TokenReduceExtension()
