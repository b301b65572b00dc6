"""A tiny OmniGen2: one refiner of each kind and one joint layer, 2 query heads sharing 1 key/value
head (grouped, as the real 21 / 7), text to image without reference images."""

from __future__ import annotations

import torch

from random_dits import CONTEXT_DIM, TEXT_TOKENS, Fixture, Spec

_CONFIG = {"image_model": "omnigen2", "axes_dim_rope": [8, 12, 12], "axes_lens": [300, 512, 512],
           "ffn_dim_multiplier": None, "hidden_size": 64, "in_channels": 16, "multiple_of": 16, "norm_eps": 1e-5,
           "num_attention_heads": 2, "num_kv_heads": 1, "num_layers": 1, "num_refiner_layers": 1,
           "out_channels": None, "patch_size": 2, "text_feat_dim": CONTEXT_DIM, "timestep_scale": 1000.0}


def _text(generator, batch, shape):
    return torch.randn(batch, TEXT_TOKENS, CONTEXT_DIM, generator=generator), {
        "attention_mask": torch.ones(batch, TEXT_TOKENS, dtype=torch.long)}


FIXTURES = {
    # context refiner (left alone), noise refiner (image only), joint layer
    "omnigen2": Fixture(Spec("Omnigen2", 16, 8, False), _CONFIG, "OmniGen2", 2, "-gg", (8, 6), text=_text),
}

_BOOGU = {"image_model": "boogu", "axes_dim_rope": [8, 12, 12], "axes_lens": [300, 512, 512],
          "ffn_dim_multiplier": None, "hidden_size": 64, "in_channels": 16, "multiple_of": 16, "norm_eps": 1e-5,
          "num_attention_heads": 2, "num_kv_heads": 1, "num_layers": 0, "num_double_stream_layers": 1,
          "num_refiner_layers": 1, "out_channels": None, "patch_size": 2, "instruction_feat_dim": CONTEXT_DIM,
          "timestep_scale": 1000.0}

# context refiner (left alone), noise refiner (image only), dual-stream joint + image-only; no
# single-stream layer (OmniGen2's, tested above), so the model has the 2 blocks the test expects
FIXTURES["boogu"] = Fixture(Spec("Boogu", 16, 8, False), _BOOGU, "Boogu-Image", 2, "-ggg", (8, 6), text=_text)
