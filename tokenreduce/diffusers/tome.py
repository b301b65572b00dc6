"""ToMe in the BasicTransformerBlocks of a diffusers UNet, as tomesd 0.1.3 does it there.

tomesd replaces the block's class with one whose forward plans the merge on the block input
``x`` and merges the normed input of self-attention (and optionally cross-attention and the
MLP), unmerging each output before its residual add. Here the same happens through forward
hooks: the block's pre-hook plans on ``x``; the pre-hooks of ``attn1``, ``attn2`` and ``ff``
merge what they are given and their hooks unmerge what they return. Same computation, whatever
the block's norm type, and nothing of diffusers' code is copied or replaced.

UNet2DModel's plain self-attentions (DDPM, consistency models) are called on the feature map
[B, C, H, W] and norm, project, attend and add their residual inside the processor: the
attention's pre-hook plans on its input's tokens, the pre-hooks of its ``to_q`` (and ``to_k``,
``to_v`` unless only the queries merge) merge the normed tokens they are given, and the hook of
``to_out[0]`` unmerges the attention's output before the processor reshapes it and adds the
residual: ToMe's "merge the normed input, unmerge the output before the residual", with any
processor that projects through those modules (diffusers' own all do).

The plan itself is the core's (``ToMePatch``: the same partitions, drawn from a private
generator seeded from the seed, the timestep and the block, the same matching and modes) so a
diffusers pipeline merges as the ComfyUI node does; tomesd differs only where it is not
reproducible (its random targets come from a copy of the global RNG, and it turns them off for
odd batches).
"""

from __future__ import annotations

import math

import torch

from ..describe import level_text
from ..grid import grid_at
from ..run import note_reduced, note_skipped
from ..tome_dit import later_inputs_signature
from ..tome_patch import ToMePatch
from ..unet_blocks import GRADED
from .hooks import Hooks, Switch, UNetCalls, attention_backend, block_decision, on_copies, unet_sample
from .models import self_attention
from .session import Session


