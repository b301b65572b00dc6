"""Input checks shared by the nodes. ComfyUI skips its own min/max check for every input a
node's ``validate_inputs`` takes, and this ComfyUI does not check V3 combo values at all, so
the nodes check both here, with messages that name the input. Values that are links arrive as
None at validation time; execution checks them again."""

from __future__ import annotations


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_present(values: dict) -> str | None:
    """At execution every widget input has a value; None there came from the client."""
    missing = [name for name, value in values.items() if value is None]
    return f"{missing[0]} has no value (null)." if missing else None


def check_ranges(values: dict, ranges: dict) -> str | None:
    for name, value in values.items():
        low, high = ranges[name]
        if value is None:
            continue
        # The host reports a value it cannot convert but still calls validate_inputs with it.
        if not is_number(value):
            return f"{name} {value!r} is not a number."
        if not low <= value <= high:
            return f"{name} {value:g} is out of range: it must be between {low:g} and {high:g}."
    return None


def check_choices(values: dict, choices: dict) -> str | None:
    for name, value in values.items():
        options = choices[name]
        if value is not None and value not in options:
            return f"{name} {value!r} is not one of {', '.join(map(repr, options))}."
    return None


def check_window(start_percent, end_percent) -> str | None:
    if is_number(start_percent) and is_number(end_percent) and start_percent > end_percent:
        return f"start_percent {start_percent:g} is after end_percent {end_percent:g}: the patch would never be active."
    return None


def first_problem(*problems: str | None) -> str | None:
    return next((p for p in problems if p is not None), None)
