"""ToDo on diffusers' DiTs under the quality budget, decided per block (issue #51), as on
ComfyUI's DiTs (``tokenreduce/todo_dit_blocks.py``, ``late_blocks.py``).

With a budget (``max_change``), which selected blocks ToDo reduces, and how, is decided block by
block, before the run's first reduced call, on a late input:

1. the model call is run again whole (the model's own forward, below its hooks, nothing reduced),
   which gives its flow velocity ``v``; one Euler step along it moves the call's latent to the
   noise level at ``window.LATE`` of the run's schedule (``x + (late - sigma) * v``: the
   prediction noised again with the call's own noise, as ``window.late_latent`` computes it from
   the prediction of the clean latent). The schedule is
   the pipeline's flow scheduler's own sigmas (from its begin index: an image-to-image run's
   steps); for a model called on its own, the unshifted flow schedule, as its percents are mapped
   (``session.Session.late_sigma``);
2. the call is run once more there, with the timestep of that level; each selected block's output
   is handed on whole, and the block is run again on copies of its input with its grid calls
   reduced by each method of the ladder (nearest, then the window), so every block is measured on
   the input the unreduced model hands it, in one call;
3. the changes are graded under one budget (``late_blocks.grade``, ``pays.grade_blocks``), kept per
   block and model (the block's own weights' fingerprint), said in one report line. Speed stays
   decided per kind of attention call (every block makes the same shapes).

Where the late input cannot be made (a scheduler that is not a flow schedule, a family whose
timestep runs the other way: Lumina 2, an output of another shape than the latent) or the blocks
run compiled (whose Python cannot follow a block's choice), ToDo decides per kind as before.
"""

from __future__ import annotations

import torch

from ..describe import grid_text
from ..late_blocks import NotRehearsed, grade, once_per_run, say_graded
from ..measure import copied_containers
from ..pays import Work, relative_change
from ..peak_window import WINDOW
from ..run import call_context
from ..window import LATE
from .hooks import on_copies, weights_fingerprint

GRID = "grid"  # the one kind of unit: a block's grid attention calls (its shapes are the kind's)
NO_GRADE = object()  # decided per kind (kept per run, so the reasons are asked once)


def _prediction(output) -> torch.Tensor | None:
    """The tensor a transformer's forward returns first (``return_dict`` or not)."""
    if torch.is_tensor(output):
        return output
    sample = getattr(output, "sample", None)
    if torch.is_tensor(sample):
        return sample
    if isinstance(output, (tuple, list)) and output and torch.is_tensor(output[0]):
        return output[0]
    return None


def _snapshot(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A block's inputs as they are now: containers copied, tensors cloned (the block may change
    them in place before the measurement reads them)."""
    again, named = copied_containers((args, kwargs))
    fresh = lambda value: value.clone() if torch.is_tensor(value) else value  # noqa: E731
    return tuple(map(fresh, again)), {name: fresh(value) for name, value in named.items()}


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
        args, kwargs = arguments.inputs
        x, t = arguments("hidden_states"), arguments("timestep")
        if not torch.is_tensor(x) or t is None:
            raise NotRehearsed("the model call has no latent and timestep to move to a later step")
        t = torch.as_tensor(t, device=x.device)
        sigma = t.float() / self.family.timestep_scale
        x_late, t_late = x, t
        if sigma.numel() not in (1, x.shape[0]):  # a timestep per token (Wan 2.2 TI2V's): no one level to move
            raise NotRehearsed("the call's timestep is not one per sample")
        if bool((sigma > late).all()):  # one read, while measuring; else the call is later already
            again, named = _copies(args, kwargs)
            velocity = _prediction(self._whole(lambda: self.model.forward(*again, **named)))
            if velocity is None or velocity.shape != x.shape:
                raise NotRehearsed("the model's prediction is not of its latent's shape")
            step = (late - sigma.reshape(-1)).reshape((-1,) + (1,) * (x.ndim - 1))  # one row, or one a sample
            x_late = (x.float() + step * velocity.float()).to(x.dtype)  # window.late_latent, for a flow velocity
            t_late = t.new_full(t.shape, late * self.family.timestep_scale)
        again, named = _copies(args, kwargs)
        again, named = self._with(again, named, hidden_states=x_late, timestep=t_late)
        ladder = self._ladder()
        found, held, handles, inside = {}, {}, [], []  # inside: a reduced side runs (its hooks pass)

        def keep(index):
            def before(module, args, kwargs):
                if not inside:
                    held[index] = _snapshot(args, kwargs)
            return before

        def measure(index):
            def after(module, args, kwargs, output):
                if inside:
                    return
                inputs = held.pop(index)
                inside.append(index)
                try:
                    found[index] = {method: relative_change(output, self._reduced_block(index, inputs, method))
                                    for method in ladder}
                finally:
                    inside.clear()
            return after

        try:
            for index, block in enumerate(self._blocks):
                handles.append(block.register_forward_pre_hook(keep(index), with_kwargs=True))
                handles.append(block.register_forward_hook(measure(index), with_kwargs=True))
            self._whole(lambda: self.model.forward(*again, **named))
        finally:
            for handle in handles:
                handle.remove()
        missing = [index for index in range(len(self._blocks)) if index not in found]
        if missing:
            raise NotRehearsed(f"the model call, run again to measure its blocks, never reached block "
                               f"{', '.join(map(str, missing))}")
        return found

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

    def _with(self, args: tuple, kwargs: dict, **values) -> tuple[tuple, dict]:
        """The call's arguments with ``values`` in place of the named ones (by position or keyword)."""
        args, kwargs = list(args), dict(kwargs)
        for name, value in values.items():
            position = self._positions.get(name)
            if position is not None and position < len(args):
                args[position] = value
            else:
                kwargs[name] = value
        return tuple(args), kwargs

    def mark_block(self, index: int):
        """Pre-hook of selected block ``index``: the block running now, for its graded method."""
        def before(module, args, kwargs):
            if self.graded is not None:
                self.block_now = index
        return before


def _copies(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments with their lists and dicts copied (what the model consumes stays)."""
    return copied_containers((args, kwargs))
