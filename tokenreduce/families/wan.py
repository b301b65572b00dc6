"""Wan 2.1 / 2.2: per block self-attention over the video tokens, then cross-attention to the
text (and, for Wan 2.1 i2v, to CLIP image tokens). Fun Control (control latents concatenated in
channels) and the camera models (camera embeddings added to the patch embedding) keep that
token layout, as does Wan 2.2 Animate (pose latents added to the patch embedding; its face
adapter's attention is called without transformer_options, so the override never counts it).
FlowRVS is a t2v Wan sampled from the input video's latent (image-to-image flow): the same calls.
WanDancer (0.33) is an i2v Wan with a reference image's CLIP tokens in the cross-attention; its
music encoder and per-frame music injector call attention without transformer_options (never
counted). SCAIL puts reference frames before the video and pose tokens after it in the
self-attention. Wan VACE adds VACE blocks that run a hint stream of the same grid (its own
self-attention, then cross-attention) after some main blocks. HuMo appends a reference frame's
tokens after the video and cross-attends to audio tokens after the text."""

from __future__ import annotations

import math

from ..dit import (IMAGE, OTHER, BlockArgs, DiTMerge, Family, Geometry, Slot, TokenLayout, block_paths, clean_frames,
                   video_grid)


def plan(model) -> tuple[Slot, ...]:
    slots = []
    for i, block in enumerate(model.blocks):
        slots.append(Slot(IMAGE, i))  # self-attention over the video tokens, then cross-attention
        image_context = type(block.cross_attn).__name__ == "WanI2VCrossAttention"  # Wan 2.1 i2v: CLIP tokens too
        slots.extend([Slot(OTHER, i)] * (2 if image_context else 1))
    return tuple(slots)


def patch(model) -> tuple[int, int, int]:
    return tuple(model.patch_size)


def geometry(model) -> Geometry:
    attention = model.blocks[0].self_attn
    return Geometry(attention.num_heads, attention.head_dim, False)


def subject_tokens(patch, kwargs) -> int:
    """Tokens of the frames a call appends to the video in time (Wan Phantom's subject images,
    WanPhantomSubjectToVideo's ``time_dim_concat``): patchified like the video, after it in x and
    in the positions, and not its frames: outside the grid, never merged."""
    concat = kwargs.get("time_dim_concat")
    return math.prod(video_grid(concat, patch)) if concat is not None else 0


def tokens(model, patch, x, context, kwargs) -> TokenLayout | None:
    if kwargs.get("context_latents") is not None:  # in-context reference streams (0.33): not handled
        return None
    grid = video_grid(x, patch)
    # Fun models put a reference frame's tokens before the video. Wan Animate's first latent
    # frame is its reference image (WanAnimateToVideo puts it there; the model adds the pose to
    # the frames after it): not the video's, so before the grid too.
    prefix = grid[1] * grid[2] if (getattr(model, "ref_conv", None) is not None
                                   and kwargs.get("reference_latent") is not None) else 0
    if type(model).__name__ == "AnimateWanModel" and grid[0] > 1:
        prefix, grid = prefix + grid[1] * grid[2], (grid[0] - 1, *grid[1:])
    length = prefix + math.prod(grid) + subject_tokens(patch, kwargs)
    return TokenLayout(grid, joint=None, image=(length, prefix), whole_frames=clean_frames(kwargs))


def scail_tokens(model, patch, x, context, kwargs) -> TokenLayout | None:
    """SCAIL / SCAIL-2 (0.33): self-attention over [reference frames, video, pose frames]. The
    reference latents are put before the video in time and the pose latent (often at half the
    size) is patchified on its own and appended after it; neither is mixed into the grid, nor are
    frames appended to the video in time (``subject_tokens``)."""
    if kwargs.get("context_latents") is not None:
        return None
    grid = video_grid(x, patch)
    reference, pose = kwargs.get("reference_latent"), kwargs.get("pose_latents")
    before = math.prod(video_grid(reference, patch)) if reference is not None else 0
    after = math.prod(video_grid(pose, patch)) if pose is not None else 0
    return TokenLayout(grid, joint=None, image=(before + math.prod(grid) + subject_tokens(patch, kwargs) + after,
                                                before))


def vace_plan(model) -> tuple[Slot, ...]:
    """The main blocks' calls, each VACE block's after the main block it follows (one hint
    stream). A hint stream is the VACE frames patchified on the main grid: its self-attention
    is a grid call of its own tokens (never mixed with the video's), reduced with the main
    block it follows; its cross-attention to the text is left alone."""
    main = plan(model)
    slots = []
    for i in range(len(model.blocks)):
        slots.extend(slot for slot in main if slot.block == i)
        if model.vace_layers_mapping.get(i) is not None:
            slots.extend([Slot(IMAGE, i), Slot(OTHER, i)])
    return tuple(slots)


def vace_tokens(model, patch, x, context, kwargs) -> TokenLayout | None:
    hints = kwargs.get("vace_context")
    # [B, streams, C, T, H, W]: each stream runs every VACE block again; the plan places one.
    if hints is None or hints.shape[1] != 1 or tuple(hints.shape[-3:]) != tuple(x.shape[-3:]):
        return None
    # WanVaceToVideo puts a reference image in front of the video as its first latent frame (and
    # trims it after sampling); whether there is one is only in the VACE mask's values, which are
    # not read (no host sync), so the first latent frame is always kept whole: it costs 1/T of
    # the tokens that could merge where there is no reference.
    layout = tokens(model, patch, x, context, kwargs)
    return layout._replace(whole_frames=max(1, layout.whole_frames)) if layout is not None else None


