"""ToMe on diffusers' DiTs under the quality budget, decided per block (issue #51), as on ComfyUI's
DiTs (``tokenreduce/tome_dit_blocks.py``) and as ToDo's through diffusers (``todo_blocks.py``).

With a budget (``max_change``), before the run's first merged block, every selected block's
change is read alone on the late input (``late.py``), merged at the node's ratio and at half of it
(the milder step; with ``share_plans`` each ratio's plan made by the first block measured, as the
run's blocks at half the ratio share a plan of their own); the blocks' changes are graded under one
budget (``late_blocks.grade``), kept per block and model, said in one report line. The measured
merge is the run's: the same tiles (its clean first frames kept out) and the same code
(``_merged``). Speed stays decided in the blocks, per kind of block and merged count, on the
block's own call, as before (``tome_dit._pays``): a block the budget lets merge at a count whose
kind does not pay runs whole, which spends less of the budget than was allowed.

Where no late input can be made (Lumina 2, a scheduler that is not a flow schedule) or the blocks
run compiled, ToMe decides per kind as before.
"""

from __future__ import annotations

import torch

from ..describe import grid_text
from ..late_blocks import grade, once_per_run, say_graded
from ..measure import copied_containers
from ..pays import Work, relative_change
from ..run import call_context
from ..tome_dit import merged_count
from ..whole_difference import corrected_block
from ..window import LATE
from .hooks import weights_fingerprint
from .late import late_call, measure_blocks, snapshot

NO_GRADE = object()  # decided per kind (kept per run, so the reasons are asked once)


