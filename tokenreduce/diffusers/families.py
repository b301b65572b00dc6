"""diffusers' DiT transformers, family by family: where their blocks are, which attention of a
block runs over the image or video grid, and where that grid sits in the key sequence.

The same idea as the core's ``dit.py`` (for ComfyUI's model classes), for diffusers' own: a
model call's *token layout* (``dit.TokenLayout``) is the grid ``(t, h, w)`` of its main image or
video tokens (frame-major raster order, as every family patchifies) and, for the joint calls
(text and image in one sequence) and the image-only calls, the key length and where the grid
starts. The orders are diffusers', read from the processors of the installed version:

- Flux (FluxAttnProcessor): text first, then the image (then Kontext's reference tokens), in
  the double blocks and in the single blocks (which concatenate ``[text, image]`` themselves);
- Chroma (Flux's processor): the same order; its single blocks are handed ``[text, image]``;
- Lumina 2 (Lumina2AttnProcessor2_0): the caption, then the image, in its joint ``layers`` (the
  refiners run before them on each alone), where every sample's caption has the same length;
- AuraFlow (AuraFlowAttnProcessor2_0): its 8 register tokens, the text, then the image, in the
  joint blocks and in the single blocks (handed ``[registers, text, image]``);
- SD3 / SD3.5 (JointAttnProcessor2_0): image first, then text; SD3.5's second attention of a
  dual block (``attn2``) over the image only;
- Qwen-Image (QwenDoubleStreamAttnProcessor2_0): text first, then the image (then the edit
  model's reference images);
- HunyuanVideo (HunyuanVideoAttnProcessor2_0): video first, then text, in both block kinds;
- Wan and LTX-Video: self-attention over the video only (``attn1``; ``attn2`` is
  cross-attention to text or image embeddings and stays as it is).

Classes are recognised by name: nothing here imports diffusers.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ..dit import TokenLayout

Arguments = Callable[[str], object]  # a model call's argument by name (None when not given)


class DiffusersFamily(NamedTuple):
    """A family of diffusers transformer classes (the core's ``dit.Family`` describes ComfyUI's)."""

    name: str  # as the user knows it (the report says it)
    classes: tuple[str, ...]  # diffusers' transformer class names
    rope: bool  # keys carry rotated positions when they reach attention: select, never average
    video: bool
    blocks: tuple[str, ...]  # the model's block lists, in call order
    attentions: tuple[str, ...]  # a block's attention modules over the grid
    layout: Callable  # (model, arguments, state: the patch's dict for what it keeps) -> TokenLayout | None
    timestep_scale: float  # the timestep the pipeline passes at the highest noise
    # the timestep is the flow's noise level times timestep_scale and the output its velocity (the
    # quality budget's late input: todo_blocks.py); not Lumina 2's (below, and it negates the output)
    late_input: bool = True
    # the timestep rises as sampling goes, timestep_scale minus the noise level's (Lumina 2's
    # pipeline passes 1 - sigma): the session turns it round (session.Session)
    rising_timestep: bool = False


def _image_grid(hidden, patch: tuple[int, int, int]) -> tuple[int, int, int]:
    """The token grid of a latent [B, C, H, W] or [B, C, T, H, W] patchified by (pt, ph, pw)."""
    t = hidden.shape[2] if hidden.ndim == 5 else 1
    pt, ph, pw = patch
    return (t // pt, hidden.shape[-2] // ph, hidden.shape[-1] // pw)


def _text(arguments: Arguments) -> int:
    text = arguments("encoder_hidden_states")
    return 0 if text is None else text.shape[1]


def _prod(grid) -> int:
    return grid[0] * grid[1] * grid[2]


class _FluxGrid:
    """Flux packs the latent before the transformer: its grid is only in ``img_ids``. Reading
    it costs one device read, done once per ids tensor (a pipeline passes the same one every
    step)."""

    def __init__(self):
        self._ids = None
        self._grid = None

    def __call__(self, ids) -> tuple[int, int, int] | None:
        if ids is self._ids:
            return self._grid
        main = ids[0] if ids.ndim == 3 else ids
        first = main[:, 0]
        count = int((first == first[0]).sum())  # Kontext's reference tokens follow with another index
        rows, cols = (int(v) + 1 for v in main[:count, 1:3].amax(dim=0).tolist())
        grid = (1, rows, cols) if rows * cols == count else None
        self._ids, self._grid = ids, grid
        return grid


def _flux_layout(model, arguments: Arguments, state: dict) -> TokenLayout | None:
    grid_of = state.setdefault("flux grid", _FluxGrid())
    grid = grid_of(arguments("img_ids"))
    if grid is None:
        return None
    text = _text(arguments)
    return TokenLayout(grid, (text + arguments("hidden_states").shape[1], text), None)


def _sd3_layout(model, arguments: Arguments, state: dict) -> TokenLayout:
    p = model.config.patch_size
    grid = _image_grid(arguments("hidden_states"), (1, p, p))
    image = _prod(grid)
    return TokenLayout(grid, (image + _text(arguments), 0), (image, 0))


def _auraflow_layout(model, arguments: Arguments, state: dict) -> TokenLayout:
    p = model.config.patch_size
    grid = _image_grid(arguments("hidden_states"), (1, p, p))
    text = model.register_tokens.shape[1] + _text(arguments)
    return TokenLayout(grid, (text + _prod(grid), text), None)


class _CaptionLengths:
    """Lumina 2 joins each sample's valid caption tokens and its image: the grid starts after the
    caption's length in its mask, read once per mask tensor."""

    def __init__(self):
        self._mask = None
        self._lengths = None

    def __call__(self, mask) -> set:
        if mask is not self._mask:
            self._mask, self._lengths = mask, set(mask.sum(dim=1).tolist())
        return self._lengths


