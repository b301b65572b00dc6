"""Where ComfyUI versions differ for this pack, in one place.

- The attention override (``transformer_options["optimized_attention_override"]``, every
  version since 0.3.6x): one slot that attention-backend and SageAttention-style nodes use too.
  We keep whatever was there and call it with our keys (our patch's ``previous``), so both act.
  0.33 adds ``ModelPatcher.set_model_optimized_attention`` and may hand attention functions
  ``AttentionTensorContainer`` objects: it unwraps them into tensors before calling an override
  that, like ours, declares no ``container_function``; setting the slot directly works in both.
"""

from __future__ import annotations

OVERRIDE = "optimized_attention_override"


def install_attention_override(patcher, patch) -> None:
    """Make ``patch.override`` the clone's attention override, chained to the one it replaces."""
    options = patcher.model_options.setdefault("transformer_options", {})
    patch.previous = options.get(OVERRIDE)
    options[OVERRIDE] = patch.override
