"""Kandinsky 5 (video and image): text-only encoder blocks (left alone), then per visual block a
self-attention over the frame-major (t, h, w) latent tokens and a cross-attention to the text.

The i2v image and mask are latent channels; ``time_dim_replace`` overwrites latent frames: no
extra tokens. An image latent is one frame.

Some ComfyUI trees (not 0.33.0) send the self-attention of a call with more than 40 latent frames
(the 10 s models) to NABLA: the tokens are put in fractal order (8x8 tiles) and attended with
flex attention under a block-sparse mask, never through the host's attention; only the
cross-attention reaches it. Such a model's self-attention takes ``sparse_params``; ToDo and ToMe
leave those calls alone and say why."""

from __future__ import annotations

import functools
import inspect
import math

from ..dit import IMAGE, OTHER, BlockArgs, DiTMerge, Family, Geometry, Slot, TokenLayout, block_paths, video_grid


def plan(model) -> tuple[Slot, ...]:
    text = tuple(Slot(OTHER, -1) for _ in model.text_transformer_blocks)
    return text + tuple(slot for i in range(len(model.visual_transformer_blocks))
                        for slot in (Slot(IMAGE, i), Slot(OTHER, i)))


def patch(model) -> tuple[int, int, int]:
    return tuple(model.patch_size)


def geometry(model) -> Geometry:
    attention = model.visual_transformer_blocks[0].self_attention
    return Geometry(attention.num_heads, attention.head_dim, True)  # transposed to [B, heads, N, head_dim]


NABLA_FRAMES = 40  # the model's threshold: more latent frames than this use NABLA where it has it


@functools.lru_cache(maxsize=None)
def _has_nabla(attention_class: type) -> bool:
    return "sparse_params" in inspect.signature(attention_class.forward).parameters


def tokens(model, patch, x, context, kwargs) -> TokenLayout | str:
    if x.ndim == 4:
        x = x.unsqueeze(2)
    if x.shape[2] > NABLA_FRAMES and _has_nabla(type(model.visual_transformer_blocks[0].self_attention)):
        return (f"with more than {NABLA_FRAMES} latent frames ({x.shape[2]} here) this Kandinsky 5 model runs its "
                f"self-attention as NABLA sparse attention over reordered tokens, which never reaches the host's "
                f"attention and takes the whole grid in its own order, so it is not reduced; those model calls were "
                f"left alone. With {NABLA_FRAMES} latent frames or fewer they are reduced")
    grid = video_grid(x, patch)  # the model pads the latent to whole patches
    return TokenLayout(grid, joint=None, image=(math.prod(grid), 0))


def blocks(model) -> tuple[str, ...]:
    return block_paths(model, "visual_transformer_blocks")


# ToMe: ComfyUI 0.33's block-replace lookup on the visual blocks hands the replacement an
# original block that calls the block by keywords it does not take (x=, context=) and returns the
# tokens alone where the lookup takes {"x": ...} back. So ToMe keys its replacements apart from
# that lookup ("visual_block": the model then calls the block itself) and reaches each merged
# block through the layer seam (DiTMerge.layer_args): x (the video grid alone; the text refined
# apart before, unmerged), the text, a per-sample time embedding and freqs ([1, N, 1, D/2, 2, 2],
# the grid's rotary positions, passed by keyword). NABLA calls are left alone (``tokens``).
MERGE = DiTMerge(lambda m: {i: ("visual_block", i) for i in range(len(m.visual_transformer_blocks))}, {
    "visual_block": BlockArgs("x", lambda lay: lay.image, pe="freqs", pe_dim=1, in_pe=lambda lay: lay.image),
}, layer_args=("x", "context", "time_embed", "freqs"))

FAMILIES = (
    Family("Kandinsky 5", ("Kandinsky5",), ("Kandinsky5",), True, True, blocks, plan, patch, tokens, geometry,
           merge=MERGE),
    Family("Kandinsky 5 image", ("Kandinsky5Image",), ("Kandinsky5",), True, False, blocks, plan, patch, tokens,
           geometry, merge=MERGE),
)
