"""Tiny MiniMax-H3 (ComfyUI 0.33): 2 blocks of self-attention over [text | audio | video] and a
1-block text refiner (run once per sampling in extra_conds, outside the model calls); 24-channel
latent, 16x spatial and 4x temporal VAE, patch (1, 2, 2): 9 frames of 128x96 px are a 3x4x3 grid,
with the stereo audio latent (15 frames, 30 tokens) that EmptyMiniMaxH3LatentAV gives beside it.

The model takes one batch item per call and never batches cond with uncond (each conditioning's
payload has its own packed layout), so one CFG step makes two model calls of these ``calls``
(tests/test_comfy_dit_inprocess.py: SEPARATE_CFG)."""

from __future__ import annotations

import torch

import random_dits
from random_dits import Fixture, Spec

TEXT = 12  # Qwen3-VL hidden states (5120 wide; 32 here)
AUDIO_FRAMES = 15  # the latent format's round((1 + 4 + 4) * 5 / 3) for 3 latent frames


def _text(generator, batch, shape):
    return random_dits.text_tokens(generator, batch, TEXT, 32), {}


def _first_frame(generator, shape) -> dict:
    """MiniMaxH3ImageToVideo's first keyframe: one latent frame packed as cond rows between the
    text and the audio."""
    frame = torch.randn([1, 24, 1, *shape[3:]], generator=generator)
    return {"minimax_keyframes": [{"resolved_frame_index": 0, "latent": frame}]}


def _latent(generator, shape):
    """The nested video + audio latent the sampler gets (as MiniMaxH3AV.fix_empty_latent makes it)."""
    import comfy.nested_tensor

    return comfy.nested_tensor.NestedTensor((torch.zeros(shape), torch.zeros(shape[0], 32, 2, AUDIO_FRAMES)))


FIXTURES = {
    "minimax_h3": Fixture(
        spec=Spec("MiniMaxH3", 24, 16, True, 4),
        # rope: 3 axes x 4 frequencies, rotating 24 of each head's 32 channels
        config={"image_model": "minimax_h3", "hidden_size": 64, "num_layers": 2, "token_refiner_num_layers": 1,
                "num_attention_heads": 2, "attention_head_dim": 32, "ffn_hidden_size": 64, "latents_dim": 24,
                "audio_latents_dim": 32, "text_dim": 32, "timestep_input_dim": 32, "time_embed_hidden_size": 32,
                "time_embed_dim": 32, "rope_inv_freq_len": 4},
        family="MiniMax-H3", blocks=2, calls="gg", grid=(3, 4, 3), text=_text, latent=_latent),
}
FIXTURES["minimax_h3_keyframe"] = FIXTURES["minimax_h3"]._replace(shared=_first_frame)
