"""MiniMax-H3 (ComfyUI 0.33): one packed sequence per model call, [text | keyframe / reference
rows | audio | video], self-attention over all of it in every block (rope on q and k); the
target video (patch (1, 2, 2), frame-major) is always the last segment.

The model takes one batch item per call (its forward refuses a batch above 1): q, k and v reach
attention as ``[1, heads, tokens, head_dim]`` (``skip_reshape``), wrapped in the host's
``AttentionTensorContainer``; ComfyUI unwraps them for an override without ``container_function``
(ours), so the override sees plain tensors. Cond and uncond never share a model call: each
conditioning's payload holds its own ``PackedLayout`` (compared by identity), so ComfyUI runs
them one after the other. The sequence's segments are read from that layout; where it is
missing or not this call's shape, the sequence is only placed without keyframe or reference
rows. The text is refined once per sampling run outside the model call (``extra_conds``); a
call given unrefined text runs the refiner's attention inside, ahead of the blocks, which the
plan does not count: such a call is left alone."""

from __future__ import annotations

import math

from ..dit import JOINT, Family, Geometry, Slot, TokenLayout, block_paths, ceil_div


def plan(model) -> tuple[Slot, ...]:
    return tuple(Slot(JOINT, i) for i in range(len(model.blocks)))


def patch(model) -> tuple[int, int, int]:
    return tuple(model.patch_size)


def geometry(model) -> Geometry:
    attention = model.blocks[0].attn
    return Geometry(attention.heads, attention.head_dim, True)


def _video_segment(layout, signature) -> tuple[int, int] | None:
    """(start, length) of the target video in the payload's packed layout, if it is this call's."""
    if layout is None or getattr(layout, "signature", None) != signature:
        return None
    video = [(a, b) for a, b, kind in layout.segments if kind == "video"]
    return (video[0][0], video[0][1] - video[0][0]) if len(video) == 1 and video[0][1] == layout.seq_len else None


def tokens(model, patch, x, context, kwargs) -> TokenLayout | None:
    shapes = kwargs.get("latent_shapes")
    payload = kwargs.get("minimax_payload") or {}
    if context is None or context.shape[-1] != model.hidden_size or shapes is None or len(shapes) < 2:
        return None  # unrefined text (refiner calls ahead of the blocks), or no packed video + audio latent
    video, audio = shapes[0], shapes[1]
    pt, ph, pw = patch
    grid = (ceil_div(video[2], pt), ceil_div(video[3], ph), ceil_div(video[4], pw))
    n_video = math.prod(grid)
    # the model's own signature: text, latent frames, height and width padded to the patch, audio frames
    signature = (context.shape[1], video[2], grid[1] * ph, grid[2] * pw, audio[-1])
    found = _video_segment(payload.get("layout"), signature)
    if found is not None:
        start, length = found
        return TokenLayout(grid, joint=(start + length, start), image=None) if length == n_video else None
    if payload.get("keyframes") or payload.get("refs"):
        return None  # rows between text and audio that only the model's layout places
    start = context.shape[1] + 2 * audio[-1]  # text, then both stereo channels of the audio
    return TokenLayout(grid, joint=(start + n_video, start), image=None)


FAMILIES = (
    Family("MiniMax-H3", ("MiniMaxH3",), ("MiniMaxH3Model",), True, True,
           lambda m: block_paths(m, "blocks"), plan, patch, tokens, geometry,
           merge_refusal="its blocks are handed the packed sequence without a batch dimension ([tokens, width]) and "
                         "their modulation as mod_segments, (start, stop, row) token ranges each applied in place, "
                         "which ToMe's block description (tokens [B, L, C], a modulation per sample or per token) "
                         "does not take"),
)
