"""HiDream-I1 (HiDreamImageTransformer2DModel): double-stream blocks over [image, T5, Llama
layer] and single-stream blocks over the same sequence, the image grid first in every call.
Each block sees its own Llama layer appended to [T5, last Llama layer], so the text after the
grid is T5 + 2 Llama sequences long in every call."""

from __future__ import annotations

import math

from ..dit import JOINT, BlockArgs, DiTMerge, Family, Geometry, Slot, TokenLayout, block_paths, image_grid


def plan(model) -> tuple[Slot, ...]:
    return tuple(Slot(JOINT, i) for i in range(len(model.double_stream_blocks) + len(model.single_stream_blocks)))


def geometry(model) -> Geometry:
    # q, k, v go to the host's attention as [B, N, heads * head_dim]
    return Geometry(model.num_attention_heads, model.attention_head_dim, False)


def tokens(model, patch, x, context, kwargs) -> TokenLayout | None:
    llama = kwargs.get("encoder_hidden_states_llama3")  # [B, Llama layers, tokens, width]
    if kwargs.get("image_cond") is not None or llama is None or model.caption_projection is None:
        # HiDream-E1 edits concatenate the reference to the latent's width: the grid would hold it
        return None
    grid = image_grid(x, patch)
    image = grid[1] * grid[2]
    return TokenLayout(grid, joint=(image + context.shape[1] + 2 * llama.shape[2], 0), image=None)


def merge_keys(model) -> dict:
    doubles = len(model.double_stream_blocks)
    return {**{i: ("double_block", i) for i in range(doubles)},
            **{doubles + i: ("single_block", i) for i in range(len(model.single_stream_blocks))}}


# ToMe: HiDream calls its blocks directly (no patches_replace["dit"] lookup in ComfyUI 0.3.75 or
# 0.33), by keyword: block(image_tokens=, image_tokens_masks=, text_tokens=, adaln_input=, rope=,
# transformer_options=). The host reaches each merged block through an object patch on its
# forward that hands these on under ``layer_args``' names (DiTMerge.layer_args). Double blocks
# take the image stream alone (the text apart, returned with it: ``layer_returns``), single
# blocks [image, T5, Llama, Llama]; the rotary table ([B, L, 1, ...]) runs over [image, text] in
# both, the grid first; the image mask is None in both hosts (made only for lists of images), the
# modulation per sample. Only the grid merges.
MERGE = DiTMerge(merge_keys, {
    "double_block": BlockArgs("img", lambda lay: (math.prod(lay.grid), 0), pe="pe", pe_dim=1,
                              in_pe=lambda lay: lay.joint),
    "single_block": BlockArgs("img", lambda lay: lay.joint, pe="pe", pe_dim=1, in_pe=lambda lay: lay.joint),
}, layer_args=("img", "mask", "txt", "vec", "pe"), layer_returns={"double_block": ("img", "txt")})

FAMILIES = (
    Family("HiDream", ("HiDream",), ("HiDreamImageTransformer2DModel",), True, False,
           lambda m: block_paths(m, "double_stream_blocks", "single_stream_blocks"), plan,
           lambda m: (1, m.patch_size, m.patch_size), tokens, geometry, merge=MERGE),
)
