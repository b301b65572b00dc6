"""The trained photo fixtures (``photo_fixtures.py``) as diffusers models: the Flux fixture as a
``FluxTransformer2DModel``, the SD fixture as a ``UNet2DConditionModel``.

So the diffusers adapter can be checked on trained models (issue #51: the quality budget through
diffusers on a trained model), against what the ComfyUI node does on the same weights. The Flux
fixture is trained in ComfyUI's Flux class (BFL's layout); diffusers' single-file converter
assumes Flux.1's width (3072), so its keys are mapped here, for any width. The SD fixture's UNet
goes through diffusers' own converter (``convert_ldm_unet_checkpoint``) with its config.

``sample`` runs what ComfyUI's KSampler runs for a fixture (euler, the simple schedule of its
model sampling, its CFG: 1 for Flux, one model call a step; 2 for SD, cond and uncond in one
batch) with the diffusers model called as its pipeline calls it (Flux: packed 2x2 latents,
``img_ids`` rows and columns, ``timestep`` = sigma; SD: the input scaled by 1 / sqrt(sigma^2 + 1),
the timestep of the sigma), from the same noise (``comfy.sample.prepare_noise``), and decodes
with the fixture's codec.

Runs inside the host venv with the ComfyUI folder importable (as ``photo_fixtures``).
"""

from __future__ import annotations

import torch

import photo_fixtures as pf


def _split(weight: torch.Tensor, sizes: list[int]) -> tuple:
    return torch.split(weight, sizes, dim=0)


def _scale_shift(weight: torch.Tensor) -> torch.Tensor:
    """BFL's final modulation is (shift, scale); diffusers' AdaLayerNormContinuous reads (scale, shift)."""
    shift, scale = weight.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


def converted(model_sd: dict, hidden: int, mlp_hidden: int) -> dict:
    """BFL / ComfyUI Flux keys (the fixture's ``model.`` entries, prefix removed) -> diffusers'."""
    out = {}

    def take(source: str, target: str, transform=None):
        for suffix in ("weight", "bias"):
            key = f"{source}.{suffix}"
            if key in model_sd:
                value = model_sd[key]
                out[f"{target}.{suffix}"] = transform(value) if transform is not None else value

    def qkv(source: str, targets: tuple, extra: list[int] = ()):
        for suffix in ("weight", "bias"):
            key = f"{source}.{suffix}"
            if key in model_sd:
                for target, part in zip(targets, _split(model_sd[key], [hidden] * 3 + list(extra))):
                    out[f"{target}.{suffix}"] = part

    take("img_in", "x_embedder")
    take("txt_in", "context_embedder")
    take("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1")
    take("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2")
    take("vector_in.in_layer", "time_text_embed.text_embedder.linear_1")
    take("vector_in.out_layer", "time_text_embed.text_embedder.linear_2")
    take("final_layer.linear", "proj_out")
    take("final_layer.adaLN_modulation.1", "norm_out.linear", _scale_shift)
    doubles = sorted({int(k.split(".")[1]) for k in model_sd if k.startswith("double_blocks.")})
    for i in doubles:
        s, t = f"double_blocks.{i}", f"transformer_blocks.{i}"
        take(f"{s}.img_mod.lin", f"{t}.norm1.linear")
        take(f"{s}.txt_mod.lin", f"{t}.norm1_context.linear")
        qkv(f"{s}.img_attn.qkv", (f"{t}.attn.to_q", f"{t}.attn.to_k", f"{t}.attn.to_v"))
        qkv(f"{s}.txt_attn.qkv", (f"{t}.attn.add_q_proj", f"{t}.attn.add_k_proj", f"{t}.attn.add_v_proj"))
        out[f"{t}.attn.norm_q.weight"] = model_sd[f"{s}.img_attn.norm.query_norm.scale"]
        out[f"{t}.attn.norm_k.weight"] = model_sd[f"{s}.img_attn.norm.key_norm.scale"]
        out[f"{t}.attn.norm_added_q.weight"] = model_sd[f"{s}.txt_attn.norm.query_norm.scale"]
        out[f"{t}.attn.norm_added_k.weight"] = model_sd[f"{s}.txt_attn.norm.key_norm.scale"]
        take(f"{s}.img_attn.proj", f"{t}.attn.to_out.0")
        take(f"{s}.txt_attn.proj", f"{t}.attn.to_add_out")
        take(f"{s}.img_mlp.0", f"{t}.ff.net.0.proj")
        take(f"{s}.img_mlp.2", f"{t}.ff.net.2")
        take(f"{s}.txt_mlp.0", f"{t}.ff_context.net.0.proj")
        take(f"{s}.txt_mlp.2", f"{t}.ff_context.net.2")
    singles = sorted({int(k.split(".")[1]) for k in model_sd if k.startswith("single_blocks.")})
    for i in singles:
        s, t = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        qkv(f"{s}.linear1", (f"{t}.attn.to_q", f"{t}.attn.to_k", f"{t}.attn.to_v", f"{t}.proj_mlp"), [mlp_hidden])
        take(f"{s}.linear2", f"{t}.proj_out")
        take(f"{s}.modulation.lin", f"{t}.norm.linear")
        out[f"{t}.attn.norm_q.weight"] = model_sd[f"{s}.norm.query_norm.scale"]
        out[f"{t}.attn.norm_k.weight"] = model_sd[f"{s}.norm.key_norm.scale"]
    return out