class ToMeBlockBudget:
    """The per-block budget of ``tome_dit.DiffusersToMeDiT`` (its ``prepare`` asks ``_graded``;
    each wrapped block reads ``graded``: block index -> merged count)."""

    def block_keys(self) -> dict:
        """{block index: (kind, its place in its list)}: how the report names the merged blocks
        ('double 1, single 0-2', as ComfyUI's block-replace keys name Flux's)."""
        kinds = self.replace_keys()

        def place(site) -> int:
            tail = site.path.rpartition(".")[2]
            return int(tail) if tail.isdigit() else site.key[1]
        return {site.key[1]: (kinds[site.key[1]][0], place(site)) for site in self.sites}

    def _graded(self, arguments, layout, tiles, r: int) -> dict | None:
        """{block index: merged count} of the selected blocks this layout's calls merge, decided per
        block under the budget on a late input; None: decided per kind. Made once per layout and run."""
        if self.rule is None or self.rule.max_change <= 0 or any(self._compiled(b) for b in self._wrapped[:1]):
            return None
        run = self.session.run
        cache_key = ("diffusers tome graded", layout, arguments("hidden_states").device)
        found = run.cache.get(cache_key)
        if found is None:
            found = run.cache[cache_key] = self._decide_blocks(arguments, layout, tiles, r)
        return None if found is NO_GRADE else found

    def _decide_blocks(self, arguments, layout, tiles, r: int):
        run = self.session.run
        late = self.session.late_sigma() if self.family.late_input else None
        if late is None or getattr(arguments, "inputs", None) is None:
            return NO_GRADE
        half = merged_count(tiles, self.settings.ratio / 2)
        counts = tuple(dict.fromkeys(c for c in (r, half) if c > 0))  # distinct, the most first
        keys = self.block_keys()
        units = sorted((key[0], block) for block, key in keys.items())
        device = arguments("hidden_states").device

        graded = grade(units, counts, lambda unit, count: True, lambda unit, count: self._block_change(
            arguments, layout, tiles, late, unit, count, counts), self.rule.max_change, run.reach)
        if graded is None:  # a change not knowable here: per kind
            return NO_GRADE
        labels = {count: f"ratio {ratio:g}" for ratio, count in
                  ((self.settings.ratio / 2, half), (self.settings.ratio, r))}
        grid = layout.grid if layout.grid[0] > 1 else layout.grid[1:]
        say_graded(run, device, f"{self.family.name} blocks, {grid_text(grid)} grid, per block", graded, units, keys,
                   self.rule.max_change, self.rule.decisions.where, label=labels.get, name_kinds=False)
        return {block: count for (_, block), count in graded.choice.items()}

    def _block_change(self, arguments, layout, tiles, late: float, unit: tuple, count: int, counts: tuple):
        """The change of ``unit`` (kind, block index) alone merged by ``count``, kept per block and
        model; measured, where not kept, in one rehearsal that reads every block."""
        run, s = self.session.run, self.settings
        kind, index = unit
        hidden = arguments("hidden_states")
        planned = ("corrected, planned at", f"{self._plan_level() or 0:.4g}") if self.correct else ()
        signature = ("diffusers ToMe DiT", self.family.name, kind, *layout.grid, layout.whole_frames, count, s.ratio,
                     *self.strides, s.share_plans, str(hidden.dtype), "block", index, "late", LATE, *planned)

        def work() -> Work:
            return Work({}, lambda _: 0.0, lambda _: 0.0, change=lambda: once_per_run(
                run, ("diffusers tome late", layout, hidden.device),
                lambda: self._rehearse_late(arguments, layout, tiles, late, counts)).get(index, {}).get(count))

        block = self._blocks_by_index[index][0]
        return self.rule.decide(hidden.device, signature, work, f"{kind} {index}, {count} merged",
                                model=lambda: weights_fingerprint(block), reach=run.reach, budgeted=False,
                                untimed=True)

    def _plan_level(self) -> float | None:
        """correct_from_whole: the noise level of the step whose plan the late step reuses at the
        most (``plan_every - 1`` steps before it); None: the call's own input."""
        return self.session.level_before_late(self.every - 1)

    def _rehearse_late(self, arguments, layout, tiles, late: float, counts: tuple) -> dict:
        """{block index: {merged count: change}} of every selected block, read in one rerun of the
        model call at the late input; with correct_from_whole each block merged by the plans a
        rehearsal at its plan's step made, their differences from the whole block added (as the run
        runs the late step)."""
        call = late_call(self.model, arguments, self.family.timestep_scale, late, self._whole)
        # per count, a step's plans: share_plans' plan (made by the first block measured), and
        # correct_from_whole's differences (it needs share_plans)
        shared = {count: {} if self.settings.share_plans else None for count in counts}
        blocks = {index: entry[0] for index, entry in self._blocks_by_index.items()}

        def merged_block(index: int, inputs: tuple, count: int, planning: bool = False):
            _, original, kind, merged, positional = self._blocks_by_index[index]
            args, kwargs = inputs
            named = snapshot((), {**dict(zip(positional, args)), **kwargs})[1]
            current = self.Current(layout, tiles, count, shared[count], planning)
            run = lambda given: self._merged(original, given, current, merged)  # noqa: E731
            return corrected_block(shared[count], (kind, index), planning, named, lambda given: original(**given),
                                   run) if self.correct else run(named)

        if self.correct:
            def plan(index: int, inputs: tuple, output) -> None:
                for count in counts:
                    merged_block(index, inputs, count, planning=True)
            level = self._plan_level()
            planned = copied_containers(arguments.inputs) if level is None else late_call(
                self.model, arguments, self.family.timestep_scale, level, self._whole)
            measure_blocks(self.model, blocks, planned, self._whole, plan)

        def measure(index: int, inputs: tuple, output) -> dict:
            outs = {count: merged_block(index, inputs, count) for count in counts}
            # None: not its layout, whole
            return {count: 0.0 if out is None else relative_change(output, out) for count, out in outs.items()}
        return measure_blocks(self.model, blocks, call, self._whole, measure)

    def _whole(self, run):
        """``run()`` with every block as it is (the measurement's unreduced side)."""
        saved = self.current, self.session.context
        self.current, self.session.context = None, call_context(False)
        try:
            with torch.no_grad():
                return run()
        finally:
            self.current, self.session.context = saved