def _lumina_layout(model, arguments: Arguments, state: dict) -> TokenLayout | None:
    p = model.config.patch_size
    grid = _image_grid(arguments("hidden_states"), (1, p, p))
    mask = arguments("encoder_attention_mask")
    lengths = {_text(arguments)} if mask is None else state.setdefault("caption lengths", _CaptionLengths())(mask)
    if len(lengths) != 1:  # captions of several lengths: each sample's grid starts elsewhere
        return None
    text = int(next(iter(lengths)))
    return TokenLayout(grid, (text + _prod(grid), text), None)


def _qwen_layout(model, arguments: Arguments, state: dict) -> TokenLayout | None:
    shapes = arguments("img_shapes")
    if not shapes:
        return None
    first = shapes[0][0] if isinstance(shapes[0], (list, tuple)) and isinstance(shapes[0][0], (list, tuple)) \
        else shapes[0]
    grid = tuple(int(n) for n in first)
    text = _text(arguments)
    return TokenLayout(grid, (text + arguments("hidden_states").shape[1], text), None)


def _hunyuan_layout(model, arguments: Arguments, state: dict) -> TokenLayout:
    p, pt = model.config.patch_size, model.config.patch_size_t
    grid = _image_grid(arguments("hidden_states"), (pt, p, p))
    return TokenLayout(grid, (_prod(grid) + _text(arguments), 0), None)


def _clean_frames(arguments: Arguments) -> int:
    """``TokenLayout.whole_frames`` of a diffusers video call: 1 where the call gives each token a
    timestep of its own (Wan 2.2 TI2V's ``expand_timesteps``, LTX-Video's image to video: the first
    latent frame is the clean start image), as the ComfyUI side reads the noise mask
    (``dit.clean_frames``); the values are not read (no host sync)."""
    timestep = arguments("timestep")
    return 1 if torch.is_tensor(timestep) and timestep.ndim > 1 and timestep.shape[-1] > 1 else 0


def _wan_layout(model, arguments: Arguments, state: dict) -> TokenLayout:
    grid = _image_grid(arguments("hidden_states"), tuple(model.config.patch_size))
    return TokenLayout(grid, None, (_prod(grid), 0), whole_frames=_clean_frames(arguments))


def _ltx_layout(model, arguments: Arguments, state: dict) -> TokenLayout | None:
    dims = tuple(arguments(name) for name in ("num_frames", "height", "width"))
    if None in dims:
        return None
    p, pt = model.config.patch_size, model.config.patch_size_t
    grid = (dims[0] // pt, dims[1] // p, dims[2] // p)
    tokens = arguments("hidden_states").shape[1]
    return TokenLayout(grid, None, (tokens, 0), whole_frames=_clean_frames(arguments)) if _prod(grid) == tokens \
        else None


FAMILIES = (
    DiffusersFamily("Flux", ("FluxTransformer2DModel",), True, False,
                    ("transformer_blocks", "single_transformer_blocks"), ("attn",), _flux_layout, 1.0),
    DiffusersFamily("SD3", ("SD3Transformer2DModel",), False, False, ("transformer_blocks",), ("attn", "attn2"),
                    _sd3_layout, 1000.0),
    DiffusersFamily("Qwen-Image", ("QwenImageTransformer2DModel",), True, False, ("transformer_blocks",), ("attn",),
                    _qwen_layout, 1.0),
    DiffusersFamily("HunyuanVideo", ("HunyuanVideoTransformer3DModel",), True, True,
                    ("transformer_blocks", "single_transformer_blocks"), ("attn",), _hunyuan_layout, 1000.0),
    DiffusersFamily("Wan", ("WanTransformer3DModel",), True, True, ("blocks",), ("attn1",), _wan_layout, 1000.0),
    DiffusersFamily("LTX-Video", ("LTXVideoTransformer3DModel",), True, True, ("transformer_blocks",), ("attn1",),
                    _ltx_layout, 1000.0),
    DiffusersFamily("Chroma", ("ChromaTransformer2DModel",), True, False,
                    ("transformer_blocks", "single_transformer_blocks"), ("attn",), _flux_layout, 1.0),
    DiffusersFamily("Lumina 2", ("Lumina2Transformer2DModel",), True, False, ("layers",), ("attn",), _lumina_layout,
                    1.0, late_input=False, rising_timestep=True),
    DiffusersFamily("AuraFlow", ("AuraFlowTransformer2DModel",), False, False,
                    ("joint_transformer_blocks", "single_transformer_blocks"), ("attn",), _auraflow_layout, 1.0),
)


def family_of(model) -> DiffusersFamily | None:
    name = type(model).__name__
    return next((family for family in FAMILIES if name in family.classes), None)


def supported() -> str:
    return ", ".join(family.name for family in FAMILIES)
