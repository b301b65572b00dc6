"""ToDo inside ComfyUI's transformer blocks: self-attention keeps every query and sees keys and
values pooled on the block's grid.

``attn1_patch`` receives the normed block input before projection as queries, keys and values
alike; returning shorter keys/values makes the attention read fewer tokens, which every
ComfyUI attention backend supports (it is what cross-attention does). Nothing to unmerge.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..tokenreduce import downsample_tokens
from .blocks import block_level
from .session import SessionPatch


@dataclass(frozen=True)
class ToDoSettings:
    factors: dict  # downsample level -> pooling factor per side (> 1)
    method: str


class ToDoPatch(SessionPatch):
    """The patch function of one ToDo node output."""

    def attn1(self, n, context, value, extra_options):
        run = self.session.current()
        if run is None:
            return n, context, value
        level = block_level(extra_options)
        if level is None:
            return n, context, value
        (h, w), downsample = level
        factor = self.settings.factors.get(downsample)
        if factor is None or not run.in_window(extra_options):
            return n, context, value
        if context.shape[1] != h * w or value.shape[1] != h * w:
            run.skipped_calls += 1  # another patch changed the keys/values; reported at run end
            return n, context, value
        keys = downsample_tokens(context, h, w, factor, self.settings.method)
        values = keys if value is context else downsample_tokens(value, h, w, factor, self.settings.method)
        run.record((h, w), downsample, lambda: {"q": (n.shape[1], n.shape[1]), "k/v": (h * w, keys.shape[1])})
        return n, keys, values
