"""Tiny diffusers models and pipelines with random weights, built from config (nothing is
downloaded), for the tests, the benchmark and the example: the real classes, a few channels.

Pipelines are driven with ``prompt_embeds`` (no tokenizer or text encoder needed); the DiT
transformers are called directly with random inputs shaped as their pipelines pass them.
Imports diffusers (only this module and what imports it).
"""

from __future__ import annotations

import torch

TEXT_DIM = 32  # width of the random text embeddings
TEXT_TOKENS = 7


def _seeded(seed: int):
    return torch.Generator().manual_seed(seed)


def _random_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights from a private generator: the same model on every machine, the global RNG untouched."""
    generator = _seeded(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.eval()


def unet(sdxl: bool = False, seed: int = 0, size: int = 16):
    from diffusers import UNet2DConditionModel

    if sdxl:  # SDXL's shape: no attention at the finest level, text_time added conditions
        model = UNet2DConditionModel(
            sample_size=size, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64, 64),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 1, 2), attention_head_dim=(2, 4, 4), cross_attention_dim=TEXT_DIM,
            addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=80,
            use_linear_projection=True, norm_num_groups=32)
    else:
        model = UNet2DConditionModel(
            sample_size=size, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=8,
            cross_attention_dim=TEXT_DIM, norm_num_groups=32)
    return _random_weights(model, seed)


def vae(seed: int = 1):
    from diffusers import AutoencoderKL

    model = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                          up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8),
                          latent_channels=4, norm_num_groups=8, layers_per_block=1, sample_size=32)
    return _random_weights(model, seed)


def pipeline(sdxl: bool = False, seed: int = 0, size: int = 16):
    """A StableDiffusion (or SDXL) pipeline of tiny random models, without text encoders."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       timestep_spacing="leading", steps_offset=1)
    if sdxl:
        pipe = StableDiffusionXLPipeline(vae=vae(), text_encoder=None, text_encoder_2=None, tokenizer=None,
                                         tokenizer_2=None, unet=unet(True, seed, size), scheduler=scheduler)
    else:
        pipe = StableDiffusionPipeline(vae=vae(), text_encoder=None, tokenizer=None, unet=unet(False, seed, size),
                                       scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def flux_pipeline(seed: int = 0):
    """A Flux pipeline of a tiny random transformer and VAE, without text encoders."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae(), text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=transformer("Flux", seed))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def prompt(pipe, batch: int = 1, seed: int = 2) -> dict:
    """Random prompt embeddings (and the pooled ones SDXL and Flux take) for ``batch`` prompts,
    with negatives where the pipeline runs CFG."""
    generator = _seeded(seed)
    embeds = lambda *shape: torch.randn(batch, *shape, generator=generator)  # noqa: E731
    if type(pipe).__name__.startswith("Flux"):  # guidance-distilled: no negatives
        return {"prompt_embeds": embeds(TEXT_TOKENS, TEXT_DIM), "pooled_prompt_embeds": embeds(TEXT_DIM)}
    values = {"prompt_embeds": embeds(TEXT_TOKENS, TEXT_DIM), "negative_prompt_embeds": embeds(TEXT_TOKENS, TEXT_DIM)}
    if type(pipe).__name__.startswith("StableDiffusionXL"):
        values.update(pooled_prompt_embeds=embeds(TEXT_DIM), negative_pooled_prompt_embeds=embeds(TEXT_DIM))
    return values


def generate(pipe, batch: int = 1, steps: int = 3, guidance: float = 5.0, seed: int = 0, size: int = 128,
             **extra) -> torch.Tensor:
    """Latents of one pipeline run (no VAE decode), from a private generator."""
    return pipe(**prompt(pipe, batch), num_inference_steps=steps, guidance_scale=guidance, height=size, width=size,
                generator=_seeded(seed), output_type="latent", **extra).images


# --- DiT transformers, called as their pipelines call them ---------------------------------------

def _flux(seed):
    from diffusers import FluxTransformer2DModel
    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT_DIM,
                                  pooled_projection_dim=TEXT_DIM, axes_dims_rope=(4, 6, 6))


def _flux_inputs(model, g, batch, frames, h, w):
    ids = torch.zeros(h, w, 3)
    ids[..., 1], ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None, :]
    return dict(hidden_states=torch.randn(batch, h * w, 16, generator=g),
                encoder_hidden_states=torch.randn(batch, TEXT_TOKENS, TEXT_DIM, generator=g),
                pooled_projections=torch.randn(batch, TEXT_DIM, generator=g), timestep=torch.full((batch,), 0.7),
                img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(TEXT_TOKENS, 3))


def _chroma(seed):
    from diffusers import ChromaTransformer2DModel
    return ChromaTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT_DIM,
                                    axes_dims_rope=(4, 6, 6), approximator_num_channels=16, approximator_hidden_dim=32,
                                    approximator_layers=1)


def _chroma_inputs(model, g, batch, frames, h, w):
    inputs = _flux_inputs(model, g, batch, frames, h, w)
    del inputs["pooled_projections"]
    mask = torch.ones(batch, TEXT_TOKENS + h * w, dtype=torch.bool)
    mask[:, TEXT_TOKENS - 2:TEXT_TOKENS] = False  # padded text, as ChromaPipeline's mask: it must follow the tokens
    return {**inputs, "attention_mask": mask}


def _auraflow(seed):
    from diffusers import AuraFlowTransformer2DModel
    return AuraFlowTransformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_mmdit_layers=2,
                                      num_single_dit_layers=2, attention_head_dim=16, num_attention_heads=2,
                                      joint_attention_dim=TEXT_DIM, caption_projection_dim=32, out_channels=4,
                                      pos_embed_max_size=256)


def _auraflow_inputs(model, g, batch, frames, h, w):
    return dict(hidden_states=torch.randn(batch, 4, 2 * h, 2 * w, generator=g),
                encoder_hidden_states=torch.randn(batch, TEXT_TOKENS, TEXT_DIM, generator=g),
                timestep=torch.full((batch,), 0.7))


def _lumina(seed):
    from diffusers import Lumina2Transformer2DModel
    return Lumina2Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, hidden_size=32, num_layers=3,
                                     num_refiner_layers=1, num_attention_heads=2, num_kv_heads=2,
                                     cap_feat_dim=TEXT_DIM, axes_dim_rope=(4, 6, 6), axes_lens=(64, 32, 32))


def _lumina_inputs(model, g, batch, frames, h, w):
    return dict(hidden_states=torch.randn(batch, 4, 2 * h, 2 * w, generator=g),
                encoder_hidden_states=torch.randn(batch, TEXT_TOKENS, TEXT_DIM, generator=g),
                encoder_attention_mask=torch.ones(batch, TEXT_TOKENS, dtype=torch.bool),
                timestep=torch.full((batch,), 0.3))


def _sd3(seed):
    from diffusers import SD3Transformer2DModel
    return SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=16,
                                 num_attention_heads=2, joint_attention_dim=TEXT_DIM, caption_projection_dim=32,
                                 pooled_projection_dim=TEXT_DIM, out_channels=4, pos_embed_max_size=32,
                                 dual_attention_layers=(0,))


def _sd3_inputs(model, g, batch, frames, h, w):
    return dict(hidden_states=torch.randn(batch, 4, 2 * h, 2 * w, generator=g),
                encoder_hidden_states=torch.randn(batch, TEXT_TOKENS, TEXT_DIM, generator=g),
                pooled_projections=torch.randn(batch, TEXT_DIM, generator=g), timestep=torch.full((batch,), 700.0))


def _wan(seed):
    from diffusers import WanTransformer3DModel
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                 out_channels=4, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=3,
                                 rope_max_seq_len=64)


def _wan_inputs(model, g, batch, frames, h, w):
    return dict(hidden_states=torch.randn(batch, 4, frames, 2 * h, 2 * w, generator=g),
                encoder_hidden_states=torch.randn(batch, TEXT_TOKENS, TEXT_DIM, generator=g),
                timestep=torch.full((batch,), 700.0))


def _qwen(seed):
    from diffusers import QwenImageTransformer2DModel
    return QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=3,
                                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=TEXT_DIM,
                                       axes_dims_rope=(4, 6, 6))


def _qwen_inputs(model, g, batch, frames, h, w):
    return dict(hidden_states=torch.randn(batch, h * w, 16, generator=g),
                encoder_hidden_states=torch.randn(batch, TEXT_TOKENS, TEXT_DIM, generator=g),
                encoder_hidden_states_mask=torch.ones(batch, TEXT_TOKENS, dtype=torch.long),
                timestep=torch.full((batch,), 0.7), img_shapes=[[(1, h, w)]] * batch)


def _hunyuan(seed):
    from diffusers import HunyuanVideoTransformer3DModel
    return HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                          num_layers=2, num_single_layers=2, num_refiner_layers=1, patch_size=2,
                                          patch_size_t=1, text_embed_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM,
                                          rope_axes_dim=(4, 6, 6))


def _hunyuan_inputs(model, g, batch, frames, h, w):
    mask = torch.ones(batch, TEXT_TOKENS, dtype=torch.long)
    mask[:, -2:] = 0  # padded text: the attention mask must follow the reduced keys
    return dict(hidden_states=torch.randn(batch, 4, frames, 2 * h, 2 * w, generator=g),
                encoder_hidden_states=torch.randn(batch, TEXT_TOKENS, TEXT_DIM, generator=g),
                encoder_attention_mask=mask, pooled_projections=torch.randn(batch, TEXT_DIM, generator=g),
                timestep=torch.full((batch,), 700.0), guidance=torch.full((batch,), 3500.0))


def _ltx(seed):
    from diffusers import LTXVideoTransformer3DModel
    return LTXVideoTransformer3DModel(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1,
                                      num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
                                      num_layers=3, caption_channels=TEXT_DIM)


def _ltx_inputs(model, g, batch, frames, h, w):
    return dict(hidden_states=torch.randn(batch, frames * h * w, 8, generator=g),
                encoder_hidden_states=torch.randn(batch, TEXT_TOKENS, TEXT_DIM, generator=g),
                encoder_attention_mask=torch.ones(batch, TEXT_TOKENS, dtype=torch.long),
                timestep=torch.full((batch,), 700.0), num_frames=frames, height=h, width=w)


TRANSFORMERS = {"Flux": (_flux, _flux_inputs), "Chroma": (_chroma, _chroma_inputs), "SD3": (_sd3, _sd3_inputs),
                "AuraFlow": (_auraflow, _auraflow_inputs), "Lumina 2": (_lumina, _lumina_inputs),
                "Wan": (_wan, _wan_inputs),
                "Qwen-Image": (_qwen, _qwen_inputs), "HunyuanVideo": (_hunyuan, _hunyuan_inputs),
                "LTX-Video": (_ltx, _ltx_inputs)}


def transformer(family: str, seed: int = 0) -> torch.nn.Module:
    return _random_weights(TRANSFORMERS[family][0](seed), seed)


def transformer_inputs(family: str, model, batch: int = 1, frames: int = 1, h: int = 8, w: int = 8,
                       seed: int = 3) -> dict:
    """Random inputs of one model call on an h x w token grid (``frames`` for the video models)."""
    return TRANSFORMERS[family][1](model, _seeded(seed), batch, frames, h, w)
