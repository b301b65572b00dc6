"""ToMe for SD inside the transformer blocks of a UNet, through the attention patches that
ComfyUI and the WebUI (Forge) call the same way.

A block gives patches the normed input ``n = norm1(x)`` of self-attention (``attn1_patch``,
with keys and values still ``n``), the attention output before the residual add
(``attn1_output_patch``) and the same pair for cross-attention; all four get the same
``extra_options`` dict within one block call, so the plan made on entry travels there to the
unmerge. There is no hook around the feed-forward, so MLP merging replaces that block's
``ff.forward`` (an object patch the host restores when the model is unpatched); the plan reaches
it through a slot of the thread running the model call (ComfyUI's multi-GPU split runs several
model calls at once, each device's in its own thread).

Per block call the self-attention patch plans the merge once on ``n`` (ComfyUI's built-in
does the same; tomesd plans on the block input ``x``) and every stage of that block reuses
the plan, as tomesd does. With ``share_plans`` the first block of each grid in a model call
plans and the other blocks of that grid reuse its plan; with ``plan_every`` n those plans also
serve the calls like it (``run.plan_key``) of the next n - 1 steps (decided in ``prepare_call``).

Mode ``q, k, v + proportional attention``: the attn1 patch leaves the merged keys' log sizes in
the call context and the attention override (ours in front of any other; diffusers passes them as attn1's ``attention_mask``) adds them
to that self-attention call as its mask, so a merged key weighs as the tokens it stands for
(``bipartite.log_sizes``); the next attention call takes them, whatever it is, so none outlives it.

Compile-friendly: the random partitions are drawn before each model call (``prepare_call``,
outside a compiled region, from seeds that hash the noise level); in the call the patches only
do tensor work on what the call context holds.
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

import torch

from .bipartite import MergePlan, Partition, log_sizes, partition_grid, plan_merge
from .describe import level_text
from .grid import grid_at
from .layout import unet_call_grid, unet_call_key
from .measure import RANDOM_TOKENS, UNetLevels, sample, compute_dtype
from .methods import MODE_PROPORTIONAL, MODE_QUERIES, tile_matching, tome_reach
from .override_front import InFront, hand_on
from .pays import AutoRule, Work
from .run import CallPatch, ModelCall, RunState, call_context, note_reduced, note_skipped, plan_key
from .seeding import derive_seed
from .tome_dit import BlockPlan, Tiles, alike_bound, later_inputs_signature, make_tiles, merge, plan_block, restore
from .unet_blocks import GRADED, UNetBlockBudget

PLAN = "tokenreduce.tome_plan"  # key of this block call's plan in extra_options
SIZES = "sizes"  # call context: the log sizes of the keys of the self-attention call the attn1 patch just merged
SHARED = ("shared",)  # the key shared plans are drawn under
RATIOS = "ratios"  # call context: level -> the ratio its blocks merge at where not the node's (the budget's milder step)


class TilePlan(NamedTuple):
    """matching "tile (fast)": the DiT path's tile plan (``tome_dit.plan_block``: each source
    compared with its own cell's destination only) behind the ``MergePlan`` interface the
    patches use. Merging is a dense per-cell sum and a gather, unmerging one gather: no
    scatter, no sort over a similarity matrix."""

    plan: BlockPlan

    @property
    def tokens(self) -> int:
        return self.plan.tokens

    @property
    def merged_tokens(self) -> int:
        return self.plan.merged_tokens

    @property
    def is_identity(self) -> bool:
        return self.plan.r <= 0

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        return merge(self.plan, x)

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        return restore(self.plan, x)

    def log_sizes(self) -> torch.Tensor:
        return log_sizes(self.plan.restore_map, self.merged_tokens)


def draw_cells(h: int, w: int, sx: int, sy: int, generator: torch.Generator | None, device,
               tiled: bool) -> Partition | Tiles | None:
    """The merge targets of an ``h x w`` grid: tomesd's partition, or the tiles of "tile (fast)"
    (one target per whole ``sy x sx`` cell, drawn with ``generator`` or the first token)."""
    if tiled:
        return make_tiles((1, h, w), (1, sy, sx), generator, device) if h >= sy and w >= sx else None
    return partition_grid(h, w, sx, sy, generator, device)


def plan_cells(metric: torch.Tensor, w: int, h: int, sx: int, sy: int, cells: Partition | Tiles | None, r: int,
               reach: int | None, bound: float | None = None) -> MergePlan | TilePlan:
    """Plan merging ``r`` tokens of ``metric`` with the targets ``draw_cells`` drew (``bound``:
    only tokens at least this alike to their target, ``r`` the most)."""
    if isinstance(cells, Tiles):
        r = min(r, cells.sources)
        if r > 0:
            with torch.no_grad():
                plan = plan_block(metric, cells, r, bound=bound)
            if plan.r > 0:
                return TilePlan(plan)
        return MergePlan.identity(metric.shape[0], metric.shape[1])
    return plan_merge(metric, w, h, sx, sy, cells, r, reach, bound)


class ToMePatch(UNetBlockBudget, InFront, CallPatch):
    """The patch functions of one ToMe node output, for the sites of ``target``, and, with mode
    proportional, its attention override: the self-attention call whose keys the attn1 patch
    merged gets their log sizes as an additive bias (``bipartite.log_sizes``); every other call
    is handed on as it came."""

    def __init__(self, settings, target, context_key: str, label: str, unet: UNetLevels,
                 rule: AutoRule | None = None):
        CallPatch.__init__(self, context_key, label, rule)
        InFront.__init__(self)
        # keys merge only with q, k, v merged together (not queries only, nor keys ToDo already reduced)
        self.proportional = settings.mode == MODE_PROPORTIONAL and settings.merge_attn
        self.settings = settings
        self.unet = unet
        self.max_level = target.level
        self.sites = target.sites
        self.site_levels = frozenset(site.level for site in target.sites)  # levels with self-attention blocks
        self.queries_only = settings.mode == MODE_QUERIES
        self.reach = tome_reach(settings)
        self.tiled = tile_matching(settings)
        self.bound = alike_bound(settings)
        self._per_thread = threading.local()  # .mlp_plans: site key -> this thread's call's plan (MLP patches)

    # --- before each model call (outside any compiled region) ------------------------------
    def prepare_call(self, context: dict, run: RunState, call: ModelCall) -> None:
        """Draw this call's partitions of every selected block's grid. With proportional attention
        ours goes in front of any attention override first (auto's measurement runs the block
        through it), and steps aside for a call that merges nothing."""
        if not self.proportional:
            self._prepare(context, run, call)
            return
        options = call.options  # this call's own dict (the host copies it per call)
        front, after = self._in_front(run, options, say=False)
        self._prepare(context, run, call)
        self.stay_or_step_aside(run, options, front, after, bool(context["active"]))

    def _prepare(self, context: dict, run: RunState, call: ModelCall) -> None:
        self.mlp_plans().clear()
        if not context["active"]:
            return
        latent_hw, device, sigmas = tuple(call.x.shape[-2:]), call.x.device, call.sigmas
        s = self.settings
        levels = sorted({site.level for site in self.sites if site.level <= self.max_level})
        key = self.call_key(call)
        ratios = run.cache.setdefault(("tome unet ratios", key), {}) if self.rule is not None else {}
        graded = self._graded_blocks(run, call, levels)  # with a budget: block by block (unet_blocks.py)

        def runs(level: int) -> bool:  # asked once per run and kind of call (``left_alone`` keeps the answer)
            if graded is not None:
                return level in graded.levels
            ratios[level] = self._ratio(run, call, level, latent_hw)
            return ratios[level] is not None

        context["left"] = left = self.left_alone(context, run, call, levels, runs)
        if not context["active"]:  # every level left alone
            return
        if graded is not None:
            context[GRADED] = graded.methods
        milder = run.cache.get(("tome unet milder", key))
        if milder is None:  # one object per run and kind of call: a compiled model sees no new value
            milder = run.cache[("tome unet milder", key)] = {level: ratio for level, ratio in ratios.items()
                                                             if ratio is not None and ratio != s.ratio}
        context[RATIOS] = milder
        shared = {}  # share_plans: grid -> the plan of this call
        every = getattr(s, "plan_every", 1)
        if every > 1:  # plan reuse across steps: the plans of an earlier step's call like this one
            reuse, step = plan_key(call), run.step(sigmas)
            kept = run.kept_plans(reuse, step, every)
            if kept is None:
                run.keep_plans(reuse, step, shared)  # filled by this call's first block of each grid
            else:
                shared = dict(kept)  # a copy: a grid planned anew here is this call's own
        keys = {(SHARED if s.share_plans else site.key, grid_at(latent_hw, site.level)) for site in self.sites
                if site.level in levels and site.level not in left and grid_at(latent_hw, site.level) not in shared
                and (graded is None or site.key in graded.methods)}
        sigma = run.sigma(sigmas) if s.use_rand and keys else None  # nothing to draw: no read (a device sync)
        context["partitions"] = {key: self._partition(run, key[0], key[1], device, sigma) for key in keys}
        # A grid the latent does not predict (a model that rescales inside, Kohya Deep Shrink)
        # is drawn when met: correct everywhere, a graph break under torch.compile.
        context["draw_partition"] = lambda key, grid: self._partition(run, key, grid, device, sigma)
        context["shared"] = shared

    # --- reduce_when auto ----------------------------------------------------------------------
    def call_key(self, call: ModelCall) -> tuple:
        return self.unet.call_key(call)

    def _ratio(self, run: RunState, call: ModelCall, level: int, latent_hw: tuple[int, int]) -> float | None:
        """The ratio a level merges at in this run: the node's, or None (left alone) by reduce_when
        auto; where the node's is over the quality budget, half of it where that is within the
        budget and pays (the milder step, as ToDo's nearest steps down to the window: issue #51)."""
        ratio = self.settings.ratio
        decision = self._decision(run, call, level, latent_hw, ratio)
        if decision is None or decision.reduce:
            return ratio
        milder = ratio / 2
        if not decision.over_budget or int(math.prod(grid_at(latent_hw, level)) * milder) <= 0:
            return None
        return milder if self._decision(run, call, level, latent_hw, milder).reduce else None

    def _decision(self, run: RunState, call: ModelCall, level: int, latent_hw: tuple[int, int], ratio: float,
                  budgeted: bool = True):
        if self.rule is None:
            return None
        grid = grid_at(latent_hw, level)
        instead = "" if ratio == self.settings.ratio else f", ratio {ratio:g} instead"
        return self.decision(run, call.x.device, self._level_kind(call, level, ratio),
                             lambda: (level_text(level, grid) + instead, lambda: self._work(call, level, grid, ratio)),
                             lambda: self.unet.fingerprint(call, level), budgeted=budgeted)

    # --- the per-block budget's parts (unet_blocks.UNetBlockBudget) ---------------------------
    def _block_ladder(self) -> tuple[float, ...]:
        """The node's ratio steps down to half of it."""
        return (self.settings.ratio, self.settings.ratio / 2)

    def _speed_pays(self, run: RunState, call: ModelCall, level: int, ratio: float) -> bool:
        latent_hw = tuple(call.x.shape[-2:])
        if int(math.prod(grid_at(latent_hw, level)) * ratio) <= 0:  # merges nothing there
            return False
        return self._decision(run, call, level, latent_hw, ratio, budgeted=False).reduce

    def _level_kind(self, call: ModelCall, level: int, ratio: float) -> tuple:
        s = self.settings
        reduction = ("ToMe", ratio, s.stride_x, s.stride_y, s.mode, s.merge_attn, s.merge_crossattn, s.merge_mlp,
                     s.matching, s.share_plans, *later_inputs_signature(s))
        return self.unet.kind(call, level, grid_at(tuple(call.x.shape[-2:]), level), reduction)

    def _block_context(self, run: RunState, call: ModelCall, level: int, ratio: float) -> dict | None:
        """A call context in which the level's blocks merge at ``ratio`` (as timed: top-left
        targets); None where that merges nothing."""
        grid = grid_at(tuple(call.x.shape[-2:]), level)
        if int(math.prod(grid) * ratio) <= 0:
            return None
        return self.timing_context(grid, call.x.device, {} if ratio == self.settings.ratio else {level: ratio})

    @staticmethod
    def _method_label(ratio: float) -> str:
        return f"ratio {ratio:g}"

    def _work(self, call: ModelCall, level: int, grid: tuple[int, int], ratio: float) -> Work:
        """A block of the level unmerged and merged at ``ratio`` (plan, merge, the smaller calls,
        unmerge). With share_plans one plan serves the level's blocks: the block is timed with its
        plan made once, and the plan's own time, shared by the level's blocks (and with plan_every
        by that many steps), is added."""
        s = self.settings
        h, w = grid
        context = self.timing_context(grid, call.x.device, {} if ratio == s.ratio else {level: ratio})
        block = self.unet.work(call, level, grid, self.context_key, lambda: context)()
        if not s.share_plans:
            return block
        tokens = sample((call.x.shape[0], h * w, self.unet.block_dim(call, level)), call.x.device, compute_dtype(call))
        blocks = sum(1 for site in self.sites if site.level == level) * getattr(s, "plan_every", 1)
        r = int(h * w * ratio)
        partition = context["draw_partition"](None, grid)
        plan = lambda: plan_cells(tokens, w, h, s.stride_x, s.stride_y, partition, r, self.reach)  # noqa: E731 - random tokens: unbounded
        return block._replace(runs={**block.runs, "plan": plan}, reduced_ms=lambda t: t["reduced"] + t["plan"] / blocks)

    def timing_context(self, grid: tuple[int, int], device: torch.device, ratios: dict | None = None) -> dict:
        """A fresh call context in which a timed block merges at ``grid`` (every host times in
        one): top-left targets, no draw from the run's generators, nothing noted in the run;
        ``ratios``: level -> a ratio other than the node's (the budget's milder step)."""
        s = self.settings
        partition = draw_cells(grid[0], grid[1], s.stride_x, s.stride_y, None, device, self.tiled)
        return call_context(True, left=frozenset(), shared={}, partitions={},
                            draw_partition=lambda key, g: partition, **{RATIOS: ratios or {}})

    def mlp_plans(self) -> dict:
        """This thread's site key -> plan of its current model call, for the MLP object patches.
        Made outside any compiled region (prepare_call) so a compiled model always finds it."""
        plans = getattr(self._per_thread, "mlp_plans", None)
        if plans is None:
            plans = self._per_thread.mlp_plans = {}
        return plans

    def _partition(self, run: RunState, key: tuple, grid: tuple[int, int], device: torch.device, sigma):
        s = self.settings
        h, w = grid
        if not s.use_rand:  # the top-left token of every cell: the same for the whole run
            cache_key = ("tome top-left", grid, device, self.tiled)
            cached = run.cache.get(cache_key)
            if cached is None:
                cached = run.cache[cache_key] = draw_cells(h, w, s.stride_x, s.stride_y, None, device, self.tiled)
            return cached
        # Keyed by when and where, not by call order: split or batched cond/uncond and area
        # conditioning draw the same partition for the same block and step.
        generator = run.generator(device, derive_seed(s.seed, sigma, key, h, w))
        return draw_cells(h, w, s.stride_x, s.stride_y, generator, device, self.tiled)

    def end_run(self, run: RunState) -> None:
        self.mlp_plans().clear()  # a host that keeps object patches after the run must find no plan

    # --- in the model call ----------------------------------------------------------------
    def _locate(self, context: dict, n: torch.Tensor, extra_options: dict,
                key: tuple) -> tuple[tuple[int, int], int] | None:
        """The grid and level of a block call this patch reduces, or None where it is left
        alone: a level above max_downsample, a step outside the window, or tokens that are not
        the block's grid (another patch reshaped them, or temporal attention), or a level with no
        self-attention site (the x4 upscaler's attn1 attends to the text there)."""
        located = unet_call_grid(extra_options)
        if (located is None or not context["active"] or located[1] > self.max_level or located[1] in context["left"]
                or located[1] not in self.site_levels):
            return None
        graded = context.get(GRADED)  # the budget decided block by block: a block left alone merges nothing
        if graded is not None and key not in graded:
            return None
        grid = located[0]
        if n.shape[1] != grid[0] * grid[1]:
            note_skipped(context)  # reported at the end of the run
            return None
        return located

    def _plan(self, context: dict, key: tuple, grid: tuple[int, int], level: int, n: torch.Tensor) -> MergePlan:
        ratio = self._ratio_of(context, key, level)
        if self.settings.share_plans:
            # The first block of this grid in this model call plans for all of them: the
            # similarity is computed once per level instead of once per block (the blocks the
            # budget's milder step merges share a plan of their own).
            shared_key = grid if ratio == self.settings.ratio else (grid, ratio)
            shared = context["shared"].get(shared_key)
            if shared is None:
                shared = context["shared"][shared_key] = self._new_plan(context, SHARED, grid, level, n, ratio)
            return shared
        return self._new_plan(context, key, grid, level, n, ratio)

    def _ratio_of(self, context: dict, key: tuple, level: int) -> float:
        """The ratio the block ``key`` merges at in this call: the budget's per-block choice, the
        level's milder step, or the node's."""
        graded = context.get(GRADED)
        if graded is not None and key in graded:
            return graded[key]
        return context.get(RATIOS, {}).get(level, self.settings.ratio)

    def _new_plan(self, context: dict, key: tuple, grid: tuple[int, int], level: int, n: torch.Tensor,
                  ratio: float) -> MergePlan:
        s = self.settings
        h, w = grid
        partitions = context["partitions"]
        partition = partitions[(key, grid)] if (key, grid) in partitions else context["draw_partition"](key, grid)
        r = int(n.shape[1] * ratio)  # the budget's milder step: its own
        # timed on random tokens (``measure.RANDOM_TOKENS``): nothing is alike there, so ratio's count,
        # the most a bounded merge does
        bound = None if context.get(RANDOM_TOKENS) else self.bound
        timer = context["timer"]
        if timer is None:
            return plan_cells(n, w, h, s.stride_x, s.stride_y, partition, r, self.reach, bound)
        return timer.timed(n.device, lambda: plan_cells(n, w, h, s.stride_x, s.stride_y, partition, r, self.reach, bound))

    def attn1(self, n, context, value, extra_options):
        call = self.call_context(extra_options)
        key = unet_call_key(extra_options)
        if call is None or key is None or not call["active"]:
            if self.settings.merge_mlp and key is not None:
                # Every block call sets its block's MLP slot, a plan or None: the feed-forward after
                # it reads this call's, never one an earlier call of the block left on this thread
                # (the auto rule's reduced run, then a call it leaves alone; the reduced call, then
                # measure_change's unreduced rerun; a rehearsal, which runs no call context).
                self.mlp_plans()[key] = None
            return n, context, value
        located = self._locate(call, n, extra_options, key)
        plan = None if located is None else self._plan(call, key, *located, n)
        extra_options[PLAN] = plan
        if self.settings.merge_mlp:
            self.mlp_plans()[key] = plan
        if plan is None:
            return n, context, value
        s = self.settings
        # Keys/values stay full in queries-only mode, or as an earlier patch (ToDo) left them.
        keys_merged = s.merge_attn and not self.queries_only and context is n and value is n
        note_reduced(call, *located, lambda: self._stages(n.shape[1], plan.merged_tokens, context.shape[1], keys_merged))
        if not s.merge_attn:
            return n, context, value
        merged = plan.merge(n)
        if keys_merged and self.proportional:
            call[SIZES] = plan.log_sizes()  # the override adds them to this block's self-attention
        return (merged, merged, merged) if keys_merged else (merged, context, value)

    def _stages(self, tokens: int, merged: int, keys: int, keys_merged: bool) -> dict:
        """Tokens before and after, per merged stage, for the run's report."""
        s = self.settings
        stages = {}
        if s.merge_attn:
            stages["q"] = (tokens, merged)
            stages["k/v"] = (keys, merged if keys_merged else keys)
        if s.merge_crossattn:
            stages["cross q"] = (tokens, merged)
        if s.merge_mlp:
            stages["mlp"] = (tokens, merged)
        return stages

    def unmerge_output(self, n, extra_options):
        """attn1/attn2 output patch: restore the full sequence where the input was merged."""
        plan = extra_options.get(PLAN)
        if plan is None or n.shape[1] != plan.merged_tokens:
            return n
        return plan.unmerge(n)

    def _run_before(self, after, func, *args, **kwargs):
        """Proportional attention: the self-attention call whose keys the attn1 patch just merged
        gets their log sizes as an additive mask ([B, 1, keys]: every head and query; added to a
        mask the call has); every other call (cross-attention, levels not merged, calls outside a
        run) is handed on as it came."""
        options = kwargs.get("transformer_options")
        call = self.call_context(options) if isinstance(options, dict) else None
        sizes = call.pop(SIZES, None) if call is not None and call["active"] else None
        if sizes is not None:
            q, k = args[:2]
            dim = 2 if kwargs.get("skip_reshape") else 1  # [B, H, N, D], else [B, N, H*D]
            if q.shape[dim] != k.shape[dim] or k.shape[dim] != sizes.shape[1] or k.shape[0] != sizes.shape[0]:
                note_skipped(call)  # not the self-attention the patch merged (another pack's attention between)
            else:
                bias = sizes.to(q.dtype).unsqueeze(1)
                if len(args) > 4:
                    mask = args[4]
                    args = (*args[:4], bias if mask is None else mask + bias, *args[5:])
                else:
                    mask = kwargs.get("mask")
                    kwargs = {**kwargs, "mask": bias if mask is None else mask + bias}
        return hand_on(after, func, args, kwargs)

    def attn2(self, n, context, value, extra_options):
        plan = extra_options.get(PLAN)
        if plan is None or plan.tokens != n.shape[1]:
            return n, context, value
        return plan.merge(n), context, value

    def mlp_forward(self, site_key: tuple, feed_forward: torch.nn.Module):
        """A replacement ``forward`` for the feed-forward module of the block ``site_key``."""
        original = type(feed_forward).forward

        def forward(x):
            plan = self.mlp_plans().get(site_key)
            if plan is None or plan.tokens != x.shape[1]:
                return original(feed_forward, x)
            return plan.unmerge(original(feed_forward, plan.merge(x)))

        forward.feed_forward = feed_forward  # the module it runs (each device copy gets its own)
        return forward
