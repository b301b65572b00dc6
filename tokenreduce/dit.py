"""Where a DiT's attention runs over its image or video grid, family by family.

A DiT has no per-block attention patches: the pack reaches its attention through the host's
attention override, which sees every call (q, k, v) of a model call in order. What a family
tells here, from the model's own modules and from what a model call is given (the latent, the
text, reference latents), is

- its *call plan*: the attention calls of one model call in order, each a joint call (text and
  image tokens in one sequence), an image-only call, or one the pack leaves alone (text-only
  refiners, cross-attention to text or image embeddings), with the block it belongs to;
- its *token layout* for a model call: the grid ``(t, h, w)`` of the main image or video tokens
  (frame-major raster order, as every family patchifies) and where that grid sits in the key
  sequence of joint and image-only calls; text, reference-image and padding tokens are around it.

The override reduces only a call whose slot in the plan is a grid call and whose length is the
length the layout predicts; anything else passes through untouched. Classes are recognised by
name and attribute: nothing here imports a host.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

JOINT, IMAGE, OTHER = "joint", "image", "other"  # kinds of attention call


class Slot(NamedTuple):
    kind: str  # JOINT, IMAGE or OTHER
    block: int  # the block it belongs to (-1: none)


class Geometry(NamedTuple):
    """How a family passes q, k and v of its grid calls to the host's attention."""

    heads: int
    head_dim: int
    heads_first: bool  # [B, heads, N, head_dim] (the host's skip_reshape); else [B, N, heads * head_dim]


class TokenLayout(NamedTuple):
    grid: tuple[int, int, int]  # (t, h, w) of the main image/video tokens
    joint: tuple[int, int] | None  # (key sequence length, start of the grid) of joint calls
    image: tuple[int, int] | None  # the same for image-only calls


class Family(NamedTuple):
    name: str  # as the user knows it
    configs: tuple[str, ...]  # the host's model-config class names it covers
    model_class: str  # the diffusion model's class name
    rope: bool  # positions are rotated into q and k before the attention call
    video: bool
    blocks: Callable  # diffusion model -> module paths (under it) of its blocks, in call order
    plan: Callable  # diffusion model -> tuple[Slot, ...]
    patch: Callable  # diffusion model -> (pt, ph, pw)
    tokens: Callable  # (diffusion model, its patch, x, context, kwargs) -> TokenLayout | None
    geometry: Callable  # diffusion model -> Geometry of its grid calls (the auto rule times one)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _ref_tokens(refs, ph: int, pw: int) -> int:
    return sum(_ceil(r.shape[-2], ph) * _ceil(r.shape[-1], pw) for r in refs or [])


def _paths(model, *names: str) -> tuple[str, ...]:
    return tuple(f"{name}.{i}" for name in names for i in range(len(getattr(model, name))))


# --- Flux.1 (dev, schnell, Fill, Kontext), Flux.2, Chroma ----------------------------------------

def _flux_plan(model) -> tuple[Slot, ...]:
    return tuple(Slot(JOINT, i) for i in range(len(model.double_blocks) + len(model.single_blocks)))


def _flux_patch(model) -> tuple[int, int, int]:
    return (1, model.patch_size, model.patch_size)


