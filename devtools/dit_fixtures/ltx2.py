"""Tiny LTX-2 (``LTXAV``, ComfyUI 0.33): 2 audio-video blocks; 128-channel video latent, 32x
spatial and 8x temporal VAE, patch 1: 17 frames of 128x96 px are a 3x4x3 grid. The text comes
as the connectors' output (video and audio halves, ``caption_channels`` each), so extra_conds
passes it on as it is.

Three calls of the model: with the audio latent beside the video (a nested latent, as
LTXVConcatAVLatent makes it: 8 channels x 16 frequency bins a frame, 5 frames here), per block
the video self-attention, its text cross-attention, the audio self-attention and text
cross-attention, audio-to-video and video-to-audio; with the video alone, the first two; and
with one guide frame appended (LTXVAddGuide at strength 0.5: its keyframe positions and guide
attention entry in the conditioning), where each video self-attention is split into two masked
calls (the video's queries, the guide's) over the video and guide keys."""

from __future__ import annotations

import torch

import random_dits
from random_dits import Fixture, Spec

AUDIO_FRAMES = 5
GUIDE_STRENGTH = 0.5


def _text(generator, batch, shape):  # the connectors' output: video and audio halves, 32 wide each
    return random_dits.text_tokens(generator, batch, 12, 64), {}


def _with_audio(generator, shape):
    import comfy.nested_tensor

    return comfy.nested_tensor.NestedTensor((torch.zeros(shape), torch.zeros(shape[0], 8, AUDIO_FRAMES, 16)))


def _with_guide_frame(generator, shape):
    """The latent with one guide frame appended, as LTXVAddGuide leaves it."""
    return torch.zeros(*shape[:2], shape[2] + 1, *shape[3:])


def _guide_mask(latent):
    """The noise mask LTXVAddGuide gives: the video denoised, the guide frame kept at 1 - strength."""
    mask = torch.ones(latent.shape[0], 1, *latent.shape[2:])
    mask[:, :, -1:] = 1.0 - GUIDE_STRENGTH
    return mask


def _guide(generator, shape):
    """The guide's keyframe positions (pixel coordinates of its tokens, at latent frame 0) and
    its guide attention entry."""
    from comfy.ldm.lightricks.symmetric_patchifier import SymmetricPatchifier, latent_to_pixel_coords

    frame = torch.zeros(1, shape[1], 1, *shape[3:])
    _, coords = SymmetricPatchifier(1, start_end=True).patchify(frame)
    keyframes = latent_to_pixel_coords(coords, (8, 32, 32), causal_fix=True)
    entry = {"pre_filter_count": keyframes.shape[2], "strength": GUIDE_STRENGTH, "pixel_mask": None,
             "latent_shape": [1, *shape[3:]]}
    return {"keyframe_idxs": keyframes, "guide_attention_entries": [entry]}


_CONFIG = {"image_model": "ltxav", "num_layers": 2, "attention_head_dim": 32, "num_attention_heads": 2,
           "cross_attention_dim": 64, "caption_channels": 32, "in_channels": 128, "out_channels": 128,
           "audio_in_channels": 128, "audio_attention_head_dim": 16, "audio_num_attention_heads": 2,
           "audio_cross_attention_dim": 32, "connector_attention_head_dim": 16, "connector_num_attention_heads": 2,
           "connector_num_layers": 1}

FIXTURES = {
    "ltxav": Fixture(spec=Spec("LTXAV", 128, 32, True, 8), config=_CONFIG, family="LTX-2", blocks=2,
                     calls="g-----g-----", grid=(3, 4, 3), text=_text, latent=_with_audio),
}
FIXTURES["ltxav_video"] = FIXTURES["ltxav"]._replace(calls="g-g-", latent=None)
FIXTURES["ltxav_guide"] = FIXTURES["ltxav"]._replace(calls="gg-gg-", latent=_with_guide_frame, mask=_guide_mask,
                                                     shared=_guide)
