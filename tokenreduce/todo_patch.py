"""ToDo inside the transformer blocks of a UNet: self-attention keeps every query and sees keys
and values pooled on the block's grid.

``attn1_patch`` (ComfyUI, and the WebUI's Forge, call it the same way) receives the normed block
input before projection as queries, keys and values alike; returning shorter keys/values makes
the attention read fewer tokens, which every attention backend supports (it is what
cross-attention does). Nothing to unmerge.

``method`` window (issue #50): each query keeps its attention's peak, its tile's window of exact
keys and the 16 keys with the most attention mass (the sinks a trained UNet's self-attention rests
on), beside the strided far field weighted by the tokens each key stands for (``peak_window.py``).
The keys must be projected first, so the attn1 patch only marks the call (its grid and level) and
leaves the tokens as they are; what the block calls next with the projected q, k and v runs the
whole attention windowed. That is the host's seam (``window``): ComfyUI's attention override
(``BY_OVERRIDE``: every UNet attention call passes through it), or, on Forge, which has none, an
``attn1`` replace patch on each block the window may run in (``BY_REPLACE``: the block hands it
q, k and v; calls it does not window go to the host's attention function). The window also is the
quality budget's milder step: where nearest changes a level's block by more than ``max_change``,
the window is measured in its place and runs where it is within the budget and pays (as on DiTs,
``todo_dit.py``).
"""

from __future__ import annotations

from typing import Callable

import torch

from .describe import level_text
from .downsample import downsample_tokens, downsampled_grid
from .grid import grid_at
from .layout import unet_call_grid, unet_call_key
from .measure import UNetLevels
from .override_front import InFront, hand_on
from .pays import AutoRule
from .peak_window import HEAVY_KEYS, WINDOW, WindowPlan, window_call, window_plan
from .run import CallPatch, ModelCall, RunState, call_context, note_reduced, note_skipped
from .unet_blocks import GRADED, UNetBlockBudget

WINDOWED = "windowed"  # call context: the levels whose self-attention runs windowed in this call
PENDING = "window"  # call context: (grid, level) of the self-attention call the attn1 patch just saw
WINDOW_PLANS = "window plans"  # call context: level -> its WindowPlan, built before the call
BY_OVERRIDE = "attention override"  # how the host runs the window: its attention override (ComfyUI)
BY_REPLACE = "attn1 replace"  # ... an attn1 replace patch per block (Forge)