def sd_unet(fixture: pf.Fixture, dtype: torch.dtype = torch.float32):
    """The SD fixture's trained weights in diffusers' UNet2DConditionModel (eval)."""
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    config = fixture.spec.unet_config
    widths = tuple(config["model_channels"] * m for m in config["channel_mult"])
    attends = [depth > 0 for depth in config["transformer_depth"][::config["num_res_blocks"][0]]]
    diffusers_config = dict(
        sample_size=config["image_size"], in_channels=config["in_channels"], out_channels=config["out_channels"],
        layers_per_block=config["num_res_blocks"][0], block_out_channels=widths,
        down_block_types=tuple("CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attends),
        up_block_types=tuple("CrossAttnUpBlock2D" if a else "UpBlock2D" for a in reversed(attends)),
        cross_attention_dim=config["context_dim"], attention_head_dim=config["num_heads"])  # diffusers: the heads
    source = {f"model.diffusion_model.{k}": v.float()
              for k, v in fixture.patcher.model.diffusion_model.state_dict().items()}
    model = UNet2DConditionModel(**diffusers_config)
    model.load_state_dict(convert_ldm_unet_checkpoint(source, diffusers_config), strict=True)
    return model.to(dtype).eval()


def diffusers_model(fixture: pf.Fixture, dtype: torch.dtype = torch.float32):
    """The fixture's weights in the diffusers model of its family."""
    return flux_transformer(fixture, dtype) if fixture.spec.name == "flux" else sd_unet(fixture, dtype)


def flux_transformer(fixture: pf.Fixture, dtype: torch.dtype = torch.float32):
    """The fixture's trained weights in diffusers' FluxTransformer2DModel (eval, no grad needed)."""
    from diffusers import FluxTransformer2DModel

    config = fixture.spec.unet_config
    hidden, heads = config["hidden_size"], config["num_heads"]
    mlp_hidden = int(hidden * config["mlp_ratio"])
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=config["in_channels"] * config["patch_size"] ** 2, num_layers=config["depth"],
        num_single_layers=config["depth_single_blocks"], attention_head_dim=hidden // heads,
        num_attention_heads=heads, joint_attention_dim=config["context_in_dim"],
        pooled_projection_dim=config["vec_in_dim"], guidance_embeds=False, axes_dims_rope=tuple(config["axes_dim"]))
    source = {k: v.float() for k, v in fixture.patcher.model.diffusion_model.state_dict().items()}
    # the host may name Flux's norms .weight (ComfyUI 0.33) where the file has .scale
    source = {(k[:-len(".weight")] + ".scale" if "_norm." in k and k.endswith(".weight") else k): v
              for k, v in source.items()}
    model.load_state_dict(converted(source, hidden, mlp_hidden), strict=True)
    return model.to(dtype).eval()


