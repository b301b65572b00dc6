"""TokenReduce: token merging (ToMe) and token downsampling for ComfyUI.

ComfyUI loads this folder from ``custom_nodes/`` and calls ``comfy_entrypoint``. The
host-free algorithms live in ``tokenreduce/``; the ComfyUI nodes in ``nodes/``.
"""

from .nodes import comfy_entrypoint

WEB_DIRECTORY = "./js"

__all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]
