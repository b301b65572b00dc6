"""A function's own code run with some of its global names bound to other values: the way the
hosts reach an attention call that a model's code makes by a module-level name (Forge's Flux
blocks' ``attention``, diffusers processors' ``dispatch_attention_fn`` and
``F.scaled_dot_product_attention``) without changing the module, the class or the code."""

from __future__ import annotations

import types
from typing import Callable


def rebuilt(func: Callable, **names) -> types.FunctionType:
    """``func`` (a plain function) rebuilt over a copy of its globals in which each of ``names``
    is the value given: the same code object, defaults, closure and names; nothing global changed."""
    function = types.FunctionType(func.__code__, {**func.__globals__, **names}, func.__name__, func.__defaults__,
                                  func.__closure__)
    function.__kwdefaults__ = func.__kwdefaults__
    function.__qualname__ = func.__qualname__
    return function
