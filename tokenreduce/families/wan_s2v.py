"""Wan 2.2 S2V (sound to video): per block self-attention over [video, reference frames, packed
motion tokens], then cross-attention to the text (Wan 2.1 t2v blocks). The reference latent is
patchified like the video and appended after it; the motion latent (the last frames of the video
before this one) is packed by the model's frame packer into its newest frame at the video's patch,
the 2 before at twice and the 16 before at 4 times that patch, appended after the reference. Both
counts follow from the shapes of the call's inputs (computed here from the packer's own buckets
and kernels); neither is mixed into the grid. The audio injector's per-frame cross-attention to
the audio tokens is called without transformer_options: the override never sees it (left alone).

ComfyUI 0.3.75 calls the S2V blocks (and a block replacement's original block) without
transformer_options, so their attention calls carry no call context; the ComfyUI adapter hands
the call's options to them there (``nodes/host.py``).

ToMe merges the blocks as Wan's (``wan.MERGE``): the video's grid first in x, the reference and
motion tokens after it kept, the rotary positions alike; the modulation e0 has one row per entry
of the model's timestep sequence (frames, reference frames, then doubled and 3 more with motion),
which the block spreads over x in runs as Wan 2.2's per-frame timesteps (``modulation_runs``).
The audio injector runs after the block, outside the block-replace seam, on the restored tokens."""

from __future__ import annotations

import math

from ..dit import Family, TokenLayout, block_paths, video_grid
from .wan import MERGE, geometry, patch, plan, subject_tokens


def _conv_tokens(shape, kernel) -> int:
    """Tokens of a [..., T, H, W] latent patchified by a convolution whose stride is its kernel."""
    return math.prod(size // k for size, k in zip(shape[-3:], kernel))


def motion_tokens(model, motion) -> int:
    """Tokens the frame packer makes of a motion latent [B, C, T, H, W]: it pads or cuts it to the
    last sum(buckets) frames and patchifies the newest bucket at its first kernel, the next at its
    second and the oldest at its third (ComfyUI's packer drops no bucket in the S2V call)."""
    packer = model.frame_packer
    height, width = motion.shape[-2:]
    convs = (packer.proj, packer.proj_2x, packer.proj_4x)
    return sum(_conv_tokens((frames, height, width), tuple(conv.kernel_size))
               for frames, conv in zip(packer.zip_frame_buckets, convs))


def tokens(model, patch, x, context, kwargs) -> TokenLayout | None:
    if kwargs.get("context_latents") is not None:  # the Wan forward's in-context streams: not S2V's
        return None
    grid = video_grid(x, patch)
    reference, motion = kwargs.get("reference_latent"), kwargs.get("reference_motion")
    extra = subject_tokens(patch, kwargs)  # frames appended to the video in time: after it, not its grid
    extra += _conv_tokens(reference.shape, patch) if reference is not None else 0
    extra += motion_tokens(model, motion) if motion is not None else 0
    return TokenLayout(grid, joint=None, image=(math.prod(grid) + extra, 0))


def check(model) -> str | None:
    packer = getattr(model, "frame_packer", None)
    if packer is None or len(packer.zip_frame_buckets) != 3:
        return "its frame packer is not the three-bucket packer whose motion tokens the Wan S2V layout counts"
    if any(type(block.cross_attn).__name__ != "WanT2VCrossAttention" for block in model.blocks):
        return "its blocks cross-attend to more than the text, which the Wan S2V plan does not place"
    return None


FAMILIES = (
    Family("Wan S2V", ("WAN22_S2V",), ("WanModel_S2V",), True, True,
           lambda m: block_paths(m, "blocks"), plan, patch, tokens, geometry, check, merge=MERGE),
)
