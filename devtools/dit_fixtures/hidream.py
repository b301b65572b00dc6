"""A tiny HiDream-I1: one double- and one single-stream block, 2 heads of 32, 2 routed experts;
T5 tokens and a 2-layer Llama stack of another length."""

from __future__ import annotations

import torch

from random_dits import CONTEXT_DIM, POOLED_DIM, TEXT_TOKENS, Fixture, Spec

LLAMA_TOKENS = 10  # the Llama sequence is not as long as the T5 one
_CONFIG = {"image_model": "hidream", "attention_head_dim": 32, "axes_dims_rope": [16, 8, 8],
           "caption_channels": [CONTEXT_DIM, CONTEXT_DIM], "max_resolution": [128, 128], "in_channels": 16,
           "llama_layers": [0, 1], "num_attention_heads": 2, "num_routed_experts": 2, "num_activated_experts": 1,
           "num_layers": 1, "num_single_layers": 1, "out_channels": 16, "patch_size": 2, "text_emb_dim": POOLED_DIM}


def _text(generator, batch, shape):
    return torch.randn(batch, TEXT_TOKENS, CONTEXT_DIM, generator=generator), {
        "pooled_output": torch.randn(batch, POOLED_DIM, generator=generator),
        "conditioning_llama3": torch.randn(batch, 2, LLAMA_TOKENS, CONTEXT_DIM, generator=generator)}


FIXTURES = {
    # the benchmark's: 2 double- and 4 single-stream blocks as Flux.1's, each with a Llama layer
    # (a block past the list would take the T5 tokens as its Llama ones)
    "hidream": Fixture(Spec("HiDream", 16, 8, False), _CONFIG, "HiDream", 2, "gg", (8, 6), text=_text,
                       deep={"num_layers": 2, "num_single_layers": 4, "llama_layers": [0, 1] * 3}),
}
