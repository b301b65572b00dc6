"""Patches that run inside a DiT's blocks and read the model call's whole token grid.

ComfyUI's InfiniteTalk / MultiTalk (``comfy/ldm/wan/model_multitalk.py``, in ComfyUI releases
after 0.3.75; 0.3.75 has none) puts patches in the call's ``transformer_options["patches"]``
that Wan's blocks run on their tokens: ``attn1_patch`` (after self-attention, handed its queries
and keys), ``attn2_patch`` (after cross-attention) and ``cross_attn`` (InfiniteTalk's looping
sampler adds it while sampling). They reshape those tokens by the call's full grid
(``transformer_options["grid_sizes"]``), which merged tokens no longer fill: ToMe leaves such a
call's blocks whole and says why. Read per model call, so a patch set on the clone before or
after ToMe, or added while sampling, is seen alike.
"""

from __future__ import annotations

IN_BLOCK_PATCHES = ("attn1_patch", "attn2_patch", "cross_attn")  # transformer_options["patches"] kinds


def grid_reading_patches(options: dict) -> str | None:
    """Why a model call with these host options (ComfyUI's transformer_options) cannot have its
    blocks merged, or None: patches inside its blocks read the whole grid."""
    patches = options.get("patches") if isinstance(options, dict) else None
    found = {kind: patches[kind] for kind in IN_BLOCK_PATCHES if isinstance(patches, dict) and patches.get(kind)}
    if not found:
        return None
    named = "; ".join(f"{kind}: {', '.join(dict.fromkeys(type(p).__name__ for p in listed))}"
                      for kind, listed in found.items())
    return (f"its model options hold patches that run inside the blocks ({named}), as ComfyUI's InfiniteTalk / "
            f"MultiTalk sets them, and reshape the block's tokens by the call's whole grid, which merged tokens would "
            f"not fill")
