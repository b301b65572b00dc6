"""Tiny Cosmos Predict2 (text to image, image to video) and Anima: 2 blocks of self-attention
(latent grid) and cross-attention (text); 16-channel Wan 2.1 latent, patch (1, 2, 2)."""

from __future__ import annotations

import torch

import random_dits
from random_dits import Fixture, Spec

_PREDICT2 = {"image_model": "cosmos_predict2", "max_img_h": 240, "max_img_w": 240, "max_frames": 128,
             "out_channels": 16, "patch_spatial": 2, "patch_temporal": 1, "model_channels": 64, "num_heads": 2,
             "num_blocks": 2, "concat_padding_mask": True, "crossattn_emb_channels": 32, "pos_emb_cls": "rope3d",
             "pos_emb_learnable": True, "pos_emb_interpolation": "crop", "min_fps": 1, "max_fps": 30,
             "use_adaln_lora": True, "adaln_lora_dim": 16, "extra_per_block_abs_pos_emb": False}


_V1 = {"image_model": "cosmos", "max_img_h": 240, "max_img_w": 240, "max_frames": 128, "out_channels": 16,
       "patch_spatial": 2, "patch_temporal": 1, "model_channels": 64, "num_blocks": 2, "num_heads": 2,
       "block_config": "FA-CA-MLP", "concat_padding_mask": True, "crossattn_emb_channels": 32,
       "pos_emb_cls": "rope3d", "pos_emb_learnable": False, "pos_emb_interpolation": "crop",
       "block_x_format": "THWBD", "affline_emb_norm": True, "use_adaln_lora": True, "adaln_lora_dim": 16,
       "extra_per_block_abs_pos_emb": True, "extra_per_block_abs_pos_emb_type": "learnable"}


def _v1_text(generator, batch, shape):  # T5-XXL tokens padded to 512 (12 here) and their mask
    return random_dits.text_tokens(generator, batch, 12, 32), {"attention_mask": torch.ones(batch, 12)}


def _text(generator, batch, shape):  # T5-XXL tokens (1024 wide after the projection; 32 here)
    return random_dits.text_tokens(generator, batch, 12, 32), {}


def _first_frame(latent):  # CosmosPredict2ImageToVideoLatent: frame 0 is the clean image
    mask = torch.ones([latent.shape[0], 1, *latent.shape[2:]])
    mask[:, :, :1] = 0.0
    return mask


FIXTURES = {
    # Cosmos 1.0: 8x temporal VAE, so 9 frames are 2 latent frames
    "cosmos1_t2v": Fixture(
        spec=Spec("CosmosT2V", 16, 8, True, 8), config={**_V1, "in_channels": 16}, family="Cosmos 1.0", blocks=2,
        calls="g-g-", grid=(3, 8, 6), text=_v1_text),
    "cosmos1_i2v": Fixture(
        spec=Spec("CosmosI2V", 16, 8, True, 8), config={**_V1, "in_channels": 17}, family="Cosmos 1.0", blocks=2,
        calls="g-g-", grid=(3, 8, 6), text=_v1_text, mask=_first_frame),
    "cosmos_predict2_t2i": Fixture(
        spec=Spec("CosmosT2IPredict2", 16, 8, False, five_d=True),
        config={**_PREDICT2, "in_channels": 16}, family="Cosmos Predict2 image", blocks=2, calls="g-g-", grid=(8, 6),
        text=_text),
    "cosmos_predict2_i2v": Fixture(
        spec=Spec("CosmosI2VPredict2", 16, 8, True, 4),
        config={**_PREDICT2, "in_channels": 17}, family="Cosmos Predict2", blocks=2, calls="g-g-", grid=(3, 8, 6),
        text=_text, mask=_first_frame),
    "anima": Fixture(  # the text tokens straight to the DiT (no t5xxl_ids: the LLM adapter is not run)
        spec=Spec("Anima", 16, 8, False, five_d=True),
        config={**_PREDICT2, "image_model": "anima", "in_channels": 16}, family="Anima", blocks=2, calls="g-g-",
        grid=(8, 6), text=_text),
}
