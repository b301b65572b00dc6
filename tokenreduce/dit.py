"""What a DiT family tells ToDo: the types a family module fills in, and helpers they share.

A DiT has no per-block attention patches: the pack reaches its attention through the host's
attention override, which sees every call (q, k, v) of a model call in order. What a family
tells, from the model's own modules and from what a model call is given (the latent, the
text, reference latents), is

- its *call plan*: the attention calls of one model call in order, each a joint call (text and
  image tokens in one sequence), an image-only call, or one the pack leaves alone (text-only
  refiners, cross-attention to text or image embeddings, audio streams), with the block it
  belongs to. Most families make the same calls in every model call (``plan``, per model); one
  whose calls depend on the call's inputs (an audio stream present or not, blocks skipping their
  self-attention, a call split into masked parts) also describes each call's plan (``call_plan``);
- its *token layout* for a model call: the grid ``(t, h, w)`` of the main image or video tokens
  (frame-major raster order, as every family patchifies) and where that grid sits in the key
  sequence of joint and image-only calls; text, reference-image and padding tokens are around it.

The override reduces only a call whose slot in the plan is a grid call and whose length is the
length the layout predicts; anything else passes through untouched. Each family lives in a
module of its own under ``families/``, registered in ``families/__init__.py``. Classes are
recognised by name: nothing here imports a host.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple

JOINT, IMAGE, OTHER = "joint", "image", "other"  # kinds of attention call


class Slot(NamedTuple):
    kind: str  # JOINT, IMAGE or OTHER
    block: int  # the block it belongs to (-1: none)
    # its queries are a part of the key sequence (one of the calls a host splits an attention
    # into by groups of queries, each over all keys): the keys are still the grid's
    part: bool = False


class Geometry(NamedTuple):
    """How a family passes q, k and v of its grid calls to the host's attention."""

    heads: int
    head_dim: int
    heads_first: bool  # [B, heads, N, head_dim] (the host's skip_reshape); else [B, N, heads * head_dim]


class TokenLayout(NamedTuple):
    grid: tuple[int, int, int]  # (t, h, w) of the main image/video tokens
    joint: tuple[int, int] | None  # (key sequence length, start of the grid) of joint calls
    image: tuple[int, int] | None  # the same for image-only calls
    # the grid's first frames that are conditioning and that ToMe keeps whole (never merged, nor
    # merged into): the clean first frame of an image-to-video call whose frames have timesteps of
    # their own. Reference and subject frames that are not the video's sit outside the grid instead
    whole_frames: int = 0


class BlockArgs(NamedTuple):
    """Where one kind of block's inputs sit in the host's block-replace arguments."""

    tokens: str  # the argument holding the sequence with the grid (restored after the block)
    # TokenLayout -> (length of that sequence, where the grid starts in it); None: the layout has none
    in_tokens: Callable
    pe: str | None = None  # rotary positions, indexed like the tokens (a tensor, or a tuple: the tensor first)
    pe_dim: int | Callable = 1  # their token dimension (or: the positions argument -> it), counting a batch dimension
    in_pe: Callable | None = None  # TokenLayout -> (length, grid start) of the positions' sequence
    mask: str | None = None  # an attention mask over the positions' sequence (its last two dimensions)
    modulation: str | None = None  # a modulation that may be per token ([B, L, ...] over the tokens' sequence)
    modulation_ndim: int = 2  # a modulation with fewer dimensions is per sample (Wan: [B, 6, C] vs [B, L, 6, C])
    # the modulation may hold one row per run of consecutive tokens, fewer rows than tokens (Wan's
    # per-frame timesteps, spread over the sequence by the block's repeat_e)
    modulation_runs: bool = False
    pe_also: tuple[str, ...] = ()  # further tables indexed like ``pe`` (Mochi's rope_sin next to its rope_cos)
    # False: the positions have no batch dimension (Mochi's [N, heads, D/2]); merged, each batch item
    # gets its own (a batch dimension added), which the block's rotation broadcasts against its
    # [B, N, heads, D/2] queries and keys
    pe_batch: bool = True
    # the tokens argument is a tuple of streams (LTX-2's img = (video, audio)) and the sequence with
    # the grid is this item of it; the others pass through, as the block leaves them
    tokens_item: int | None = None
    modulation_also: tuple[str, ...] = ()  # further modulations indexed like ``modulation`` (LTX-2's cross-attention ones)
    # a modulation the host holds in an object of its own -> its rows, a tensor [B, rows, ...] that the
    # block takes in the object's place (LTX-2's CompressedTimestep: a row per frame, per token or per sample)
    modulation_rows: Callable | None = None
    # of a tuple: how many of its leading items are tables (LTX-Video's (positions, ...): 1; CogVideoX's (cos, sin): 2)
    pe_items: int = 1
    # with pe_batch False, where a table is given: the block takes one for the whole batch and
    # cannot take one per sample (CogVideoX's rotation broadcasts its [N, D] as [1, 1, N, D]), so
    # the plan is made once for the batch (``tome_dit.plan_block``'s shared) and the table handed
    # on merged, still without a batch dimension
    pe_shared: bool = False


