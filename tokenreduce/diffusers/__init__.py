"""TokenReduce for diffusers: the ComfyUI nodes' ToMe and ToDo on diffusers pipelines and models.

    from tokenreduce.diffusers import apply_patch
    patch = apply_patch(pipe, "ToMe", ratio=0.5)   # or "ToDo", factor=2 (UNets and DiTs)
    image = pipe(prompt).images[0]; print(patch.report_lines()); patch.remove()

The inputs, their checks and messages, the info text and the run report are the nodes' (one
table: ``tokenreduce.methods``); see docs/diffusers.md. diffusers itself is never imported here:
models are recognised by class name, so ``import tokenreduce`` works without it.
"""

from .api import TokenReducePatch, apply_patch, decisions_path, remove_patch

__all__ = ["apply_patch", "remove_patch", "TokenReducePatch", "decisions_path"]