class ToDoPatch(UNetBlockBudget, InFront, CallPatch):
    """The patch function of one ToDo node output on a UNet (and, where the window may run, its
    attention override: ``may_window``)."""

    heavy_keys = HEAVY_KEYS

    def __init__(self, factors: dict, method: str, context_key: str, label: str, unet: UNetLevels,
                 rule: AutoRule | None = None, window: str | None = None, attention: Callable | None = None):
        CallPatch.__init__(self, context_key, label, rule)
        InFront.__init__(self)
        self.factors = factors  # level -> pooling factor per side (> 1)
        self.method = method
        self.unet = unet
        # The window can run: set as the method, or the budget's milder step for nearest, where the
        # host has a seam for it (``window``: BY_OVERRIDE, BY_REPLACE; None: it has none).
        self.window = window
        self.may_window = window is not None and may_window(method, rule)
        # BY_REPLACE: the host's attention (q, k, v, heads) -> [B, N, H*D] for the calls not windowed
        self.attention = attention or plain_attention
        self._windowed = frozenset(factors) if method == WINDOW else frozenset()  # without an auto rule

    # --- before each model call (outside any compiled region) ------------------------------
    def prepare_call(self, context: dict, run: RunState, call: ModelCall) -> None:
        if not self.may_window:
            self._prepare(context, run, call)
            return
        if self.window == BY_REPLACE:
            self._prepare(context, run, call)
            if not (context["active"] and context.get(WINDOWED)):
                self._replace_aside(run, call.options)
            return
        options = call.options  # this call's own dict (the host copies it per call)
        # Ours in front first: the window's measurement runs the block through it.
        front, after = self._in_front(run, options, say=False)
        self._prepare(context, run, call)
        # Where no level of this call runs windowed (nearest within the budget, or left alone) ours
        # steps aside for the call.
        self.stay_or_step_aside(run, options, front, after, bool(context["active"] and context.get(WINDOWED)))

    def _replace_aside(self, run: RunState, options: dict) -> None:
        """BY_REPLACE, a call with no level windowed: its options get the attn1 replace patches
        without ours (the host's own self-attention runs, as unpatched; nothing of ours per call).
        Measured first: the window's measurement runs the block with ours. One dict per run and
        set of replace patches."""
        replaces = options.get("patches_replace", {})
        attn1 = replaces.get("attn1", {})
        key = ("todo unet replace aside", id(attn1))
        aside = run.cache.get(key)
        if aside is None or aside[0] is not attn1:  # kept with the dict it was made from: its id is not reused
            ours = self.attn1_replace
            aside = run.cache[key] = (attn1, {**replaces, "attn1": {b: f for b, f in attn1.items() if f != ours}}
                                      if ours in attn1.values() else None)
        if aside[1] is not None:
            options["patches_replace"] = aside[1]

    def _prepare(self, context: dict, run: RunState, call: ModelCall) -> None:
        if not context["active"]:
            return
        levels = [level for level in self.factors if level in self.unet.first]  # others have no blocks (said)
        key = self.call_key(call)
        if self.rule is None:
            context["left"] = frozenset()
            context[WINDOWED] = self._windowed
            self._put_plans(context, run, call, key)
            return
        graded = self._graded_blocks(run, call, levels)  # with a budget: block by block (unet_blocks.py)
        if graded is not None:
            context["left"] = self.left_alone(context, run, call, levels, lambda level: level in graded.levels)
            context[GRADED] = graded.methods
            context[WINDOWED] = self._windowed_of(run, key, graded)
            self._put_plans(context, run, call, key)
            return
        methods = run.cache.setdefault(("todo unet methods", key), {})

        def runs(level: int) -> bool:  # asked once per run and kind of call (``left_alone`` keeps the answer)
            methods[level] = self._method(run, call, level)
            return methods[level] is not None

        context["left"] = self.left_alone(context, run, call, levels, runs)
        windowed = run.cache.get(("todo unet windowed", key))
        if windowed is None:  # one object per run and kind of call: a compiled model sees no new value
            windowed = frozenset(level for level, method in methods.items() if method == WINDOW)
            run.cache[("todo unet windowed", key)] = windowed
        context[WINDOWED] = windowed
        self._put_plans(context, run, call, key)

    @staticmethod
    def _windowed_of(run: RunState, key, graded) -> frozenset:
        """The levels with a block graded to the window: one object per run and kind of call."""
        windowed = run.cache.get(("todo unet graded windowed", key))
        if windowed is None:
            windowed = run.cache[("todo unet graded windowed", key)] = frozenset(
                level for level, methods in graded.levels.items() if WINDOW in methods)
        return windowed

    def _put_plans(self, context: dict, run: RunState, call: ModelCall, key) -> None:
        """The window's plans of this call's windowed levels, built here, before the call (never in
        a compiled region: a plan is built once, with a host read), one dict per run and kind."""
        if not context[WINDOWED]:
            return
        plans = run.cache.get(("todo unet window plans", key))
        if plans is None:
            grids = {level: grid_at(tuple(call.x.shape[-2:]), level) for level in context[WINDOWED]
                     if level in self.unet.first}
            plans = {level: self._plan(run, grid, self.factors[level], call.x.device) for level, grid in grids.items()}
            run.cache[("todo unet window plans", key)] = plans
        context[WINDOW_PLANS] = plans

    def call_key(self, call) -> tuple:
        return self.unet.call_key(call)

    def _method(self, run: RunState, call: ModelCall, level: int) -> str | None:
        """How this level is reduced in this run: the node's method, or None (left alone) by
        reduce_when auto; the window where nearest is over the quality budget and the window is
        within it and pays."""
        decision = self._decision(run, call, level, self.method)
        if decision.reduce:
            return self.method
        if self.method != "nearest" or not self.may_window or not decision.over_budget:
            return None
        return WINDOW if self._decision(run, call, level, WINDOW).reduce else None

    def _decision(self, run: RunState, call: ModelCall, level: int, method: str, budgeted: bool = True):
        grid = grid_at(tuple(call.x.shape[-2:]), level)
        instead = "" if method == self.method else f", method {method} instead"
        # The window is timed on a CPU too: on a small grid it can be more work than full attention.
        return self.decision(run, call.x.device, self._level_kind(call, level, method), lambda: (
            level_text(level, grid) + instead,
            self.unet.work(call, level, grid, self.context_key, lambda: self._block_context(run, call, level, method))),
            lambda: self.unet.fingerprint(call, level), time_cpu=method == WINDOW, budgeted=budgeted)

    # --- the per-block budget's parts (unet_blocks.UNetBlockBudget) ---------------------------
    def _block_ladder(self) -> tuple[str, ...]:
        """nearest steps down to the window where the window can run; any other method alone."""
        return (self.method, WINDOW) if self.method == "nearest" and self.may_window else (self.method,)

    def _speed_pays(self, run: RunState, call: ModelCall, level: int, method: str) -> bool:
        return self._decision(run, call, level, method, budgeted=False).reduce

    def _level_kind(self, call: ModelCall, level: int, method: str) -> tuple:
        return self.unet.kind(call, level, grid_at(tuple(call.x.shape[-2:]), level),
                              ("ToDo", self.factors[level], method))

    def _block_context(self, run: RunState, call: ModelCall, level: int, method: str) -> dict:
        """A call context in which the level's blocks are reduced by ``method``."""
        if method != WINDOW:
            return call_context(True, left=frozenset(), **{WINDOWED: frozenset()})
        plan = self._plan(run, grid_at(tuple(call.x.shape[-2:]), level), self.factors[level], call.x.device)
        return call_context(True, left=frozenset(), **{WINDOWED: frozenset([level]), WINDOW_PLANS: {level: plan}})

    @staticmethod
    def _method_label(method: str) -> str:
        return method

    # --- in the model call ----------------------------------------------------------------
    def attn1(self, n, context, value, extra_options):
        call = self.call_context(extra_options)
        if call is None or not call["active"]:
            return n, context, value
        located = unet_call_grid(extra_options)
        if located is None:
            return n, context, value
        (h, w), level = located
        factor = self.factors.get(level)
        if factor is None or level in call["left"]:
            return n, context, value
        graded = call.get(GRADED)  # the budget decided block by block: this block's method, or none
        method = graded.get(unet_call_key(extra_options)) if graded is not None else \
            (WINDOW if level in call.get(WINDOWED, ()) else self.method)
        if method is None:
            return n, context, value
        if context.shape[1] != h * w or value.shape[1] != h * w:
            note_skipped(call)  # another patch changed the keys/values; reported at run end
            return n, context, value
        if method == WINDOW:
            call[PENDING] = ((h, w), level)  # the override runs this block's self-attention windowed
            return n, context, value
        keys = downsample_tokens(context, h, w, factor, self.method)
        values = keys if value is context else downsample_tokens(value, h, w, factor, self.method)
        note_reduced(call, (h, w), level, lambda: {"q": (n.shape[1], n.shape[1]), "k/v": (h * w, keys.shape[1])})
        return n, keys, values

    def _run_before(self, after, func, *args, **kwargs):
        """The self-attention call the attn1 patch marked, run windowed; every other call (cross-
        attention, levels not windowed, calls outside a run) handed on as it came."""
        options = kwargs.get("transformer_options")
        call = self.call_context(options) if isinstance(options, dict) else None
        q, k, v = args[:3]
        heads = args[3] if len(args) > 3 else kwargs["heads"]
        dim = 2 if kwargs.get("skip_reshape") else 1  # [B, H, N, D], else [B, N, H*D]
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        out = self._window_run(call, q, k, v, heads, dim, mask, bool(kwargs.get("skip_output_reshape")))
        return hand_on(after, func, args, kwargs) if out is None else out

    def attn1_replace(self, q, k, v, extra_options):
        """BY_REPLACE (Forge): the block's self-attention, q, k and v projected ([B, N, H*D]): the
        call the attn1 patch marked runs windowed, every other one in the host's attention."""
        call = self.call_context(extra_options)
        heads = extra_options["n_heads"]
        out = self._window_run(call, q, k, v, heads, 1, None, False)
        return self.attention(q, k, v, heads) if out is None else out

    def _window_run(self, call: dict | None, q, k, v, heads: int, dim: int, mask, heads_out: bool):
        """The marked self-attention call run windowed, or None: no call marked (cross-attention,
        levels not windowed, calls outside a run), or not the one the patch saw."""
        pending = call.pop(PENDING, None) if call is not None and call["active"] else None
        if pending is None:
            return None
        (h, w), level = pending
        plan = call.get(WINDOW_PLANS, {}).get(level)
        if plan is None or plan.grid[1:] != (h, w) or mask is not None or \
                not q.shape[dim] == k.shape[dim] == v.shape[dim] == h * w:
            note_skipped(call)  # not the self-attention the patch saw (another pack's attention in between)
            return None
        note_reduced(call, (h, w), level, lambda: {"q": (h * w, h * w), "k/v": (h * w, round(plan.seen * h * w))})
        return window_call(q, k, v, heads, dim, plan, None, self.heavy_keys, heads_out=heads_out)

    @staticmethod
    def _plan(run: RunState, grid: tuple[int, int], factor: float, device) -> WindowPlan:
        """The window's plan of a level's grid: built once per run, grid, factor and device (as the
        DiT path's: nothing of a run outlives it)."""
        key = ("todo unet window plan", grid, factor, device)
        plan = run.cache.get(key)
        if plan is None:
            plan = run.cache[key] = unet_window_plan(grid, factor, device)
        return plan


def may_window(method: str, rule: AutoRule | None) -> bool:
    """Whether ToDo may run the window: set as its method, or as the quality budget's milder step
    (nearest with a budget: where nearest is over it, the window is measured in its place)."""
    return method == WINDOW or (method == "nearest" and rule is not None and rule.max_change > 0)


def unet_window_plan(grid: tuple[int, int], factor: float, device) -> WindowPlan:
    """The window's plan of a UNet level's self-attention: its grid's tokens alone (no text), the
    far field on the grid ``factor`` pools it to (a host read: built before a call, never in one)."""
    h, w = grid
    return window_plan(h * w, 0, (1, h, w), (1, *downsampled_grid(h, w, factor)), (1, factor, factor), device)


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """torch's attention of a host's UNet call ([B, N, H*D] in and out), where the host gives no
    attention function of its own (a ComfyUI patcher standing in for Forge's, in the tests)."""
    b, _, inner = q.shape
    q, k, v = (t.view(b, -1, heads, inner // heads).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(b, -1, inner)
