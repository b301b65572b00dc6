"""Which model's weights a unit runs with, as a short stable string: the quality budget's key.

The change reducing makes is a property of the weights (the same reduction changes a trained
model's block a hundredfold more than a random one's, a fine-tune's or a LoRA's more or less than
its base's), so the auto rule keeps it per model (``pays.Decisions.decide``'s ``model``), while
speed stays keyed by shape. What identifies the weights here: a strided sample of ``SAMPLES``
values of each parameter of the unit measured (names, shapes and dtypes included), hashed. Read
once per run and kind, where the rule decides, never in a block call: a few hundred small reads.
Stable across restarts and devices (the values, not ids or addresses), the same whether a weight
sits on the CPU (offloaded) or the GPU.

Where the host patches weights on the fly (ComfyUI's LoRA patches applied in the forward under
lowvram; Forge's online LoRAs) the live module does not show what the block computes with; each
host's adapter says it (``ModelCall.fingerprint``: the base weights and the patches of the block's
keys with their strengths), handing ``fingerprint`` the parts. Host-free: imports only torch.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch

SAMPLES = 64  # values read from each tensor (strided over all of it)
ITEMS = 32  # at most this many items of a list or tuple of patches are described (strengths, tensors)


def sampled(tensor: torch.Tensor, count: int = SAMPLES) -> tuple:
    """``count`` values spread evenly over ``tensor`` (its storage as it is: a quantized weight's
    raw values), as floats; its shape and dtype with them."""
    head = (tuple(int(s) for s in tensor.shape), str(tensor.dtype))
    try:
        flat = tensor.detach().reshape(-1)
        n = flat.numel()
        if n == 0:
            return head
        index = torch.linspace(0, n - 1, min(count, n), device=flat.device).long()
        try:
            values = flat[index].float()
        except (RuntimeError, TypeError, NotImplementedError):  # a dtype indexing or casting cannot take
            values = flat.view(torch.uint8)[index].float()
        return (*head, tuple(values.cpu().tolist()))
    except Exception:  # noqa: BLE001 - a tensor that cannot be read (meta, an exotic subclass): its shape must do
        return (*head, "unread")


def described(value, depth: int = 0):
    """A hashable, stable description of a patch's value: tensors sampled, numbers and strings as
    they are, lists and tuples item by item, a weight adapter by its type and weights, a function by
    its name; anything else by its type (no ids, no addresses)."""
    if isinstance(value, torch.Tensor):
        return sampled(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > 6:
        return type(value).__name__
    if isinstance(value, dict):
        return tuple((str(k), described(v, depth + 1)) for k, v in sorted(value.items(), key=lambda kv: str(kv[0])))
    if isinstance(value, (list, tuple)):
        return (len(value), tuple(described(v, depth + 1) for v in value[:ITEMS]))
    weights = getattr(value, "weights", None)  # ComfyUI's weight adapters (LoRA, LoHa, ...)
    if weights is not None:
        return (type(value).__name__, described(weights, depth + 1))
    if callable(value):
        return getattr(value, "__qualname__", type(value).__name__)
    return type(value).__name__


def fingerprint(parts: Iterable) -> str:
    """The string the decisions file keeps a model's change under, from the described ``parts``."""
    digest = hashlib.sha256(repr(tuple(described(part) for part in parts)).encode("utf-8"))
    return f"w{digest.hexdigest()[:20]}"


def module_fingerprint(module: torch.nn.Module) -> str:
    """The weights of ``module`` as it holds them now (every parameter, by name; buffers are left
    out: some are caches of a size's positions, not weights)."""
    return fingerprint(module.named_parameters())
