"""ToDo on diffusers models: every query stays; self-attention reads keys and values downsampled
on the image or video grid.

UNets: a pre-hook on each selected block's ``attn1`` passes the normed tokens, pooled on the
block's grid, as ``encoder_hidden_states``: the processor projects keys and values from them,
as ComfyUI's ``attn1_patch`` does (any processor, any attention backend). UNet2DModel's plain
self-attentions are called on the feature map [B, C, H, W] and norm it inside the processor
(its ``spatial_norm``, then ``group_norm``, which it does not apply to ``encoder_hidden_states``):
their pre-hook norms the tokens as the processor does and passes those, pooled, the same way.
With method window (issue #50) the keys must be projected first: the pre-hook only marks the call
(its grid and level) and the self-attention's processor, swapped for a subclass as on DiTs (below),
runs it through the core's ``peak_window.window_call`` (every query; its tile's window, the 16
heaviest keys and the strided far field weighted by its counts), with plans built before the model
call, outside the blocks. It also is the quality budget's milder step, as in ComfyUI and Forge
(``todo_patch.py``): where nearest changes a level's block by more than ``max_change``, the window
is measured in its place and runs where it is within the budget and pays.

DiTs: keys carry rotary positions and are concatenated with the text inside the processor, so
the reduction has to happen where the processor hands q, k and v to the attention: its call to
``dispatch_attention_fn`` (diffusers' attention dispatcher, which ``set_attention_backend``
routes to SDPA, flash, Sage...) or to ``F.scaled_dot_product_attention`` (older processors such
as SD3's). Each selected attention module gets a processor of a subclass whose ``__call__`` is
the original's code run with those two names bound to ours: the processor's own code, state and
signature, nothing copied, and the module's other processors untouched. Ours index the keys
(nearest: strided, each kept key with its own rotated position) or pool them (average) on the
grid part of the sequence the call's layout predicts, and pass everything else as it is; then
the original is called. With method window they run the whole call (queries too) through the
core's ``peak_window.window_call`` instead, as ComfyUI's override does (``todo_dit.py``), and
keep nearest's keys where it cannot run (a mask of the call's own).
The per-call layout is computed by the transformer's pre-hook, outside
the blocks (which a regional ``compile_repeated_blocks`` compiles) and kept while it does not
change, so a compiled block sees the same objects every step.
"""

from __future__ import annotations

import copy
import math
import types
from typing import Callable

import torch
import torch.nn.functional as F

from ..describe import grid_text, level_text
from ..downsample import downsample_tokens
from ..grid import grid_at
from ..peak_window import HEAVY_KEYS, WINDOW, WindowPlan, sdpa, window_call
from ..rebind import rebuilt
from ..run import SKIPPED, CallPatch, note_reduced, note_skipped
from ..todo_dit import keep_plans, kept_keys, reduced_tokens, window_plans, window_runs
from ..todo_patch import may_window, unet_window_plan
from .hooks import (Hooks, Switch, UNetCalls, attention_backend, block_decision, block_input, on_copies,
                    unet_sample, weights_fingerprint)
from .models import self_attention
from .session import Session
from .todo_blocks import DiTBlockBudget

DISPATCH = "dispatch_attention_fn"
EXTRAS = ("dropout_p", "is_causal", "scale")  # after the mask, by position or name: SDPA's and the dispatcher's order
NO_WINDOWS = types.MappingProxyType({})  # no call windowed: one object, so a compiled block sees no new value


