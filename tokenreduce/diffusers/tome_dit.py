"""ToMe on diffusers DiT transformers: whole-block token merging through the core (``tome_dit``).

The core merges a block's grid tokens before the block and restores the block's change after it:
``block_plan`` and ``run_merged_block``, the very functions the ComfyUI node's block replacement
(and Forge's) calls, so plans, gathers made once per plan, rows run apart and the input the block
may edit in place are handled alike on every host. diffusers has no such seam, so ``install`` wraps the
``forward`` of each selected block (an attribute on the block instance, over the class's) and
``uninstall`` deletes it again: nothing is left on the model. Each family describes its blocks
once, in a ``Seam`` (``MERGES``, by diffusers family name: Flux, SD3, Qwen-Image, Wan,
HunyuanVideo, LTX-Video, Chroma, AuraFlow, Lumina 2): which argument holds the grid tokens and
where the grid sits in it, its rotary, per-token modulation and attention-mask arguments, and
where the output holds the tokens; text and reference tokens are never merged. A block of a class its family's seam does
not name is refused at ``apply_patch``, naming the class.

Rotary positions, per-token modulation and mask columns follow the tokens (each merged token
takes its destination's). Where a family's rotary has no batch dimension (Flux's, Chroma's and
HunyuanVideo's ``(cos, sin)`` [L, D], Qwen-Image's complex freqs) a merged call takes each
sample's own rows, and a batch of several samples (each with its own plan) runs the block once
per sample (the core's rule for a block given one table for the batch, CogVideoX's in ComfyUI
too: a sample's output never depends on what it is batched with); Wan's [1, L, 1, D], LTX-Video's [B, L, D] and Lumina 2's [B, L, D/2] take a batch
at once.

Tiles are drawn from a private generator seeded from the seed and the timestep (as the ComfyUI
node draws them), once per run and timestep (the calls of a step share them; under a pipeline the
scheduler's timesteps are read once per run, not each call's), so reruns are bit for bit and the
global RNG is untouched.

With ``plan_every`` a call's shared plan also serves the calls at the same place in the next
steps (``Session.plan_key``), kept in the run as the ComfyUI node keeps it (``RunState.keep_plans``);
with ``correct_from_whole`` the blocks run through the core's ``corrected_block`` as there.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, NamedTuple

import torch

from ..describe import grid_text
from ..dit import BlockArgs
from ..pays import Work
from ..run import CallPatch, note_reduced, note_skipped
from ..seeding import derive_seed
from ..tome_dit import (SHARED_PLAN, Tiles, alike_bound, block_plan, corrects, gathered, later_inputs_signature,
                        make_tiles, merged_count, plan_block, plan_sequence_index, run_merged_block, shared_plan,
                        take)
from ..whole_difference import corrected_block
from .hooks import attention_backend, weights_fingerprint
from .session import Session
from .tome_blocks import ToMeBlockBudget

PE = "tokenreduce positions"  # the key under which a block's rotary positions go through merged_args
SCHEDULE = "tome dit schedule"  # run.cache: (the pipeline scheduler's timesteps, their values) of the run


class Seam(NamedTuple):
    """How ToMe reaches one diffusers family's blocks: the core's ``BlockArgs`` (where the grid
    tokens, rotary positions and per-token modulation sit in a block's arguments, by name) and what
    diffusers' blocks add to it. One per family (``MERGES``); nothing else in this module knows a
    family."""

    args: BlockArgs | dict  # its pe is PE: the positions as ``rope_in`` gives them (or per kind: {kind: BlockArgs})
    kinds: dict  # block class name -> kind, as the report says
    rope: tuple[str, ...] = ()  # the rotary argument's name, per block kind (the one its forward has); (): none
    rope_in: Callable | None = None  # that argument -> positions [1, L, ...] (token dimension 1)
    rope_out: Callable | None = None  # (merged positions [B or 1, L', ...], the argument) -> the block's argument
    per_sample: bool = False  # the rotary has no batch dimension: a batch runs the block once per sample
    # where the block's output holds the tokens (its tuple's index; None: the output), or per kind: {kind: that}
    tokens_out: int | None | dict = 1
    mask: str | None = None  # an attention mask [B, L] or [B, 1, 1, L] over a joint sequence holding the grid
    in_mask: Callable | None = None  # TokenLayout -> (L, where the grid starts in it)


# Flux (diffusers >= 0.35): both block kinds take the image tokens as ``hidden_states`` and the
# text as ``encoder_hidden_states``, rotary (cos, sin) [L, D] over [text, image(, references)];
# they return (encoder_hidden_states, hidden_states). Kontext's reference tokens follow the image.
_FLUX = Seam(BlockArgs("hidden_states", lambda lay: (lay.joint[0] - lay.joint[1], 0), pe=PE, pe_dim=1,
                       in_pe=lambda lay: lay.joint),
             {"FluxTransformerBlock": "double_block", "FluxSingleTransformerBlock": "single_block"},
             ("image_rotary_emb",), lambda rope: torch.stack(tuple(rope[:2]), -2).unsqueeze(0),
             lambda positions, rope: (positions[0, :, 0], positions[0, :, 1]), per_sample=True)
# SD3 / SD3.5 (JointTransformerBlock): the image tokens alone in ``hidden_states`` (the text in
# ``encoder_hidden_states``, joined inside the attention), no rotary; returns
# (encoder_hidden_states or None in the last block, hidden_states).
_SD3 = Seam(BlockArgs("hidden_states", lambda lay: lay.image), {"JointTransformerBlock": "joint_block"})
# Qwen-Image (QwenImageTransformerBlock): the image tokens (then the edit model's references) in
# ``hidden_states``; rotary (image freqs [L, D/2] complex, text freqs), no batch dimension;
# ``modulate_index`` [B, L] (Qwen-Image-Edit-2511's zero_cond_t) picks each token's modulation.
# Returns (encoder_hidden_states, hidden_states).
_QWEN = Seam(BlockArgs("hidden_states", lambda lay: (lay.joint[0] - lay.joint[1], 0), pe=PE, pe_dim=1,
                       in_pe=lambda lay: (lay.joint[0] - lay.joint[1], 0), modulation="modulate_index"),
             {"QwenImageTransformerBlock": "double_block"},
             ("image_rotary_emb",), lambda rope: rope[0].unsqueeze(0), lambda positions, rope: (positions[0], rope[1]),
             per_sample=True)
# Wan 2.1 / 2.2 (WanTransformerBlock): the video tokens in ``hidden_states`` (text by
# cross-attention); rotary (cos, sin) [1, L, 1, D], broadcast over the batch; ``temb`` [B, 6, C],
# or [B, L, 6, C] per token (Wan 2.2 TI2V). Returns hidden_states.
_WAN = Seam(BlockArgs("hidden_states", lambda lay: lay.image, pe=PE, pe_dim=1, in_pe=lambda lay: lay.image,
                      modulation="temb", modulation_ndim=4),
            {"WanTransformerBlock": "block"},
            ("rotary_emb",), lambda rope: torch.stack(tuple(rope), -1), lambda positions, rope: positions.unbind(-1),
            tokens_out=None)
# HunyuanVideo (HunyuanVideoTransformerBlock, HunyuanVideoSingleTransformerBlock): the video tokens
# alone in ``hidden_states`` (the single blocks append the text themselves); rotary (cos, sin)
# [L, D] over the video, no batch dimension (``freqs_cis`` in the double blocks,
# ``image_rotary_emb`` in the single ones); ``attention_mask`` [B, 1, 1, L + text] over
# [video, text]. Both return (hidden_states, encoder_hidden_states). The model also hands them
# ``token_replace_emb`` and ``first_frame_num_tokens`` positionally, which these classes ignore
# (the I2V model's token-replace blocks, which use them, are other classes: not merged).
_HUNYUAN = Seam(BlockArgs("hidden_states", lambda lay: (math.prod(lay.grid), 0), pe=PE, pe_dim=1,
                          in_pe=lambda lay: (math.prod(lay.grid), 0)),
                {"HunyuanVideoTransformerBlock": "double_block", "HunyuanVideoSingleTransformerBlock": "single_block"},
                ("freqs_cis", "image_rotary_emb"), lambda rope: torch.stack(tuple(rope), -1).unsqueeze(0),
                lambda positions, rope: positions[0].unbind(-1), per_sample=True, tokens_out=0,
                mask="attention_mask", in_mask=lambda lay: lay.joint)
# LTX-Video (LTXVideoTransformerBlock): the video tokens in ``hidden_states`` (text by
# cross-attention); rotary (cos, sin) [B, L, D]; ``temb`` [B, 1, 6C], or [B, L, 6C] per token
# (the first frame's conditioning). Returns hidden_states.
_LTX = Seam(BlockArgs("hidden_states", lambda lay: lay.image, pe=PE, pe_dim=1, in_pe=lambda lay: lay.image,
                      modulation="temb", modulation_ndim=3),
            {"LTXVideoTransformerBlock": "block"},
            ("image_rotary_emb",), lambda rope: torch.stack(tuple(rope), -1), lambda positions, rope: positions.unbind(-1),
            tokens_out=None)

# Chroma (ChromaTransformerBlock, ChromaSingleTransformerBlock): Flux's blocks with the modulation
# handed in; the double blocks take the image tokens as ``hidden_states``, the single ones the
# joint [text, image] sequence; rotary as Flux's; ``attention_mask`` [B, text + image] (the
# text's padding). Double blocks return (encoder_hidden_states, hidden_states), single ones the
# sequence.
_CHROMA = Seam({"double_block": _FLUX.args,
                "single_block": BlockArgs("hidden_states", lambda lay: lay.joint, pe=PE, pe_dim=1,
                                          in_pe=lambda lay: lay.joint)},
               {"ChromaTransformerBlock": "double_block", "ChromaSingleTransformerBlock": "single_block"},
               _FLUX.rope, _FLUX.rope_in, _FLUX.rope_out, per_sample=True,
               tokens_out={"double_block": 1, "single_block": None}, mask="attention_mask",
               in_mask=lambda lay: lay.joint)

# AuraFlow (AuraFlowJointTransformerBlock, AuraFlowSingleTransformerBlock): no rotary (learned
# positions added before the blocks); the joint blocks take the image tokens as
# ``hidden_states`` (registers and text as ``encoder_hidden_states``) and return
# (encoder_hidden_states, hidden_states); the single ones take and return the joint
# [registers, text, image] sequence.
_AURAFLOW = Seam({"joint_block": BlockArgs("hidden_states", lambda lay: (lay.joint[0] - lay.joint[1], 0)),
                  "single_block": BlockArgs("hidden_states", lambda lay: lay.joint)},
                 {"AuraFlowJointTransformerBlock": "joint_block", "AuraFlowSingleTransformerBlock": "single_block"},
                 tokens_out={"joint_block": 1, "single_block": None})

# Lumina 2 (Lumina2TransformerBlock, its joint ``layers``): the joint [caption, image] sequence in
# ``hidden_states``; rotary freqs [B, L, D/2] complex over it; ``attention_mask`` None where the
# captions are of one length (the layout's condition). Returns the sequence.
_LUMINA = Seam(BlockArgs("hidden_states", lambda lay: lay.joint, pe=PE, pe_dim=1, in_pe=lambda lay: lay.joint),
               {"Lumina2TransformerBlock": "block"}, ("image_rotary_emb",), lambda rope: rope,
               lambda positions, rope: positions, tokens_out=None, mask="attention_mask", in_mask=lambda lay: lay.joint)

# diffusers family name -> Seam
MERGES = {"Flux": _FLUX, "SD3": _SD3, "Qwen-Image": _QWEN, "Wan": _WAN, "HunyuanVideo": _HUNYUAN, "LTX-Video": _LTX,
          "Chroma": _CHROMA, "AuraFlow": _AURAFLOW, "Lumina 2": _LUMINA}


class _Current(NamedTuple):
    """The model call running now, as the merged blocks read it."""

    layout: object  # its TokenLayout
    tiles: Tiles
    r: int  # tokens merged
    plans: dict | None  # share_plans: the plan its first merged block makes for the others (with
    # plan_every an earlier step's, with the differences correct_from_whole kept); None: each block plans
    planning: bool  # it makes its plans (not reusing an earlier step's): correct_from_whole runs the blocks whole
    key: object = SHARED_PLAN  # where in plans its shared plan is (the budget's milder count: one of its own)


def _per_kind(value, kind: str):
    """A seam's field for one kind of block (a dict by kind, or one value for every kind)."""
    return value[kind] if isinstance(value, dict) else value


def merges(family) -> bool:
    """Whether ToMe merges whole blocks of this diffusers family."""
    return family is not None and family.name in MERGES


class DiffusersToMeDiT(ToMeBlockBudget, CallPatch):
    """ToMe on the selected blocks of one diffusers DiT: the core's plan, merge, block run and
    restore (``tome_dit.block_plan``, ``run_merged_block``), as the ComfyUI node runs them (with a
    budget, decided per block: ``tome_blocks.py``)."""

    Current = _Current

    def __init__(self, settings, family, sites, label: str, session: Session, rule=None):
        super().__init__("tokenreduce.diffusers", label, rule)
        self.settings = settings
        self.bound = alike_bound(settings)  # min_similarity, read once (per block call: a lookup)
        self.family = family
        self.seam = MERGES[family.name]
        self.sites = sites
        self.session = session
        self.strides = (getattr(settings, "stride_t", 1) if family.video else 1, settings.stride_y, settings.stride_x)
        self.every = getattr(settings, "plan_every", 1)  # a plan reused over this many steps (share_plans)
        self.correct = corrects(settings)  # correct_from_whole: the whole block's difference kept per plan
        self.model = None
        self.state: dict = {}  # what the family's layout keeps between calls (Flux: its img_ids' grid)
        self.current: _Current | None = None  # the model call running now; None: blocks as they are
        self.wrapped = False  # patched under a torch.compile wrapper (apply_patch sets it): the model runs compiled
        self._wrapped: list = []  # the blocks whose forward we set
        self._blocks_by_index: dict = {}  # block index -> (block, its forward, kind, (BlockArgs, rope, out), positional)
        self.graded: dict | None = None  # per block under the budget: block index -> merged count (None: per kind)

    # --- before each model call ------------------------------------------------------------
    def prepare(self, context: dict, arguments) -> None:
        self.current, self.graded = None, None
        if not context["active"]:
            return
        layout = self.family.layout(self.model, arguments, self.state)
        if layout is None:
            self.session.run.warn_once(f"{self.label}: this {self.family.name} model call has inputs whose token "
                                       f"layout ToMe does not know; those calls were left alone.")
            return
        x = arguments("hidden_states")
        kept = self._earlier_plans(context, arguments, layout)
        reused = shared_plan(kept) if kept is not None else None
        tiles = reused.tiles if reused is not None else self._tiles(layout.grid, x.device, context, layout.whole_frames)
        r = merged_count(tiles, self.settings.ratio)
        if r <= 0:
            return
        # this call's plans: an earlier step's (with the differences correct_from_whole kept with
        # them), or none yet (its first merged block plans, and with share_plans keeps it here)
        plans = dict(kept) if reused is not None else {} if self.settings.share_plans else None
        if reused is None and self.every > 1:  # kept for the next every - 1 steps
            self.session.run.keep_plans(*self.session.plan_key(context, x, arguments("encoder_hidden_states")), plans)
        self.current = _Current(layout, tiles, r, plans, reused is None)
        self.graded = self._graded(arguments, layout, tiles, r)
        if self.graded == {}:  # every block over the budget alone: the call as it is
            self.current = None

    def _earlier_plans(self, context: dict, arguments, layout) -> dict | None:
        """plan_every: the plans an earlier step's call like this one made (fewer than plan_every
        steps before) for this grid, or None: this call plans (the ComfyUI node's rule)."""
        if self.every <= 1:
            return None
        key, step = self.session.plan_key(context, arguments("hidden_states"), arguments("encoder_hidden_states"))
        plans = self.session.run.kept_plans(key, step, self.every)
        plan = shared_plan(plans) if plans is not None else None
        return plans if plan is not None and plan.tiles.grid == layout.grid else None

    def _tiles(self, grid: tuple[int, int, int], device, context: dict, whole_frames: int = 0) -> Tiles:
        """The call's tiles, made once per run and draw: the first token of every tile (use_rand
        off), or drawn from a private generator seeded from the seed, the timestep and the grid (as
        the ComfyUI node draws them): the calls of one step share them. The first ``whole_frames``
        (a clean start frame: the layout's) are kept out of every tile, as the ComfyUI node keeps them."""
        s, run = self.settings, self.session.run
        seed = derive_seed(s.seed, self._timestep(context), "dit", *grid, *self.strides) if s.use_rand else None
        key = ("tome dit tiles", grid, self.strides, whole_frames, device, seed)
        tiles = run.cache.get(key)
        if tiles is None:
            generator = run.generator(device, seed) if seed is not None else None
            tiles = run.cache[key] = make_tiles(grid, self.strides, generator, device, whole_frames)
        return tiles

    def _timestep(self, context: dict) -> float:
        """The call's timestep as a number (its draw's seed). Under a pipeline whose scheduler says
        which of its timesteps the call is at (``step_index``, before the first step its
        ``begin_index`` or 0) its timesteps are read from the device once per run; otherwise the
        call's own, once per call (none where the session read it already)."""
        run, scheduler = self.session.run, self.session.scheduler()
        timesteps = getattr(scheduler, "timesteps", None)
        if torch.is_tensor(timesteps) and timesteps.ndim == 1 and hasattr(type(scheduler), "step_index"):
            index = scheduler.step_index
            index = index if index is not None else (getattr(scheduler, "begin_index", None) or 0)
            cached = run.cache.get(SCHEDULE)
            if cached is None or cached[0] is not timesteps:
                cached = run.cache[SCHEDULE] = (timesteps, timesteps.float().cpu().tolist())
            if 0 <= index < len(cached[1]):
                return cached[1][index]
        return run.sigma(torch.as_tensor(context["timestep"]))

    # --- in the block ----------------------------------------------------------------------
    def _forward(self, block, original, path: str, index: int):
        signature = inspect.signature(original)
        kind = self.seam.kinds[type(block).__name__]
        rope = next((name for name in self.seam.rope if name in signature.parameters), None)
        spec, tokens_out = _per_kind(self.seam.args, kind), _per_kind(self.seam.tokens_out, kind)
        # its positional parameters by name, read here: binding at call time (inspect) breaks compiled graphs
        positional = [name for name, p in signature.parameters.items()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        processor = next((m.processor for m in block.modules() if getattr(m, "processor", None) is not None), None)
        backend = attention_backend(processor) if processor is not None else ""
        merged = (spec, rope, tokens_out)
        self._blocks_by_index[index] = (block, original, kind, merged, positional)

        def forward(*args, **kwargs):
            current, context = self.current, self.session.context
            if current is None or context is None:
                return original(*args, **kwargs)
            graded = self.graded
            if graded is not None:  # the budget's count for this block (none: left alone)
                count = graded.get(index)
                if count is None:
                    return original(*args, **kwargs)
                if count != current.r:
                    current = current._replace(r=count, key=(SHARED_PLAN, count))
            # extra positional arguments (HunyuanVideo's, which its blocks ignore) are dropped
            call = {**dict(zip(positional, args)), **kwargs}
            if not self._pays(context, block, kind, backend, original, call, merged, current, graded is None):
                return original(*args, **kwargs)
            noted = []

            def merged_run(given: dict):
                return self._merged(original, given, current, merged, context["timer"], noted)

            # correct_from_whole: the step that plans runs the block whole too, the others add the kept difference
            out = corrected_block(current.plans, (kind, path), current.planning, call, lambda given: original(**given),
                                  merged_run) if self.correct else merged_run(call)
            if out is None:
                note_skipped(context)  # not the predicted layout: left alone
                return original(*args, **kwargs)
            if not noted:  # min_similarity: nothing alike enough merged, the block ran whole
                return out
            layout, plan = current.layout, noted[0]
            grid = layout.grid if layout.grid[0] > 1 else layout.grid[1:]
            note_reduced(context, grid, 1, lambda: {"blocks": (plan.tokens, plan.merged_tokens)})
            return out
        return forward

    def _merged(self, original, call: dict, current: tuple, block: tuple, timer=None, noted: list | None = None):
        """The block's output with the grid merged through it and its change restored (the core's
        ``run_merged_block``), or None where its inputs are not the predicted layout. ``block``: its
        kind's (BlockArgs, rotary argument name or None, tokens_out); ``current``: the call's."""
        seam = self.seam
        spec, rope_name, tokens_out = block
        layout, tiles, r, plans, _, key = current
        x = call.get(spec.tokens)
        where = spec.in_tokens(layout)
        rope = call.get(rope_name) if rope_name else None
        if x is None or x.ndim != 3 or where is None or x.shape[1] != where[0] or (rope_name and rope is None):
            return None
        plan = block_plan(plans, x, where, layout, tiles, r, timer=timer, bound=self.bound, key=key)
        if plan.r <= 0:  # min_similarity: nothing in this call's grid is alike enough to merge
            return original(**call)
        if noted is not None:  # the plan the block merged with, for the report (min_similarity: its own count)
            noted.append(plan)
        args = {name: value for name, value in call.items() if name != rope_name}
        if rope_name:  # the rotary as positions [1, L, ...] (made once per plan), merged by the core as the tokens
            args[PE] = gathered(plan, ("rotary", rope_name), rope, lambda: seam.rope_in(rope))

        def inner(new: dict):
            if rope_name:
                new = dict(new)
                new[rope_name] = seam.rope_out(new.pop(PE), rope)
            return original(**new)

        # a rotary without a batch dimension (Flux's, HunyuanVideo's): each row runs with its own
        return run_merged_block(spec, layout, plan, args, inner, tokens_out, seam.per_sample and rope_name is not None,
                                (lambda new, plan: self._merged_mask(new, plan, layout)) if seam.mask else None)

    def _merged_mask(self, new: dict, plan, layout) -> dict | None:
        """The seam's attention mask [B, L] or [B, 1, 1, L] over a joint sequence holding the grid,
        its columns at the merged tokens (made once per plan); None where it is not over that
        sequence."""
        mask = new.get(self.seam.mask)
        if not torch.is_tensor(mask):
            return {}
        where = self.seam.in_mask(layout)
        if mask.ndim not in (2, 4) or mask.shape[-1] != where[0] or (mask.ndim == 4 and mask.shape[-2] != 1):
            return None
        return {self.seam.mask: gathered(plan, ("mask", self.seam.mask), mask,
                                         lambda: take(mask, -1, plan_sequence_index(plan, where)))}

    def _compiled(self, block) -> bool:
        """Whether the model (or this block) runs compiled: its own kind of call for the auto rule."""
        return self.wrapped or torch.compiler.is_compiling() or \
            getattr(self.model, "_compiled_call_impl", None) is not None or \
            getattr(block, "_compiled_call_impl", None) is not None

    def _pays(self, context: dict, block, kind: str, backend: str, original, call: dict, merged: tuple,
              current: _Current, budgeted: bool = True) -> bool:
        """reduce_when auto: the first block of each kind timed unmerged and merged (plan, merge,
        block, restore) as the model hands it its inputs, under a kind that names everything the
        ComfyUI node's does (the attention backend, compiled or not, share_plans); on a CPU merged,
        untimed. ``budgeted`` False: speed alone, per kind and merged count (the budget decided per
        block: ``tome_blocks.py``)."""
        if self.rule is None:
            return True
        s = self.settings
        layout, r = current.layout, current.r
        x = call.get(merged[0].tokens)
        signature = ("diffusers ToMe DiT", self.family.name, kind, tuple(x.shape[1:]) if torch.is_tensor(x) else (),
                     *layout.grid, r, s.ratio, *self.strides, layout.whole_frames, s.share_plans, str(getattr(x, "dtype", "")), backend,
                     *(("compiled",) if self._compiled(block) else ()), *later_inputs_signature(s))

        def describe():
            n = math.prod(layout.grid)
            grid = layout.grid if layout.grid[0] > 1 else layout.grid[1:]
            site = f"{self.family.name} {kind.replace('_', ' ')}s, {grid_text(grid)} grid ({n} → {n - r} tokens)"
            return site, lambda: self._work(original, call, merged, current)
        decision = self.decision(self.session.run, x.device, signature, describe, lambda: weights_fingerprint(block),
                                 budgeted=budgeted)
        return decision is None or decision.reduce

    def _work(self, original, call: dict, merged: tuple, current: _Current) -> Work:
        """The block unmerged and merged, as the ComfyUI node times its blocks: with share_plans the
        merged block with its plan made once, and the plan's own time shared by the merged blocks."""
        layout, tiles, r, plans, _, _ = current
        # the call's own plans stay untouched; per kind the budget reads the merged block uncorrected
        # (per block, corrected from its plan's step: tome_blocks)
        reduced = _Current(layout, tiles, r, {} if plans is not None else None, True)
        runs = {"full": lambda: original(**call), "reduced": lambda: self._merged(original, call, reduced, merged)}
        if plans is None:
            return Work(runs, lambda t: t["full"], lambda t: t["reduced"])
        x = call[merged[0].tokens]
        grid = x.narrow(1, merged[0].in_tokens(layout)[1], math.prod(layout.grid))
        runs["plan"] = lambda: plan_block(grid, tiles, r, bound=self.bound)
        calls_per_plan = len(self.sites) * self.every  # the block calls one plan serves, over plan_every steps
        whole_share = 1 / self.every if self.correct else 0.0  # correct_from_whole: a whole run per plan
        return Work(runs, lambda t: t["full"],
                    lambda t: t["reduced"] + t["plan"] / calls_per_plan + t["full"] * whole_share)

    def replace_keys(self) -> dict:
        """{block index: (kind, index)} of the blocks it merges (the info text counts them by kind)."""
        def kind(site):
            name = type(self.model.get_submodule(site.path)).__name__
            return self.seam.kinds.get(name, name)
        return {site.key[1]: (kind(site), site.key[1]) for site in self.sites}

    # --- installing ------------------------------------------------------------------------------
    def install(self, hooks, model: torch.nn.Module) -> None:
        self.model = model
        blocks = [model.get_submodule(site.path) for site in self.sites]
        for site, block in zip(self.sites, blocks):  # checked before any is wrapped
            if type(block).__name__ not in self.seam.kinds:
                raise ValueError(f"{self.label}: ToMe cannot patch this {self.family.name} model "
                                 f"({type(model).__name__}): its block {site.path} is a {type(block).__name__}, "
                                 f"whose inputs ToMe does not know how to merge (it merges "
                                 f"{', '.join(self.seam.kinds)}). For this model use ToDo (apply_patch(model, "
                                 f"\"ToDo\")).")
            if "forward" in block.__dict__:
                raise ValueError(f"{self.label}: block {site.path} of this {self.family.name} model has its forward "
                                 f"replaced already (another patch); ToMe cannot wrap it.")
        for site, block in zip(self.sites, blocks):
            block.forward = self._forward(block, block.forward, site.path, site.key[1])
            self._wrapped.append(block)

    def uninstall(self) -> None:
        for block in reversed(self._wrapped):
            block.__dict__.pop("forward", None)
        self._wrapped.clear()
        self._blocks_by_index.clear()
        self.state.clear()
        self.current = None
