"""HiDream-I1 (HiDreamImageTransformer2DModel): double-stream blocks over [image, T5, Llama
layer] and single-stream blocks over the same sequence, the image grid first in every call.
Each block sees its own Llama layer appended to [T5, last Llama layer], so the text after the
grid is T5 + 2 Llama sequences long in every call."""

from __future__ import annotations

from ..dit import JOINT, Family, Geometry, Slot, TokenLayout, block_paths, direct_call_refusal, image_grid

# ToMe: the double and single stream blocks are called by keyword (image_tokens=, text_tokens=,
# rope=, ...), the double blocks returning (image, text), each block handed its own Llama layer's
# text tokens; the layer seam hands on positional arguments and returns the tokens alone.
MERGE_REFUSAL = direct_call_refusal("its blocks are called by keyword with the image and the text apart, the double "
                                    "blocks returning the (image, text) pair")


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


FAMILIES = (
    Family("HiDream", ("HiDream",), ("HiDreamImageTransformer2DModel",), True, False,
           lambda m: block_paths(m, "double_stream_blocks", "single_stream_blocks"), plan,
           lambda m: (1, m.patch_size, m.patch_size), tokens, geometry, merge_refusal=MERGE_REFUSAL),
)
