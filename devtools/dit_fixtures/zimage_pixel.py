"""A tiny Z-Image pixel space (NextDiTPixelSpace): Z-Image's tiny config on 16x16 px RGB patches,
with a one-block decoder."""

from __future__ import annotations

import torch

from random_dits import CONTEXT_DIM, TEXT_TOKENS, Fixture, Spec, text_tokens

# dim >= 256: the modulation feeds a 256-wide time embedding to Linear(min(dim, 256), ...).
_CONFIG = {"image_model": "zimage_pixel", "patch_size": 16, "in_channels": 3, "dim": 256, "cap_feat_dim": CONTEXT_DIM,
           "n_layers": 1, "n_refiner_layers": 1, "qk_norm": True, "n_heads": 2, "n_kv_heads": 2,
           "axes_dims": [32, 48, 48], "axes_lens": [1536, 512, 512], "rope_theta": 256.0,
           "ffn_dim_multiplier": 8.0 / 3.0, "z_image_modulation": True, "time_scale": 1000.0,
           "pad_tokens_multiple": 32, "decoder_in_channels": 16 * 16 * 3, "decoder_hidden_size": 32,
           "decoder_num_res_blocks": 1, "decoder_max_freqs": 4}


def _text(generator, batch, shape):
    return text_tokens(generator, batch), {"attention_mask": torch.ones(batch, TEXT_TOKENS, dtype=torch.long)}


FIXTURES = {
    # caption refiner (left alone), noise refiner (image only), joint layer; 128x96 px -> 8x6 patches
    "zimage_pixel": Fixture(Spec("ZImagePixelSpace", 3, 1, False), _CONFIG, "Z-Image pixel space", 2, "-gg", (8, 6),
                            text=_text),
}
