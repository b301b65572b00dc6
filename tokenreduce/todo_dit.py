"""ToDo on DiTs: every query stays; in the blocks it reduces, the image or video keys and values
of self-attention are downsampled on their grid (per frame spatially, optionally along time).
Text, reference-image and padding tokens are kept as they are and never mixed with the grid.

It runs as the host's attention override (ComfyUI's ``optimized_attention_override``), which sees
every attention call of the model in order; a family's call plan (``dit.py``) says which calls
are joint or image-only attention over the grid and which block each belongs to. Before each
model call the layout of that call's tokens is computed from its inputs and turned into the key
positions to keep; in the call, a grid call of a selected block whose key length is the predicted
one reads its keys and values through that index (nearest: strided, each kept key keeps its
own rotary position) or pooled (average, only where keys carry no rotated positions). In a
block ToMe merged (its merge handed on in the block's options, ``run.MERGED_GRID``) the grid is
the merged tokens: the keys kept are the merged tokens ToDo's kept grid positions were merged
into (``merged_keep_index``; nearest in any case), so the two stack in either order. Everything
else passes through. An override that was installed before ours is called with our keys
instead of the backend, so the two stack. One installed after ours (a backend choice such as
KJNodes' SageAttention patch or ComfyUI's own ``set_model_optimized_attention``: they replace the
slot and call neither what was there nor the backend they are handed) would shut ToDo out; at each
model call ToDo then puts itself in front of it, so both act, and the report says so.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from .describe import grid_text
from .dit import OTHER, TokenLayout, geometry_of
from .downsample import downsampled_grid, grid_keep_index, pool_grid_tokens
from .late_blocks import model_block
from .measure import backend_of, compute_dtype, dit_attention_work, dit_block_fingerprint, on_copies
from .override_front import InFront, hand_on
from .pays import CPU, AutoRule, Decision
from .peak_window import HEAVY_KEYS, WINDOW, WindowPlan, window_call, window_plan
from .run import MERGED_GRID, OVERRIDE, CallPatch, ModelCall, RunState, call_context, note_reduced, note_skipped
from .todo_dit_blocks import BlockBudget
from .tome_dit import NotReached, captured_blocks, take


class KeepPlan(NamedTuple):
    """How one kind of grid call's keys are reduced in a model call."""

    index: torch.Tensor  # the key positions kept (text and others, the kept grid tokens, the rest)
    start: int  # where the grid's tokens start in the key sequence
    grid: tuple[int, int, int]
    target: tuple[int, int, int]  # the grid after downsampling

    @property
    def tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def kept(self) -> int:
        return math.prod(self.target)


def _keep_plan(length: int, start: int, grid: tuple[int, int, int], target: tuple[int, int, int],
               factors: tuple[float, float, float], device) -> KeepPlan:
    kept = grid_keep_index(grid, target, factors, device) + start
    end = start + math.prod(grid)
    index = torch.cat([torch.arange(start, device=device), kept, torch.arange(end, length, device=device)])
    return KeepPlan(index, start, grid, target)


def keep_plans(tokens: TokenLayout, factor: float, temporal_factor: float, device) -> dict:
    """(call kind, key length) -> KeepPlan of a model call with this token layout, pooled
    ``factor`` per side and ``temporal_factor`` along time: the same for every call with it."""
    t, h, w = tokens.grid
    th, tw = downsampled_grid(h, w, factor)
    target = (max(1, math.ceil(t / temporal_factor - 1e-9)), th, tw)
    factors = (temporal_factor, factor, factor)
    return {(kind, spec[0]): _keep_plan(spec[0], spec[1], tokens.grid, target, factors, device)
            for kind, spec in (("joint", tokens.joint), ("image", tokens.image)) if spec is not None}


def window_plans(plans: dict, factor: float, temporal_factor: float, device) -> dict:
    """Method window: (call kind, key length) -> peak_window.WindowPlan over the same grid and far
    field as ``plans`` (``keep_plans``); every host builds them once per layout with this."""
    return {key: window_plan(key[1], keep.start, keep.grid, keep.target, (temporal_factor, factor, factor), device)
            for key, keep in plans.items()}


def reduced_tokens(keep: KeepPlan, window: WindowPlan | None = None) -> dict:
    """What a reduced grid call's queries see, as every host's report states it: every query,
    and the kept keys (or, with ``window``, the mean share of the grid's keys a query sees)."""
    keys = keep.kept if window is None else round(window.seen * keep.tokens)
    return {"q": (keep.tokens, keep.tokens), "k/v": (keep.tokens, keys)}