def _flux_geometry(model) -> Geometry:
    return Geometry(model.num_heads, model.hidden_size // model.num_heads, True)


def _text_first_tokens(model, patch, x, context, kwargs) -> TokenLayout:
    """[text, main image, reference images...]: Flux, Chroma, Flux.2, Qwen-Image."""
    _, ph, pw = patch
    h, w = _ceil(x.shape[-2], ph), _ceil(x.shape[-1], pw)
    text = context.shape[1]
    return TokenLayout((1, h, w), joint=(text + h * w + _ref_tokens(kwargs.get("ref_latents"), ph, pw), text),
                       image=None)


# --- Qwen-Image (and Edit) ----------------------------------------------------------------------

def _qwen_plan(model) -> tuple[Slot, ...]:
    return tuple(Slot(JOINT, i) for i in range(len(model.transformer_blocks)))


def _qwen_geometry(model) -> Geometry:
    attention = model.transformer_blocks[0].attn
    return Geometry(attention.heads, attention.dim_head, True)


# --- Lumina 2 and Z-Image (NextDiT) --------------------------------------------------------------

def _lumina_plan(model) -> tuple[Slot, ...]:
    refiners = len(model.noise_refiner)
    return (tuple(Slot(OTHER, -1) for _ in model.context_refiner)  # text only
            + tuple(Slot(IMAGE, i) for i in range(refiners))
            + tuple(Slot(JOINT, refiners + i) for i in range(len(model.layers))))


def _lumina_geometry(model) -> Geometry:
    attention = model.layers[0].attention  # keys are repeated to every query head before the call
    return Geometry(attention.n_local_heads, attention.head_dim, True)


def _lumina_tokens(model, patch, x, context, kwargs) -> TokenLayout | None:
    if kwargs.get("ref_latents"):  # Z-Image with reference images: the main image comes last; not handled
        return None
    _, ph, pw = patch
    h, w = _ceil(x.shape[-2], ph), _ceil(x.shape[-1], pw)
    multiple = getattr(model, "pad_tokens_multiple", None) or 1
    text = _ceil(context.shape[1], multiple) * multiple  # caption, padded to the multiple (Z-Image: 32)
    image = _ceil(h * w, multiple) * multiple  # the grid, then pad tokens
    return TokenLayout((1, h, w), joint=(text + image, text), image=(image, 0))


# --- SD3 / SD3.5 (MMDiT) -------------------------------------------------------------------------

def _sd3_plan(model) -> tuple[Slot, ...]:
    slots = []
    for i, block in enumerate(model.joint_blocks):
        slots.append(Slot(JOINT, i))
        if getattr(block.x_block, "x_block_self_attn", False):  # SD3.5 Medium: an image-only call after it
            slots.append(Slot(IMAGE, i))
    return tuple(slots)


def _sd3_patch(model) -> tuple[int, int, int]:
    p = model.x_embedder.patch_size
    return (1, p[0], p[1]) if isinstance(p, (tuple, list)) else (1, p, p)


def _sd3_geometry(model) -> Geometry:
    attention = model.joint_blocks[0].x_block.attn
    return Geometry(attention.num_heads, attention.head_dim, False)


def _sd3_tokens(model, patch, x, context, kwargs) -> TokenLayout:
    _, ph, pw = patch
    h, w = _ceil(x.shape[-2], ph), _ceil(x.shape[-1], pw)
    text = context.shape[1] + getattr(model, "register_length", 0)
    return TokenLayout((1, h, w), joint=(text + h * w, text), image=(h * w, 0))


# --- Wan 2.1 / 2.2 ------------------------------------------------------------------------------

def _wan_plan(model) -> tuple[Slot, ...]:
    slots = []
    for i, block in enumerate(model.blocks):
        slots.append(Slot(IMAGE, i))  # self-attention over the video tokens, then cross-attention
        image_context = type(block.cross_attn).__name__ == "WanI2VCrossAttention"  # Wan 2.1 i2v: CLIP tokens too
        slots.extend([Slot(OTHER, i)] * (2 if image_context else 1))
    return tuple(slots)


def _wan_patch(model) -> tuple[int, int, int]:
    return tuple(model.patch_size)


def _wan_geometry(model) -> Geometry:
    attention = model.blocks[0].self_attn
    return Geometry(attention.num_heads, attention.head_dim, False)


def _wan_tokens(model, patch, x, context, kwargs) -> TokenLayout | None:
    if kwargs.get("context_latents") is not None:  # in-context reference streams (0.33): not handled
        return None
    pt, ph, pw = patch
    frames = x.shape[2] + (kwargs["time_dim_concat"].shape[2] if kwargs.get("time_dim_concat") is not None else 0)
    grid = (_ceil(frames, pt), _ceil(x.shape[3], ph), _ceil(x.shape[4], pw))
    # Fun models put a reference frame's tokens before the video.
    prefix = grid[1] * grid[2] if (getattr(model, "ref_conv", None) is not None
                                   and kwargs.get("reference_latent") is not None) else 0
    return TokenLayout(grid, joint=None, image=(prefix + math.prod(grid), prefix))


# --- HunyuanVideo 1.0 / 1.5 ---------------------------------------------------------------------

def _hunyuan_plan(model) -> tuple[Slot, ...]:
    refiner = len(model.txt_in.individual_token_refiner.blocks)  # text only
    return tuple(Slot(OTHER, -1) for _ in range(refiner)) + tuple(
        Slot(JOINT, i) for i in range(len(model.double_blocks) + len(model.single_blocks)))


def _hunyuan_patch(model) -> tuple[int, int, int]:
    return tuple(model.patch_size)


def _hunyuan_tokens(model, patch, x, context, kwargs) -> TokenLayout:
    pt, ph, pw = patch
    grid = (_ceil(x.shape[2], pt), _ceil(x.shape[3], ph), _ceil(x.shape[4], pw))
    text = context.shape[1]
    if getattr(model, "byt5_in", None) is not None and kwargs.get("txt_byt5") is not None:
        text += kwargs["txt_byt5"].shape[1]
    if getattr(model, "vision_in", None) is not None and kwargs.get("clip_fea") is not None:
        text += kwargs["clip_fea"].shape[1]
    ref = kwargs.get("ref_latent")
    refs = 0 if ref is None else _ceil(ref.shape[-3], pt) * _ceil(ref.shape[-2], ph) * _ceil(ref.shape[-1], pw)
    # ComfyUI 0.3.75 orders the joint sequence image first ([ref, video, text]); later versions
    # text first ([text, ref, video]) and drop this attribute.
    image_first = bool(getattr(model.double_blocks[0], "flipped_img_txt", False))
    start = refs if image_first else text + refs
    return TokenLayout(grid, joint=(text + refs + math.prod(grid), start), image=None)


FAMILIES = (
    Family("Flux.1", ("Flux", "FluxSchnell", "FluxInpaint"), "Flux", True, False,
           lambda m: _paths(m, "double_blocks", "single_blocks"), _flux_plan, _flux_patch, _text_first_tokens,
           _flux_geometry),
    Family("Flux.2", ("Flux2",), "Flux", True, False,
           lambda m: _paths(m, "double_blocks", "single_blocks"), _flux_plan, _flux_patch, _text_first_tokens,
           _flux_geometry),
    Family("Chroma", ("Chroma",), "Chroma", True, False,
           lambda m: _paths(m, "double_blocks", "single_blocks"), _flux_plan, _flux_patch, _text_first_tokens,
           _flux_geometry),
    Family("Qwen-Image", ("QwenImage",), "QwenImageTransformer2DModel", True, False,
           lambda m: _paths(m, "transformer_blocks"), _qwen_plan, lambda m: (1, m.patch_size, m.patch_size),
           _text_first_tokens, _qwen_geometry),
    Family("Lumina 2 / Z-Image", ("Lumina2", "ZImage"), "NextDiT", True, False,
           lambda m: _paths(m, "noise_refiner", "layers"), _lumina_plan, lambda m: (1, m.patch_size, m.patch_size),
           _lumina_tokens, _lumina_geometry),
    Family("SD3 / SD3.5", ("SD3",), "OpenAISignatureMMDITWrapper", False, False,
           lambda m: _paths(m, "joint_blocks"), _sd3_plan, _sd3_patch, _sd3_tokens, _sd3_geometry),
    Family("Wan 2.1 / 2.2", ("WAN21_T2V", "WAN21_I2V", "WAN22_T2V"), "WanModel", True, True,
           lambda m: _paths(m, "blocks"), _wan_plan, _wan_patch, _wan_tokens, _wan_geometry),
    Family("HunyuanVideo", ("HunyuanVideo", "HunyuanVideoI2V", "HunyuanVideo15"), "HunyuanVideo", True, True,
           lambda m: _paths(m, "double_blocks", "single_blocks"), _hunyuan_plan, _hunyuan_patch, _hunyuan_tokens,
           _flux_geometry),
)


def dit_family(config_name: str, diffusion_model) -> Family | None:
    """The family of a model, by the host's config name, checked against its module class (a
    variant built on another class, such as Wan VACE, is not covered)."""
    for family in FAMILIES:
        if config_name in family.configs and type(diffusion_model).__name__ == family.model_class:
            return family
    return None


def supported_names() -> str:
    return ", ".join(family.name for family in FAMILIES)