class DiTMerge(NamedTuple):
    """How ToMe reaches a family's blocks: the host's block-replace key of each block (by the
    block's index in the family's plan) and where each kind of block's inputs sit."""

    keys: Callable  # diffusion model -> {block index: (kind, number)} (the host's patches_replace["dit"] keys)
    args: dict  # kind -> BlockArgs
    # (diffusion model, call kwargs) -> why this call's blocks cannot be merged, or None
    check: Callable | None = None
    # None: the host looks the keys up itself. Else the model calls its blocks directly (NextDiT,
    # OmniGen2, Krea 2): the host reaches each merged block through an object patch on its forward (on the clone)
    # that hands its positional arguments on under these names (the first: the tokens, which the
    # block returns) with the call's transformer_options, and looks the key up there itself; the
    # block's parameters these stand for may be passed by keyword too (HiDream)
    layer_args: tuple[str, ...] | None = None
    # kind -> the names of the tuple a block of that kind returns (HiDream's double blocks: (img,
    # txt)); a kind not named returns the tokens alone
    layer_returns: dict | None = None
    # the calls ``check`` leaves alone, said in a few words for the model table ("calls with ..."):
    # required wherever ``check`` can refuse a call (tests/test_core_families.py)
    leaves_alone: str | None = None
    # True: something inside the blocks splits their tokens into equal groups, one per frame in
    # frame order (Wan HuMo's audio cross-attention): each frame merges the same count and the
    # merged tokens stay frame by frame (``tome_dit.plan_block``); tiles within frames only (stride_t 1)
    frame_grouped: bool = False
    # with frame_grouped: call kwargs -> how many equal groups the blocks split their tokens into
    # (HuMo: its audio frames); a call where that is not the grid's frame count is left alone
    frame_groups: Callable | None = None


def direct_call_refusal(what: str) -> str:
    """Family.merge_refusal of a family whose model calls its blocks with no block-replace lookup
    (patches_replace["dit"]) in a way the layer seam (``DiTMerge.layer_args``: the tokens, their
    rotary table, mask and modulation as positional arguments, the tokens returned) does not
    describe; ``what``: what in this family's block call it does not describe."""
    return ("its model calls its blocks directly (no block-replace lookup), which ToMe reaches only through a layer "
            f"call it describes, and {what}")


def _no_check(model) -> None:
    return None


class Family(NamedTuple):
    name: str  # as the user knows it
    configs: tuple[str, ...]  # the host's model-config class names it covers (exact names)
    model_classes: tuple[str, ...]  # the diffusion model classes it knows (exact names)
    rope: bool  # positions are rotated into q and k before the attention call
    video: bool
    blocks: Callable  # diffusion model -> module paths (under it) of its blocks, in call order
    plan: Callable  # diffusion model -> tuple[Slot, ...]
    patch: Callable  # diffusion model -> (pt, ph, pw)
    # (diffusion model, its patch, x, context, kwargs) -> TokenLayout; None where the call's inputs
    # hold tokens it cannot place, or a str: why this model call cannot be reduced (said as a warning)
    tokens: Callable
    # diffusion model -> Geometry of its grid calls, or {kind: Geometry} where its joint and
    # image-only calls differ (PixelDiT's pixel blocks have heads of their own): the auto rule
    # times each kind of grid call in its own shape (geometry_of)
    geometry: Callable
    # diffusion model -> why this model of the family cannot be reduced (a stream or block the
    # plan does not know), or None
    check: Callable = _no_check
    # (diffusion model, x, context, kwargs, the call's options) -> tuple[Slot, ...]: the plan of
    # this model call, for a family whose calls depend on its inputs (streams present or not,
    # blocks that skip a call, calls split in parts); or a str: why this call cannot be planned
    # (said as a warning, the call left alone). None: every call follows ``plan``
    call_plan: Callable | None = None
    # How ToMe merges whole blocks of this family (DiTMerge: the host's block-replace
    # keys and where each kind of block's tokens, positions, modulation and mask sit), or None:
    # ToMe refuses the family (tome_dit.tome_refusal says why)
    merge: DiTMerge | None = None
    # Without ``merge``: why ToMe cannot reach the family's blocks (the host hands them no
    # block-replace seam, ...), said in the refusal and the model table; None: not described yet
    merge_refusal: str | None = None


def geometry_of(family: Family, model, kind: str) -> Geometry:
    """The shape in which ``family``'s ``model`` passes q, k and v of its grid calls of ``kind``
    (JOINT or IMAGE) to the host's attention."""
    found = family.geometry(model)
    return found[kind] if isinstance(found, Mapping) else found


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def ref_tokens(refs, ph: int, pw: int) -> int:
    """Tokens of reference latents patchified at (ph, pw), as the Flux-style families append them."""
    return sum(ceil_div(r.shape[-2], ph) * ceil_div(r.shape[-1], pw) for r in refs or [])


def block_paths(model, *names: str) -> tuple[str, ...]:
    """Module paths of the blocks in the model's lists ``names``, in that order."""
    return tuple(f"{name}.{i}" for name in names for i in range(len(getattr(model, name))))


def image_grid(x, patch) -> tuple[int, int, int]:
    """The token grid of an image latent [B, C, H, W] (or [B, C, 1, H, W]) at (1, ph, pw)."""
    _, ph, pw = patch
    return (1, ceil_div(x.shape[-2], ph), ceil_div(x.shape[-1], pw))


def video_grid(x, patch, frames: int | None = None) -> tuple[int, int, int]:
    """The token grid of a video latent [B, C, T, H, W] at (pt, ph, pw)."""
    pt, ph, pw = patch
    return (ceil_div(x.shape[2] if frames is None else frames, pt), ceil_div(x.shape[3], ph), ceil_div(x.shape[4], pw))


def clean_frames(kwargs) -> int:
    """``TokenLayout.whole_frames`` of a video call: 1 where the call has a denoise mask (the
    latent's noise mask: Wan 2.2 TI2V's Wan22ImageToVideoLatent, LTXVImgToVideo), with which the
    model gives each frame (or token) a timestep of its own and the first latent frame is the
    clean start image; else 0. Which frames are clean is in the mask's values, which are not read
    (no host sync): the start image is taken to be the first latent frame alone."""
    return 1 if kwargs.get("denoise_mask") is not None else 0
