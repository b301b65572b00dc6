"""Kandinsky 5 (video and image): text-only encoder blocks (left alone), then per visual block a
self-attention over the frame-major (t, h, w) latent tokens and a cross-attention to the text.

The i2v image and mask are latent channels; ``time_dim_replace`` overwrites latent frames: no
extra tokens. An image latent is one frame.

Some ComfyUI trees (not 0.33.0) send the self-attention of a call with more than 40 latent frames
(the 10 s models) to NABLA: the tokens are put in fractal order (8x8 tiles) and attended with
flex attention under a block-sparse mask, never through the host's attention; only the
cross-attention reaches it. Such a model's self-attention takes ``sparse_params``; ToDo leaves
those calls alone and says why."""

from __future__ import annotations

import functools
import inspect
import math

from ..dit import IMAGE, OTHER, Family, Geometry, Slot, TokenLayout, block_paths, video_grid


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
                f"attention, so ToDo cannot reduce it; those model calls were left alone. With "
                f"{NABLA_FRAMES} latent frames or fewer it reduces them")
    grid = video_grid(x, patch)  # the model pads the latent to whole patches
    return TokenLayout(grid, joint=None, image=(math.prod(grid), 0))


def blocks(model) -> tuple[str, ...]:
    return block_paths(model, "visual_transformer_blocks")


# ToMe: the visual blocks have a block-replace lookup (0.33), but the original block it hands the
# replacement returns a tensor while the lookup takes a dict back ({"x": ...}); ToMe's wrapper
# passes the block's result on as it is.
MERGE_REFUSAL = ("its block-replace lookup hands the replacement an original block that returns a tensor where it "
                 "takes a dict back, which ToMe's block wrapper does not convert yet")

FAMILIES = (
    Family("Kandinsky 5", ("Kandinsky5",), ("Kandinsky5",), True, True, blocks, plan, patch, tokens, geometry,
           merge_refusal=MERGE_REFUSAL),
    Family("Kandinsky 5 image", ("Kandinsky5Image",), ("Kandinsky5",), True, False, blocks, plan, patch, tokens,
           geometry, merge_refusal=MERGE_REFUSAL),
)
