"""A method's declared inputs (``tokenreduce.methods``) as ComfyUI sees them: V3 schema
inputs, and the ``validate_inputs`` that checks them when a prompt is queued. Inputs declared
``advanced`` are marked so where the host can fold them (``host.supports_advanced_inputs``).

ComfyUI checks min/max itself only for the inputs a node's ``validate_inputs`` does not take,
and this ComfyUI does not check V3 combo values at all: the generated ``validate_inputs``
takes every input the method checks itself (all but ``host_checked`` ones), so each is
checked once, with a message that names it. Values that are links arrive as None then;
execution checks them again.
"""

from __future__ import annotations

import inspect

from comfy_api.latest import io

from ..tokenreduce.inputs import BOOL, CHOICE, FLOAT, INT, SEED, Input, Method
from .host import supports_advanced_inputs


def v3_input(spec: Input):
    flags = {"optional": True} if spec.optional else {}
    if spec.advanced and supports_advanced_inputs():  # elsewhere the input shows as it always did
        flags["advanced"] = True
    if spec.kind == FLOAT:
        return io.Float.Input(spec.name, default=spec.default, min=spec.low, max=spec.high, step=spec.step,
                              tooltip=spec.tooltip, **flags)
    if spec.kind == INT:
        return io.Int.Input(spec.name, default=spec.default, min=spec.low, max=spec.high, tooltip=spec.tooltip,
                            **flags)
    if spec.kind == SEED:
        # The frontend gives every INT input named "seed" a "control after generate" widget
        # (saved in workflows after the seed); declared so that the API says so too. Our
        # extension sets it to "fixed" on new nodes: a merge seed must not change per run.
        return io.Int.Input(spec.name, default=spec.default, min=spec.low, max=spec.high,
                            control_after_generate=True, tooltip=spec.tooltip, **flags)
    if spec.kind == BOOL:
        return io.Boolean.Input(spec.name, default=spec.default, tooltip=spec.tooltip, **flags)
    if spec.kind == CHOICE:
        return io.Combo.Input(spec.name, options=list(spec.options), default=spec.default, tooltip=spec.tooltip,
                              **flags)
    raise ValueError(f"unknown input kind {spec.kind!r}")


def v3_inputs(method: Method) -> list:
    return [v3_input(spec) for spec in method.inputs]


def validate_inputs_for(method: Method):
    """The node's ``validate_inputs`` classmethod: takes exactly the inputs the method checks."""

    def validate_inputs(cls, **values) -> bool | str:
        problem = method.problem(values)
        return True if problem is None else problem

    checked = [spec.name for spec in method.inputs if not spec.host_checked]
    validate_inputs.__signature__ = inspect.Signature(
        [inspect.Parameter("cls", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None) for name in checked])
    return classmethod(validate_inputs)
