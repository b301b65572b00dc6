"""ToDo on DiTs under the quality budget, decided per block (issue #51).

With a budget (``max_change``), which blocks of a model call ToDo reduces, and how, is decided
block by block: each reduced block's change is read alone, on a late input (``late_blocks.py``:
the model's own prediction noised again to three quarters of the run's schedule, where the output
unit ranks the blocks as their pictures do), for the node's method and for the milder window; the
blocks' changes add up under one budget (``pays.grade_blocks``); speed stays decided per kind of
attention call (every block makes the same shapes). A mixin of ``todo_dit.ToDoDiTPatch``: it reads
the patch's plans, its speed decisions and its override.
"""

from __future__ import annotations

from typing import Callable

from .describe import grid_text
from .dit import TokenLayout
from .late_blocks import grade, late_block_changes, model_block, once_per_run, say_graded
from .measure import dit_block_fingerprint, on_copies
from .pays import Work, relative_change
from .peak_window import WINDOW
from .run import OVERRIDE, ModelCall, RunState, call_context
from .window import LATE


class BlockBudget:
    """The per-block budget of ``todo_dit.ToDoDiTPatch`` (its ``_graded`` decides; the patch's
    override reads the result from the call's context, ``graded``)."""

    def _ladder(self) -> tuple[str, ...]:
        """The methods a block may run, the most reducing first: nearest steps down to the window."""
        return (self.method, WINDOW) if self.method == "nearest" else (self.method,)

    def _graded(self, run: RunState, call: ModelCall, tokens: TokenLayout, plans: dict, installed: Callable,
                after: Callable | None, planned: tuple) -> dict | None:
        """{(kind, block): method} of the blocks this layout's calls reduce, decided per block under
        the quality budget (``pays.grade_blocks``): each block's change read alone on a late input
        (``late_blocks.py``), with each method that pays for its kind of call (speed stays a matter
        of the kind: the same shapes in every block). None: decided per kind instead (no budget; the
        host cannot run the call again; blocks without a block-replace key, whose inputs nothing can
        catch). Made once per layout and run, the same dict for every call."""
        if self.rule is None or self.rule.max_change <= 0:
            return None
        cache_key = ("todo dit graded", tokens, call.x.device)
        if cache_key in run.cache:
            return run.cache[cache_key]
        plan, _ = planned
        keys = self.family.merge.keys(self.model) if self.family.merge is not None else {}
        lengths = {kind: length for kind, length in plans}
        units = sorted({(slot.kind, slot.block) for slot in plan
                        if slot.kind in lengths and slot.block in self.blocks})
        if call.rehearse is None or not units or any(keys.get(block) is None for _, block in units):
            run.cache[cache_key] = None
            return None

        def pays(unit: tuple, method: str) -> bool:
            return self._decision(run, call, tokens, unit[0], lengths[unit[0]], plans, installed, after, planned,
                                  method, budgeted=False).reduce

        graded = grade(units, self._ladder(), pays, lambda unit, method: self._block_change(
            run, call, tokens, plans, installed, after, planned, unit, method), self.rule.max_change, run.reach)
        if graded is None:  # a change not knowable here: per kind
            run.cache[cache_key] = None
            return None
        grid = tokens.grid if tokens.grid[0] > 1 else tokens.grid[1:]
        say_graded(run, call.x.device, f"{grid_text(grid)} grid, per block", graded, units, keys,
                   self.rule.max_change, self.rule.decisions.where)
        run.cache[cache_key] = graded.choice
        return graded.choice

    def _block_change(self, run: RunState, call: ModelCall, tokens: TokenLayout, plans: dict, installed: Callable,
                      after: Callable | None, planned: tuple, unit: tuple, method: str):
        """The change of ``unit`` (kind, block) alone reduced by ``method``, kept per block and model
        (the block's own weights' fingerprint); measured, where not kept, in one rehearsal that
        reads every block (``_late_changes``)."""
        kind, block = unit
        length = next(length for k, length in plans if k == kind)
        signature = (*self._signature(call, kind, length, plans, after, method), "block", block, "late", LATE)

        def work() -> Work:
            return Work({}, lambda _: 0.0, lambda _: 0.0, change=lambda: self._late_changes(
                run, call, tokens, plans, installed, planned).get(unit, {}).get(method))

        return self.rule.decide(call.x.device, signature, work, f"{kind} attention, block {block}, {method}",
                                model=lambda: dit_block_fingerprint(call, self.model, self.family.blocks, block),
                                reach=run.reach, budgeted=False, untimed=True)

    def _late_changes(self, run: RunState, call: ModelCall, tokens: TokenLayout, plans: dict, installed: Callable,
                      planned: tuple) -> dict:
        """{(kind, block): {method: change}} of every reduced block and method of the ladder, from
        one rehearsal at the late input (``late_blocks.late_block_changes``), once per run and
        layout; {} where the model never reached a block (not known); a failure (out of memory,
        say) raised for each block."""
        return once_per_run(run, ("todo dit late", tokens, call.x.device),
                            lambda: self._rehearse_late(run, call, tokens, plans, installed, planned))

    def _rehearse_late(self, run: RunState, call: ModelCall, tokens: TokenLayout, plans: dict, installed: Callable,
                       planned: tuple) -> dict:
        plan, _ = planned
        lengths = {kind: length for kind, length in plans}
        keys = self.family.merge.keys(self.model)
        first = {}
        for index, slot in enumerate(plan):
            first.setdefault(slot.block, index)
        kinds = {}  # block -> the kinds of grid call it makes
        for kind, block in {(slot.kind, slot.block) for slot in plan
                            if slot.kind in lengths and slot.block in self.blocks}:
            kinds.setdefault(block, []).append(kind)
        ladder = self._ladder()
        windows = self._window_plans(run, tokens, plans, call.x.device) if WINDOW in ladder else {}

        def measure(block, args, extra):
            options = {**args["transformer_options"], OVERRIDE: installed}

            def side(context: dict):
                context["calls"] = first[block]  # the block's attention calls are counted from its first
                return on_copies(model_block, {**args, "transformer_options": {**options, self.context_key: context}},
                                 extra)()

            whole = side(call_context(False))
            changes = {}
            for kind in sorted(kinds[block]):
                for method in ladder:
                    window = {"windows": {(kind, lengths[kind]): windows[(kind, lengths[kind])]}} \
                        if method == WINDOW else {}
                    reducing = call_context(True, plan=plan, keep=plans, left=frozenset(set(lengths) - {kind}),
                                            **window)
                    changes[(kind, method)] = relative_change(whole, side(reducing))
            return whole, changes

        found = late_block_changes(call, run.late_sigma, {block: keys[block] for block in sorted(kinds)}, measure)
        return {(kind, block): {method: change for (k, method), change in changes.items() if k == kind}
                for block, changes in found.items() for kind in kinds[block]}
