"""Model configs of the host that ToDo does not reduce, each with the reason (what is missing).

A config listed here is refused with its reason, never with the generic list. The coverage test
(tests/test_comfy_coverage_inprocess.py) fails for a host config that is neither a family's
(``families/``), nor a UNet the UNet path patches, nor listed here: a family the host adds later
shows up as a failing test, not as a silent refusal. When a family gets its module, its configs
leave this table.
"""

from __future__ import annotations

_AUDIO = "an audio model: its tokens are a 1-D sequence of audio latents, there is no image or video grid to reduce"
_SHAPE = "a 3-D shape model: its tokens are a set of shape latents or sparse voxels, not an image or video grid"
_NOT_DIFFUSION = "not an image or video denoiser (detection, segmentation or depth): nothing for ToDo to reduce"

# PixArt (comfy/ldm/pixart), HunyuanDiT (comfy/ldm/hydit) and ERNIE-Image (comfy/ldm/ernie, 0.33
# only) call optimized_attention without transformer_options in every tree that has them: the
# override never sees a call, and reaching them would mean replacing their attention modules'
# forward (a copy of the host's code), not a hook.
_NO_OVERRIDE = ("its attention calls do not pass transformer_options to the host's attention (ComfyUI 0.3.75 and "
                "0.33), so the attention override ToDo uses never sees them: nothing to reduce through it")

REFUSED: dict[str, str] = {
    # Not image or video generators.
    "StableAudio": _AUDIO, "StableAudio3": _AUDIO, "ACEStep": _AUDIO, "ACEStep15": _AUDIO, "MiniMaxMusic3": _AUDIO,
    "Hunyuan3Dv2": _SHAPE, "Hunyuan3Dv2mini": _SHAPE, "Hunyuan3Dv2_1": _SHAPE, "TripoSplat": _SHAPE,
    "Trellis2": _SHAPE,
    "RT_DETR_v4": _NOT_DIFFUSION, "SAM3": _NOT_DIFFUSION, "SAM31": _NOT_DIFFUSION, "DepthAnything3": _NOT_DIFFUSION,
    # Image and video DiTs.
    "PixArtAlpha": _NO_OVERRIDE, "PixArtSigma": _NO_OVERRIDE, "HunyuanDiT": _NO_OVERRIDE,
    "HunyuanDiT1": _NO_OVERRIDE, "ErnieImage": _NO_OVERRIDE,
    # Wan variants whose self-attention is not one call over the model call's video grid (0.33).
    "WAN21_CausalAR_T2V": ("Wan causal autoregressive (0.33): each chunk's queries attend to a KV cache of the "
                           "frames generated before it, so the keys are not the model call's video grid"),
    # Wan Animate 2 (comfy/ldm/wan/model_animate2.py): without pose latents (outside the pose
    # window) plain Wan self-attention; with them, per block a pose branch (its self- and
    # cross-attention) and then the video's self-attention as one call per latent frame.
    "WAN_Animate2": ("Wan Animate 2 (0.33): with pose latents each block's self-attention runs once per latent "
                     "frame, frame j's queries over the keys of every video token (the reference slot and the video) "
                     "plus pose frame j-1's tokens (frame 0: the video tokens alone), so one block's grid calls have "
                     "two key lengths where ToDo's token layout has one per kind of call; and the pose branch's own "
                     "attention calls run or not by the state of its pose cache (animate2_cache, which the model "
                     "selects and fills during the call), which a plan made before the call cannot read without "
                     "changing it"),
    # HiDream-O1 (comfy/ldm/hidream_o1/attention.py): each decoder layer runs the prompt prefix
    # causally through SDPA directly and only the rest through the host's attention.
    "HiDreamO1": ("HiDream-O1 (0.33): each decoder layer's call through the host's attention has queries only for "
                  "the tokens after the prompt prefix (timestep token, image and reference patches) over keys of the "
                  "whole sequence [prompt, image, references]: the prefix's causal pass calls SDPA directly and "
                  "later steps take its keys from a cache. ToDo's DiT override reduces a call only where its "
                  "queries and keys are the same sequence, so these calls would pass unreduced"),
    "SeedVR2": ("SeedVR2 (0.33, video restoration): its attention runs over variable-length packed windows "
                "(the video cut into shifted 3-D windows, each window's tokens concatenated with the text, all "
                "windows in one sequence split by cumulative lengths) and calls the host's attention per window "
                "without transformer_options, so the override ToDo uses never sees those calls"),
}

# UNets the UNet path leaves alone (tests/test_comfy_unet_variants_inprocess.py). The video UNet's
# refusal is raised by layout.unet_layout, which walks UNets before any config is looked up.
VIDEO_UNET = ("a video UNet (SVD / SV3D): each SpatialVideoTransformer runs a spatial block over each frame's grid "
              "and a temporal block over the frames of each position, and ComfyUI calls both blocks' attention "
              "patches with the same key (block, block_index, activations_shape); the two can be told apart only by "
              "token count, which is ambiguous when the frame count equals a grid's size, so neither node patches "
              "it rather than risk reducing time as if it were space")
_CASCADE = ("Stable Cascade (stage C / stage B) is not an SD-style UNet: its AttnBlocks attend from the latent grid "
            "to the grid tokens concatenated with its condition tokens, through the attention override with no "
            "attention patches (attn1_patch) and no block keys; the UNet path cannot reach it and no DiT family "
            "maps its call plan (which calls attend over the grid, where the condition tokens sit) yet")
REFUSED.update({"SVD_img2vid": VIDEO_UNET, "SV3D_u": VIDEO_UNET, "SV3D_p": VIDEO_UNET,
                "Stable_Cascade_C": _CASCADE, "Stable_Cascade_B": _CASCADE})
