"""ToMe on DiTs under the quality budget, decided per block (issue #51), as ToDo's is
(``todo_dit_blocks.py``): each merged block's change read alone on the late input
(``late_blocks.py``), at the node's ratio and at half of it (the milder step, its own shared plan),
the blocks' changes summed within ``max_change`` (``late_blocks.grade``); speed stays decided per
kind of block and merged count. Read late, the Flux fixture's ToMe blocks rank as their pictures do
but for one swap, where the first call's unit ranked the block that moves them least highest
(docs/quality.md). With correct_from_whole each block is read as the late step runs it: merged with
the plan a rehearsal made ``plan_every - 1`` steps earlier, that plan's difference from the whole
block added. A mixin of ``tome_dit.ToMeDiTPatch``; the block replacement reads the choice from the
call's context (``graded``: block -> merged count)."""

from __future__ import annotations

from .describe import grid_text
from .dit import TokenLayout
from .late_blocks import grade, late_block_changes, model_block, once_per_run, say_graded
from .measure import dit_block_fingerprint, on_copies
from .pays import Work, relative_change
from .run import LEFT_ALONE, ModelCall, RunState, call_context
from .window import LATE


class ToMeBlockBudget:
    """The per-block budget of ``tome_dit.ToMeDiTPatch``."""

    def _ratios(self) -> tuple[float, ...]:
        """The ratios a block may merge at, the most first: the node's, then half of it."""
        return (self.settings.ratio, self.settings.ratio / 2)

    def graded_left(self, context: dict, run: RunState, call: ModelCall, kinds, graded: dict) -> frozenset:
        """The kinds of block none of which the budget merges; where that is every kind, the call's
        context is switched off and later calls like it step aside (``CallPatch.steps_aside``)."""
        keys = self.replace_keys()
        left = frozenset(kind for kind in kinds if not any(keys[block][0] == kind for block in graded))
        if len(left) == len(kinds):
            context["active"] = False
            run.cache[(LEFT_ALONE, self.call_key(call))] = (left, True)
        return left

    def _graded(self, run: RunState, call: ModelCall, tokens: TokenLayout, tiles, ladder: tuple) -> dict | None:
        """{block index: merged count} of the blocks this layout's calls merge, decided per block
        under the quality budget (``ladder``: (ratio, merged count), the node's first). None:
        decided per kind instead (no budget; the host cannot run the call again; a model whose
        blocks the rehearsal never reaches). Made once per layout and run."""
        if self.rule is None or self.rule.max_change <= 0 or call.rehearse is None:
            return None
        cache_key = ("tome dit graded", tokens, call.x.device)
        if cache_key in run.cache:
            return run.cache[cache_key]
        keys = self.replace_keys()
        units = sorted((key[0], block) for block, key in keys.items())
        counts = tuple(dict.fromkeys(r for _, r in ladder if r > 0))  # distinct, the most first
        if not units or not counts:
            run.cache[cache_key] = None
            return None

        def pays(unit: tuple, r: int) -> bool:
            decision = self._decision(run, call, tokens, unit[0], r, tiles, budgeted=False)
            return decision is None or decision.reduce

        graded = grade(units, counts, pays, lambda unit, r: self._block_change(run, call, tokens, tiles, unit, r,
                                                                               counts),
                       self.rule.max_change, run.reach)
        if graded is None:  # a change not knowable here: per kind
            run.cache[cache_key] = None
            return None
        labels = {r: f"ratio {ratio:g}" for ratio, r in reversed(ladder)}
        grid = tokens.grid if tokens.grid[0] > 1 else tokens.grid[1:]
        say_graded(run, call.x.device, f"{self.family.name} blocks, {grid_text(grid)} grid, per block", graded,
                   units, keys, self.rule.max_change, self.rule.decisions.where, label=labels.get, name_kinds=False)
        choice = run.cache[cache_key] = {block: r for (_, block), r in graded.choice.items()}
        return choice

    def _plan_level(self, run: RunState) -> float | None:
        """correct_from_whole: the noise level of the step whose plan (and its difference from the
        whole block) the late step reuses at the most, ``plan_every - 1`` steps before it (the run's
        first where it has fewer); None: the call's own input (the run's levels not known)."""
        levels = run.late_levels
        return levels[max(0, len(levels) - getattr(self.settings, "plan_every", 1))] if levels else None

    def _block_change(self, run: RunState, call: ModelCall, tokens: TokenLayout, tiles, unit: tuple, r: int,
                      counts: tuple):
        """The change of ``unit`` (kind, block) alone merged by ``r``, kept per block and model
        (corrected from the whole block: per the level its plan is made at too)."""
        kind, block = unit
        planned = ("corrected, planned at", f"{self._plan_level(run) or 0:.4g}") if self.correct else ()
        signature = (*self._signature(call, tokens, kind, r), "block", block, "late", LATE, *planned)

        def work() -> Work:
            return Work({}, lambda _: 0.0, lambda _: 0.0, change=lambda: self._late_changes(
                run, call, tokens, tiles, counts).get(unit, {}).get(r))

        return self.rule.decide(call.x.device, signature, work, f"{kind} {block}, {r} merged",
                                model=lambda: dit_block_fingerprint(call, self.model, self.family.blocks, block),
                                reach=run.reach, budgeted=False, untimed=True)

    def _late_changes(self, run: RunState, call: ModelCall, tokens: TokenLayout, tiles, counts: tuple) -> dict:
        """{(kind, block): {merged count: change}} of every merged block, from one rehearsal at the
        late input, once per run and layout; {} where a block was never reached; a failure raised
        for each block."""
        return once_per_run(run, ("tome dit late", tokens, call.x.device),
                            lambda: self._rehearse_late(run, call, tokens, tiles, counts))

    def _rehearse_late(self, run: RunState, call: ModelCall, tokens: TokenLayout, tiles, counts: tuple) -> dict:
        keys = self.replace_keys()
        # Per count, the plans of a step as the run keeps them: share_plans' one plan (made by the
        # first block measured) and correct_from_whole's differences (one a block; it needs share_plans)
        kept = {r: {} if self.settings.share_plans else None for r in counts}

        def merged(block, args, extra, r: int, planning: bool = False):
            merging = call_context(True, layout=tokens, tiles=tiles, r=r, left=frozenset(),
                                   plans={} if kept[r] is None else kept[r], planning=planning)
            options = {**args["transformer_options"], self.context_key: merging}
            return on_copies(self.replacement(keys[block][0], block, None), {**args, "transformer_options": options},
                             extra)()

        if self.correct:
            # The plans and their differences are made steps before the late one reuses them: a
            # rehearsal at that step's input plans (each merged block also runs whole, as it does
            # in the run), the late one reads the block merged by that plan and corrected.
            def plan(block, args, extra):
                for r in counts:
                    whole = merged(block, args, extra, r, planning=True)
                return whole, None
            late_block_changes(call, self._plan_level(run), dict(keys), plan)

        def measure(block, args, extra):
            whole = on_copies(model_block, args, extra)()
            return whole, {r: relative_change(whole, merged(block, args, extra, r)) for r in counts}

        found = late_block_changes(call, run.late_sigma, dict(keys), measure)
        return {(keys[block][0], block): changes for block, changes in found.items()}