class DiffusersToMe(UNetCalls, ToMePatch):
    """ToMe on the selected BasicTransformerBlocks (or UNet2DModel's plain attentions) of one UNet."""

    def __init__(self, settings, target, label: str, session: Session, rule=None):
        super().__init__(settings, target, "tokenreduce.diffusers", label, unet=None, rule=rule)
        self.session = session
        self.switch = Switch(session)
        self.current = None  # the plan of the block call running now (blocks run one at a time)
        self._merged_input = None  # (tokens, merged) of a plain attention's projections: merged once

    def prepare(self, context: dict, arguments) -> None:
        """Before a model call: where its partitions come from (drawn when first needed)."""
        super().prepare(context, arguments)
        if not context["active"]:
            return
        run = self.session.run
        timestep, device, noise = context["timestep"], unet_sample(arguments).device, []

        def draw(key, grid):  # the timestep seeds the draws: read (a device sync) at the first only
            if not noise:
                noise.append(run.sigma(timestep) if self.settings.use_rand else None)
            return self._partition(run, key, grid, device, noise[0])
        context.update(partitions={}, shared=self._shared_plans(context, arguments), left=frozenset(),
                       draw_partition=draw)
        if self.rule is not None:  # the blocks decided to merge, at their ratio: one dict per run and kind of call
            context[GRADED] = run.cache.setdefault(("diffusers tome graded", self.call_key(arguments)), {})

    def _shared_plans(self, context: dict, arguments) -> dict:
        """share_plans: grid -> the plan of this call, filled by its first block of each grid; with
        plan_every the plans of an earlier step's call like this one (fewer than plan_every steps
        before; a copy: a grid planned anew here is this call's own), or kept for the next steps
        (the ComfyUI node's rule; ``Session.plan_key`` says which calls are alike)."""
        every, shared = getattr(self.settings, "plan_every", 1), {}
        if every <= 1:
            return shared
        key, step = self.session.plan_key(context, unet_sample(arguments), arguments("encoder_hidden_states"))
        kept = self.session.run.kept_plans(key, step, every)
        if kept is not None:
            return dict(kept)
        self.session.run.keep_plans(key, step, shared)
        return shared

    # --- in the block ---------------------------------------------------------------------
    def _grid(self, tokens: int) -> tuple[tuple[int, int], int]:
        """The block's grid and level, found from its token count as tomesd does."""
        h0, w0 = self.session.latent_hw
        level = int(math.ceil(math.sqrt((h0 * w0) // tokens)))
        return grid_at((h0, w0), level), level

    def block(self, site):
        def before(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            if x.ndim == 4:  # a plain attention's feature map [B, C, H, W]: plan on its tokens
                x = x.flatten(2).transpose(1, 2)
            self.current, self._merged_input = self._plan_block(site, module, x, args, kwargs), None
        return before

    def _plan_block(self, site, module, x: torch.Tensor, args, kwargs):
        context = self.session.context
        if context is None or not context["active"]:
            return None
        grid, level = self._grid(x.shape[1])
        if level > self.max_level:
            return None
        if grid[0] * grid[1] != x.shape[1]:
            note_skipped(context)
            return None
        if not self._reduces(context, site, module, level, grid, args, kwargs):
            return None
        plan = self._plan(context, site.key, grid, level, x)
        s = self.settings
        keys_merged = s.merge_attn and not self.queries_only
        note_reduced(context, grid, level,
                     lambda: self._stages(x.shape[1], plan.merged_tokens, x.shape[1], keys_merged))
        return plan

    def _reduces(self, context, site, module, level: int, grid, args, kwargs) -> bool:
        """reduce_when auto: this level's block call timed unmerged and merged, once per kind; with a
        quality budget each block held against it alone (``hooks.block_decision``), and where the
        node's ratio is over it, half of it (the milder step, as in the core's ``tome_patch``),
        which then merges this block (``GRADED``: the run's dict of the blocks that merge, as the
        core's per-block budget gives it)."""
        if self.switch.forced is not None:
            return self.switch.forced
        if self.rule is None:
            return True
        ratio = self.settings.ratio
        kind, decision = self._decision(site, module, level, grid, args, kwargs, ratio)
        if not decision.reduce and decision.over_budget and int(grid[0] * grid[1] * ratio / 2) > 0:
            ratio /= 2
            kind, decision = self._decision(site, module, level, grid, args, kwargs, ratio)
        reduces = decision.reduce
        if reduces:
            context[GRADED][site.key] = ratio  # the core's plan reads it (``tome_patch._ratio_of``)
        return self.decided(context, (*kind, site.path), reduces)

    def _decision(self, site, module, level: int, grid, args, kwargs, ratio: float) -> tuple:
        """(kind, the auto rule's decision) of this block's call merged at ``ratio``."""
        s = self.settings
        x = args[0] if args else kwargs["hidden_states"]
        kind = ("diffusers ToMe", level, grid, tuple(x.shape), str(x.dtype), ratio, s.stride_x, s.stride_y,
                s.mode, s.merge_attn, s.merge_crossattn, s.merge_mlp, s.matching, s.share_plans,
                attention_backend(self_attention(module).processor), *later_inputs_signature(s))
        instead = "" if ratio == s.ratio else f", ratio {ratio:g} instead"
        ratios = {} if ratio == s.ratio else {level: ratio}

        def describe():  # timed in a context of its own (the core's), as the ComfyUI path times
            # max_change: the block's change on the input the model hands it now (this pre-hook's),
            # before the block runs: a block over budget is left alone from this call on
            return level_text(level, grid) + instead, lambda: self.switch.work(
                lambda: module(*args, **kwargs), lambda: self.timing_context(grid, x.device, ratios),
                unit=on_copies(module, args, kwargs))
        return kind, block_decision(self, x.device, kind, describe, module, site.path, level_text(level, grid),
                                    f"ratio {ratio:g}")

    def end_block(self, module, args, kwargs, output):
        self.current = self._merged_input = None

    def merge_projection_input(self, module, args, kwargs):
        """Pre-hook of a plain attention's ``to_q`` / ``to_k`` / ``to_v``: their input merged
        (the same normed tokens for the three: merged once)."""
        plan = self.current
        x = args[0] if args else kwargs.get("input")
        if plan is None or x is None or x.ndim != 3 or x.shape[1] != plan.tokens:
            return None
        if self._merged_input is None or self._merged_input[0] is not x:
            self._merged_input = (x, plan.merge(x))
        merged = self._merged_input[1]
        return ((merged, *args[1:]), kwargs) if args else (args, {**kwargs, "input": merged})

    def merge_input(self, stage: bool, keep_keys: bool = False, weigh_keys: bool = False):
        """Pre-hook of attn1 / attn2 / ff: merge the tokens it is given (``keep_keys``: the
        queries only, keys and values from the full tokens; ``weigh_keys``: proportional attention,
        the merged keys' log sizes as the processor's additive mask)."""
        def before(module, args, kwargs):
            plan = self.current
            if plan is None or not stage:
                return None
            x = args[0] if args else kwargs["hidden_states"]
            if x.shape[1] != plan.tokens:
                return None
            merged = plan.merge(x)
            if keep_keys and kwargs.get("encoder_hidden_states") is None:
                kwargs = {**kwargs, "encoder_hidden_states": x}
            elif weigh_keys and not plan.is_identity:
                # [B, 1, keys]: every head and query (diffusers' processors repeat it per head)
                sizes = plan.log_sizes().to(merged.dtype).unsqueeze(1)
                given = kwargs.get("attention_mask")
                kwargs = {**kwargs, "attention_mask": sizes if given is None else given + sizes}
            args = (merged, *args[1:]) if args else ()
            if not args:
                kwargs = {**kwargs, "hidden_states": merged}
            return args, kwargs
        return before

    def unmerge_output(self, module, args, kwargs, output):
        plan = self.current
        if plan is None or not torch.is_tensor(output) or output.shape[1] != plan.merged_tokens:
            return output
        return plan.unmerge(output)

    def install(self, hooks: Hooks, model: torch.nn.Module) -> None:
        s = self.settings
        blocks = [model.get_submodule(site.path) for site in self.sites]
        if self.proportional and any(self_attention(block) is block for block in blocks):  # before any hook
            raise ValueError(f"{self.label}: mode '{s.mode}' runs in transformer blocks' self-attention; this "
                             f"UNet's plain attentions (UNet2DModel) project and attend inside one processor "
                             f"call, where the merged keys' sizes cannot go in: use mode 'q, k, v (tomesd)'.")
        for site, block in zip(self.sites, blocks):
            hooks.pre(block, self.block(site))
            hooks.post(block, self.end_block)
            if self_attention(block) is block:  # a plain attention (UNet2DModel)
                self._install_plain(hooks, block)
                continue
            for name, stage, keep_keys, weigh_keys in (("attn1", s.merge_attn, self.queries_only, self.proportional),
                                                       ("attn2", s.merge_crossattn, False, False),
                                                       ("ff", s.merge_mlp, False, False)):
                module = getattr(block, name, None)
                if module is None or not stage:
                    continue
                hooks.pre(module, self.merge_input(stage, keep_keys, weigh_keys))
                hooks.post(module, self.unmerge_output)

    def _install_plain(self, hooks: Hooks, attention: torch.nn.Module) -> None:
        """Merge a plain attention's projections' input, unmerge its output projection's output."""
        if not self.settings.merge_attn:
            return
        for name in ("to_q",) if self.queries_only else ("to_q", "to_k", "to_v"):
            hooks.pre(getattr(attention, name), self.merge_projection_input)
        hooks.post(attention.to_out[0], self.unmerge_output)
