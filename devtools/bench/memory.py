"""Memory of a pass: the peak of the process or of the GPU, and the attention working set."""

from __future__ import annotations

import math
from pathlib import Path


class PeakMemory:
    """Peak memory of a measured pass: the CUDA allocator's peak (``max_memory_allocated``) on
    a GPU; on a CPU the peak resident set of this process above what it held before (Linux:
    VmHWM, reset through /proc/self/clear_refs), so the model's weights are not counted."""

    def __init__(self):
        import torch

        self.torch = torch
        self.cuda = torch.cuda.is_available()
        self.baseline = 0

    @staticmethod
    def _status_kib(field: str) -> int | None:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        except OSError:
            return None
        return None

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass
        self.baseline = self._status_kib("VmRSS") or 0

    def peak_mib(self) -> float | None:
        if self.cuda:
            return self.torch.cuda.max_memory_allocated() / 2**20
        peak = self._status_kib("VmHWM")
        return None if peak is None else max(0, peak - self.baseline) / 1024


# ComfyUI's attention functions (decorated with functools.wraps) by the names the benchmark uses.
BACKEND_OF_FUNCTION = {"attention_pytorch": "sdpa", "attention_sub_quad": "sub-quad", "attention_split": "split",
                       "attention_basic": "basic"}


class AttentionWorkingSet:
    """The largest working set of any attention call while attached: the bytes of its queries,
    keys and values plus the attention scores the backend holds at once (none for PyTorch's
    SDPA, whose fused kernels keep them in blocks; one query chunk x key chunk for the
    sub-quadratic and split backends, whose chunk sizes are derived from free memory the way
    ComfyUI 0.3.75 derives them; the whole matrix otherwise). One score buffer is counted:
    the softmax may hold a second one for a moment.

    Recorded through ComfyUI's ``transformer_options["optimized_attention_override"]`` hook,
    chained to the override already there (the benchmark's backend choice, or a user's)."""

    def __init__(self, backend: str | None = None):
        self.backend = backend  # None: the function ComfyUI would call decides
        self.peak_bytes = 0
        self.calls = 0

    @property
    def peak_mib(self) -> float | None:
        return self.peak_bytes / 2**20 if self.calls else None

    def attached(self, model):
        """A clone of ``model`` whose attention calls are recorded here."""
        clone = model.clone()
        options = clone.model_options.setdefault("transformer_options", {})
        previous = options.get("optimized_attention_override")

        def override(func, *args, **kwargs):
            self.note(func, args, kwargs)
            if previous is not None:
                return previous(func, *args, **kwargs)
            return func(*args, **kwargs)

        options["optimized_attention_override"] = override
        return clone

    def note(self, func, args: tuple, kwargs: dict) -> None:
        names = ("q", "k", "v", "heads", "mask", "attn_precision")
        given = {**dict(zip(names, args)), **{k: v for k, v in kwargs.items() if k in names}}
        q, k, v = given["q"], given["k"], given["v"]
        backend = self.backend or BACKEND_OF_FUNCTION.get(getattr(func, "__name__", ""), "basic")
        tensors = sum(t.numel() * t.element_size() for t in (q, k, v))
        scores = scores_bytes(backend, q, k, given["heads"], bool(kwargs.get("skip_reshape")),
                              given.get("attn_precision"))
        self.peak_bytes = max(self.peak_bytes, tensors + scores)
        self.calls += 1


def scores_bytes(backend: str, q, k, heads: int, skip_reshape: bool, attn_precision) -> int:
    """Bytes of the attention scores ``backend`` materialises at once for these queries and keys."""
    if backend == "sdpa":
        return 0
    import comfy.model_management as mm
    import torch
    from comfy.ldm.modules.attention import get_attn_precision

    if skip_reshape:  # (batch, heads, tokens, dim)
        batch_heads, q_tokens, k_tokens = q.shape[0] * q.shape[1], q.shape[2], k.shape[2]
    else:  # (batch, tokens, heads * dim)
        batch_heads, q_tokens, k_tokens = q.shape[0] * heads, q.shape[1], k.shape[1]
    upcast = get_attn_precision(attn_precision, q.dtype) == torch.float32
    element = 4 if upcast else q.element_size()
    if backend == "sub-quad":  # comfy.ldm.modules.attention.attention_sub_quad
        free, _ = mm.get_free_memory(q.device, True)
        query_chunk, kv_chunk = 512, None
        for x in (4096, 2048, 1024, 512, 256):
            if free / (batch_heads * element * x * 4.0) >= k_tokens:
                query_chunk, kv_chunk = x, k_tokens
                break
        kv_chunk = min(kv_chunk or int(math.sqrt(k_tokens)), k_tokens)
        return batch_heads * min(query_chunk, q_tokens) * kv_chunk * element
    if backend == "split":  # comfy.ldm.modules.attention.attention_split
        free = mm.get_free_memory(q.device)
        required = batch_heads * q_tokens * k_tokens * element * 3
        steps = 2 ** math.ceil(math.log(required / free, 2)) if required > free else 1
        rows = q_tokens // steps if q_tokens % steps == 0 else q_tokens
        return batch_heads * rows * k_tokens * element
    return batch_heads * q_tokens * k_tokens * element
