"""JoyImage (JoyImageTransformer3DModel, ComfyUI 0.33): double-stream blocks, joint attention
over [main image, reference images, text]: the main grid first, each reference patchified at the
same 3-D patch after it, the text last. Only the main image is rotated in place (rms_rope)."""

from __future__ import annotations

from ..dit import JOINT, BlockArgs, DiTMerge, Family, Geometry, Slot, TokenLayout, block_paths, ceil_div, video_grid


def plan(model) -> tuple[Slot, ...]:
    return tuple(Slot(JOINT, i) for i in range(len(model.double_blocks)))


def geometry(model) -> Geometry:
    attention = model.double_blocks[0].attn
    heads = attention.num_attention_heads
    inner = attention.img_attn_qkv.weight.shape[0] // 3
    return Geometry(heads, inner // heads, False)  # [B, N, heads * head_dim]


def tokens(model, patch, x, context, kwargs) -> TokenLayout | None:
    if x.ndim != 5 or x.shape[2] > patch[0]:  # an image is one latent frame: more would be a clip
        return None
    grid = video_grid(x, patch)
    refs = sum(ceil_div(r.shape[2], patch[0]) * ceil_div(r.shape[3], patch[1]) * ceil_div(r.shape[4], patch[2])
               for r in kwargs.get("ref_latents") or [])
    image = grid[0] * grid[1] * grid[2] + refs
    # ``image``: the image stream [main image, references] its blocks are handed apart from the
    # text (ToMe's); the model makes no image-only attention call
    return TokenLayout(grid, joint=(image + context.shape[1], 0), image=(image, 0))


# ToMe: each block is handed img = [main image, references] and txt apart, the rotary positions
# of img alone ([1, L, 1, ...]) and a per-sample modulation (vec [B, 6, C]).
MERGE = DiTMerge(lambda m: {i: ("double_block", i) for i in range(len(m.double_blocks))}, {
    "double_block": BlockArgs("img", lambda lay: lay.image, pe="pe", pe_dim=1, in_pe=lambda lay: lay.image),
})


FAMILIES = (
    Family("JoyImage", ("JoyImage",), ("JoyImageTransformer3DModel",), True, False,
           lambda m: block_paths(m, "double_blocks"), plan, lambda m: tuple(m.patch_size), tokens, geometry,
           merge=MERGE),
)
