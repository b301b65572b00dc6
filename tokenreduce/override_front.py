"""Our attention override in front of the host's attention backend and of any other override.

ComfyUI's ``optimized_attention_override`` is one slot (``transformer_options``), which
attention-backend nodes (KJNodes' SageAttention patch, ComfyUI's own
``set_model_optimized_attention``) use too. An override installed before ours is kept as
``previous`` and called with our keys, so both act. One installed after ours replaces the slot and
calls neither what was there nor the backend it is handed: it would shut ours out, so at each model
call ours puts itself in front of it in that call's options (their own dict), and the report says
so. Shared by ToDo's DiT path (every grid call) and its UNet window (self-attention at the levels
the window runs)."""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Callable

from .run import OVERRIDE, RunState

FRONTS = 8  # overrides found installed after ours that keep their front object (see _front_of)


def hand_on(after: Callable | None, func: Callable, args: tuple, kwargs: dict):
    """The attention call handed to the next override (``after``) or to the backend ``func``."""
    return after(func, *args, **kwargs) if after is not None else func(*args, **kwargs)


class InFront:
    """An attention override that stays in front: subclasses give ``_run_before(after, func,
    *args, **kwargs)`` and a ``label``; ``previous`` is the override installed before ours."""

    previous: Callable | None = None

    def __init__(self, previous: Callable | None = None):
        self._fronts = OrderedDict()  # id of an override found installed after ours -> (it, ours in front of it)
        self._fronts_lock = threading.Lock()
        self.previous = previous

    def override(self, func, *args, **kwargs):
        return self._run_before(self.previous, func, *args, **kwargs)

    def _run_before(self, after, func, *args, **kwargs):  # pragma: no cover - every subclass has its own
        raise NotImplementedError

    def _in_front(self, run: RunState, options: dict, say: bool = True) -> tuple[Callable, Callable | None]:
        """The override this call runs ours as, and the one ours hands its keys to. Where another
        node set the override after ours (or removed it: None), ours goes in front of it in this
        call's options (their own dict): the same object for the same found override every call,
        so a compiled model sees no new value; said in the report (``say``; else the caller says it,
        ``say_in_front``, where ours acts)."""
        current = options.get(OVERRIDE)
        if getattr(current, "__self__", None) is self and getattr(current, "__func__", None) is InFront.override:
            return current, self.previous
        if isinstance(current, functools.partial) and current.func == self._run_before:  # kept from an earlier call
            return current, current.args[0]
        options[OVERRIDE] = front = self._front_of(current)
        if say:
            self.say_in_front(run, current)
        return front, current

    def stay_or_step_aside(self, run: RunState, options: dict, front: Callable, after: Callable | None,
                           acts: bool) -> None:
        """After a call's ``_in_front(..., say=False)``: where ours ``acts`` in the call it stays in
        front (and says so where another node's override is behind it); else it steps aside for the
        call, so the call's attention pays no Python of ours and nothing is said."""
        if acts:
            if getattr(front, "__self__", None) is not self:  # in front of another node's override: said
                self.say_in_front(run, after)
            return
        if after is None:
            options.pop(OVERRIDE, None)
        else:
            options[OVERRIDE] = after

    def say_in_front(self, run: RunState, current: Callable | None) -> None:
        """The report's note that ours went in front of ``current`` (the override another node set)."""
        if current is None:
            run.note_once(f"{self.label}: a node applied after this one removed the attention override; "
                          f"{self.label} put its own back, in front of the attention backend.")
        else:
            name = getattr(current, "__qualname__", type(current).__name__)
            run.note_once(f"{self.label}: an attention override applied after this node ({name}) had replaced its "
                          f"own; {self.label} runs in front of it, so both act.")

    def _front_of(self, current: Callable | None) -> Callable:
        """Ours in front of ``current``, one object per override found (looked up by identity: an
        override need not be hashable). Kept for the last ``FRONTS`` overrides found, so a model
        whose override is replaced on every run does not grow this without bound."""
        with self._fronts_lock:  # the model's calls may come from several threads (multi-GPU)
            found = self._fronts.get(id(current))
            if found is not None and found[0] is current:
                self._fronts.move_to_end(id(current))
                return found[1]
            front = functools.partial(self._run_before, current)
            self._fronts[id(current)] = (current, front)  # holds current: its id is not reused meanwhile
            while len(self._fronts) > FRONTS:
                self._fronts.popitem(last=False)
            return front


def beneath_ours(override: Callable | None) -> Callable | None:
    """``override`` with ours stepped over: the override our front hands the call to (another
    pack's, or None). A UNet call's kind names other packs' overrides only, so ToDo's window
    override (installed where the window can run) does not make a kind of its own."""
    while True:
        owner = getattr(override, "__self__", None)
        if isinstance(owner, InFront) and getattr(override, "__func__", None) is InFront.override:
            override = owner.previous
        elif isinstance(override, functools.partial) and isinstance(getattr(override.func, "__self__", None), InFront):
            override = override.args[0]
        else:
            return override
