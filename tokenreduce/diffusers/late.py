"""The quality budget's late rehearsal on diffusers' DiTs (issue #51), for ToDo's and ToMe's
per-block budgets (``todo_blocks.py``, ``tome_blocks.py``), as ``late_blocks.py`` is ComfyUI's.

diffusers has no block-replace seam, so a model call is rehearsed by the model's own forward (below
the hooks on the model, on copies of its lists and dicts), with forward hooks on the measured blocks:

1. ``late_call``: the call run whole for its flow velocity, and its latent moved by one Euler step
   to the noise level ``late`` (``x + (late - sigma) * v``: the prediction noised again with the
   call's own noise, as ``window.late_latent`` computes it from the prediction of the clean
   latent), with the timestep of that level; a call at or below ``late`` is its own input;
2. ``measure_blocks``: that call run once more, each measured block's output handed on whole and
   the block run again on a copy of its input by ``measure`` (reduced each way the budget asks), so
   every block is measured on the input the unreduced model hands it, in one call.

Every family the adapter knows is a flow model whose timestep is the sigma times its
``timestep_scale`` (``families.DiffusersFamily.late_input``: not Lumina 2's).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..late_blocks import NotRehearsed, reached
from ..measure import copied_containers


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


def snapshot(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A block's inputs as they are now: containers copied, tensors cloned (the block may change
    them in place before the measurement reads them)."""
    again, named = copied_containers((args, kwargs))
    fresh = lambda value: value.clone() if torch.is_tensor(value) else value  # noqa: E731
    return tuple(map(fresh, again)), {name: fresh(value) for name, value in named.items()}


def _replaced(args: tuple, kwargs: dict, positions: dict, **values) -> tuple[tuple, dict]:
    """The call's arguments with ``values`` in place of the named ones (by position or keyword;
    ``positions``: the forward's argument name -> its place)."""
    args, kwargs = list(args), dict(kwargs)
    for name, value in values.items():
        position = positions.get(name)
        if position is not None and position < len(args):
            args[position] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs


def late_call(model: torch.nn.Module, arguments, scale: float, late: float,
              whole: Callable[[Callable[[], object]], object]) -> tuple[tuple, dict]:
    """The (args, kwargs) of the model call ``arguments`` (a ``hooks.argument_reader`` reading,
    its ``inputs`` the call's own) moved to the noise level ``late``; ``whole(run)`` runs the
    model's forward with nothing reduced. Raises NotRehearsed where the call cannot be moved."""
    args, kwargs = arguments.inputs
    x, t = arguments("hidden_states"), arguments("timestep")
    if not torch.is_tensor(x) or t is None:
        raise NotRehearsed("the model call has no latent and timestep to move to a later step")
    t = torch.as_tensor(t, device=x.device)
    sigma = t.float().reshape(-1) / scale
    if sigma.numel() not in (1, x.shape[0]):  # a timestep per token (Wan 2.2 TI2V's): no one level to move
        raise NotRehearsed("the call's timestep is not one per sample")
    if not bool((sigma > late).all()):  # one read, while measuring: the call is as late already
        return copied_containers((args, kwargs))
    again, named = copied_containers((args, kwargs))
    velocity = _prediction(whole(lambda: model.forward(*again, **named)))
    if velocity is None or velocity.shape != x.shape:
        raise NotRehearsed("the model's prediction is not of its latent's shape")
    step = (late - sigma).reshape((-1,) + (1,) * (x.ndim - 1))  # one row, or one a sample
    x_late = (x.float() + step * velocity.float()).to(x.dtype)
    again, named = copied_containers((args, kwargs))
    positions = {name: place for place, name in enumerate(arguments.names)}
    return _replaced(again, named, positions, hidden_states=x_late, timestep=t.new_full(t.shape, late * scale))


def measure_blocks(model: torch.nn.Module, blocks: dict, call: tuple[tuple, dict],
                   whole: Callable[[Callable[[], object]], object],
                   measure: Callable[[object, tuple, object], object]) -> dict:
    """{key: what ``measure(key, inputs, output)`` found} for ``blocks`` ({key: block module}),
    each measured in one run of the model's forward on ``call`` (its (args, kwargs)) with nothing
    reduced (``whole``): ``inputs`` the block's (args, kwargs) as the model handed them, ``output``
    its whole output, which the model goes on with. Raises NotRehearsed where a block was not
    reached."""
    found, held, handles, inside = {}, {}, [], []  # inside: a measured side runs (its own hooks pass)

    def keep(key):
        def before(module, args, kwargs):
            if not inside:
                held[key] = snapshot(args, kwargs)
        return before

    def read(key):
        def after(module, args, kwargs, output):
            if inside:
                return
            inside.append(key)
            try:
                found[key] = measure(key, held.pop(key), output)
            finally:
                inside.clear()
        return after

    try:
        for key, block in blocks.items():
            handles.append(block.register_forward_pre_hook(keep(key), with_kwargs=True))
            handles.append(block.register_forward_hook(read(key), with_kwargs=True))
        again, named = call
        whole(lambda: model.forward(*again, **named))
    finally:
        for handle in handles:
            handle.remove()
    return reached(blocks, found)
