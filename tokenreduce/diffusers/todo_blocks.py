"""ToDo on diffusers' DiTs under the quality budget, decided per block (issue #51), as on
ComfyUI's DiTs (``tokenreduce/todo_dit_blocks.py``, ``late_blocks.py``).

With a budget (``max_change``), which selected blocks ToDo reduces, and how, is decided block by
block, before the run's first reduced call, on a late input (``late.py``: the model call moved by
one Euler step along its own velocity to the noise level at ``window.LATE`` of the run's schedule,
``session.Session.late_sigma``), every selected block measured there in one rehearsal with its
grid calls reduced by each method of the ladder (nearest, then the window); the changes graded
under one budget (``late_blocks.grade``, ``pays.grade_blocks``), kept per block and model (the
block's own weights' fingerprint), said in one report line. Speed stays decided per kind of
attention call (every block makes the same shapes).

Where the late input cannot be made (a scheduler that is not a flow schedule, a family whose
timestep runs the other way: Lumina 2, an output of another shape than the latent) or the blocks
run compiled (whose Python cannot follow a block's choice), ToDo decides per kind as before.
"""

from __future__ import annotations

import torch

from ..describe import grid_text
from ..late_blocks import grade, once_per_run, say_graded
from ..pays import Work, relative_change
from ..peak_window import WINDOW
from ..run import call_context
from ..window import LATE
from .hooks import on_copies, weights_fingerprint
from .late import late_call, measure_blocks

GRID = "grid"  # the one kind of unit: a block's grid attention calls (its shapes are the kind's)
NO_GRADE = object()  # decided per kind (kept per run, so the reasons are asked once)


class DiTBlockBudget:
    """The per-block budget of ``todo.DiTToDo`` (its ``_pays`` asks ``_graded``; the processors
    read ``graded`` and the block running now, ``block_now``)."""

    def _ladder(self) -> tuple[str, ...]:
        """The methods a block may run, the most reducing first: nearest steps down to the window."""
        return (self.method, WINDOW) if self.method == "nearest" and self._windows else (self.method,)

    def block_key(self, index: int) -> tuple[str, int]:
        """How the report names a selected block: its list in the model and its place there."""
        path = self.sites[index].path
        name, _, place = path.rpartition(".")
        return (name.rpartition(".")[2] or name, int(place)) if place.isdigit() else (path, index)

    def _graded(self, hidden: torch.Tensor, arguments) -> dict | None:
        """{block index: method} of the selected blocks this layout's calls reduce, decided per
        block under the quality budget on a late input; None: decided per kind (no budget, compiled
        blocks, no late input). Made once per layout and run."""
        if self.rule is None or self.rule.max_change <= 0 or self._compiled():
            return None
        run = self.session.run
        cache_key = ("diffusers todo graded", self._layout)
        found = run.cache.get(cache_key)
        if found is None:
            found = run.cache[cache_key] = self._decide_blocks(hidden, arguments)
        return None if found is NO_GRADE else found

    def _decide_blocks(self, hidden: torch.Tensor, arguments):
        run = self.session.run
        late = self.session.late_sigma() if self.family.late_input else None
        if late is None or getattr(arguments, "inputs", None) is None or \
                getattr(self.model, "is_cache_enabled", False):
            return NO_GRADE
        units = [(GRID, index) for index in range(len(self._blocks))]

        def pays(unit: tuple, method: str) -> bool:
            saved, self.windows = self.windows, self._windows if method == WINDOW else {}  # what is timed
            try:
                decision = self._decision(hidden, arguments, method, budgeted=False)
            finally:
                self.windows = saved
            return decision is None or decision.reduce

        graded = grade(units, self._ladder(), pays, lambda unit, method: self._block_change(
            hidden, arguments, late, unit[1], method), self.rule.max_change, run.reach)
        if graded is None:  # a change not knowable here: per kind
            return NO_GRADE
        layout, _ = self._layout
        grid = layout.grid if layout.grid[0] > 1 else layout.grid[1:]
        keys = {index: self.block_key(index) for _, index in units}
        say_graded(run, hidden.device, f"{grid_text(grid)} grid, per block", graded, units, keys,
                   self.rule.max_change, self.rule.decisions.where, name_kinds=False)
        return {index: method for (_, index), method in graded.choice.items()}

    def _block_change(self, hidden: torch.Tensor, arguments, late: float, index: int, method: str):
        """The change of selected block ``index`` alone reduced by ``method``, kept per block and
        model; measured, where not kept, in one rehearsal that reads every block."""
        run = self.session.run
        signature = (*self._kind(hidden, method), "block", index, "late", LATE)

        def work() -> Work:
            return Work({}, lambda _: 0.0, lambda _: 0.0, change=lambda: once_per_run(
                run, ("diffusers todo late", self._layout),
                lambda: self._rehearse_late(arguments, late)).get(index, {}).get(method))

        block = self._blocks[index]
        return self.rule.decide(hidden.device, signature, work, f"grid attention, block {index}, {method}",
                                model=lambda: weights_fingerprint(block), reach=run.reach, budgeted=False,
                                untimed=True)

    def _rehearse_late(self, arguments, late: float) -> dict:
        """{block index: {method: change}} of every selected block and method of the ladder, read
        in one rerun of the model call at the late input."""
        call = late_call(self.model, arguments, self.family.timestep_scale, late, self._whole)
        ladder = self._ladder()

        def measure(index: int, inputs: tuple, output) -> dict:
            return {method: relative_change(output, self._reduced_block(index, inputs, method)) for method in ladder}
        return measure_blocks(self.model, dict(enumerate(self._blocks)), call, self._whole, measure)

    def _whole(self, call):
        """``call()`` with every processor passing through (the measurement's unreduced side)."""
        saved = self.switch.forced, self.session.context
        self.switch.forced, self.session.context = False, call_context(False)
        try:
            with torch.no_grad():
                return call()
        finally:
            self.switch.forced, self.session.context = saved

    def _reduced_block(self, index: int, inputs: tuple, method: str):
        """Selected block ``index`` run on copies of ``inputs`` with its grid calls reduced by ``method``."""
        saved = self.switch.forced, self.session.context, self.windows
        self.switch.forced, self.session.context = True, call_context(True)
        self.windows = self._windows if method == WINDOW else {}  # nearest: no window
        try:
            with torch.no_grad():
                return on_copies(self._blocks[index], *inputs)()
        finally:
            self.switch.forced, self.session.context, self.windows = saved

    def mark_block(self, index: int):
        """Pre-hook of selected block ``index``: the block running now, for its graded method."""
        def before(module, args, kwargs):
            if self.graded is not None:
                self.block_now = index
        return before