class UNetToDo(UNetCalls, CallPatch):
    """ToDo on the self-attention of the selected sites of one UNet: the ``attn1`` of its
    BasicTransformerBlocks, or UNet2DModel's plain attentions."""

    def __init__(self, factors: dict, method: str, sites, label: str, session: Session, rule=None):
        super().__init__("tokenreduce.diffusers", label, rule)
        self.factors = factors  # level -> pooling factor per side (> 1)
        self.method = method
        self.sites = sites
        self.session = session
        self.switch = Switch(session)
        self.block_input = None  # max_change: (block, args, kwargs) of the site's block call running now
        self.block_names: dict = {}  # block module -> its path (the budget decides per block)
        self.may_window = may_window(method, rule)
        self.measuring: str | None = None  # the method the auto rule's forced calls run (its measurement)
        self.milder_step_off: str | None = None  # why the milder step cannot run here (said each run)
        self.plans: dict = {}  # level -> WindowPlan of the current latent (method window: built in prepare)
        self._plans_for: tuple | None = None  # (latent grid, device) the plans are for
        self.pending: tuple | None = None  # (grid, level) of the self-attention call marked to run windowed now
        self._swapped: list = []  # may_window: (attention module, its original processor, ours)
        self._classes: dict = {}
        self._dispatchers: dict = {}

    def prepare(self, context: dict, arguments) -> None:
        super().prepare(context, arguments)
        if self.milder_step_off:
            self.session.run.note_once(self.milder_step_off)
        if not self.may_window:
            return
        device = unet_sample(arguments).device
        if (self.session.latent_hw, device) != self._plans_for:  # a new size, or the model moved
            # method window: every level's plan before the call; the milder step: built where it is taken
            self.plans = {level: unet_window_plan(grid_at(self.session.latent_hw, level), factor, device)
                          for level, factor in self.factors.items()} if self.method == WINDOW else {}
            self._plans_for = (self.session.latent_hw, device)

    def _plan(self, level: int, grid: tuple[int, int], device) -> WindowPlan:
        plan = self.plans.get(level)
        if plan is None or plan.grid[1:] != grid:
            plan = self.plans[level] = unet_window_plan(grid, self.factors[level], device)
        return plan

    def attn1(self, block: torch.nn.Module, level: int):
        factor = self.factors[level]

        def before(module, args, kwargs):
            context = self.session.context
            if context is None or not context["active"] or kwargs.get("encoder_hidden_states") is not None:
                return None
            x = args[0] if args else kwargs["hidden_states"]
            h, w = grid_at(self.session.latent_hw, level)
            tokens = x.shape[1] if x.ndim == 3 else math.prod(x.shape[2:])
            if tokens != h * w or x.ndim not in (3, 4):
                note_skipped(context)  # tokens that are not the block's grid (another patch reshaped them)
                return None
            method = self._method(context, block, module, level, (h, w), x, args, kwargs)
            if method is None:
                return None
            if method == WINDOW:
                plan = self._plan(level, (h, w), x.device)
                self.pending = ((h, w), level)  # the processor runs this call windowed (and notes it)
                if torch.compiler.is_compiling():  # the processor notes only eagerly: noted here, where it is marked
                    note_reduced(context, (h, w), level, lambda: window_stages(h * w, plan))
                return None
            keys = downsample_tokens(x if x.ndim == 3 else normed_tokens(module, x, kwargs), h, w, factor, self.method)
            note_reduced(context, (h, w), level, lambda: {"q": (h * w, h * w), "k/v": (h * w, keys.shape[1])})
            return args, {**kwargs, "encoder_hidden_states": keys}
        return before

    def _method(self, context: dict, block, module, level: int, grid, x, args, kwargs) -> str | None:
        """How this call is reduced (None: left alone): the node's method, or, where nearest is over
        the quality budget, the window where it is within it and pays (the milder step)."""
        if self.switch.forced is not None:  # the auto rule's measurement: the method it measures, or none
            return self.measuring if self.switch.forced else None
        if self.rule is None:
            return self.method
        decision = self._decision(context, block, module, level, grid, x, args, kwargs, self.method)
        if decision is None or decision.reduce:
            return self.method
        if self.method == WINDOW or not self.may_window or not decision.over_budget:
            return None
        window = self._decision(context, block, module, level, grid, x, args, kwargs, WINDOW)
        return WINDOW if window is None or window.reduce else None

    def _decision(self, context: dict, block, module, level: int, grid, x, args, kwargs, method: str):
        """reduce_when auto with ``method``: the self-attention call timed unreduced and reduced;
        max_change: the change of the whole block (its residuals, norms, cross-attention and MLP too)
        on the input the model handed it in this call, kept by ``keep_block_input``."""
        kind = ("diffusers ToDo", level, grid, tuple(x.shape), str(x.dtype), self.factors[level], method,
                attention_backend(module.processor))
        instead = "" if method == self.method else f", method {method} instead"

        def measuring(run):
            def call():
                saved, self.measuring = self.measuring, method
                try:
                    return run()
                finally:
                    self.measuring = saved
            return call

        def describe():
            held = self.block_input
            unit = on_copies(*held) if held is not None and held[0] is block else None
            return level_text(level, grid) + instead, lambda: self.switch.work(
                measuring(lambda: module(*args, **kwargs)), unit=measuring(unit) if unit is not None else None)
        # The window is timed on a CPU too: on a small grid it can be more work than full attention.
        name = self.block_names[block]
        decision = block_decision(self, x.device, kind, describe, block, name, level_text(level, grid), method,
                                  time_cpu=method == WINDOW)
        self.decided(context, (*kind, name), decision is None or decision.reduce)
        return decision

    # --- method window: in the self-attention's processor -------------------------------------
    def _windowed_or_none(self, q, k, v, mask, dim: int, extras: dict):
        """The call the pre-hook marked, run windowed; None for every other call."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        (h, w), level = pending
        if mask is not None or extras.get("dropout_p") or extras.get("is_causal") or \
                not q.shape[dim] == k.shape[dim] == v.shape[dim] == h * w:
            if self.session.context is not None:
                note_skipped(self.session.context)  # not the call the pre-hook saw: as it came
            return None
        plan = self.plans[level]
        if self.session.context is not None and not torch.compiler.is_compiling():  # noted where it runs
            note_reduced(self.session.context, (h, w), level, lambda: window_stages(h * w, plan))
        return _windowed(q, k, v, dim, plan, extras.get("scale"))

    def _dispatch(self, original):
        def dispatch_attention_fn(query, key, value, attn_mask=None, *args, **kwargs):  # [B, N, heads, D]
            out = self._windowed_or_none(query, key, value, attn_mask, 1, {**dict(zip(EXTRAS, args)), **kwargs})
            return original(query, key, value, attn_mask, *args, **kwargs) if out is None else out
        return dispatch_attention_fn

    def _sdpa(self, query, key, value, attn_mask=None, *args, **kwargs):  # [B, heads, N, D]
        out = self._windowed_or_none(query, key, value, attn_mask, 2, {**dict(zip(EXTRAS, args)), **kwargs})
        return F.scaled_dot_product_attention(query, key, value, attn_mask, *args, **kwargs) if out is None else out

    def _unmark(self, module, args, kwargs, output):
        self.pending = None  # a marked call that did not reach our processor (one set after ours) marks no other

    def keep_block_input(self, module, args, kwargs):
        """Pre-hook of a site's block (before its self-attention's): what the model hands it,
        held while it runs for the quality budget's measurement (not while we measure)."""
        if self.switch.forced is None:
            self.block_input = (module, args, kwargs)

    def drop_block_input(self, module, args, kwargs, output):
        if self.switch.forced is None:
            self.block_input = None  # no activation held past its block

    def install(self, hooks: Hooks, model: torch.nn.Module) -> None:
        blocks = [(model.get_submodule(site.path), site.level) for site in self.sites]
        self.block_names = {block: site.path for (block, _), site in zip(blocks, self.sites)}  # the budget's, per block
        if self.may_window:  # first: a processor that cannot run the window refuses before any hook is set
            try:
                for block, _ in blocks:
                    self._swapped.append(swap_processor(
                        self_attention(block), self._classes, self._dispatchers, self._dispatch, self._sdpa,
                        f"{self.label}: the self-attention processor {{}} of this UNet"))
            except ValueError as cannot:
                restore_processors(self._swapped)
                if self.method == WINDOW:
                    raise
                # nearest pools in the pre-hook, with any processor: only its milder step is off (said)
                self.may_window = False
                self.milder_step_off = (f"{cannot} So the quality budget's milder step (method window) is off; "
                                        f"nearest runs where it is within the budget.")
        budget = self.rule is not None and self.rule.max_change > 0
        for block, level in blocks:
            if budget:  # registered first: for a plain attention the block is its own self-attention
                hooks.pre(block, self.keep_block_input)
                hooks.post(block, self.drop_block_input)
            attention = self_attention(block)
            hooks.pre(attention, self.attn1(block, level))
            if self.may_window:
                hooks.post(attention, self._unmark)

    def uninstall(self) -> None:
        restore_processors(self._swapped)


