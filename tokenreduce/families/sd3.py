"""SD3 / SD3.5 (MMDiT): joint blocks over [text (+ registers), image]; SD3.5 Medium adds an
image-only call in its first blocks. Positions are added, not rotated: keys may be pooled."""

from __future__ import annotations

from ..dit import IMAGE, JOINT, BlockArgs, DiTMerge, Family, Geometry, Slot, TokenLayout, block_paths, image_grid


def plan(model) -> tuple[Slot, ...]:
    slots = []
    for i, block in enumerate(model.joint_blocks):
        slots.append(Slot(JOINT, i))
        if getattr(block.x_block, "x_block_self_attn", False):  # SD3.5 Medium: an image-only call after it
            slots.append(Slot(IMAGE, i))
    return tuple(slots)


def patch(model) -> tuple[int, int, int]:
    p = model.x_embedder.patch_size
    return (1, p[0], p[1]) if isinstance(p, (tuple, list)) else (1, p, p)


def geometry(model) -> Geometry:
    attention = model.joint_blocks[0].x_block.attn
    return Geometry(attention.num_heads, attention.head_dim, False)


def tokens(model, patch, x, context, kwargs) -> TokenLayout:
    grid = image_grid(x, patch)
    text = context.shape[1] + getattr(model, "register_length", 0)
    return TokenLayout(grid, joint=(text + grid[1] * grid[2], text), image=(grid[1] * grid[2], 0))


# ToMe: each joint block is handed img (the image tokens alone, their positions already added)
# and txt ([registers, text]) apart, and a per-sample modulation (vec); SD3.5 Medium's image-only
# self-attention runs inside the block on the merged tokens.
MERGE = DiTMerge(lambda m: {i: ("double_block", i) for i in range(len(m.joint_blocks))}, {
    "double_block": BlockArgs("img", lambda lay: lay.image),
})

FAMILIES = (
    Family("SD3 / SD3.5", ("SD3",), ("OpenAISignatureMMDITWrapper",), False, False,
           lambda m: block_paths(m, "joint_blocks"), plan, patch, tokens, geometry, merge=MERGE),
)