def vace_check(model) -> str | None:
    if type(model.vace_blocks[0].cross_attn).__name__ != "WanT2VCrossAttention":
        return "its VACE blocks cross-attend to image tokens too, which the Wan VACE plan does not place"
    return None


def humo_plan(model) -> tuple[Slot, ...]:
    """Per block: self-attention over [video, reference frame], cross-attention to the text,
    then to the audio tokens (grouped per frame: left alone)."""
    return tuple(slot for i in range(len(model.blocks)) for slot in (Slot(IMAGE, i), Slot(OTHER, i), Slot(OTHER, i)))


def humo_tokens(model, patch, x, context, kwargs) -> TokenLayout | None:
    # Without audio embeddings the blocks skip the audio call the plan counts; the extra
    # streams of the Wan forward (time_dim_concat, context_latents) are not HuMo's.
    if kwargs.get("audio_embed") is None or kwargs.get("time_dim_concat") is not None \
            or kwargs.get("context_latents") is not None:
        return None
    grid = video_grid(x, patch)
    reference = kwargs.get("reference_latent")
    # The reference latent is patchified like the video and appended after it (not reduced).
    extra = math.prod(video_grid(reference, patch)) if reference is not None else 0
    return TokenLayout(grid, joint=None, image=(math.prod(grid) + extra, 0))


def humo_check(model) -> str | None:
    if any(type(block).__name__ != "WanAttentionBlockAudio" for block in model.blocks):
        return "its blocks are not the audio blocks (WanAttentionBlockAudio) the Wan HuMo plan counts"
    return None


# ToMe: each block's x is [reference frame (Fun), video]; its rotary positions (freqs) follow x,
# and so does a modulation per frame (Wan 2.2 TI2V's timesteps where frames are kept clean, e0
# [B, frames, 6, C], which the block spreads over the frames' tokens) or per token; the camera
# and VACE models hand e0 as [B, 6, C], per sample (the block tells them apart by ndim).
MERGE = DiTMerge(lambda m: {i: ("double_block", i) for i in range(len(m.blocks))}, {
    "double_block": BlockArgs("img", lambda lay: lay.image, pe="pe", pe_dim=1, in_pe=lambda lay: lay.image,
                              modulation="vec", modulation_ndim=4, modulation_runs=True),
})


def humo_merge_check(model, kwargs) -> str | None:
    """HuMo's audio cross-attention (in each block) splits the block's tokens into as many equal
    groups as the call has audio frames, one per frame in order (the video's latent frames and the
    reference frame's). Merged by frame (``DiTMerge.frame_grouped``) the video frames stay equal
    groups; a reference frame's tokens, never merged, would not be as many as a merged frame's."""
    if kwargs.get("reference_latent") is not None:
        return ("its audio cross-attention splits each block's tokens [video, reference frame] into equal groups, one "
                "per frame, and the reference frame's tokens (never merged) would outnumber a merged video frame's "
                "(WanHuMoImageToVideo always adds a reference frame, zeros without a reference image); ToMe merges "
                "Wan HuMo calls without a reference latent only")
    return None


# ToMe on HuMo: x is the video alone (without a reference latent), merged frame by frame with the
# same count per frame, so the audio cross-attention's per-frame groups are the merged frames.
def humo_groups(kwargs) -> int | None:
    """The groups HuMo's audio cross-attention splits a block's tokens into: its audio frames (a
    reference latent's frames added as zero audio)."""
    audio, reference = kwargs.get("audio_embed"), kwargs.get("reference_latent")
    if audio is None:
        return None
    return audio.shape[1] + (reference.shape[-3] if reference is not None else 0)


HUMO_MERGE = MERGE._replace(check=humo_merge_check, frame_grouped=True, frame_groups=humo_groups,
                            leaves_alone="calls with a reference latent, which ComfyUI's WanHuMoImageToVideo always "
                                         "adds (zeros without a reference image): with that node no call merges; and "
                                         "calls whose audio frames are not their latent frames")

FAMILIES = (
    Family("Wan 2.1 / 2.2", ("WAN21_T2V", "WAN21_I2V", "WAN22_T2V", "WAN21_FunControl2V", "WAN21_Camera",
                             "WAN22_Camera", "WAN22_Animate", "WAN21_FlowRVS",
                             "WAN22_WanDancer"),
           ("WanModel", "CameraWanModel", "AnimateWanModel", "WanDancerModel"),
           True, True,
           lambda m: block_paths(m, "blocks"), plan, patch, tokens, geometry, merge=MERGE),
    # ToMe: x = [reference frames, video, pose frames], its positions alike: the video's grid merges.
    Family("Wan SCAIL", ("WAN21_SCAIL", "WAN21_SCAIL2"), ("SCAILWanModel", "SCAIL2WanModel"), True, True,
           lambda m: block_paths(m, "blocks"), plan, patch, scail_tokens, geometry, merge=MERGE),
    # ToMe: the main blocks merge; the VACE blocks run outside the block-replace seam, on the
    # hint stream and the model's unmerged input tokens, and add to the restored output.
    Family("Wan VACE", ("WAN21_Vace",), ("VaceWanModel",), True, True,
           lambda m: block_paths(m, "blocks"), vace_plan, patch, vace_tokens, geometry, vace_check,
           merge=MERGE),
    Family("Wan HuMo", ("WAN21_HuMo",), ("HumoWanModel",), True, True,
           lambda m: block_paths(m, "blocks"), humo_plan, patch, humo_tokens, geometry, humo_check,
           merge=HUMO_MERGE),
)