def window_runs(mask, queries: int, length: int) -> bool:
    """Whether a grid call of ``length`` keys runs windowed (``peak_window.window_call``, the whole
    call): only without a mask of its own and with every query (else its keys are kept as nearest)."""
    return mask is None and queries == length


def kept_keys(x: torch.Tensor, dim: int, keep: KeepPlan, method: str) -> torch.Tensor:
    """Keys (or values) ``x`` of a grid call reduced by its plan: the kept positions (nearest) or
    the grid part pooled (average), the tokens around the grid as they are."""
    if method == "nearest":
        return x.index_select(dim, keep.index)
    grid_part = x.narrow(dim, keep.start, keep.tokens)
    pooled = pool_grid_tokens(grid_part, dim, keep.grid, keep.target)
    end = keep.start + keep.tokens
    return torch.cat([x.narrow(dim, 0, keep.start), pooled, x.narrow(dim, end, x.shape[dim] - end)], dim=dim)


def merged_keep_index(keep: KeepPlan, merged, length: int) -> torch.Tensor:
    """[B, L'] the key positions a grid call of ``length`` keys keeps in a block ToMe merged
    (``merged``: its ``tome_dit.BlockPlan``): the tokens before and after the grid, and for each
    grid position nearest downsampling keeps, the merged token it was merged into (its row in
    ToMe's restore map): ToDo's nearest selection applied to the grid as ToMe restores it. The
    count is ToDo's (no host sync); two kept positions merged into one token give its key twice,
    as the restored grid would."""
    start, m = keep.start, merged.merged_tokens
    positions = keep.index.narrow(0, start, keep.kept) - start  # the grid positions ToDo keeps
    rows = merged.restore_map.index_select(1, positions) + start
    b, device = rows.shape[0], rows.device
    return torch.cat([torch.arange(start, device=device).expand(b, start), rows,
                      torch.arange(start + m, length, device=device).expand(b, length - start - m)], 1)