def _ids(h: int, w: int) -> torch.Tensor:
    ids = torch.zeros(h, w, 3)
    ids[..., 1], ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None, :]
    return ids.reshape(-1, 3)


def pack(x: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] latents -> [B, (H/2)(W/2), 4C] tokens, as FluxPipeline packs them (ComfyUI's patchify order)."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    b, _, d = tokens.shape
    c = d // 4
    return tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


def velocity(model, fixture: pf.Fixture, x: torch.Tensor, sigma: float, caption: str) -> torch.Tensor:
    """The model's prediction on latents ``x`` [1, C, H, W] at ``sigma`` (the velocity ComfyUI's
    Flux returns: denoised = x - sigma * v), called as FluxPipeline calls the transformer."""
    with torch.no_grad():
        text = fixture.text([caption]).float()
        h, w = x.shape[-2:]
        out = model(hidden_states=pack(x), encoder_hidden_states=text, pooled_projections=text.mean(1),
                    timestep=torch.full((x.shape[0],), float(sigma)), img_ids=_ids(h // 2, w // 2),
                    txt_ids=torch.zeros(text.shape[1], 3), return_dict=False)[0]
    return unpack(out, h, w)


def schedule(fixture: pf.Fixture, steps: int, denoise: float = 1.0) -> list[float]:
    """The sigmas ComfyUI's KSampler runs for the fixture (its model sampling, the simple
    scheduler; with ``denoise`` below 1 the last steps of a longer schedule)."""
    import comfy.samplers

    total = steps if denoise >= 1.0 else int(steps / denoise)
    sigmas = comfy.samplers.calculate_sigmas(fixture.patcher.get_model_object("model_sampling"), "simple", total)
    return sigmas[-(steps + 1):].tolist()


def denoised(model, fixture: pf.Fixture, x: torch.Tensor, sigma: float, caption: str) -> torch.Tensor:
    """The denoised prediction ComfyUI's sampler takes a step with: Flux's velocity turned into it
    (x - sigma * v, CFG 1); SD's noise prediction of cond and uncond in one batch, combined by
    the fixture's CFG, turned into it (x - sigma * eps)."""
    if fixture.spec.name == "flux":
        return x - sigma * velocity(model, fixture, x, sigma, caption)
    model_sampling = fixture.patcher.get_model_object("model_sampling")
    with torch.no_grad():
        text = torch.cat([fixture.text([caption]), fixture.text([pf.EMPTY])]).float()
        sigmas = torch.full((2,), float(sigma))
        given = model_sampling.calculate_input(sigmas, torch.cat([x, x]))
        eps = model(given, model_sampling.timestep(sigmas).float(), encoder_hidden_states=text).sample
    cond, uncond = eps.chunk(2)
    return x - sigma * (uncond + (cond - uncond) * pf.CFG[fixture.spec.name])


def sample(model, fixture: pf.Fixture, caption: str, seed: int, steps: int, image: torch.Tensor | None = None,
           denoise: float = 1.0, px: int | None = None) -> torch.Tensor:
    """One image as ``photo_fixtures.sample`` makes it through ComfyUI (euler, simple, the
    fixture's CFG), the model calls made by the diffusers model ``model`` (patched or not)."""
    import comfy.sample

    latent = pf.start_latent(fixture, image, px)
    noise = comfy.sample.prepare_noise(latent, seed)
    model_sampling = fixture.patcher.get_model_object("model_sampling")
    latent_format = fixture.patcher.model.latent_format
    clean = latent_format.process_in(latent) if image is not None else torch.zeros_like(latent)
    sigmas = schedule(fixture, steps, denoise)
    full = sigmas[0] >= float(model_sampling.sigma_max) - 1e-5  # KSampler's max_denoise
    x = model_sampling.noise_scaling(torch.tensor(sigmas[0]), noise, clean, full)
    for sigma, following in zip(sigmas[:-1], sigmas[1:]):
        x = x + (following - sigma) * (x - denoised(model, fixture, x, sigma, caption)) / sigma
    return fixture.vae.decode(latent_format.process_out(x))
