"""ToDo inside the transformer blocks of a UNet: self-attention keeps every query and sees keys
and values pooled on the block's grid.

``attn1_patch`` (ComfyUI, and the WebUI's Forge, call it the same way) receives the normed block
input before projection as queries, keys and values alike; returning shorter keys/values makes
the attention read fewer tokens, which every attention backend supports (it is what
cross-attention does). Nothing to unmerge.
"""

from __future__ import annotations

from .describe import level_text
from .downsample import downsample_tokens
from .grid import grid_at
from .layout import unet_call_grid
from .measure import UNetLevels
from .pays import AutoRule
from .run import CallPatch, call_context, note_reduced, note_skipped


class ToDoPatch(CallPatch):
    """The patch function of one ToDo node output on a UNet."""

    def __init__(self, factors: dict, method: str, context_key: str, label: str, unet: UNetLevels,
                 rule: AutoRule | None = None):
        super().__init__(context_key, label, rule)
        self.factors = factors  # level -> pooling factor per side (> 1)
        self.method = method
        self.unet = unet

    def prepare_call(self, context: dict, run, call) -> None:
        if not context["active"]:
            return
        levels = [level for level in self.factors if level in self.unet.first]  # others have no blocks (said)
        context["left"] = self.left_alone(context, run, call, levels, lambda level: self._pays(run, call, level))

    def call_key(self, call) -> tuple:
        return self.unet.call_key(call)

    def _pays(self, run, call, level: int) -> bool:
        grid = grid_at(tuple(call.x.shape[-2:]), level)
        kind = self.unet.kind(call, level, grid, ("ToDo", self.factors[level], self.method))
        return self.pays(run, call.x.device, kind, lambda: (
            level_text(level, grid), self.unet.work(call, level, grid, self.context_key, self._measuring_context)),
            lambda: self.unet.fingerprint(call, level))

    @staticmethod
    def _measuring_context() -> dict:
        return call_context(True, left=frozenset())

    def attn1(self, n, context, value, extra_options):
        call = self.call_context(extra_options)
        if call is None or not call["active"]:
            return n, context, value
        located = unet_call_grid(extra_options)
        if located is None:
            return n, context, value
        (h, w), level = located
        factor = self.factors.get(level)
        if factor is None or level in call["left"]:
            return n, context, value
        if context.shape[1] != h * w or value.shape[1] != h * w:
            note_skipped(call)  # another patch changed the keys/values; reported at run end
            return n, context, value
        keys = downsample_tokens(context, h, w, factor, self.method)
        values = keys if value is context else downsample_tokens(value, h, w, factor, self.method)
        note_reduced(call, (h, w), level, lambda: {"q": (n.shape[1], n.shape[1]), "k/v": (h * w, keys.shape[1])})
        return n, keys, values
