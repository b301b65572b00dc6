"""LTX-2 (``LTXAV``, ComfyUI 0.33): audio and video in one model. Per transformer block, in this
order: the video self-attention over the video tokens (frame-major, patch (1, 1, 1)), the video's
cross-attention to the text, then with an audio stream the audio self-attention, the audio's
cross-attention to the text, and the audio-to-video and video-to-audio cross-attention. Only the
video self-attention is a grid call; the audio tokens and every cross-attention are left alone.

Which of these calls a model call makes depends on the call, so the family plans each call
(``call_plan``) from its inputs and options:

- the audio stream's calls (its self-attention, its cross-attention to the text, the
  video-to-audio cross-attention) run only where the call has audio tokens (a video + audio
  latent, whose shapes the sampler passes as ``latent_shapes``, or a reference audio) and
  ``run_ax`` is not off; the
  audio<->video cross-attention only where ``a2v_cross_attn`` / ``v2a_cross_attn`` are not off
  (LTXVModalityGuidance severs both in its extra pass);
- the audio-to-video cross-attention runs wherever the video stream runs and the call has audio
  tokens, ``run_ax`` off included;
- STG (``stg_self_attn_blocks``: LTXVApplySTG's perturbed pass) replaces the self-attentions of
  those blocks (the video's and the audio's) by their values: no attention call there;
- guides (LTXVAddGuide: ``keyframe_idxs``) append their frames' tokens after the video, in the
  keys of the video self-attention (kept, never mixed with the grid); with a guide strength other
  than 1 or a guide attention mask the host splits each video self-attention into two masked
  calls by groups of queries (the video's, the guides'), both over every key: both are reduced
  on the video grid (``Slot.part``).

Guides that drop tokens by their denoise mask (IC-LoRA's dilated references) change the key
count: those calls do not match the predicted layout and are left alone (the report says so).

ToMe merges the video grid's tokens through whole blocks (``MERGE``). Each block is handed the
two streams as one pair ``img = (video, audio)``: the video (item 0: the grid, then any guide
frames' tokens, kept) is merged, the audio passes through whole, as do the text and the guides.
The video's two rotary tables follow its tokens (``v_pe`` for its self-attention, ``v_cross_pe``
for the audio<->video cross-attention), and so do its three timestep modulations, which the host
hands over as ``CompressedTimestep`` objects (a row per latent frame spread over the frame's
tokens, a row per token, or one per sample): a merged block is given their rows per merged token
as plain tensors, which the block takes in their place (one per sample: the object as it is).
The audio's queries in the video-to-audio cross-attention attend to the merged video tokens (as
ToDo's pooled keys, a merged token counts once); the audio tokens themselves never merge, and
where that cross-attention is cut (``v2a_cross_attn`` off) the audio comes out exactly as
unmerged. STG's value pass-through, the audio stream off (``run_ax``) and the video off
(``run_vx``: its tokens come back unchanged) need nothing of their own. A model call whose guides
weight the attention to their tokens (a guide strength other than 1, or a pixel mask: the host's
guide attention mask over the unmerged sequence) is left alone, with a warning."""

from __future__ import annotations

import math

from ..dit import IMAGE, OTHER, BlockArgs, DiTMerge, Family, Slot, TokenLayout, block_paths
from .ltx import geometry, patch  # LTX-Video's: the same video blocks and patchifier


def plan(model) -> tuple[Slot, ...]:
    """The calls of a model call with an audio stream, no STG and no split guide calls."""
    return _plan(len(model.transformer_blocks), True, True, True, (), 1)


def _plan(blocks: int, video: bool, audio: bool, a2v_v2a: tuple | bool, stg, parts: int) -> tuple[Slot, ...]:
    """``audio``: the audio stream runs; ``a2v_v2a``: whether the audio-to-video and the
    video-to-audio cross-attention run (a bool for both)."""
    a2v, v2a = (a2v_v2a, a2v_v2a) if isinstance(a2v_v2a, bool) else a2v_v2a
    slots = []
    for i in range(blocks):
        if video:
            if i not in stg:
                slots += [Slot(IMAGE, i, parts > 1)] * parts
            slots.append(Slot(OTHER, i))  # cross-attention to the text
        if audio:
            if i not in stg:  # STG passes the values through in every self-attention of the block
                slots.append(Slot(OTHER, i))
            slots.append(Slot(OTHER, i))  # the audio's cross-attention to the text
        if a2v:
            slots.append(Slot(OTHER, i))
        if v2a:
            slots.append(Slot(OTHER, i))
    return tuple(slots)


