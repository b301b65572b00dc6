"""HunyuanVideo 1.0 / i2v / 1.5: a text-only token refiner, then double- and single-stream
blocks whose attention is joint over the video, reference and text tokens."""

from __future__ import annotations

import math

from ..dit import JOINT, OTHER, Family, Slot, TokenLayout, block_paths, ceil_div, video_grid
from .flux import geometry


def plan(model) -> tuple[Slot, ...]:
    refiner = len(model.txt_in.individual_token_refiner.blocks)  # text only
    return tuple(Slot(OTHER, -1) for _ in range(refiner)) + tuple(
        Slot(JOINT, i) for i in range(len(model.double_blocks) + len(model.single_blocks)))


def patch(model) -> tuple[int, int, int]:
    return tuple(model.patch_size)


def tokens(model, patch, x, context, kwargs) -> TokenLayout:
    grid = video_grid(x, patch)
    text = context.shape[1]
    if getattr(model, "byt5_in", None) is not None and kwargs.get("txt_byt5") is not None:
        text += kwargs["txt_byt5"].shape[1]
    if getattr(model, "vision_in", None) is not None and kwargs.get("clip_fea") is not None:
        text += kwargs["clip_fea"].shape[1]
    ref = kwargs.get("ref_latent")
    refs = 0 if ref is None else math.prod(ceil_div(n, p) for n, p in zip(ref.shape[-3:], patch))
    # ComfyUI 0.3.75 orders the joint sequence image first ([ref, video, text]); later versions
    # text first ([text, ref, video]) and drop this attribute.
    image_first = bool(getattr(model.double_blocks[0], "flipped_img_txt", False))
    start = refs if image_first else text + refs
    return TokenLayout(grid, joint=(text + refs + math.prod(grid), start), image=None)


FAMILIES = (
    Family("HunyuanVideo", ("HunyuanVideo", "HunyuanVideoI2V", "HunyuanVideo15"), ("HunyuanVideo",), True, True,
           lambda m: block_paths(m, "double_blocks", "single_blocks"), plan, patch, tokens, geometry),
)
