"""Tiny Wan variants built on the Wan 2.1 layout: Fun Control, the camera models, VACE and S2V, each
with the conditioning its ComfyUI node gives (control latents, camera embeddings, VACE frames
and mask)."""

from __future__ import annotations

import torch

import random_dits
from random_dits import Fixture, Spec

# The tiny Wan of random_dits (dim 64, 2 heads, 2 blocks); a copy: random_dits defines its own
# after collecting the fixtures.
_WAN = {"image_model": "wan2.1", "dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 2, "patch_size": (1, 2, 2),
        "freq_dim": 256, "text_dim": 64, "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}
_GRID = (3, 8, 6)  # 9 frames of 128x96 px: 3 latent frames of 16x12, patch 2
_FAMILY = "Wan 2.1 / 2.2"


def _text(generator, batch, shape):
    return torch.randn(batch, random_dits.WAN_TEXT_TOKENS, _WAN["text_dim"], generator=generator), {}


def _clip(generator, shape) -> dict:
    """CLIPVisionEncode's output as the i2v-style nodes pass it (Wan 2.1 models with img_emb)."""
    states = torch.randn(shape[0], random_dits.WAN_CLIP_TOKENS, 1280, generator=generator)
    return {"clip_vision_output": random_dits._clip_vision_output(penultimate_hidden_states=states)}


def _start_image(generator, shape, channels: int = 16) -> dict:
    """concat_latent_image and concat_mask as WanCameraImageToVideo stores them: a start image
    in frame 0, the rest zeros, masked so frame 0 is kept."""
    image = torch.zeros([shape[0], channels] + shape[2:])
    image[:, :, :1] = torch.randn([shape[0], channels, 1] + shape[3:], generator=generator)
    mask = torch.ones([1, 1] + shape[2:])
    mask[:, :, :1] = 0.0
    return {"concat_latent_image": image, "concat_mask": mask}


def _camera(generator, shape) -> dict:
    """WanCameraEmbedding's output: 24 Plücker channels (6 x 4 frames folded) per latent frame,
    at pixel size."""
    return {"camera_conditions": torch.randn([1, 24, shape[2], shape[3] * 8, shape[4] * 8], generator=generator)}


def _fun_control(generator, shape) -> dict:
    # WanFunControlToVideo: the control video's latent and the start image's (16 + 16 channels).
    return {"concat_latent_image": torch.randn([shape[0], 32] + shape[2:], generator=generator), **_clip(generator, shape)}


def _vace(generator, shape) -> dict:
    # WanVaceToVideo: one stream of inactive and reactive frame latents (16 + 16 channels) and
    # the mask folded 8x8 into 64 channels, all at the latent's size.
    frames = torch.randn([shape[0], 32] + shape[2:], generator=generator)
    mask = (torch.rand([shape[0], 64] + shape[2:], generator=generator) > 0.5).float()
    return {"vace_frames": [frames], "vace_mask": [mask], "vace_strength": [1.0]}


def _animate(generator, shape) -> dict:
    # WanAnimateToVideo: the reference image as frame 0 of the concat latent, the pose video's
    # latent for the frames after it, CLIP vision of the reference.
    pose = torch.randn([shape[0], 16, shape[2] - 1] + shape[3:], generator=generator)
    return {**_start_image(generator, shape), "pose_video_latent": pose, **_clip(generator, shape)}


def _humo_text(generator, batch, shape):
    # WanHuMoImageToVideo: audio windows [B, latent frames, 8, 5, 1280] (the negative's are zeros)
    context, _ = _text(generator, batch, shape)
    return context, {"audio_embed": torch.randn([1, shape[2], 8, 5, 1280], generator=generator)}


def _humo_reference(generator, shape) -> dict:
    # WanHuMoImageToVideo: the reference image's latent, one frame at the video's size.
    return {"reference_latents": [torch.randn([1, 16, 1] + shape[3:], generator=generator)]}


def _scail(generator, shape) -> dict:
    # WanSCAILToVideo: one reference image's latent (a frame before the video), the pose video's
    # latent at half the size, CLIP vision of the reference.
    reference = torch.randn([1, 16, 1] + shape[3:], generator=generator)
    pose = torch.randn([shape[0], 16, shape[2], shape[3] // 2, shape[4] // 2], generator=generator)
    return {"reference_latents": [reference], "pose_video_latent": pose, **_clip(generator, shape)}


def _scail2(generator, shape) -> dict:
    # SCAIL-2 in replacement mode: the 28-channel identity masks of the pose frames (at the pose's
    # size) and of the reference frame followed by zeros over the video frames.
    masks = {"driving_mask_28ch": (torch.rand([1, shape[2], 28, shape[3] // 2, shape[4] // 2],
                                              generator=generator) > 0.5).float(),
             "ref_mask_28ch": torch.cat([(torch.rand([1, 1, 28] + shape[3:], generator=generator) > 0.5).float(),
                                         torch.zeros([1, shape[2], 28] + shape[3:])], dim=1),
             "ref_mask_flag": False}
    return {**_scail(generator, shape), **masks}


def _dancer(generator, shape) -> dict:
    # WanDancerToVideo: a start image, CLIP vision of it and of the reference image, and the
    # music features [1, audio frames, 35] the WanDancer audio encoder node gives.
    reference = random_dits._clip_vision_output(
        penultimate_hidden_states=torch.randn(shape[0], random_dits.WAN_CLIP_TOKENS, 1280, generator=generator))
    return {**_start_image(generator, shape), **_clip(generator, shape), "clip_vision_output_ref": reference,
            "audio_embed": torch.randn([1, 4 * shape[2], 35], generator=generator)}


def _s2v(generator, shape) -> dict:
    # WanSoundImageToVideo: the audio encoder's 25 layers of 1024 features at 4 per latent frame
    # [B, 25, 1024, 4 T], a reference image's latent (one frame), the last 19 latent frames of a
    # motion video (packed by the model into 1 + 2 + 16 frames at 1x, 2x and 4x its patch), the
    # control video's latent.
    return {"audio_embed": torch.randn([1, 25, 1024, 4 * shape[2]], generator=generator),
            "reference_latents": [torch.randn([1, 16, 1] + shape[3:], generator=generator)],
            "reference_motion": torch.randn([1, 16, 19] + shape[3:], generator=generator),
            "control_video": torch.randn([1, 16] + shape[2:], generator=generator)}


FIXTURES = {
    # S2V: self-attention over [video, reference frame, packed motion tokens]; its audio
    # injector's per-frame cross-attention is called without transformer_options (never counted).
    "wan22_s2v": Fixture(
        Spec("WAN22_S2V", 16, 8, True, 4), {**_WAN, "model_type": "s2v", "in_dim": 16, "out_dim": 16},
        "Wan S2V", 2, "g-g-", _GRID, text=_text, shared=_s2v),
    # FlowRVS: a t2v Wan whose sampling starts from the input video's latent and takes the model's
    # output as the result; an empty latent would give identical tokens everywhere.
    "wan21_flow_rvs": Fixture(
        Spec("WAN21_FlowRVS", 16, 8, True, 4), {**_WAN, "model_type": "flow_rvs", "in_dim": 16, "out_dim": 16},
        _FAMILY, 2, "g-g-", _GRID, text=_text, latent=lambda g, shape: torch.randn(shape, generator=g)),
    # SCAIL: self-attention over [reference frame, video, pose frames at half size]; i2v blocks.
    "wan21_scail": Fixture(
        Spec("WAN21_SCAIL", 16, 8, True, 4), {**_WAN, "model_type": "scail", "in_dim": 20, "out_dim": 16},
        "Wan SCAIL", 2, "g--g--", _GRID, text=_text, shared=_scail),
    "wan21_scail2": Fixture(
        Spec("WAN21_SCAIL2", 16, 8, True, 4), {**_WAN, "model_type": "scail2", "in_dim": 20, "out_dim": 16},
        "Wan SCAIL", 2, "g--g--", _GRID, text=_text, shared=_scail2),
    # WanDancer: patch 1, so a frame's tokens split evenly over the 8 music windows per latent
    # frame its injector attends from (a real 480p frame has 1560 tokens).
    "wan22_wandancer": Fixture(
        Spec("WAN22_WanDancer", 16, 8, True, 4),
        {**_WAN, "model_type": "wandancer", "in_dim": 36, "out_dim": 16, "patch_size": (1, 1, 1),
         "audio_inject_layers": [0, 1], "music_dim": 32, "music_heads": 2, "music_latent_dim": 32},
        _FAMILY, 2, "g--g--", (3, 16, 12), text=_text, shared=_dancer),
    "wan21_fun_control": Fixture(
        Spec("WAN21_FunControl2V", 16, 8, True, 4), {**_WAN, "model_type": "i2v", "in_dim": 48, "out_dim": 16},
        _FAMILY, 2, "g--g--", _GRID, text=_text, shared=_fun_control),
    "wan21_camera": Fixture(  # img_emb: cross-attention to CLIP-vision tokens too
        Spec("WAN21_Camera", 16, 8, True, 4), {**_WAN, "model_type": "camera", "in_dim": 32, "out_dim": 16},
        _FAMILY, 2, "g--g--", _GRID, text=_text,
        shared=lambda g, shape: {**_start_image(g, shape), **_camera(g, shape), **_clip(g, shape)}),
    "wan22_camera": Fixture(
        Spec("WAN22_Camera", 16, 8, True, 4), {**_WAN, "model_type": "camera_2.2", "in_dim": 36, "out_dim": 16},
        _FAMILY, 2, "g-g-", _GRID, text=_text, shared=lambda g, shape: {**_start_image(g, shape), **_camera(g, shape)}),
    # Block 0: self, cross, then VACE block 0 on the hint stream (its self, its cross); block 1.
    "wan21_vace": Fixture(
        Spec("WAN21_Vace", 16, 8, True, 4),
        {**_WAN, "model_type": "vace", "in_dim": 16, "out_dim": 16, "vace_layers": 1, "vace_in_dim": 96},
        "Wan VACE", 2, "g-g-g-", _GRID, text=_text, shared=_vace),
    # Animate: i2v blocks; pose latents added to the video tokens (the face video is left out: its
    # 512 px motion encoder is large, and the face adapter's attention never reaches the override).
    "wan22_animate": Fixture(
        Spec("WAN22_Animate", 16, 8, True, 4), {**_WAN, "model_type": "animate", "in_dim": 36, "out_dim": 16},
        # Its first latent frame is the reference image, kept out of the grid (before it).
        _FAMILY, 2, "g--g--", (_GRID[0] - 1, *_GRID[1:]), text=_text, shared=_animate),
    # HuMo 1.7B: self over [video, reference frame], text cross, audio cross (per frame).
    "wan21_humo": Fixture(
        Spec("WAN21_HuMo", 16, 8, True, 4), {**_WAN, "model_type": "humo", "in_dim": 16, "out_dim": 16},
        "Wan HuMo", 2, "g--g--", _GRID, text=_humo_text, shared=_humo_reference),
}
