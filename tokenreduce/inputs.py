"""A method's inputs, declared once: from the declaration a host builds its UI (ComfyUI's V3
schema, the WebUI's controls), checks values when a job is queued and again when it runs, and
gets the frozen settings object the patch receives. Tests and benchmarks take their defaults
from here too. Pure Python: no host, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, make_dataclass
from typing import Callable

FLOAT, INT, BOOL, CHOICE, SEED = "float", "int", "bool", "choice", "seed"
SEED_MAX = 0xFFFF_FFFF_FFFF_FFFF


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Input:
    name: str
    kind: str  # FLOAT, INT, BOOL, CHOICE or SEED
    default: object
    tooltip: str
    low: float | None = None
    high: float | None = None
    step: float | None = None  # UI step of a FLOAT
    options: tuple[str, ...] = ()  # of a CHOICE
    # Added after the first release: optional and declared last, so that saved workflows
    # without it load unchanged; a missing or null value means the default.
    optional: bool = False
    # The host checks its range itself (ComfyUI checks min/max of inputs a node does not
    # validate); our checks leave it alone.
    host_checked: bool = False
    # An expert input: a host that can fold inputs shows it only on request (ComfyUI 0.33's
    # "advanced" inputs; nodes/host.supports_advanced_inputs), the others show it as before. The
    # design card's inputs (what a user sets first) are not advanced; where the input sits, its
    # name and its value in saved workflows do not change with this.
    advanced: bool = False

    def problem(self, value) -> str | None:
        """Why this value cannot be used, or None. None values (links, unknown yet) pass."""
        if value is None or self.host_checked:
            return None
        if self.kind == CHOICE:
            return None if value in self.options else \
                f"{self.name} {value!r} is not one of {', '.join(map(repr, self.options))}."
        if self.kind in (FLOAT, INT):
            # The host reports a value it cannot convert but still asks the node about it.
            if not is_number(value):
                return f"{self.name} {value!r} is not a number."
            if not self.low <= value <= self.high:
                return f"{self.name} {value:g} is out of range: it must be between {self.low:g} and {self.high:g}."
        return None


Check = Callable[[dict], "str | None"]  # a rule across inputs; values may be None where unknown


@dataclass(frozen=True)
class Method:
    """A token-reduction method as a host node shows it: its inputs and the rules across them."""

    name: str
    inputs: tuple[Input, ...]
    checks: tuple[Check, ...] = ()

    def __post_init__(self):
        fields = [(i.name, object) for i in self.inputs]
        object.__setattr__(self, "settings_type", make_dataclass(f"{self.name}Settings", fields, frozen=True))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs)

    def defaults(self) -> dict:
        return {i.name: i.default for i in self.inputs}

    def problem(self, values: dict) -> str | None:
        """The first reason these values cannot work, or None: each input, then the rules."""
        for spec in self.inputs:
            problem = spec.problem(values.get(spec.name))
            if problem is not None:
                return problem
        return next((p for p in (check(values) for check in self.checks) if p is not None), None)

    def settings(self, values: dict):
        """The frozen settings for a run from the values a host passes when the node runs.
        Raises ValueError for a required value that is missing or null, or any problem."""
        complete = {}
        for spec in self.inputs:
            value = values.get(spec.name)
            if value is None and not spec.optional:
                raise ValueError(f"{spec.name} has no value (null).")
            complete[spec.name] = spec.default if value is None else value
        problem = self.problem(complete)
        if problem is not None:
            raise ValueError(problem)
        return self.settings_type(**complete)
