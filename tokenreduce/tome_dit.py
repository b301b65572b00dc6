"""ToMe on DiTs: whole-block token merging through the host's block-replace seam.

In each selected block the image or video grid's tokens are merged before the block runs and
restored after it, so attention, the projections and the MLP all run on fewer tokens. Text,
reference-image, register and other non-grid tokens are never merged: a family's ``TokenLayout``
(``dit.py``) says where the grid sits in a block's sequence. Rotary positions, per-token
modulation and masks are indexed the same way as the tokens (each merged token takes its
destination's position).

GPU-friendly, with no scatter and no host sync:

- *Tiles*: the grid ``(t, h, w)`` is cut into ``st x sy x sx`` tiles; each full tile keeps one
  destination (drawn per tile from a private seeded generator before the model call, or the
  first token), tokens of the partial tiles at the edges are kept as they are, and so are a
  video's conditioning frames (``TokenLayout.whole_frames``) and, with ``st`` above 1, its first
  frame (never in a tile with later frames) and the frames left over after it (``frame_tiling``).
- *Plan*: each source is compared (cosine) with its own tile's destination only; the ``r`` most
  similar sources of the whole grid merge (one stable sort on the device, no ``.item()``; with
  ``min_similarity`` only those at least that alike, a count read from the device once per plan).
- *Merge*: a dense masked sum per tile (reshape, multiply, sum), the kept sources gathered.
- *Restore*: ONE gather from a map computed with the plan: every token reads its merged row.
  The block's change is restored, not the merged state: ``out = x + restore(block(m) - m)`` with
  ``m = merge(x)``, so every token keeps its own residual stream; a block that changes nothing
  gives ``x`` back bit for bit.

With ``share_plans`` the first merged block of a model call plans and the others reuse its plan;
with ``plan_every`` n that plan also serves the calls like it (``run.plan_key``: same latent,
batch and cond/uncond rows) of the next n - 1 steps, put into their contexts by ``prepare_call``
(outside any compiled region: a compiled model sees two kinds of call, planning and reusing).
With ``correct_from_whole`` the step that plans also runs each merged block whole and keeps the
difference, which the steps reusing the plan add (``whole_difference``).

A merged block is handed a copy of the call's options with its plan under ``run.MERGED_GRID``,
so ToDo's attention override inside it reduces the merged grid's keys (``todo_dit``).

A family tells how its blocks are reached with a ``DiTMerge`` (``Family.merge``): which
block-replace key each block has and, per kind of block, where its grid tokens, rotary
positions, modulation and mask sit in the arguments the host hands the replacement.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from .bipartite import alike_count
from .describe import grid_text
from .dit import BlockArgs, TokenLayout
from .grid_patches import grid_reading_patches
from .measure import backend_of, compute_dtype, dit_block_fingerprint, measuring_options, on_copies
from .pays import AutoRule, Work
from .run import (MERGED_GRID, OVERRIDE, CallPatch, ModelCall, RunState, call_context, note_reduced, note_skipped,
                  plan_key)
from .seeding import derive_seed
from .tome_dit_blocks import ToMeBlockBudget
from .whole_difference import corrected_block


class Tiles(NamedTuple):
    """The destinations of a grid: fixed for a model call (drawn before it)."""

    grid: tuple[int, int, int]
    tile_index: torch.Tensor  # [T, k] grid positions of each full tile's tokens, its destination first
    extra_index: torch.Tensor  # [E] grid positions outside full tiles (kept whole)
    inverse: torch.Tensor  # [N] where each grid position sits in cat(extra_index, tile_index.flatten())

    @property
    def sources(self) -> int:
        return self.tile_index.shape[0] * (self.tile_index.shape[1] - 1)


def frame_tiling(t: int, st: int, whole_frames: int = 0) -> tuple[int, int, int]:
    """How ``t`` latent frames are cut into tiles of ``st`` frames: (frames kept out of every tile
    at the start, frames per tile, tiles along time). The first ``whole_frames`` (the layout's
    conditioning frames) are kept out, and with ``st`` above 1 always the first frame: a causal
    video VAE's first latent frame stands for one picture alone, in image to video the clean one
    with a timestep of its own, so it never shares a tile with later frames. The tiles are counted
    from the last frame back; frames left over before them stay whole too."""
    lead = min(t, whole_frames)
    if st > 1 and t > 1:
        lead = max(lead, 1)
    span = max(1, min(st, t - lead))
    return lead, span, (t - lead) // span


def tile_structure(grid: tuple[int, int, int], strides: tuple[int, int, int], device,
                   whole_frames: int = 0) -> Tiles:
    """The tiles of ``strides`` (st, sy, sx) over ``grid`` (t, h, w, frame-major raster order),
    each with its first token as destination (``rotated`` draws others). Built on ``device`` from
    index arithmetic: no host tensor, no copy, no sync. Tokens outside full tiles stay whole: the
    last rows and columns, and the frames ``frame_tiling`` keeps out of tiles."""
    t, h, w = grid
    _, sy, sx = (max(1, min(s, n)) for s, n in zip(strides, grid))
    _, st, nt = frame_tiling(t, strides[0], whole_frames)
    ny, nx = h // sy, w // sx
    first = t - nt * st  # the first frame in a tile
    positions = torch.arange(t * h * w, device=device).view(t, h, w)
    full = positions[first:, :ny * sy, :nx * sx]
    tiles = full.reshape(nt, st, ny, sy, nx, sx).permute(0, 2, 4, 1, 3, 5).reshape(nt * ny * nx, st * sy * sx)
    outside = torch.ones(t, h, w, dtype=torch.uint8, device=device)
    outside[first:, :ny * sy, :nx * sx] = 0
    # the positions outside tiles in ascending order, without a boolean index (which would sync):
    # a stable sort puts the ones first; how many there are is known here
    extra = torch.argsort(outside.flatten(), descending=True, stable=True)[:t * h * w - tiles.numel()]
    inverse = torch.argsort(torch.cat([extra, tiles.flatten()]))
    return Tiles(grid, tiles, extra, inverse)


def rotated(tiles: Tiles, generator: torch.Generator) -> Tiles:
    """``tiles`` with each tile's destination drawn from ``generator`` (a private one): each tile's
    tokens rotated so that the drawn one comes first. Tensor work on the tiles' device: the draw is
    made where the generator lives (on CUDA the device: no host round trip) and the map back is
    rotated with it (no sort)."""
    n_tiles, k = tiles.tile_index.shape
    if k <= 1:
        return tiles
    device = tiles.tile_index.device
    offset = torch.randint(0, k, (n_tiles, 1), generator=generator, device=generator.device).to(device)
    members = torch.arange(k, device=device)
    tile_index = tiles.tile_index.gather(1, (members[None] + offset) % k)  # a rotation: the drawn one first
    extra = tiles.extra_index.shape[0]
    slot = tiles.inverse - extra  # each position's place among the tiles' tokens (negative: outside them)
    tile = slot.clamp_min(0) // k
    moved = extra + tile * k + (slot.clamp_min(0) % k - offset[tile, 0]) % k
    return tiles._replace(tile_index=tile_index, inverse=torch.where(slot >= 0, moved, tiles.inverse))


def make_tiles(grid: tuple[int, int, int], strides: tuple[int, int, int], generator: torch.Generator | None,
               device, whole_frames: int = 0) -> Tiles:
    """Tiles of ``strides`` (st, sy, sx) over ``grid`` (t, h, w, frame-major raster order), one
    destination per full tile: at a position drawn from ``generator`` (a private one), or the
    first token of the tile where it is None (``tile_structure``, ``rotated``). Tokens outside full
    tiles stay whole: the last rows and columns, the first ``whole_frames`` frames (conditioning),
    the first frame wherever ``st`` is above 1, and the frames before the first whole tile of
    ``st`` frames counted from the last frame back (``frame_tiling``)."""
    tiles = tile_structure(grid, strides, device, whole_frames)
    return rotated(tiles, generator) if generator is not None else tiles


def merged_count(tiles: Tiles, ratio: float, frames: int = 1) -> int:
    """Sources merged for ``ratio`` of the grid's tokens (at most every source of the full tiles);
    a multiple of ``frames`` (rounded down) for a plan grouped by frame (``plan_block``)."""
    r = min(int(math.prod(tiles.grid) * ratio), tiles.sources)
    return r - r % frames


def _tile_sources(grid: tuple[int, int, int], strides: tuple[int, int, int], whole_frames: int) -> int:
    """The sources of the full tiles ``make_tiles`` cuts (their tokens but the destinations)."""
    t, h, w = grid
    _, sy, sx = (max(1, min(s, n)) for s, n in zip(strides, grid))
    _, st, nt = frame_tiling(t, strides[0], whole_frames)
    return nt * (h // sy) * (w // sx) * (st * sy * sx - 1)


def frame_shortfall(name: str, grid: tuple[int, int, int], strides: tuple[int, int, int], ratio: float,
                    r: int, whole_frames: int = 0) -> str | None:
    """Why a video call merges fewer tokens (``r``) than ``ratio`` asks of its ``grid`` where
    frames kept whole are the cause (the conditioning frames, the first frame with stride_t above
    1, the frames before the first whole tile of stride_t frames, or stride_t more than the frames
    after the first), and what to set instead (only settings that merge as asked); None where it
    merges as asked or no frame is kept whole."""
    t, h, w = grid
    st, sy, sx = strides
    n = t * h * w
    asked = int(n * ratio)
    lead, span, nt = frame_tiling(t, st, whole_frames)
    left = t - lead - nt * span  # frames after the first ones that no tile reaches
    if r >= asked or lead + left == 0:
        return None
    causes = []
    if whole_frames > 0:
        first = "first latent frame is" if whole_frames == 1 else f"first {whole_frames} latent frames are"
        causes.append(f"its {first} conditioning (the clean image it starts from, with a timestep of its own), "
                      f"kept whole")
    elif lead:
        causes.append(f"with stride_t {st} its first latent frame is kept whole (it never shares a tile with later "
                      f"frames: a causal video VAE's first latent frame stands for one picture alone, and in image to "
                      f"video it is the clean image, with a timestep of its own)")
    if st > 1 and t - lead < st:
        after = f"{t - lead} latent frame{'s' if t - lead != 1 else ''}"
        causes.append(f"stride_t {st} is more than the {after} after {'it' if lead == 1 else f'the first {lead}'}, "
                      f"so each tile spans only {span}")
    elif left:
        causes.append(f"the tiles of {st} latent frames are counted from the last frame back, so the "
                      f"{'next frame stays' if left == 1 else f'next {left} frames stay'} whole too")
    advice = []
    if st > 1:  # frame counts whose frames after the first fill whole tiles of stride_t, where they merge as asked
        below = lead + (t - lead) // st * st
        lengths = [m for m in (below, below + st) if m > lead and m != t
                   and _tile_sources((m, h, w), strides, whole_frames) >= int(m * h * w * ratio)]
        if lengths:
            advice.append(f"sample a number of latent frames that is {lead} more than a multiple of {st} "
                          f"({' or '.join(map(str, lengths))})")
    # stride_t values up to the frames after the first (beyond, tiles span no more frames)
    others = [str(d) for d in range(1, min(8, max(1, t - lead)) + 1)
              if d != st and _tile_sources(grid, (d, sy, sx), whole_frames) >= asked]
    if others:
        advice.append(f"set stride_t {' or '.join(others)}")
    merge_as_asked = f"To merge as asked, {', or '.join(advice)}; or set" if advice else "Set"
    return (f"ratio {ratio:g} asks {asked} of the {n} grid tokens of this {name} call ({grid_text(grid)}) to merge, "
            f"but {r} merge: {'; '.join(causes)}. {merge_as_asked} ratio {math.floor(r / n * 100) / 100:.2f} or lower, "
            f"which merges what this call can.")


class BlockPlan(NamedTuple):
    """One merge of a grid's tokens, for a batch: which sources merge, and the maps back. Each
    row is the plan of its sample alone (a row's merge never depends on what it is batched with)."""

    tiles: Tiles
    r: int
    mask: torch.Tensor  # [B, T, k-1, 1] float32: 1 where a source merges into its tile's destination
    kept: torch.Tensor  # [B, S - r] kept sources (flat indices into the tiles' sources)
    positions: torch.Tensor  # [B, M] the grid position each merged token stands for (its destination's)
    restore_map: torch.Tensor  # [B, N] the merged row each grid position reads back
    frames: int = 1  # > 1: grouped by frame (the merged tokens frame by frame, the same count each)
    # what every block merged with this plan takes alike (sequence indices, the rotary, mask and
    # modulation gathers, each row's plan), made by the first of them: ``gathered``; None: nothing kept
    gathers: dict | None = None

    @property
    def tokens(self) -> int:
        return math.prod(self.tiles.grid)

    @property
    def merged_tokens(self) -> int:
        return self.tokens - self.r


def plan_block(grid_tokens: torch.Tensor, tiles: Tiles, r: int, frames: int = 1,
               bound: float | None = None) -> BlockPlan:
    """The merge of ``grid_tokens`` [B, N, C]: the ``r`` sources most similar (cosine) to their own
    tile's destination merge into it, per sample. Tensor work only: no host sync, no scatter.
    ``bound`` (ToMe's min_similarity): only sources at least this alike merge, ``r`` the most
    (``bipartite.alike_count``: one count for the batch, per frame with ``frames``; one read from
    the device, the bounded merge's only sync); the plan's ``r`` says how many merged.
    ``frames`` > 1 (the grid's frame count, tiles within frames: stride_t 1, ``r`` a multiple of
    it): grouped by frame, each frame's ``r / frames`` most similar sources merge and the merged
    tokens are frame by frame, each frame's as a plan of that frame alone orders them
    (``_plan_frames``). fp16 tokens are planned in float32: an fp16 token's norm passes 65504
    (inf, every similarity 0) long before its values do; bfloat16 has float32's range and is
    planned as it is (a float32 copy of every token costs a merged Flux block several per cent)."""
    b, _, c = grid_tokens.shape
    n_tiles, k = tiles.tile_index.shape
    extra = tiles.extra_index.shape[0]
    members = grid_tokens.index_select(1, tiles.tile_index.flatten()).view(b, n_tiles, k, c)
    members = members.to(accumulating(members.dtype))
    normed = members / members.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    similarity = (normed[:, :, 1:] * normed[:, :, :1]).sum(-1).flatten(1)  # [B, S]
    if bound:
        r = alike_count(similarity.view(b, frames, -1), r // frames, bound) * frames
    if frames > 1:
        return _plan_frames(similarity, tiles, r, frames)
    order = torch.argsort(similarity, dim=1, descending=True, stable=True)
    rank = torch.argsort(order, dim=1)  # each source's place in that order (the inverse permutation)
    merges = rank < r
    kept = order[:, r:]
    tile_id = torch.arange(n_tiles, device=grid_tokens.device).view(1, n_tiles, 1)
    source_slot = torch.where(merges.view(b, n_tiles, k - 1), extra + tile_id, extra + n_tiles + rank.view(b, n_tiles, k - 1) - r)
    slots = torch.cat([torch.arange(extra, device=grid_tokens.device).expand(b, extra),
                       torch.cat([(extra + tile_id).expand(b, n_tiles, 1), source_slot], 2).flatten(1)], 1)
    restore_map = slots.index_select(1, tiles.inverse)
    sources = tiles.tile_index[:, 1:].flatten()
    positions = torch.cat([tiles.extra_index.expand(b, extra), tiles.tile_index[:, 0].expand(b, n_tiles),
                           sources[kept]], 1)
    return BlockPlan(tiles, r, merges.view(b, n_tiles, k - 1, 1).float(), kept, positions, restore_map, gathers={})


def _plan_frames(similarity: torch.Tensor, tiles: Tiles, r: int, frames: int) -> BlockPlan:
    """``plan_block`` grouped by frame. The tiles, the edge tokens outside them and the sources
    are frame-major with the same count in every frame (stride_t 1), so each frame is ranked
    apart (one sort over [B, frames, S / frames]) and the merged rows, numbered as ``merge``
    concatenates them ([edge tokens, destinations, kept sources], each frame-major), are
    renumbered frame by frame: the restore map stays one gather."""
    b, s = similarity.shape
    n_tiles, k = tiles.tile_index.shape
    extra, device = tiles.extra_index.shape[0], similarity.device
    per_frame, r_frame = s // frames, r // frames
    order = torch.argsort(similarity.view(b, frames, per_frame), dim=2, descending=True, stable=True)
    rank = torch.argsort(order, dim=2)
    merges = (rank < r_frame).view(b, n_tiles, k - 1)
    frame_start = torch.arange(frames, device=device).view(1, frames, 1)
    kept = (order[:, :, r_frame:] + frame_start * per_frame).flatten(1)  # frame by frame
    kept_slot = (rank - r_frame + frame_start * (per_frame - r_frame)).view(b, n_tiles, k - 1)
    tile_id = torch.arange(n_tiles, device=device).view(1, n_tiles, 1)
    source_slot = torch.where(merges, extra + tile_id, extra + n_tiles + kept_slot)
    slots = torch.cat([torch.arange(extra, device=device).expand(b, extra),
                       torch.cat([(extra + tile_id).expand(b, n_tiles, 1), source_slot], 2).flatten(1)], 1)
    counts = (extra // frames, n_tiles // frames, per_frame - r_frame)  # per frame: edge, destinations, kept
    row = sum(counts)
    renumber = torch.cat([(i // n) * row + before + i % n for n, before, i in (
        (n, sum(counts[:j]), torch.arange(n * frames, device=device)) for j, n in enumerate(counts))])
    restore_map = renumber[slots.index_select(1, tiles.inverse)]
    sources = tiles.tile_index[:, 1:].flatten()
    positions = torch.cat([tiles.extra_index.view(1, frames, counts[0]).expand(b, -1, -1),
                           tiles.tile_index[:, 0].view(1, frames, -1).expand(b, -1, -1),
                           sources[kept].view(b, frames, -1)], 2).flatten(1)
    return BlockPlan(tiles, r, merges.unsqueeze(-1).float(), kept, positions, restore_map, frames, gathers={})


def gathered(plan: BlockPlan, key: tuple, source, compute: Callable[[], object]):
    """``compute()``, what every block merged with ``plan`` takes alike (``source``: the argument
    it reads, the same object in each block of a model call; None: the plan alone), made by the
    first of them and kept with the plan under ``key``; made again where the source is another
    (a later call's, the plan kept by plan_every). Not kept for a plan without ``gathers``."""
    cache = plan.gathers
    if cache is None:
        return compute()
    hit = cache.get(key)
    if hit is not None and hit[0] is source:
        return hit[1]
    value = compute()
    cache[key] = (source, value)
    return value


def plan_row(plan: BlockPlan, i: int) -> BlockPlan:
    """Row ``i`` of ``plan``: the plan of that sample alone (a batch of 1), kept with the plan."""
    return gathered(plan, ("row", i), None, lambda: plan._replace(
        mask=plan.mask[i:i + 1], kept=plan.kept[i:i + 1], positions=plan.positions[i:i + 1],
        restore_map=plan.restore_map[i:i + 1], gathers={}))


def accumulating(dtype: torch.dtype) -> torch.dtype:
    """The dtype tokens of ``dtype`` are planned and averaged in: float32 for fp16, whose largest
    value (65504) a norm or a tile's sum passes with values a model really has (fp16 Flux
    activations reach ComfyUI's clamp); any other dtype itself (bfloat16 has float32's range, and
    converting every merged token costs more than the merge)."""
    return torch.float32 if dtype == torch.float16 else dtype


def merge(plan: BlockPlan, grid_tokens: torch.Tensor) -> torch.Tensor:
    """[B, N, C] -> [B, M, C]: [kept edge tokens, each destination averaged with its merged
    sources, the kept sources]: a dense per-tile masked sum and one gather. fp16 tokens are
    averaged in float32 (a tile's sum of them overflows before it is divided) and handed back in
    fp16; other dtypes as they are (``accumulating``)."""
    b, _, c = grid_tokens.shape
    tiles = plan.tiles
    n_tiles, k = tiles.tile_index.shape
    members = grid_tokens.index_select(1, tiles.tile_index.flatten()).view(b, n_tiles, k, c)
    sources = members[:, :, 1:]
    dtype = accumulating(grid_tokens.dtype)
    mask, count = gathered(plan, ("mask in", dtype), None,
                           lambda: (plan.mask.to(dtype), (1 + plan.mask.sum(2)).to(dtype)))
    total = members[:, :, 0].to(dtype) + (sources.to(dtype) * mask).sum(2)
    destinations = (total / count).to(grid_tokens.dtype)
    kept = sources.reshape(b, -1, c).gather(1, plan.kept.unsqueeze(-1).expand(-1, -1, c))
    if plan.frames > 1:  # frame by frame: [edge tokens, destinations, kept sources] of each frame
        t = plan.frames
        edge = tiles.extra_index.shape[0] // t  # explicit: a view of no tokens cannot infer it
        return torch.cat([grid_tokens.index_select(1, tiles.extra_index).view(b, t, edge, c),
                          destinations.view(b, t, -1, c), kept.view(b, t, -1, c)], 2).flatten(1, 2)
    return torch.cat([grid_tokens.index_select(1, tiles.extra_index), destinations, kept], 1)


def restore(plan: BlockPlan, merged: torch.Tensor) -> torch.Tensor:
    """[B, M, C] -> [B, N, C]: every grid position reads its merged row (one gather)."""
    return merged.gather(1, plan.restore_map.unsqueeze(-1).expand(-1, -1, merged.shape[-1]))


def sequence_index(plan: BlockPlan, length: int, start: int) -> torch.Tensor:
    """[B, L'] positions of a sequence of ``length`` tokens with the grid at ``start``, merged:
    the tokens before and after the grid as they are, the grid's merged tokens between."""
    b, device = plan.positions.shape[0], plan.positions.device
    end = start + plan.tokens
    return torch.cat([torch.arange(start, device=device).expand(b, start), plan.positions + start,
                      torch.arange(end, length, device=device).expand(b, length - end)], 1)


def take(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``x`` read along ``dim`` at the per-batch positions ``index`` [B, L'] (a batch of 1 is
    broadcast to B)."""
    b = index.shape[0]
    if x.shape[0] != b:
        x = x.expand(b, *x.shape[1:])
    dim = dim % x.ndim
    view = [b if d == 0 else (index.shape[1] if d == dim else 1) for d in range(x.ndim)]
    size = [b if d == 0 else (index.shape[1] if d == dim else x.shape[d]) for d in range(x.ndim)]
    return x.gather(dim, index.view(view).expand(size))


def sequence_of(spec: BlockArgs, value):
    """The sequence with the grid in the block's tokens argument ``value`` (of a tuple of streams,
    ``spec.tokens_item``), or None where it holds none."""
    if spec.tokens_item is None:
        return value
    return value[spec.tokens_item] if isinstance(value, (tuple, list)) and len(value) > spec.tokens_item else None


def with_sequence(spec: BlockArgs, value, x: torch.Tensor):
    """The tokens argument ``value`` with its sequence replaced by ``x`` (the other streams kept)."""
    if spec.tokens_item is None:
        return x
    items = list(value)
    items[spec.tokens_item] = x
    return type(value)(items) if isinstance(value, tuple) else items


def merged_args(spec: BlockArgs, layout: TokenLayout, plan: BlockPlan, args: dict) -> tuple[dict, torch.Tensor] | None:
    """The block's arguments with the grid merged (its rotary positions, per-token modulations and
    attention mask taken at the merged tokens), and the merged grid tokens (a tensor of their own,
    not handed to the block: its change is taken from them whatever the block does to its input),
    or None where the arguments are not the predicted layout (left alone)."""
    where = spec.in_tokens(layout)
    x = sequence_of(spec, args.get(spec.tokens))
    if where is None or x is None or x.ndim != 3 or x.shape[1] != where[0]:
        return None
    length, start = where
    merged_grid = merge(plan, x.narrow(1, start, plan.tokens))
    end = start + plan.tokens
    merged_x = torch.cat([x.narrow(1, 0, start), merged_grid, x.narrow(1, end, length - end)], 1)
    new = {**args, spec.tokens: with_sequence(spec, args[spec.tokens], merged_x)}
    for taken in (_merged_modulations(spec, plan, args, where), _merged_positions(spec, layout, plan, args),
                  _merged_mask(spec, layout, plan, args)):
        if taken is None:
            return None
        new.update(taken)
    return new, merged_grid


def plan_sequence_index(plan: BlockPlan, where: tuple[int, int]) -> torch.Tensor:
    """``sequence_index`` of the sequence ``where`` (length, grid start), made once per plan."""
    return gathered(plan, ("sequence", *where), None, lambda: sequence_index(plan, *where))


_AS_GIVEN = object()  # a modulation that is not per token: the block is given it as it is


def _merged_modulations(spec: BlockArgs, plan: BlockPlan, args: dict, where: tuple[int, int]) -> dict | None:
    """{name: the modulation at the merged tokens} of the per-token modulations (``spec.modulation``
    and ``modulation_also``, over the tokens' sequence ``where``); those per sample are left as
    given. None: one whose rows are grouped otherwise (not placed: the block is left alone)."""
    names = (spec.modulation, *spec.modulation_also) if spec.modulation is not None else ()
    taken = {}
    for name in names:
        given = args.get(name)
        merged = gathered(plan, ("modulation", name), given, lambda: _merged_modulation(spec, plan, given, where))
        if merged is None:
            return None
        if merged is not _AS_GIVEN:
            taken[name] = merged
    return taken


def _merged_modulation(spec: BlockArgs, plan: BlockPlan, modulation, where: tuple[int, int]):
    """One modulation at the merged tokens: a row per token read at each merged token's, a row per
    run of consecutive tokens (Wan's per-frame timesteps) at its run's; ``_AS_GIVEN`` where it is
    per sample; None where its rows are grouped otherwise."""
    if modulation is not None and not torch.is_tensor(modulation) and spec.modulation_rows is not None:
        modulation = spec.modulation_rows(modulation)  # the host's object: its rows, taken in its place
    if not torch.is_tensor(modulation) or modulation.ndim < spec.modulation_ndim or modulation.shape[1] == 1:
        return _AS_GIVEN
    length = where[0]
    rows, index = modulation.shape[1], plan_sequence_index(plan, where)
    if rows == length:
        return take(modulation, 1, index)
    if spec.modulation_runs and rows < length:
        # one row per run of consecutive tokens, spread as the block would spread them (runs of
        # length // rows, or one more, the last cut short)
        run = length // rows + (0 if length % rows == 0 else 1)
        return take(modulation, 1, torch.div(index, run, rounding_mode="floor"))
    return None


def _merged_positions(spec: BlockArgs, layout: TokenLayout, plan: BlockPlan, args: dict) -> dict | None:
    """{name: the rotary table at the merged tokens} of ``spec.pe`` and ``pe_also`` where given;
    None where a table is not over the predicted sequence."""
    if spec.pe is None or args.get(spec.pe) is None:
        return {}
    where = spec.in_pe(layout)
    if where is None:
        return None
    taken = {}
    for name in (spec.pe, *spec.pe_also):
        pe = args.get(name)
        if pe is None:
            continue
        merged = gathered(plan, ("positions", name), pe, lambda: _merged_table(spec, plan, pe, where))
        if merged is None:
            return None
        taken[name] = merged
    return taken


def _merged_table(spec: BlockArgs, plan: BlockPlan, pe, where: tuple[int, int]):
    """One rotary argument at the merged tokens: a table, or a tuple of its first ``pe_items``
    tables and what goes with them (LTX-Video's on ComfyUI 0.33). A table the block takes for the
    whole batch (``pe_shared``) only for a plan of one row (``run_merged_block`` runs such a block
    once per row), handed on without a batch dimension. None: not over the sequence ``where``."""
    pair = isinstance(pe, tuple)
    pe_dim = spec.pe_dim(pe) if callable(spec.pe_dim) else spec.pe_dim
    index = plan_sequence_index(plan, where)
    tables = []
    for positions in pe[:spec.pe_items] if pair else (pe,):
        positions = positions if spec.pe_batch else positions.unsqueeze(0)
        if positions.shape[pe_dim] != where[0] or (spec.pe_shared and index.shape[0] != 1):
            return None
        tables.append(take(positions, pe_dim, index).squeeze(0) if spec.pe_shared else take(positions, pe_dim, index))
    return (*tables, *pe[spec.pe_items:]) if pair else tables[0]


def _merged_mask(spec: BlockArgs, layout: TokenLayout, plan: BlockPlan, args: dict) -> dict | None:
    """{name: the attention mask at the merged tokens} (over the positions' sequence, its last one
    or two dimensions), whether or not rotary positions are given; None where it is not over
    that sequence."""
    mask = args.get(spec.mask) if spec.mask is not None else None
    if mask is None:
        return {}
    where = spec.in_pe(layout) if spec.in_pe is not None else spec.in_tokens(layout)
    if where is None or not torch.is_tensor(mask) or mask.ndim < 2 or mask.shape[-1] != where[0] or \
            mask.shape[-2] not in (1, where[0]):
        return None

    def columns_and_rows():
        index = plan_sequence_index(plan, where)
        merged = take(mask, -1, index)
        return take(merged, -2, index) if merged.shape[-2] != 1 else merged
    return {spec.mask: gathered(plan, ("mask", spec.mask), mask, columns_and_rows)}


def restored(spec: BlockArgs, layout: TokenLayout, plan: BlockPlan, x: torch.Tensor, merged: torch.Tensor,
             out: torch.Tensor) -> torch.Tensor:
    """The block's output over the full sequence: every grid token its own input plus the change
    the block made to the merged token it was part of; the tokens around the grid as the block
    left them. ``merged``: the merged grid tokens (``merged_args``), or the merged sequence."""
    _, start = spec.in_tokens(layout)
    m = plan.merged_tokens
    merged_grid = merged if merged.shape[1] == m else merged.narrow(1, start, m)
    change = out.narrow(1, start, m) - merged_grid
    grid = x.narrow(1, start, plan.tokens) + restore(plan, change)
    return torch.cat([out.narrow(1, 0, start), grid, out.narrow(1, start + m, out.shape[1] - start - m)], 1)


SHARED_PLAN = "tome dit plan"  # the key of the plan all merged blocks of a model call share, in its plans


def shared_plan(plans: dict) -> BlockPlan | None:
    """A plan the merged blocks of a model call share, kept in ``plans``: the node's ratio's
    (``SHARED_PLAN``), else the one of the blocks the budget merges at a milder ratio
    (``(SHARED_PLAN, r)``: where no block merges at the node's); None: none kept."""
    milder = (plan for key, plan in plans.items() if isinstance(key, tuple) and key[:1] == (SHARED_PLAN,))
    return plans.get(SHARED_PLAN) or next(milder, None)


def block_plan(plans: dict | None, x: torch.Tensor, where: tuple[int, int], layout: TokenLayout, tiles: Tiles,
               r: int, frames: int = 1, timer=None, bound: float | None = None, key=SHARED_PLAN) -> BlockPlan:
    """The plan a merged block merges the sequence ``x`` (its grid at ``where``) with: the one kept
    in ``plans`` (share_plans: made by the model call's first merged block, or an earlier step's
    with plan_every) where it is for this batch, else made now and kept there (None: every block
    makes its own). ``timer``: the run that profiles planning (``RunState.timed``), or None.
    ``key``: where in ``plans`` (the blocks the budget merges at a milder ratio share a plan of
    their own)."""
    plan = plans.get(key) if plans is not None else None
    if plan is None or plan.restore_map.shape[0] != x.shape[0]:
        grid = x.narrow(1, where[1], math.prod(layout.grid))
        plan = plan_block(grid, tiles, r, frames, bound) if timer is None else \
            timer.timed(x.device, lambda: plan_block(grid, tiles, r, frames, bound))
        if plans is not None:
            plans[key] = plan
    return plan


class _MergedCall(NamedTuple):
    """A block call with its grid merged, before it runs."""

    plan: BlockPlan
    x: torch.Tensor  # the sequence with the grid, as the block was to be given it
    args: dict  # the merged arguments
    merged_grid: torch.Tensor  # the merged grid tokens (the block's change is taken from them)


def run_merged_block(spec: BlockArgs, layout: TokenLayout, plan: BlockPlan, args: dict, inner: Callable,
                     out_at=None, per_row: bool = False, also: Callable | None = None):
    """The block ``inner`` (its arguments -> its output) run on ``args`` with the grid merged by
    ``plan``, and its output with the change restored: every grid token its own input plus the
    change the block made to its merged token. The one way a merged block runs, whatever the host
    (ComfyUI's and Forge's block replacements, diffusers' wrapped forwards).

    ``out_at``: where the output holds the tokens' argument (a key of a dict, an index of a tuple;
    None: the output is it). ``per_row``: the block takes one rotary table for the whole batch
    (CogVideoX's, diffusers' Flux's), so each row runs apart with its own plan: a row's output
    does not depend on what it was batched with. ``also(merged args, plan)``: the host's further
    merges of the arguments ({name: value}, or None: left alone). In the block's options
    (``transformer_options``) its plan goes under ``MERGED_GRID``, for an attention patch inside
    it (ToDo). Returns None where the arguments are not the predicted layout (the caller runs the
    block as it is)."""
    x = sequence_of(spec, args.get(spec.tokens))
    batch = x.shape[0] if torch.is_tensor(x) and x.ndim == 3 else 1
    if per_row and batch > 1:
        keep = {spec.pe, *spec.pe_also}  # tables without a batch dimension, given whole to every row
        rows = [_merged_call(spec, layout, row, _row_args(spec, row, args, i, batch, keep), also)
                for i, row in ((i, plan_row(plan, i)) for i in range(batch))]
        if any(row is None for row in rows):
            return None
        return _joined([_run_merged(spec, layout, row, inner, out_at) for row in rows])
    call = _merged_call(spec, layout, plan, args, also)
    return None if call is None else _run_merged(spec, layout, call, inner, out_at)


def _merged_call(spec: BlockArgs, layout: TokenLayout, plan: BlockPlan, args: dict,
                 also: Callable | None) -> _MergedCall | None:
    made = merged_args(spec, layout, plan, args)
    if made is None:
        return None
    new, merged_grid = made
    if also is not None:
        more = also(new, plan)
        if more is None:
            return None
        new.update(more)
    options = args.get("transformer_options")
    if isinstance(options, dict):  # the merge, for an attention patch inside the block (ToDo)
        new["transformer_options"] = {**options, MERGED_GRID: plan}
    return _MergedCall(plan, sequence_of(spec, args[spec.tokens]), new, merged_grid)


def _run_merged(spec: BlockArgs, layout: TokenLayout, call: _MergedCall, inner: Callable, out_at):
    out = inner(call.args)
    held = out if out_at is None else out[out_at]
    tokens = with_sequence(spec, held, restored(spec, layout, call.plan, call.x, call.merged_grid,
                                                sequence_of(spec, held)))
    if out_at is None:
        return tokens
    if isinstance(out, dict):
        return {**out, out_at: tokens}
    parts = list(out)
    parts[out_at] = tokens
    return tuple(parts) if isinstance(out, tuple) else parts


def _row_args(spec: BlockArgs, row_plan: BlockPlan, args: dict, i: int, batch: int, keep: set) -> dict:
    """Row ``i``'s arguments of a block call on ``batch`` rows: tensors batched on their first
    dimension (or on a multiple of it, rows i, i + batch, ...: diffusers' Qwen-Image doubled
    temb), the streams of a tokens tuple too; the tables ``keep`` and anything else as given. A
    row of an argument every block is given alike is taken once per plan (``row_plan``'s), so
    what is gathered from it is too."""
    def row(value):
        if torch.is_tensor(value) and value.ndim >= 1 and value.shape[0] >= batch and value.shape[0] % batch == 0:
            return value[i::batch]
        return value
    # (the tokens are each block's own: not kept, which would keep the block's input alive)
    taken = {name: value if name in keep else row(value) if name == spec.tokens else
             gathered(row_plan, ("row of", name), value, lambda value=value: row(value)) for name, value in args.items()}
    tokens = args.get(spec.tokens)
    if spec.tokens_item is not None and isinstance(tokens, (tuple, list)):
        taken[spec.tokens] = type(tokens)(row(stream) for stream in tokens)
    return taken


def _joined(outs: list):
    """The outputs of a block run once per row, joined into the batch's (tensors concatenated, in
    dicts, tuples and lists alike; anything else the first row's)."""
    first = outs[0]
    if torch.is_tensor(first):
        return torch.cat(outs, 0)
    if isinstance(first, dict):
        return {key: _joined([out[key] for out in outs]) for key in first}
    if isinstance(first, (tuple, list)):
        return type(first)(_joined(list(parts)) for parts in zip(*outs))
    return first


def _shape_of(value):
    """A model input as the auto rule's per-run lookup keys it: a tensor's shape without the batch,
    a list of tensors' shapes, a plain value itself."""
    if torch.is_tensor(value):
        return tuple(value.shape[1:])
    if isinstance(value, (list, tuple)):
        return tuple(_shape_of(v) for v in value)
    return value if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__


def tome_dit_blocks(sites) -> frozenset:
    """The indices (in the family's plan) of the DiT blocks the selected sites are."""
    return frozenset(site.key[1] for site in sites)


def tome_refusal(target_family: str, family) -> str:
    """Why ToMe does not patch a DiT of ``family`` (no ``DiTMerge``), and what to use instead."""
    from .families import FAMILIES  # the registry imports this module's users

    merged = ", ".join(f.name for f in FAMILIES if f.merge is not None)
    why = f": {family.merge_refusal}" if getattr(family, "merge_refusal", None) else " yet"
    return (f"ToMe cannot patch this {target_family} model: it has no UNet transformer blocks, and ToMe does not merge "
            f"whole blocks of {family.name}{why} (it does on {merged}). For this model use Token Downsampling (ToDo, "
            f"TokenReduce), which supports {family.name}. Remove this node for this model.")


def later_inputs_signature(settings) -> tuple:
    """plan_every, min_similarity and correct_from_whole in the auto rule's kinds where they are set
    (none at their defaults: decisions kept before them stay valid)."""
    every, bound = getattr(settings, "plan_every", 1), alike_bound(settings)
    return ((("plan every", every) if every > 1 else ()) + (("min similarity", bound) if bound else ())
            + (("corrected from whole",) if corrects(settings) else ()))


def corrects(settings) -> bool:
    """ToMe's correct_from_whole (on DiTs, with plan_every: the whole block's difference kept per plan)."""
    return bool(getattr(settings, "correct_from_whole", False))


def alike_bound(settings) -> float:
    """ToMe's min_similarity (0: none, every merge tomesd's ``ratio``)."""
    return getattr(settings, "min_similarity", 0.0) or 0.0


class _Captured(Exception):
    """Ends a rehearsed model call once every block to time has shown its inputs."""


class NotReached(RuntimeError):
    """A rehearsed model call never reached a wanted block (``captured_blocks``): the model calls it
    without the host's key (NextDiT), or something skipped or replaced it. A fact of the model, not
    a failure of the try (out of memory, a model error): those propagate as they are."""


def captured_blocks(call: ModelCall, wanted: dict) -> dict:
    """{kind: (the block-replace function at its key, the arguments and extras the model handed it)}
    for ``wanted`` ({kind: block-replace key}): the model call rehearsed (``ModelCall.rehearse``:
    below every host wrapper) with measuring options (no call context: every TokenReduce patch
    passes through) in which the block-replace functions are only ours at the wanted keys, each
    wrapped to keep what it is given; the rehearsal stops at the last of them (the blocks after it
    never run). Nothing that may keep state between model calls runs in it: the host leaves its
    wrappers out, the blocks before run as the model's own (no other pack's block replacement),
    so the run that measures gives what later runs give."""
    if call.rehearse is None:
        raise RuntimeError("this host cannot run a model call again to time a block")
    options = measuring_options(call)
    replace = options.setdefault("patches_replace", {})
    installed = replace.get("dit", {})
    found = {}

    def keeper(kind, block):
        def keep(args, extra):
            found[kind] = (block if block is not None else _original_block, args, extra)
            if len(found) == len(wanted):
                raise _Captured
            return extra["original_block"](args)
        return keep

    replace["dit"] = {key: keeper(kind, installed.get(key)) for kind, key in wanted.items()}
    try:
        call.rehearse(options)
    except _Captured:
        return found
    missing = ", ".join(f"{kind} ({key})" for kind, key in wanted.items() if kind not in found)
    raise NotReached(f"the model call, run again to time its blocks, never reached the block of {missing} "
                       f"(something in the model skipped or replaced it)")


def _original_block(args: dict, extra: dict) -> dict:
    return extra["original_block"](args)


class ToMeDiTPatch(ToMeBlockBudget, CallPatch):
    """The block replacements of one ToMe node output on a DiT: per selected block, merge the
    grid, run the block (or the replacement that was there before ours), restore."""

    def __init__(self, settings, layout, blocks: frozenset, diffusion_model, context_key: str, label: str,
                 rule: AutoRule | None = None):
        super().__init__(context_key, label, rule)
        self.settings = settings
        self.bound = alike_bound(settings)  # min_similarity, read once (per block call: a lookup)
        self.correct = corrects(settings)
        self.family = layout.family
        self.merge = layout.family.merge
        self.blocks = blocks  # indices (in the family's plan) of the blocks it merges
        self.model = diffusion_model  # read for its structure only
        self.patch = self.family.patch(diffusion_model)
        s = settings
        self.strides = (getattr(s, "stride_t", 1) if self.family.video else 1, s.stride_y, s.stride_x)

    def replace_keys(self) -> dict:
        """{block index: the host's block-replace key} of the blocks it merges."""
        return {i: key for i, key in self.merge.keys(self.model).items() if i in self.blocks}

    # --- before each model call (outside any compiled region) ------------------------------
    def prepare_call(self, context: dict, run: RunState, call: ModelCall) -> None:
        if not context["active"]:
            return
        tokens = self.family.tokens(self.model, self.patch, call.x, call.context, call.kwargs)
        problem = self.merge.check(self.model, call.kwargs) if self.merge.check is not None else None
        problem = problem or grid_reading_patches(call.options)  # InfiniteTalk / MultiTalk's
        if tokens is None or isinstance(tokens, str) or problem:
            context["active"] = False
            reason = problem or tokens or "its inputs hold tokens whose layout ToMe does not know"
            run.warn_once(f"{self.label}: this {self.family.name} model call was left alone: {reason}.")
            return
        kept = self._earlier_plans(run, call, tokens.grid)
        reused = shared_plan(kept) if kept is not None else None
        if self.merge.frame_grouped and self.strides[0] > 1:  # the ComfyUI node refuses it at validation
            context["active"] = False
            run.warn_once(f"{self.label}: this {self.family.name} model call was left alone: its blocks group their "
                          f"tokens by latent frame, so tiles cannot span frames (stride_t {self.strides[0]}); use "
                          f"stride_t 1.")
            return
        groups = self.merge.frame_groups(call.kwargs) if self.merge.frame_groups is not None else None
        if groups is not None and groups != tokens.grid[0]:
            context["active"] = False
            run.warn_once(f"{self.label}: this {self.family.name} model call was left alone: its blocks split their "
                          f"tokens into {groups} equal groups, not one per latent frame ({tokens.grid[0]}), which "
                          f"merged frames would not keep.")
            return
        tiles = reused.tiles if reused is not None else self._tiles(run, tokens, call)
        r = merged_count(tiles, self.settings.ratio, self._frames(tokens.grid))
        if r == 0:
            context["active"] = False  # nothing merges at this size: the blocks run as they are
            return
        kinds = dict.fromkeys(kind for kind, _ in self.replace_keys().values())
        ladder = tuple((ratio, merged_count(tiles, ratio, self._frames(tokens.grid))) for ratio in self._ratios())
        graded = self._graded(run, call, tokens, tiles, ladder)  # the budget, per block (None: per kind)
        if graded is None:
            left = self.left_alone(context, run, call, kinds,
                                   lambda kind: self._pays(run, call, tokens, kind, r, tiles))
        else:
            left = self.graded_left(context, run, call, kinds, graded)
        if not context["active"]:  # reduce_when auto left every kind of block alone
            return
        shortfall = frame_shortfall(self.family.name, tokens.grid, self.strides, self.settings.ratio, r,
                                    tokens.whole_frames)
        if shortfall is not None:  # said once per run and grid (the same text)
            run.warn_once(f"{self.label}: {shortfall}")
        # this call's plans: an earlier step's (with the differences correct_from_whole kept with
        # them), or none yet (its first merged block plans, and with share_plans keeps its plan here
        # for the others: ``block_plan``)
        plans = dict(kept) if reused is not None else {}
        context.update(layout=tokens, tiles=tiles, r=r, left=left, plans=plans, planning=reused is None,
                       graded=graded)
        if reused is None and getattr(self.settings, "plan_every", 1) > 1:
            run.keep_plans(plan_key(call), run.step(call.sigmas), plans)  # they serve the next every - 1 steps

    def _earlier_plans(self, run: RunState, call: ModelCall, grid: tuple[int, int, int]) -> dict | None:
        """plan_every: the plans an earlier step's call like this one made (fewer than plan_every
        steps before) for this grid (a shared plan: ``shared_plan``), or None: this call
        plans. Decided here, outside any compiled region."""
        every = getattr(self.settings, "plan_every", 1)
        if every <= 1:
            return None
        plans = run.kept_plans(plan_key(call), run.step(call.sigmas), every)
        plan = shared_plan(plans) if plans is not None else None
        return plans if plan is not None and plan.tiles.grid == grid else None

    # --- reduce_when auto ----------------------------------------------------------------------
    def call_key(self, call: ModelCall) -> tuple:
        """What of a model call decides its token layout and the kinds of its blocks (the batch
        does not): the latent's and the text's shapes, the shapes of its other inputs (reference
        latents), the dtype, the model copy and the attention backend."""
        return (call.x.device, tuple(call.x.shape[1:]),
                tuple(call.context.shape[1:]) if call.context is not None else (),
                tuple((name, _shape_of(value)) for name, value in sorted(call.kwargs.items())),
                compute_dtype(call), call.model, backend_of(call, call.options.get(OVERRIDE)))

    def _frames(self, grid: tuple[int, int, int]) -> int:
        """The groups of a plan: the grid's frames where the family's blocks group by frame, else 1."""
        return grid[0] if self.merge.frame_grouped else 1

    def _pays(self, run: RunState, call: ModelCall, tokens: TokenLayout, kind: str, r: int, tiles: Tiles) -> bool:
        """reduce_when auto for the blocks of ``kind``: the first merged block of that kind timed
        as the model runs it unmerged, and planned, merged, run and restored with this call's
        ``tiles`` (the frames kept whole among what decides the kind: a clean first frame merges
        nothing, and changes what merges)."""
        decision = self._decision(run, call, tokens, kind, r, tiles)
        return decision is None or decision.reduce

    def _signature(self, call: ModelCall, tokens: TokenLayout, kind: str, r: int) -> tuple:
        s = self.settings
        length = self.merge.args[kind].in_tokens(tokens)
        return ("tome dit", self.family.name, kind, self._width(kind), length[0] if length else 0, *tokens.grid,
                r, s.ratio, *self.strides, tokens.whole_frames, s.share_plans, str(compute_dtype(call)),
                backend_of(call, call.options.get(OVERRIDE)), *later_inputs_signature(s))

    def _decision(self, run: RunState, call: ModelCall, tokens: TokenLayout, kind: str, r: int, tiles: Tiles,
                  budgeted: bool = True):
        """The auto rule's decision for the blocks of ``kind`` merging ``r`` tokens (None: no rule);
        ``budgeted`` False: speed alone (the budget decides per block: ``tome_dit_blocks``)."""
        if self.rule is None:
            return None
        signature = self._signature(call, tokens, kind, r)

        def describe():
            grid = tokens.grid if tokens.grid[0] > 1 else tokens.grid[1:]
            n = math.prod(tokens.grid)
            site = f"{self.family.name} {kind.replace('_', ' ')}s, {grid_text(grid)} grid ({n} → {n - r} tokens)"
            return site, lambda: self._work(call, tokens, kind, r, tiles)

        first = min(i for i, key in self.replace_keys().items() if key[0] == kind)  # the block measured
        return self.decision(run, call.x.device, signature, describe,
                             lambda: dit_block_fingerprint(call, self.model, self.family.blocks, first),
                             budgeted=budgeted)

    def _width(self, kind: str) -> int:
        """Parameters of the first merged block of ``kind`` (which model of the family, for the kind)."""
        block = min(i for i, key in self.replace_keys().items() if key[0] == kind)
        try:
            module = self.model.get_submodule(self.family.blocks(self.model)[block])
        except (AttributeError, IndexError):
            return 0
        return sum(p.numel() for p in module.parameters())

    def _work(self, call: ModelCall, tokens: TokenLayout, kind: str, r: int, tiles: Tiles) -> Work:
        """The first merged block of ``kind`` with the inputs the model hands it (captured from a
        rehearsal of this model call), through ours: unmerged (our context off), and merged
        (planned, merged, run, restored) with the tiles this call runs with (its conditioning
        frames kept whole, its destinations: ``_tiles``), so the change read is the run's. With
        share_plans one plan serves every merged block of a model call: the block is timed with
        its plan made once, and the plan's own time, shared by the merged blocks (and with
        plan_every by that many steps), is added."""
        keys = self.replace_keys()
        key = keys[min(i for i, k in keys.items() if k[0] == kind)]
        ((block, args, extra),) = captured_blocks(call, {kind: key}).values()
        options = args["transformer_options"]
        merging = call_context(True, layout=tokens, tiles=tiles, r=r, left=frozenset(), plans={})
        full = {**args, "transformer_options": {**options, self.context_key: call_context(False)}}
        reduced = {**args, "transformer_options": {**options, self.context_key: merging}}
        runs = {"full": lambda: block(full, extra), "reduced": lambda: block(reduced, extra)}
        compare = lambda: (on_copies(block, full, extra), on_copies(block, reduced, extra))  # noqa: E731 - max_change
        if not self.settings.share_plans:
            return Work(runs, lambda t: t["full"], lambda t: t["reduced"], compare=compare)
        spec = self.merge.args[kind]
        grid = sequence_of(spec, args[spec.tokens]).narrow(1, spec.in_tokens(tokens)[1], math.prod(tokens.grid))
        runs["plan"] = lambda: plan_block(grid, tiles, r, self._frames(tokens.grid), self.bound)
        # the block calls one plan serves: every merged block of every kind (those of a kind auto may
        # still leave alone included: not decided yet), over plan_every steps
        every = getattr(self.settings, "plan_every", 1)
        calls_per_plan = len(keys) * every
        # correct_from_whole: the step that plans runs the block whole too (per kind the change is
        # read uncorrected; per block, corrected from its plan's step: tome_dit_blocks)
        whole_share = 1 / every if self.correct else 0.0
        return Work(runs, lambda t: t["full"],
                    lambda t: t["reduced"] + t["plan"] / calls_per_plan + t["full"] * whole_share, compare=compare)

    def _tiles(self, run: RunState, layout: TokenLayout, call: ModelCall) -> Tiles:
        """This call's tiles: their structure (the first token of each tile the destination) made
        once per run, grid, strides and device; with use_rand the destinations drawn per call, on
        the device (``rotated``)."""
        device, grid, whole = call.x.device, layout.grid, layout.whole_frames
        key = ("tome dit tiles", grid, self.strides, whole, device)
        tiles = run.cache.get(key)
        if tiles is None:
            tiles = run.cache[key] = tile_structure(grid, self.strides, device, whole)
        if not self.settings.use_rand:  # the first token of every tile: the same for the whole run
            return tiles
        # Keyed by when and what, not by call order: cond and uncond draw the same destinations.
        seed = derive_seed(self.settings.seed, run.sigma(call.sigmas), "dit", *grid, *self.strides)
        return rotated(tiles, run.generator(device, seed))

    # --- in the model call ----------------------------------------------------------------
    def replacement(self, kind: str, block: int, previous: Callable | None) -> Callable:
        """The block-replace function of block ``block`` (a ``kind`` block), chained to the
        replacement ``previous`` that was there before ours (None: the host's own block)."""
        spec = self.merge.args[kind]

        def run_block(args: dict, extra: dict) -> dict:
            def inner(a):
                return previous(a, extra) if previous is not None else extra["original_block"](a)

            options = args.get("transformer_options")
            call = self.call_context(options) if isinstance(options, dict) else None
            if call is None or not call["active"] or kind in call["left"]:
                return inner(args)
            graded = call.get("graded")
            r = call["r"] if graded is None else graded.get(block)  # the budget's per block (None: left alone)
            if r is None:
                return inner(args)
            layout, tiles = call["layout"], call["tiles"]
            where = spec.in_tokens(layout)
            x = sequence_of(spec, args.get(spec.tokens))
            if where is None or x is None or x.ndim != 3 or x.shape[1] != where[0]:
                note_skipped(call)  # not the predicted layout (another patch changed the tokens): left alone
                return inner(args)
            plan = block_plan(call["plans"] if self.settings.share_plans else None, x, where, layout, tiles,
                              r, self._frames(layout.grid), call["timer"], self.bound,
                              SHARED_PLAN if r == call["r"] else (SHARED_PLAN, r))
            if plan.r <= 0:  # min_similarity: nothing in this call's grid is alike enough to merge
                return inner(args)
            # a block given one rotary table for the whole batch (CogVideoX's) runs once per row
            per_row = spec.pe_shared and args.get(spec.pe) is not None

            def merged(a):
                return run_merged_block(spec, layout, plan, a, inner, spec.tokens, per_row)

            out = (corrected_block(call["plans"], (kind, block), call.get("planning", False), args, inner, merged)
                   if self.correct else merged(args))
            if out is None:
                note_skipped(call)  # not the predicted layout: left alone
                return inner(args)
            grid = layout.grid if layout.grid[0] > 1 else layout.grid[1:]
            note_reduced(call, grid, 1, lambda: self._stages(plan, call["left"]))
            return out

        run_block.tokenreduce_block = (kind, block)
        return run_block

    def _stages(self, plan: BlockPlan, left: frozenset) -> dict:
        """Grid tokens before and after, per kind of block this call merged (for the run's report):
        the kinds reduce_when auto ``left`` alone ran whole and are not listed."""
        kinds = dict.fromkeys(kind for kind, _ in self.replace_keys().values() if kind not in left)
        return {f"{kind.replace('_', ' ')}s": (plan.tokens, plan.merged_tokens) for kind in kinds}