class ToDoDiTPatch(BlockBudget, InFront, CallPatch):
    """The attention override of one ToDo node output on a DiT."""

    heavy_keys = HEAVY_KEYS  # method window: the sink keys each query also sees exactly (peak_window.py)

    def __init__(self, layout, blocks: frozenset, factor: float, temporal_factor: float, method: str,
                 diffusion_model, context_key: str, label: str, rule: AutoRule | None = None, previous=None):
        CallPatch.__init__(self, context_key, label, rule)
        InFront.__init__(self, previous)  # the override installed before ours, called with our keys
        self.family = layout.family
        self.plan = layout.plan
        self.blocks = blocks  # indices of the blocks it reduces
        self.factor = factor
        self.temporal_factor = temporal_factor if self.family.video else 1.0
        self.method = method
        self.select = "nearest" if method == WINDOW else method  # how kept_keys reduces where the window does not run
        self.model = diffusion_model  # read for its structure only (reference inputs, token order)
        self.patch = self.family.patch(diffusion_model)
        self._geometry = {}  # call kind -> dit.Geometry of its grid calls, read from the model when first timed

    # --- before each model call (outside any compiled region) ------------------------------
    def prepare_call(self, context: dict, run: RunState, call: ModelCall) -> None:
        installed, after = self._in_front(run, call.options)
        if not context["active"]:
            return
        plan, first_slot = self._call_plan(run, call)
        if isinstance(plan, str):  # the family's reason: a call it cannot plan
            context["active"] = False
            run.warn_once(f"{self.label}: {plan}; those calls were left alone.")
            return
        tokens = self.family.tokens(self.model, self.patch, call.x, call.context, call.kwargs)
        if tokens is None or isinstance(tokens, str):  # a str: the family's reason
            context["active"] = False
            run.warn_once(f"{self.label}: {tokens}." if tokens else
                          f"{self.label}: this {self.family.name} model call has inputs whose token layout ToDo "
                          f"does not know (reference streams it cannot place); those calls were left alone.")
            return
        plans = self._keep_plans(run, tokens, call.x.device)
        left, windowed = set(), set()
        graded = self._graded(run, call, tokens, plans, installed, after, (plan, first_slot))
        for kind, length in plans:
            if graded is not None:  # the budget decided per block: a kind runs where a block of it reduces
                methods = {method for (k, _), method in graded.items() if k == kind}
                method = (WINDOW if WINDOW in methods else self.method) if methods else None
            else:
                method = self._method(run, call, tokens, kind, length, plans, installed, after, (plan, first_slot))
            if method is None:
                left.add(kind)
            elif method == WINDOW:
                windowed.add((kind, length))
        if len(left) == len({kind for kind, _ in plans}):
            context["active"] = False  # nothing of this call pays: the override passes every call through
            return
        context["plan"] = plan
        context["keep"] = plans
        if windowed:
            windows = self._window_plans(run, tokens, plans, call.x.device)
            if len(windowed) < len(windows):  # the kinds stepped down alone: one dict per run, as the plans
                key = ("todo dit stepped down", tokens, call.x.device, frozenset(windowed))
                if key not in run.cache:
                    run.cache[key] = {k: plan for k, plan in windows.items() if k in windowed}
                windows = run.cache[key]
            context["windows"] = windows
        context["left"] = frozenset(left)
        context["graded"] = graded  # {(kind, block): method} of the blocks that reduce; None: per kind
        context["calls"] = 0

    def _call_plan(self, run: RunState, call: ModelCall) -> tuple[tuple | str, dict]:
        """This model call's plan (the fixed one, or the family's plan of this call: the same
        object for every call that plans the same, so a compiled model sees no new value) and
        where each kind of grid call of a reduced block first comes in it (the auto rule times
        it there); a str plan: why this call cannot be planned."""
        plan = self.plan
        if self.family.call_plan is not None:
            plan = self.family.call_plan(self.model, call.x, call.context, call.kwargs, call.options)
            if isinstance(plan, str):
                return plan, {}
        cache_key = ("todo dit plan", self.blocks, plan)
        found = run.cache.get(cache_key)
        if found is None:
            first_slot = {}
            for index, slot in enumerate(plan):
                if slot.kind != OTHER and slot.block in self.blocks:
                    first_slot.setdefault(slot.kind, index)
            found = run.cache[cache_key] = (plan, first_slot)
        return found

    def _method(self, run: RunState, call: ModelCall, tokens: TokenLayout, kind: str, length: int, plans: dict,
                installed: Callable, after: Callable | None, planned: tuple) -> str | None:
        """How calls of one kind (joint or image-only) of this layout are reduced in this run: the
        node's method, or None (left alone) by reduce_when auto. The quality budget's milder step:
        where nearest changes the block's output by more than ``max_change``, the window (which
        keeps each query's peak: issue #50) is measured in its place and runs where it is within
        the budget and pays; the report names both."""
        decision = self._decision(run, call, tokens, kind, length, plans, installed, after, planned, self.method)
        if decision is None or decision.reduce:
            return self.method
        if self.method != "nearest" or not decision.over_budget:
            return None
        milder = self._decision(run, call, tokens, kind, length, plans, installed, after, planned, WINDOW)
        return WINDOW if milder.reduce else None

    def _decision(self, run: RunState, call: ModelCall, tokens: TokenLayout, kind: str, length: int, plans: dict,
                  installed: Callable, after: Callable | None, planned: tuple, method: str, budgeted: bool = True):
        """reduce_when auto's decision (None: no rule) for one kind of grid call of this layout
        reduced by ``method``, timed through ``installed`` (our override, as this call runs it),
        which calls ``after``. The window is timed on a CPU too: on a small grid it is more work
        than full attention (the Flux fixture's 32x32: docs/benchmarks.md). ``budgeted`` False:
        its speed alone (the budget decides per block: ``_graded``)."""
        if self.rule is None:
            return None
        plan, first_slot = planned
        slot = first_slot.get(kind)
        if slot is None:
            return Decision(False, None, None, CPU)  # no reduced block makes calls of this kind
        geometry = self._geometry.get(kind)
        if geometry is None:
            geometry = self._geometry[kind] = geometry_of(self.family, self.model, kind)
        signature = self._signature(call, kind, length, plans, after, method)
        instead = "" if method == self.method else f", method {method} instead"

        def describe():
            grid = tokens.grid if tokens.grid[0] > 1 else tokens.grid[1:]  # an image: no frames to name
            windows = {"windows": self._window_plans(run, tokens, plans, call.x.device)} if method == WINDOW else {}
            context = call_context(True, plan=plan, keep=plans, left=frozenset(), calls=slot, **windows)
            return (f"{grid_text(grid)} grid, {kind} attention ({length} keys){instead}",
                    dit_attention_work(call.attention, geometry, length, call, installed, self.context_key,
                                       context, slot, lambda: self._own_block(call, plan, slot, context, installed)))

        return self.decision(run, call.x.device, signature, describe,
                             lambda: dit_block_fingerprint(call, self.model, self.family.blocks, plan[slot].block),
                             time_cpu=method == WINDOW, budgeted=budgeted)

    def _signature(self, call: ModelCall, kind: str, length: int, plans: dict, after: Callable | None,
                   method: str) -> tuple:
        geometry = self._geometry.get(kind)
        if geometry is None:
            geometry = self._geometry[kind] = geometry_of(self.family, self.model, kind)
        return ("dit", self.family.name, kind, length, plans[(kind, length)].kept, *geometry,
                str(compute_dtype(call)), backend_of(call, after), method)

    def _own_block(self, call: ModelCall, plan: tuple, slot: int, reducing: dict,
                   installed: Callable) -> tuple[Callable, Callable] | None:
        """The quality budget's unit (``pays.Work.compare``): the block that makes the attention
        call ``slot``, on the inputs the model hands it in this call (captured in a rehearsal below
        every wrapper, as ToMe's auto rule captures them), run whole and with its calls reduced
        through ``installed`` (ours). A block's output, residual included, is what its reduced
        attention changes; one attention call's output on random q, k, v changes as much on random
        weights as on trained ones. None where the family's blocks have no block-replace key (ToMe
        cannot reach them either) or the host cannot run a model call again: the change is not
        known there."""
        block = plan[slot].block
        key = self.family.merge.keys(self.model).get(block) if self.family.merge is not None else None
        if key is None or call.rehearse is None:
            return None
        try:  # the model's own block: another pack's replacement at this key (a cache, a counter) runs nowhere here
            ((_, args, extra),) = captured_blocks(call, {"unit": key}).values()
        except NotReached:  # a family whose blocks the model calls without the host's key (NextDiT): not known
            return None  # (any other error, out of memory included, fails the measurement: said, tried again)
        first = min(index for index, planned in enumerate(plan) if planned.block == block)
        options = {**args["transformer_options"], OVERRIDE: installed}

        def side(context: dict) -> Callable:
            run = on_copies(model_block, {**args, "transformer_options": {**options, self.context_key: context}}, extra)

            def counted():
                context["calls"] = first  # the block's attention calls are counted from its first
                return run()
            return counted

        return side(call_context(False)), side(reducing)

    def _keep_plans(self, run: RunState, tokens: TokenLayout, device) -> dict:
        """(call kind, key length) -> KeepPlan, the same for every call with this layout."""
        cache_key = ("todo dit", tokens, device)
        plans = run.cache.get(cache_key)
        if plans is None:
            plans = run.cache[cache_key] = keep_plans(tokens, self.factor, self.temporal_factor, device)
        return plans

    def _window_plans(self, run: RunState, tokens: TokenLayout, plans: dict, device) -> dict:
        """(call kind, key length) -> peak_window.WindowPlan over the same grid and kept keys as
        ``plans``, made once per layout."""
        cache_key = ("todo dit window", tokens, device)
        found = run.cache.get(cache_key)
        if found is None:
            found = run.cache[cache_key] = window_plans(plans, self.factor, self.temporal_factor, device)
        return found

    # --- in the model call ----------------------------------------------------------------
    def _run_before(self, after, func, *args, **kwargs):
        """Reduce this call's keys and values where it is a grid call of a reduced block, then
        hand them to ``after`` (another override) or to the backend ``func``. An override set after
        ours that chains to the one it replaced calls ours again inside that: the inner call only
        passes the keys on, so one attention call is reduced and counted once."""
        options = kwargs.get("transformer_options")
        call = self.call_context(options) if isinstance(options, dict) else None
        if call is None or not call["active"] or call.get("inside"):
            return hand_on(after, func, args, kwargs)
        args, kwargs = self._reduce(call, args, kwargs, options.get(MERGED_GRID))
        window = call.pop("window", None)  # set by _reduce where this call runs windowed
        call["inside"] = True
        try:
            if window is not None:
                return self._windowed(window, after, func, args, kwargs)
            return hand_on(after, func, args, kwargs)
        finally:
            call["inside"] = False

    def _reduce(self, call: dict, args: tuple, kwargs: dict, merged=None) -> tuple[tuple, dict]:
        index = call["calls"]
        call["calls"] = index + 1
        plan = call["plan"]
        slot = plan[index] if index < len(plan) else None
        if slot is None or slot.kind == OTHER or slot.block not in self.blocks or slot.kind in call["left"]:
            return args, kwargs
        graded = call.get("graded")
        method = graded.get((slot.kind, slot.block)) if graded is not None else self.method
        if method is None:  # a block the budget left alone
            return args, kwargs
        dim = 2 if kwargs.get("skip_reshape") else 1  # [B, H, N, D], else [B, N, H*D] (SD3's v: [B, N, H, D])
        q, k, v = args[:3]
        length = k.shape[dim]
        keep = call["keep"].get((slot.kind, length))
        if keep is None and merged is not None:  # a block ToMe merged: its grid is the merged tokens
            return self._reduce_merged(call, args, kwargs, slot, dim, merged)
        if keep is None or v.shape[dim] != length or (q.shape[dim] > length if slot.part else q.shape[dim] != length):
            note_skipped(call)  # a grid call whose tokens are not the predicted layout: left alone
            return args, kwargs
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        if mask is not None and mask.shape[-1] not in (1, length):
            note_skipped(call)
            return args, kwargs
        window = call.get("windows", {}).get((slot.kind, length)) if graded is None or method == WINDOW else None
        if window is not None and window_runs(mask, q.shape[dim], length):
            call["window"] = (window, dim)  # run by _run_before: the whole call, not only its keys
            note_reduced(call, keep.grid if keep.grid[0] > 1 else keep.grid[1:], 1, lambda: reduced_tokens(keep, window))
            return args, kwargs
        args = (q, kept_keys(k, dim, keep, self.select), kept_keys(v, dim, keep, self.select), *args[3:])
        if mask is not None and mask.shape[-1] == length:
            mask = mask.index_select(-1, keep.index)
            if len(args) > 4:
                args = (*args[:4], mask, *args[5:])
            else:
                kwargs = {**kwargs, "mask": mask}
        note_reduced(call, keep.grid if keep.grid[0] > 1 else keep.grid[1:], 1, lambda: reduced_tokens(keep))
        return args, kwargs

    def _windowed(self, window: tuple[WindowPlan, int], after, func, args: tuple, kwargs: dict) -> torch.Tensor:
        """The grid call ``args`` / ``kwargs`` run as ``peak_window.window_call``: its batched
        calls go to ``after`` or the backend ``func`` as [B', H, N, D] (``skip_reshape``) with the
        log counts as the additive ``mask``; each comes back in whatever layout that backend gives."""
        plan, dim = window
        q, k, v = args[:3]
        heads = args[3] if len(args) > 3 else kwargs["heads"]

        def attend(q, k, v, bias):
            if len(args) > 4:  # the mask given by position (None: the window runs only without one)
                out = hand_on(after, func, (q, k, v, heads, bias, *args[5:]), {**kwargs, "skip_reshape": True})
            else:
                out = hand_on(after, func, (q, k, v, *args[3:]), {**kwargs, "mask": bias, "skip_reshape": True})
            return out if out.ndim == 4 else out.unflatten(2, (heads, -1)).transpose(1, 2)

        return window_call(q, k, v, heads, dim, plan, attend, self.heavy_keys,
                           heads_out=bool(kwargs.get("skip_output_reshape")))

    def _reduce_merged(self, call: dict, args: tuple, kwargs: dict, slot, dim: int, merged) -> tuple[tuple, dict]:
        """A grid call of a block ToMe merged (``merged``: its ``tome_dit.BlockPlan``): the keys and
        values kept are the merged tokens that ToDo's kept grid positions were merged into (what
        nearest downsampling keeps of the grid as ToMe restores it), each with its own rotary
        position; the tokens around the grid as they are."""
        q, k, v = args[:3]
        length = k.shape[dim]
        keep = next((plan for (kind, full), plan in call["keep"].items()
                     if kind == slot.kind and full - merged.r == length), None)
        mask = args[4] if len(args) > 4 else kwargs.get("mask")
        if keep is None or keep.grid != merged.tiles.grid or v.shape[dim] != length or \
                (q.shape[dim] > length if slot.part else q.shape[dim] != length) or \
                (mask is not None and (mask.ndim < 3 or mask.shape[-1] not in (1, length))):
            note_skipped(call)
            return args, kwargs
        index = self._merged_index(call, keep, merged, length)
        args = (q, take(k, dim, index), take(v, dim, index), *args[3:])
        if mask is not None and mask.shape[-1] == length:
            mask = take(mask, -1, index)
            if len(args) > 4:
                args = (*args[:4], mask, *args[5:])
            else:
                kwargs = {**kwargs, "mask": mask}
        m = merged.merged_tokens
        kept = index.shape[1] - (length - m)
        note_reduced(call, keep.grid if keep.grid[0] > 1 else keep.grid[1:], 1,
                     lambda: {"k/v in merged blocks": (m, kept)}, part="merged")
        return args, kwargs

    def _merged_index(self, call: dict, keep: KeepPlan, merged, length: int) -> torch.Tensor:
        """[B, L'] the key positions kept in a merged block's grid call: made once per merge and
        kind of call (the blocks sharing ToMe's plan share it), tensor work only."""
        cached = call.get("merged keep")
        if cached is not None and cached[0] is merged and cached[1] is keep:
            return cached[2]
        index = merged_keep_index(keep, merged, length)
        call["merged keep"] = (merged, keep, index)
        return index
