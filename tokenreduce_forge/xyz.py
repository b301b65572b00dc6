"""Axes of the WebUI's X/Y/Z plot: ToMe ratio and ToDo factor of the first pass (and of the
hires pass where it uses the first pass's settings).

Registered when the script loads, the way the built-in ControlNet does it: the X/Y/Z plot
script is found among the loaded scripts by its module name ("xyz_grid.py"). An axis sets the
value on the cell's processing object; ``settings.job_from_args`` applies it."""

from __future__ import annotations

from .hooks import XYZ
from .settings import METHODS, PREFIX, input_arg

AXES = (("ToMe", "ratio"), ("ToDo", "factor"))


def axis_label(method: str, name: str) -> str:
    return f"[{PREFIX}] {input_arg('first', method, name)}"


def apply_value(method: str, name: str):
    def apply(p, value, values):
        # A new dict on the cell's copy of the processing object (the grid's own is never changed).
        setattr(p, XYZ, {**(getattr(p, XYZ, None) or {}), (method, name): value})

    return apply


def confirm_values(method: str, name: str):
    (spec,) = [s for s in METHODS[method].inputs if s.name == name]

    def confirm(p, values):
        for value in values:
            problem = spec.problem(value)
            if problem is not None:
                raise RuntimeError(f"{axis_label(method, name)}: {problem}")

    return confirm


def _xyz_module():
    from modules import scripts

    for data in scripts.scripts_data:
        if data.script_class.__module__ in ("xyz_grid.py", "xy_grid.py") and hasattr(data, "module"):
            return data.module
    return None


def register() -> bool:
    """Add the axes (again, after a UI reload); whether the X/Y/Z plot script was found."""
    module = _xyz_module()
    if module is None:
        return False
    labels = {axis_label(m, n) for m, n in AXES}
    module.axis_options[:] = [option for option in module.axis_options if option.label not in labels]
    for method, name in AXES:
        module.axis_options.append(module.AxisOption(axis_label(method, name), float, apply_value(method, name),
                                                     confirm=confirm_values(method, name)))
    return True
