"""ToMe for SD inside ComfyUI's transformer blocks.

ComfyUI's BasicTransformerBlock gives patches the normed input ``n = norm1(x)`` of
self-attention (``attn1_patch``, with keys and values still ``n``), the attention output
before the residual add (``attn1_output_patch``) and the same pair for cross-attention. There
is no hook around the feed-forward, so MLP merging is an object patch of that block's
``ff.forward``, which the host restores when the model is unpatched.

Per block call the self-attention patch plans the merge once on ``n`` (ComfyUI's built-in
does the same; tomesd plans on the block input ``x``) and every stage of that block reuses
the plan, as tomesd does. The plan lives in the run state until the block's next call.

With ``share_plans`` the first block of each grid in a UNet call plans and the other blocks
of that grid reuse its plan until the next UNet call: planning (a src x dst similarity per
block, the cost tomesd pays in every block) then happens once per level and call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tokenreduce import MergePlan, derive_seed, plan_bipartite_merge
from .blocks import block_level, site_key
from .session import RunState, SessionPatch
from .unet_layout import TransformerSite


@dataclass(frozen=True)
class ToMeSettings:
    ratio: float
    stride_x: int
    stride_y: int
    max_downsample: int
    queries_only: bool  # merge the queries only (ComfyUI's built-in) instead of q, k and v
    merge_attn: bool
    merge_crossattn: bool
    merge_mlp: bool
    use_rand: bool
    seed: int
    share_plans: bool = False  # one plan per grid and UNet call instead of one per block call
    reach: int | None = None  # match within this many cells of each token's own; None: the whole grid


class ToMePatch(SessionPatch):
    """The patch functions of one ToMe node output."""

    def _locate(self, run: RunState, n: torch.Tensor, extra_options: dict) -> tuple[tuple[int, int], int] | None:
        """The grid and downsample of a block call this patch reduces, or None where it is left
        alone: a level above max_downsample, a step outside the window, or tokens that are not
        the block's grid (another patch reshaped them, or temporal attention)."""
        level = block_level(extra_options)
        if level is None:
            return None
        grid, downsample = level
        if downsample > self.settings.max_downsample or not run.in_window(extra_options):
            return None
        if n.shape[1] != grid[0] * grid[1]:
            run.skipped_calls += 1  # reported at the end of the run
            return None
        return level

    def _plan(self, run: RunState, key: tuple, grid: tuple[int, int], n: torch.Tensor,
              extra_options: dict) -> MergePlan:
        if self.settings.share_plans:
            # The first block of this grid in this UNet call plans for all of them: the
            # similarity is computed once per level instead of once per block.
            shared = run.call_plans.get(grid)
            if shared is None:
                shared = run.call_plans[grid] = self._new_plan(run, ("shared",), grid, n, extra_options)
            return shared
        return self._new_plan(run, key, grid, n, extra_options)

    def _new_plan(self, run: RunState, key: tuple, grid: tuple, n: torch.Tensor, extra_options: dict) -> MergePlan:
        s = self.settings
        h, w = grid
        generator = None
        if s.use_rand:
            # Keyed by when and where, not by call order: split or batched cond/uncond and
            # area conditioning draw the same partition for the same block and step.
            seed = derive_seed(s.seed, run.sigma(extra_options), key, h, w)
            generator = run.generator(n.device, seed)
        r = int(n.shape[1] * s.ratio)
        return run.timed(n.device, lambda: plan_bipartite_merge(n, w, h, s.stride_x, s.stride_y, r, generator, s.reach))

    def attn1(self, n, context, value, extra_options):
        run = self.session.current()
        key = site_key(extra_options)
        if run is None or key is None:
            return n, context, value
        located = self._locate(run, n, extra_options)
        plan = run.plans[key] = None if located is None else self._plan(run, key, located[0], n, extra_options)
        if plan is None:
            return n, context, value
        s = self.settings
        # Keys/values stay full in queries-only mode, or as an earlier patch (ToDo) left them.
        keys_merged = s.merge_attn and not s.queries_only and context is n and value is n
        run.record(*located, lambda: self._stages(n.shape[1], plan.merged_tokens, context.shape[1], keys_merged))
        if not s.merge_attn:
            return n, context, value
        merged = plan.merge(n)
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

    def _block_plan(self, extra_options: dict) -> MergePlan | None:
        """The plan the self-attention patch made for this block call, if any."""
        run = self.session.run
        key = site_key(extra_options)
        return run.plans.get(key) if run is not None and key is not None else None

    def unmerge_output(self, n, extra_options):
        """attn1/attn2 output patch: restore the full sequence where the input was merged."""
        plan = self._block_plan(extra_options)
        if plan is None or n.shape[1] != plan.merged_tokens:
            return n
        return plan.unmerge(n)

    def attn2(self, n, context, value, extra_options):
        plan = self._block_plan(extra_options)
        if plan is None or plan.tokens != n.shape[1]:
            return n, context, value
        return plan.merge(n), context, value

    def mlp_forward(self, site: TransformerSite, feed_forward: torch.nn.Module):
        """A replacement ``forward`` for the feed-forward module of ``site``."""
        original = type(feed_forward).forward
        session = self.session

        def forward(x):
            run = session.run
            plan = run.plans.get(site.key) if run is not None else None
            if plan is None or plan.tokens != x.shape[1]:
                return original(feed_forward, x)
            return plan.unmerge(original(feed_forward, plan.merge(x)))

        return forward
