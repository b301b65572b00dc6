"""HunyuanVideo 1.0 / i2v / SkyReels i2v / 1.5 / 1.5 SR, and HunyuanImage 2.1 and its refiner
(the same model class): a text-only token refiner, then double- and single-stream blocks whose
attention is joint over the image/video, reference and text tokens (byT5 glyph and SigLIP
vision tokens count as text)."""

from __future__ import annotations

import math

from ..dit import (JOINT, OTHER, BlockArgs, DiTMerge, Family, Slot, TokenLayout, block_paths, ceil_div, image_grid,
                   video_grid)
from .flux import geometry, merge_keys


def plan(model) -> tuple[Slot, ...]:
    refiner = len(model.txt_in.individual_token_refiner.blocks)  # text only
    return tuple(Slot(OTHER, -1) for _ in range(refiner)) + tuple(
        Slot(JOINT, i) for i in range(len(model.double_blocks) + len(model.single_blocks)))


def patch(model) -> tuple[int, int, int]:
    # HunyuanImage 2.1 patchifies a 2-D latent at (ph, pw); the others a 3-D one at (pt, ph, pw).
    size = tuple(model.patch_size)
    return size if len(size) == 3 else (1, *size)


def tokens(model, patch, x, context, kwargs) -> TokenLayout:
    grid = video_grid(x, patch) if x.ndim == 5 else image_grid(x, patch)
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


def blocks(model) -> tuple[str, ...]:
    return block_paths(model, "double_blocks", "single_blocks")


def merge_check(model, kwargs) -> str | None:
    if kwargs.get("guiding_frame_index") is not None:
        return ("its first frame is modulated apart (image to video, v2 replace) over a token range the block is "
                "given as modulation_dims, which merging would shift")
    if kwargs.get("ref_latent") is not None:
        return "its reference latent's tokens sit before the video in the double blocks' image stream, which ToMe does not place yet"
    return None


# ToMe: double blocks are handed img (the video alone) and txt apart, single blocks img = the
# whole joint sequence (0.3.75: [video, text]; later: [text, video]); the rotary positions
# ([B, 1, L, ...]) and the text mask ([1, 1, L]) run over the joint sequence in that order; the
# modulation (vec) is per sample.
MERGE = DiTMerge(merge_keys, {
    "double_block": BlockArgs("img", lambda lay: (math.prod(lay.grid), 0), pe="pe", pe_dim=2,
                              in_pe=lambda lay: lay.joint, mask="attention_mask"),
    "single_block": BlockArgs("img", lambda lay: lay.joint, pe="pe", pe_dim=2, in_pe=lambda lay: lay.joint,
                              mask="attention_mask"),
}, merge_check, leaves_alone="image-to-video calls whose first frame is modulated apart (v2 replace: "
                             "guiding_frame_index) and calls with a reference latent (ref_latent)")

FAMILIES = (
    # SkyReels i2v and 1.5 SR only concatenate image channels to the latent: no token of their own.
    Family("HunyuanVideo", ("HunyuanVideo", "HunyuanVideoI2V", "HunyuanVideoSkyreelsI2V", "HunyuanVideo15",
                            "HunyuanVideo15_SR_Distilled"), ("HunyuanVideo",), True, True,
           blocks, plan, patch, tokens, geometry, merge=MERGE),
    # An image model: a 2-D latent (2.1), or the refiner's one-frame 3-D latent; byT5 glyph tokens
    # after the text. Its own family so that the temporal factor never applies.
    Family("HunyuanImage 2.1", ("HunyuanImage21", "HunyuanImage21Refiner"), ("HunyuanVideo",), True, False,
           blocks, plan, patch, tokens, geometry, merge=MERGE),
)