def _video_shape(x, kwargs):
    shapes = kwargs.get("latent_shapes")
    if shapes:
        return tuple(shapes[0])
    return tuple((x[0] if isinstance(x, (list, tuple)) else x).shape)


def _has_audio(kwargs) -> bool:
    shapes = kwargs.get("latent_shapes")
    return bool(shapes and len(shapes) > 1 and math.prod(shapes[1]) > 0) or kwargs.get("ref_audio") is not None


def _guide_tokens(kwargs) -> int:
    keyframes = kwargs.get("keyframe_idxs")
    return 0 if keyframes is None else keyframes.shape[2]


def _weighted_guides(kwargs) -> bool:
    """Guides whose attention is weighted (strength other than 1, or a pixel mask): the host masks
    the video self-attention and splits it by groups of queries."""
    return _guide_tokens(kwargs) > 0 and any(
        entry.get("strength", 1.0) != 1.0 or entry.get("pixel_mask") is not None
        for entry in kwargs.get("guide_attention_entries") or ())


def call_plan(model, x, context, kwargs, options) -> tuple[Slot, ...]:
    video = options.get("run_vx", True)
    audio = options.get("run_ax", True) and _has_audio(kwargs)
    # The video cross-attends to the audio tokens where there are any, the audio stream run or not.
    a2v = video and _has_audio(kwargs) and options.get("a2v_cross_attn", True)
    v2a = audio and options.get("v2a_cross_attn", True)
    split = _weighted_guides(kwargs)
    return _plan(len(model.transformer_blocks), video, audio, (a2v, v2a),
                 frozenset(options.get("stg_self_attn_blocks", ())), 2 if split else 1)


def tokens(model, patch, x, context, kwargs) -> TokenLayout | str:
    _, _, frames, height, width = _video_shape(x, kwargs)[:5]
    pt, ph, pw = patch
    per_frame = (height // ph) * (width // pw)
    guides = _guide_tokens(kwargs)
    if guides % per_frame:
        return (f"LTX-2 guide tokens ({guides}) that are not whole latent frames of the video ({per_frame} tokens "
                f"a frame) cannot be placed")
    total = (frames // pt) * per_frame
    grid = (frames // pt - guides // per_frame, height // ph, width // pw)
    return TokenLayout(grid, joint=None, image=(total, 0))  # the guides' tokens after the video, kept


def _timestep_rows(timestep):
    """A ``CompressedTimestep``'s rows [B, frames, C] (each spread over its frame's tokens), [B, L, C]
    (per token) or [B, 1, C] (per sample); the block takes such a tensor in its place."""
    return getattr(timestep, "data", None)


def _merge_check(model, kwargs) -> str | None:
    if _weighted_guides(kwargs):
        return ("its guides weight the video's attention to their tokens (a guide strength other than 1 or a pixel "
                "mask: the host's guide attention mask over the unmerged tokens), which ToMe does not merge")
    return None


# ToMe: each block is handed img = (video, audio), the video's rotary tables v_pe (self-attention)
# and v_cross_pe (audio<->video cross-attention), both (matrix [B, L, heads, ...], split mode)
# pairs, its timestep modulations as CompressedTimestep objects, and self_attention_mask (None, or
# the guides' GuideAttentionMask: such calls are left alone by the check).
MERGE = DiTMerge(lambda m: {i: ("double_block", i) for i in range(len(m.transformer_blocks))}, {
    "double_block": BlockArgs("img", lambda lay: lay.image, pe="v_pe", pe_dim=1, in_pe=lambda lay: lay.image,
                              mask="self_attention_mask", modulation="v_timestep", modulation_runs=True,
                              pe_also=("v_cross_pe",), tokens_item=0,
                              modulation_also=("v_cross_scale_shift_timestep", "v_cross_gate_timestep"),
                              modulation_rows=_timestep_rows),
}, check=_merge_check,
   leaves_alone="calls whose guides weight the video's attention to them (a guide strength other than 1, or a pixel mask)")

FAMILIES = (
    Family("LTX-2", ("LTXAV",), ("LTXAVModel",), True, True,
           lambda m: block_paths(m, "transformer_blocks"), plan, patch, tokens, geometry,
           call_plan=call_plan, merge=MERGE),
)