def normed_tokens(attention: torch.nn.Module, feature_map: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The tokens [B, H*W, C] a plain attention's processor projects its keys from, made from the
    feature map [B, C, H, W] it is called on as the processor makes them (diffusers' Attention:
    ``spatial_norm`` with ``temb``, then ``group_norm`` over the channels)."""
    x = feature_map
    if getattr(attention, "spatial_norm", None) is not None:
        x = attention.spatial_norm(x, kwargs.get("temb"))
    x = x.flatten(2).transpose(1, 2)
    if getattr(attention, "group_norm", None) is not None:
        x = attention.group_norm(x.transpose(1, 2)).transpose(1, 2)
    return x


class DiTToDo(DiTBlockBudget, CallPatch):
    """ToDo on the grid attention of the selected blocks of one diffusers DiT (with a budget,
    decided per block: ``todo_blocks.py``)."""

    def __init__(self, family, factor: float, temporal_factor: float, method: str, sites, label: str,
                 session: Session, rule=None):
        super().__init__("tokenreduce.diffusers", label, rule)
        self.family = family
        self.factor = factor
        self.temporal_factor = temporal_factor if family.video else 1.0
        self.method = method
        self.select = "nearest" if method == WINDOW else method  # how kept_keys reduces where the window does not run
        self.sites = sites
        self.session = session
        self.switch = Switch(session)
        self.active = False  # read in the blocks: set per model call
        self.plans: dict = {}  # key length -> KeepPlan of the current layout (the same dict while it holds)
        self.windows = NO_WINDOWS  # key length -> peak_window.WindowPlan of the calls that run windowed now
        self._windows: dict = {}  # ... of the current layout, where the window may run
        self._layout: tuple | None = None  # (TokenLayout, device) the plans are for
        self._classes: dict = {}  # processor class -> our subclass
        self._dispatchers: dict = {}  # processor class -> the dispatch_attention_fn it calls
        self._swapped: list = []  # (attention module, its original processor, ours)
        self._blocks: list = []  # the selected blocks (compiled by compile_repeated_blocks, or not)
        self.model = None  # the transformer (set when installed): its layout is read from its config
        self.wrapped = False  # patched under a torch.compile wrapper: the blocks run compiled
        self.state: dict = {}  # what the family's layout keeps between calls (Flux: the grid of its img_ids)
        self.graded: dict | None = None  # per block under the budget: selected block index -> method (None: per kind)
        self.block_now: int | None = None  # the selected block running now (read where graded)

    # --- before each model call (outside the blocks) ---------------------------------------
    def prepare(self, context: dict, arguments) -> None:
        self.active = False
        if not context["active"]:
            return
        layout = self.family.layout(self.model, arguments, self.state)
        if layout is None:
            self.session.run.warn_once(f"{self.label}: this {self.family.name} model call has inputs whose token "
                                       f"layout ToDo does not know; those calls were left alone.")
            return
        if not self._reachable():
            return
        hidden = arguments("hidden_states")
        if (layout, hidden.device) != self._layout:  # a new size, or the model moved (offloading)
            plans = keep_plans(layout, self.factor, self.temporal_factor, hidden.device)
            self._layout, self.plans = (layout, hidden.device), {length: plan for (_, length), plan in plans.items()}
            self._windows = {}  # built where the window may run: method window, or nearest's milder step
            if may_window(self.method, self.rule):
                self._windows = {length: window for (_, length), window in
                                 window_plans(plans, self.factor, self.temporal_factor, hidden.device).items()}
            self.windows = self._windows if self.method == WINDOW else NO_WINDOWS
        self.active = bool(self.plans) and self._pays(hidden, arguments)
        if not self.active:
            return
        if self._compiled():  # compiled blocks run no Python to note what they did: the plan says it
            length, plan = next(iter(self.plans.items()))
            note_reduced(context, plan.grid if plan.grid[0] > 1 else plan.grid[1:], 1,
                         lambda: reduced_tokens(plan, self.windows.get(length)))
        else:  # the calls note what they reduce; a call that reaches none is counted (close_call)
            context["expects"] = True

    def _reachable(self) -> bool:
        """Whether any selected block still calls our processor. A processor set after
        apply_patch (IP-Adapter's and PAG's loaders, set_attn_processor) replaces ours: said, and
        where every one was replaced the call is left alone, reported as such."""
        replaced = sum(1 for attention, _, ours in self._swapped if attention.processor is not ours)
        if not replaced:
            return True
        nothing = replaced == len(self._swapped)
        self.session.run.warn_once(
            f"{self.label}: {replaced} of the {len(self._swapped)} attention processors it reduces were replaced "
            f"after apply_patch (IP-Adapter and PAG loaders, set_attn_processor do this), so "
            + ("it reduced nothing. " if nothing else "those blocks were not reduced. ")
            + "Apply TokenReduce after loading them.")
        return not nothing

    def _compiled(self) -> bool:
        return self.wrapped or torch.compiler.is_compiling() or \
            getattr(self.model, "_compiled_call_impl", None) is not None or \
            any(getattr(block, "_compiled_call_impl", None) is not None for block in self._blocks[:1])

    def close_call(self, context: dict) -> None:
        """After a model call: one that was to reduce and reached no selected block is counted
        (not where diffusers' caches are on: they serve attention from the cache, so the step is
        not reduced, and not in the report's steps, without anything having gone wrong)."""
        if context.get("expects") and not any(grid != SKIPPED for grid in context["notes"]) and \
                not getattr(self.model, "is_cache_enabled", False):
            cache = self.session.run.cache
            cache["unreached"] = cache.get("unreached", 0) + 1

    def end_run(self, run) -> None:
        unreached = run.cache.get("unreached", 0)
        if unreached:
            run.warn_once(f"{self.label} reduced nothing in {unreached} model calls: the model ran without calling "
                          f"the attention processors of the blocks it selected (a forward or a hook that skips "
                          f"them). Apply TokenReduce after other patches of the model.")

    def _pays(self, hidden: torch.Tensor, arguments) -> bool:
        """Whether this call reduces (the auto rule's decision; ``self.windows`` set where it runs
        the window): the node's method, or, where nearest is over the quality budget, the window
        where it is within it and pays (the milder step, as in ComfyUI: ``todo_dit.py``)."""
        if self.method != WINDOW:
            self.windows = NO_WINDOWS  # nearest, unless this call's decisions step down (another run's may not)
        self.graded = None
        if self.rule is None or self.switch.forced is not None:
            return True
        graded = self._graded(hidden, arguments)
        if graded is not None:  # per block: those it names reduce, each its way (_reduced)
            self.graded = graded
            return bool(graded)
        decision = self._decision(hidden, arguments, self.method)
        if decision is None or decision.reduce:
            return True
        if self.method == WINDOW or not (decision.over_budget and self._windows):
            return False
        self.windows = self._windows  # the window's measurement and, where it is taken, its calls
        window = self._decision(hidden, arguments, WINDOW)
        if window is None or window.reduce:
            return True
        self.windows = NO_WINDOWS
        return False

    def _grid_call(self, hidden: torch.Tensor) -> tuple:
        """(key length, its KeepPlan, the first reduced attention module, heads, head width) of the
        grid attention calls this layout makes."""
        length, plan = max(self.plans.items())
        attention = self._swapped[0][0]
        heads = attention.heads
        dim = attention.inner_dim // heads if hasattr(attention, "inner_dim") else hidden.shape[-1] // heads
        return length, plan, attention, heads, dim

    def _kind(self, hidden: torch.Tensor, method: str) -> tuple:
        """The kind of grid attention call this layout makes, reduced by ``method``."""
        length, plan, attention, heads, dim = self._grid_call(hidden)
        return ("diffusers ToDo DiT", self.family.name, length, plan.kept, heads, dim, str(hidden.dtype),
                method, attention_backend(attention.processor), *(("compiled",) if self._compiled() else ()))

    def _decision(self, hidden: torch.Tensor, arguments, method: str, budgeted: bool = True):
        """reduce_when auto, per layout, for ``method``: one grid attention call of the model's
        width and key count timed with full and reduced keys, as the processor makes it (diffusers'
        dispatcher with its backend, or torch's SDPA), under a kind that names that attention.
        max_change: the change of the first selected block's output (``_unit``); ``budgeted``
        False: speed alone (the budget decides per block: ``todo_blocks.py``)."""
        length, plan, attention, heads, dim = self._grid_call(hidden)
        kind = self._kind(hidden, method)
        instead = "" if method == self.method else f", method {method} instead"

        def describe():
            processor = attention.processor
            original = self._dispatchers.get(getattr(type(processor), "_tokenreduce_base", None))
            # Through diffusers' dispatcher with the processor's backend where it calls it ([B, N, heads, D]).
            shape = (hidden.shape[0], heads, length, dim) if original is None else (hidden.shape[0], length, heads, dim)
            generator = torch.Generator(device=hidden.device if hidden.device.type == "cuda" else "cpu")
            q, k, v = (torch.randn(shape, generator=generator.manual_seed(i), device=generator.device)
                       .to(hidden.device, hidden.dtype) for i in range(3))
            if original is None:
                call = (lambda: self._sdpa(q, k, v))
            else:
                dispatch, backend = self._dispatch(original), getattr(processor, "_attention_backend", None)
                call = (lambda: dispatch(q, k, v, backend=backend))
            grid = plan.grid if plan.grid[0] > 1 else plan.grid[1:]
            return f"{grid_text(grid)} grid, attention ({length} keys){instead}", lambda: self.switch.work(
                call, unit=self._unit(arguments) if budgeted else None)
        # The window is timed on a CPU too: on a small grid it can be more work than full attention.
        return self.decision(self.session.run, hidden.device, kind, describe, lambda: weights_fingerprint(attention),
                             time_cpu=method == WINDOW, budgeted=budgeted)

    def _unit(self, arguments) -> Callable[[], object] | None:
        """The quality budget's unit: the first selected block on the input the model hands it in
        this call (the call run again up to it: ``block_input``), run whole and with its grid calls
        reduced. A block's output, residual included, is what its reduced attention changes; one
        attention call on random tensors changes as much on random weights as on trained ones.
        None (the budget not applied, said) where diffusers' caches are on (running the blocks
        before it again would feed their state) or the call never reaches the block."""
        inputs = getattr(arguments, "inputs", None)
        if inputs is None or not self._blocks or getattr(self.model, "is_cache_enabled", False):
            return None
        block = self._blocks[0]
        held = block_input(self.model, block, inputs)
        return on_copies(block, *held) if held is not None else None

    # --- in the attention call --------------------------------------------------------------
    def _reduced(self, q, k, v, mask, dim: int, extras: dict):
        """k, v and the mask of a grid call with the keys/values reduced, or as they came; and the
        call's WindowPlan where it runs whole as method window (then k, v and mask as they came)."""
        active = self.active if self.switch.forced is None else self.switch.forced
        graded = self.graded if self.switch.forced is None else None
        method = graded.get(self.block_now) if graded is not None else None
        if not active or (graded is not None and method is None):  # (graded: a block left alone)
            return k, v, mask, None
        length = k.shape[dim]
        plan = self.plans.get(length)
        eager = not torch.compiler.is_compiling()
        if plan is None or q.shape[dim] != length or v.shape[dim] != length or \
                (mask is not None and mask.shape[-1] not in (1, length)):
            if eager and self.session.context is not None:
                note_skipped(self.session.context)  # not the predicted layout: left alone
            return k, v, mask, None
        window = (self._windows if method == WINDOW else NO_WINDOWS).get(length) if graded is not None else \
            self.windows.get(length)
        # As ComfyUI's (todo_dit.py), and only where the call's heads and extras are what the window computes.
        if window is not None and not (window_runs(mask, q.shape[dim], length) and q.shape == k.shape == v.shape
                                       and not extras.get("dropout_p") and not extras.get("is_causal")):
            window = None
        if eager and self.session.context is not None:  # what this call reduced (compiled: noted before the call)
            note_reduced(self.session.context, plan.grid if plan.grid[0] > 1 else plan.grid[1:], 1,
                         lambda: reduced_tokens(plan, window))
        if window is not None:
            return k, v, mask, window
        if mask is not None and mask.shape[-1] == length:
            mask = mask.index_select(-1, plan.index)
        return kept_keys(k, dim, plan, self.select), kept_keys(v, dim, plan, self.select), mask, None

    def _dispatch(self, original):
        def dispatch_attention_fn(query, key, value, attn_mask=None, *args, **kwargs):  # [B, N, heads, D]
            extras = {**dict(zip(EXTRAS, args)), **kwargs}
            k, v, mask, window = self._reduced(query, key, value, attn_mask, 1, extras)
            if window is not None:
                return _windowed(query, key, value, 1, window, extras.get("scale"))
            return original(query, k, v, mask, *args, **kwargs)
        return dispatch_attention_fn

    def _sdpa(self, query, key, value, attn_mask=None, *args, **kwargs):  # [B, heads, N, D]
        extras = {**dict(zip(EXTRAS, args)), **kwargs}
        k, v, mask, window = self._reduced(query, key, value, attn_mask, 2, extras)
        if window is not None:
            return _windowed(query, key, value, 2, window, extras.get("scale"))
        return F.scaled_dot_product_attention(query, k, v, mask, *args, **kwargs)

    # --- installing ---------------------------------------------------------------------------
    def install(self, hooks: Hooks, model: torch.nn.Module) -> None:
        self.model = model
        budget = self.rule is not None and self.rule.max_change > 0
        for index, site in enumerate(self.sites):
            block = model.get_submodule(site.path)
            self._blocks.append(block)
            if budget:  # per block: which block runs (todo_blocks.py)
                hooks.pre(block, self.mark_block(index))
            for name in self.family.attentions:
                attention = getattr(block, name, None)
                if attention is None or not hasattr(attention, "processor"):
                    continue
                self._swapped.append(swap_processor(attention, self._classes, self._dispatchers, self._dispatch,
                                                    self._sdpa, f"{self.label}: the attention processor {{}} of "
                                                    f"this {self.family.name} model"))
        if not self._swapped:
            raise ValueError(f"{self.label}: found no attention module in the selected blocks of this "
                             f"{self.family.name} model.")

    def uninstall(self) -> None:
        restore_processors(self._swapped)
        self._blocks.clear()
        self.state.clear()


def swap_processor(attention: torch.nn.Module, classes: dict, dispatchers: dict, dispatch, sdpa, whose: str) -> tuple:
    """Give ``attention`` a processor of a subclass of its own whose ``__call__`` runs against our
    attention entry points (``dispatch(original)`` for diffusers' dispatcher, ``sdpa`` for torch's);
    returns (attention, its original processor, ours) for ``restore_processors``. ``classes`` and
    ``dispatchers`` cache the subclass and the dispatcher per processor class; ``whose`` names the
    processor ({} its class) in the refusal of one that calls neither."""
    original = attention.processor
    cls = type(original)
    ours = classes.get(cls)
    if ours is None:
        call = cls.__call__
        names = set(call.__code__.co_names)
        if DISPATCH not in names and "F" not in names:
            raise ValueError(f"{whose.format(cls.__name__)} calls neither diffusers' {DISPATCH} nor "
                             f"F.scaled_dot_product_attention; ToDo cannot reach its keys. Use the model's default "
                             f"processor (model.set_default_attn_processor() or the processor diffusers gives it).")
        bound = {}
        if DISPATCH in names and DISPATCH in call.__globals__:
            dispatchers[cls] = call.__globals__[DISPATCH]
            bound[DISPATCH] = dispatch(call.__globals__[DISPATCH])
        if call.__globals__.get("F") is F:
            functional = types.ModuleType("torch.nn.functional")
            functional.__dict__.update(F.__dict__)
            functional.scaled_dot_product_attention = sdpa
            bound["F"] = functional
        ours = classes[cls] = type(cls.__name__, (cls,), {"__call__": rebuilt(call, **bound), "_tokenreduce_base": cls})
    processor = copy.copy(original)
    # One state for both: set_attention_backend (and anything else that sets a processor's
    # attribute while we are installed) is kept when we are removed.
    processor.__dict__ = original.__dict__
    processor.__class__ = ours
    attention.processor = processor
    return attention, original, processor


def restore_processors(swapped: list) -> None:
    """Undo ``swap_processor`` (and empty ``swapped``); a processor set after ours (IP-Adapter, ...) stays."""
    for attention, original, ours in reversed(swapped):
        if attention.processor is ours:
            attention.processor = original
    swapped.clear()


def window_stages(tokens: int, plan) -> dict:
    """A windowed self-attention call's counts for the report: every query, the keys each sees."""
    return {"q": (tokens, tokens), "k/v": (tokens, round(plan.seen * tokens))}


def _windowed(q, k, v, dim: int, window, scale: float | None) -> torch.Tensor:
    """A grid call (tokens at ``dim``: 1, diffusers' dispatcher's [B, N, heads, D]; 2, SDPA's
    [B, heads, N, D]) run whole by ``peak_window.window_call``, returned in the layout it came in.
    Its queries around the grid (text) go to torch's SDPA with the far field's log counts as the
    mask, not to the processor's backend: some of the dispatcher's backends (flash, sage) drop an
    ``attn_mask``. A scale of the call's own (Lumina 2's proportional attention) goes on q, as the
    window computes with the default one."""
    dim_scale = q.shape[-1] ** -0.5
    if scale is not None and scale != dim_scale:
        q = q * (scale / dim_scale)
    out = window_call(q, k, v, q.shape[3 - dim], dim, window, sdpa, HEAVY_KEYS, heads_out=True)  # [B, heads, N, D]
    return out if dim == 2 else out.transpose(1, 2)
