"""PixelDiT (PixDiT_T2I, ComfyUI 0.33): pixel space, patch 16 on the RGB image. Patch blocks
attend jointly over [text (at most txt_max_length tokens), patch grid]; then pixel blocks
compress each patch's pixels to one token and attend over the patch grid alone (image-only calls,
their own heads). PiD (PidNet) is PixelDiT with low-quality image features gated into the patch
tokens (no tokens added): the same calls and layout."""

from __future__ import annotations

from ..dit import IMAGE, JOINT, Family, Geometry, Slot, TokenLayout, block_paths, direct_call_refusal, image_grid

# ToMe: blk(s, y, c, pos_img, pos_txt, None) takes the text as a stream of its own with its own
# rotary table and returns (s, y); the pixel blocks run over [B * patches, pixels per patch].
MERGE_REFUSAL = direct_call_refusal("its patch blocks take the text as a stream of its own with its own rotary table "
                                    "and return the (image, text) pair, and its pixel blocks attend within each patch")


def plan(model) -> tuple[Slot, ...]:
    patches = len(model.patch_blocks)
    return (tuple(Slot(JOINT, i) for i in range(patches))
            + tuple(Slot(IMAGE, patches + i) for i in range(len(model.pixel_blocks))))


def geometry(model) -> dict:
    """The patch blocks' heads (joint calls) and the pixel blocks' own (image-only calls), as
    their attention modules split them."""
    return {kind: Geometry(blocks[0].attn.num_heads, blocks[0].attn.head_dim, True)
            for kind, blocks in ((JOINT, model.patch_blocks), (IMAGE, model.pixel_blocks)) if len(blocks)}


def tokens(model, patch, x, context, kwargs) -> TokenLayout:
    grid = image_grid(x, patch)
    text = min(context.shape[1], model.txt_max_length)  # longer text is cut
    image = grid[1] * grid[2]
    return TokenLayout(grid, joint=(text + image, text), image=(image, 0))


def blocks(model) -> tuple[str, ...]:
    return block_paths(model, "patch_blocks", "pixel_blocks")


def patch(model) -> tuple[int, int, int]:
    return (1, model.patch_size, model.patch_size)


FAMILIES = (
    Family("PixelDiT", ("PixelDiTT2I",), ("PixDiT_T2I",), True, False, blocks, plan, patch, tokens, geometry,
           merge_refusal=MERGE_REFUSAL),
    Family("PiD", ("PiD",), ("PidNet",), True, False, blocks, plan, patch, tokens, geometry,
           merge_refusal=MERGE_REFUSAL),
)
