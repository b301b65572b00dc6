"""Small diffusion models trained here on real photographs: the project's quality evidence.

Random weights say almost nothing about how much a reduction changes an image (a trained
attention is sharply peaked, a random one is flat), and no trained model can be downloaded
where this project is built. So two fixtures are trained here (``devtools/train_fixtures.py``)
in the real architectures, with ComfyUI's own classes, and kept in ``devtools/trained/``:

- ``flux``: ComfyUI's Flux.1 model class (double and single blocks, rotary positions, text
  tokens beside the image tokens), Flux.1 [schnell]'s flow-matching setup (no guidance input),
  16 latent channels at 1/8; native 512 px (a 32x32 token grid: 1024 image tokens).
- ``sd15``: ComfyUI's SD1.5 UNet class (self- and cross-attention transformer blocks on three
  levels), the SD (epsilon) objective, 4 latent channels at 1/8; native 256 px (its finest
  attention level 32x32).

Both read a few short captions through their real context path: a caption is a row of word
embeddings (8 tokens, learned with the model, stored beside it) given as the conditioning's
text tokens (``c_crossattn``), their mean as Flux's pooled vector. So text tokens exist, and a
reduction must leave them whole.

Latents come from a fixed linear map of 8x8 pixel patches, the principal components of the
training photos' patches (16 for Flux, 4 for SD), whitened and put into each model's latent
format (``PatchCodec``). ``PatchVAE`` wraps it in ComfyUI's own ``comfy.sd.VAE`` class, so
``VAEDecode`` / ``VAEEncode`` decode and encode these latents as they do a user's. It is no
learned autoencoder: 4 components of an 8x8 patch keep little more than its mean colour and
gradient, so the SD fixture's images are soft at 1/8 detail; the Flux fixture's 16 keep more.

The photographs ship inside scikit-image (``skimage/data``): CC0 or public domain, each
named with its licence in ``PHOTOS``. Two are held out of training for evaluation.

Runs inside the host venv with the ComfyUI folder importable.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

TRAINED = Path(__file__).resolve().parent / "trained"
TOKENS = 8  # text tokens per caption, padded
PATCH = 8


@dataclasses.dataclass(frozen=True)
class Photo:
    name: str  # skimage.data's function
    caption: str
    licence: str
    held_out: bool = False


PHOTOS = (
    Photo("astronaut", "an astronaut", "public domain (NASA)"),
    Photo("coffee", "a cup of coffee", "CC0 (Rachel Michetti)"),
    Photo("chelsea", "a cat", "CC0 (Stefan van der Walt)"),
    Photo("rocket", "a rocket", "public domain (SpaceX)"),
    Photo("hubble_deep_field", "a galaxy field", "public domain (NASA)"),
    Photo("retina", "a retina", "CC0"),
    Photo("grass", "grass", "CC0 (linolafett, DeviantArt)"),
    Photo("gravel", "gravel", "CC0 (CC0Textures)"),
    Photo("brick", "a brick wall", "CC0 (CC0Textures)"),
    Photo("camera", "", "CC0 (Lav Varshney)", held_out=True),
    Photo("immunohistochemistry", "", "no known copyright restrictions", held_out=True),
)
# The word table the trained text embeddings index (frozen: the saved weights have one row each).
# "photo" is in it but was never trained on (held-out photos are read with the empty caption).
VOCABULARY = ("<pad>", "a", "an", "astronaut", "brick", "cat", "coffee", "cup", "field", "galaxy", "grass", "gravel",
              "of", "photo", "retina", "rocket", "wall")
# The four captions every quality table samples (text to image).
EVAL_CAPTIONS = ("an astronaut", "a cup of coffee", "a cat", "a rocket")
EMPTY = ""  # the negative / dropped caption: all padding


def vocabulary() -> list[str]:
    return list(VOCABULARY)


def token_ids(caption: str) -> list[int]:
    vocab = {w: i for i, w in enumerate(vocabulary())}
    words = caption.split()
    unknown = [w for w in words if w not in vocab]
    if unknown or len(words) > TOKENS:
        raise ValueError(f"caption {caption!r}: the fixtures know only the words {vocabulary()[1:]} "
                         f"and at most {TOKENS} of them")
    return [vocab[w] for w in words] + [0] * (TOKENS - len(words))


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    family: str  # ComfyUI's config class
    unet_config: dict
    latent_channels: int
    native_px: int
    context_dim: int
    pooled: bool  # Flux's vec_in_dim: the caption's mean embedding


SPECS = {
    "flux": Spec("flux", "FluxSchnell", {
        "image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 64, "context_in_dim": 64,
        "hidden_size": 192, "mlp_ratio": 4.0, "num_heads": 3, "depth": 2, "depth_single_blocks": 4,
        "axes_dim": [16, 24, 24], "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": False,
        "txt_ids_dims": []},
        latent_channels=16, native_px=512, context_dim=64, pooled=True),
    "sd15": Spec("sd15", "SD15", {
        "use_checkpoint": False, "image_size": 32, "in_channels": 4, "out_channels": 4, "model_channels": 32,
        "use_spatial_transformer": True, "legacy": False, "use_temporal_attention": False,
        "use_temporal_resblock": False, "adm_in_channels": None, "num_res_blocks": [2, 2, 2, 2],
        "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0], "channel_mult": [1, 2, 2, 2],
        "transformer_depth_middle": 1, "use_linear_in_transformer": False, "context_dim": 64, "num_heads": 2,
        "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]},
        latent_channels=4, native_px=256, context_dim=64, pooled=False),
}


def model_config(spec: Spec, dtype: torch.dtype = torch.float32):
    import comfy.supported_models as supported
    from random_dits import for_host  # the config trimmed to the running tree's model fields

    config = getattr(supported, spec.family)(for_host(spec.unet_config))
    # The class adds its own head layout (unet_extra_config); ours must win at small widths.
    config.unet_config.update({k: v for k, v in spec.unet_config.items() if k in ("num_heads", "num_head_channels")})
    config.set_inference_dtype(dtype, None)
    return config


# --- photos -----------------------------------------------------------------------------------

def load_photo(name: str) -> torch.Tensor:
    """A photo of skimage.data as float [3, H, W] in 0..1 (grayscale ones repeated to RGB)."""
    import numpy as np
    import skimage.data

    array = np.asarray(getattr(skimage.data, name)())
    if array.ndim == 2:
        array = np.repeat(array[..., None], 3, axis=2)
    array = array[..., :3]
    return torch.from_numpy(np.ascontiguousarray(array)).permute(2, 0, 1).float() / 255.0


def square(photo: torch.Tensor, size: int) -> torch.Tensor:
    """The photo's centre square, resized to size x size (antialiased)."""
    _, h, w = photo.shape
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    crop = photo[:, top:top + side, left:left + side]
    return torch.nn.functional.interpolate(crop[None], size=(size, size), mode="bilinear", antialias=True,
                                           align_corners=False)[0].clamp(0, 1)


# --- the latent map -------------------------------------------------------------------------

class PatchCodec(torch.nn.Module):
    """A fixed linear map of 8x8 RGB patches (in -1..1) to ``channels`` whitened principal
    components, expressed in the model's latent format (so that the format's process_in gives
    unit-variance channels, as the model was trained on)."""

    def __init__(self, channels: int, scale: float, shift: float):
        super().__init__()
        dim = 3 * PATCH * PATCH
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("components", torch.zeros(channels, dim))  # rows: unit principal axes
        self.register_buffer("std", torch.ones(channels))
        self.scale, self.shift = scale, shift

    @torch.no_grad()
    def fit(self, images: list[torch.Tensor]) -> None:
        """Principal components of every non-overlapping patch of ``images`` ([3, H, W], 0..1)."""
        patches = torch.cat([self._patches(img[None].double() * 2 - 1).reshape(-1, self.mean.numel())
                             for img in images])
        mean = patches.mean(0)
        centred = patches - mean
        cov = centred.T @ centred / len(patches)
        values, vectors = torch.linalg.eigh(cov)
        order = values.argsort(descending=True)[: self.components.shape[0]]
        axes = vectors[:, order].T
        axes = axes * torch.sign(axes.sum(1, keepdim=True) + 1e-12)  # a fixed sign per axis
        self.mean.copy_(mean.float())
        self.components.copy_(axes.float())
        self.std.copy_(values[order].clamp_min(1e-12).sqrt().float())

    @staticmethod
    def _patches(x: torch.Tensor) -> torch.Tensor:  # [B, 3, H, W] -> [B, h, w, 3*8*8]
        b, c, h, w = x.shape
        x = x.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH)
        return x.permute(0, 2, 4, 1, 3, 5).reshape(b, h // PATCH, w // PATCH, c * PATCH * PATCH)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in -1..1 -> the latent [B, C, H/8, W/8] in the VAE's space."""
        patches = self._patches(x.to(self.mean.dtype)) - self.mean
        white = (patches @ self.components.T) / self.std
        return white.permute(0, 3, 1, 2) / self.scale + self.shift

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """The latent in the VAE's space -> [B, 3, H, W] in -1..1."""
        white = ((z.to(self.mean.dtype) - self.shift) * self.scale).permute(0, 2, 3, 1)
        patches = (white * self.std) @ self.components + self.mean
        b, h, w, _ = patches.shape
        x = patches.reshape(b, h, w, 3, PATCH, PATCH).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, 3, h * PATCH, w * PATCH)


def _vae_class():
    import comfy.model_management
    import comfy.model_patcher
    import comfy.sd

    class PatchVAE(comfy.sd.VAE):
        """ComfyUI's VAE class around a PatchCodec: VAEDecode, VAEEncode, batching, tiling and
        model management as for any VAE. Built through the class's pixel-space branch (its
        defaults, device and dtype choice), then given the codec as its first stage."""

        def __init__(self, codec: PatchCodec):
            super().__init__(sd={"pixel_space_vae": torch.tensor(1.0)})
            self.first_stage_model = codec.eval().to(self.vae_dtype)
            self.downscale_ratio = self.upscale_ratio = PATCH
            self.latent_channels = codec.components.shape[0]
            self.memory_used_encode = self.memory_used_decode = (
                lambda shape, dtype: 64 * shape[2] * shape[3] * 64 * comfy.model_management.dtype_size(dtype))
            self.working_dtypes = [torch.float32]
            self.vae_dtype = torch.float32
            self.first_stage_model.to(torch.float32)
            self.patcher = comfy.model_patcher.ModelPatcher(
                self.first_stage_model, load_device=self.device,
                offload_device=comfy.model_management.vae_offload_device())
            self.size = None
            self.model_size()

    return PatchVAE


# --- loading ---------------------------------------------------------------------------------

def new_codec(spec: Spec) -> PatchCodec:
    fmt = model_config(spec).latent_format
    return PatchCodec(spec.latent_channels, fmt.scale_factor, getattr(fmt, "shift_factor", 0.0))


class TextEmbedding(torch.nn.Module):
    """The fixtures' text encoder: a learned embedding per word of ``vocabulary()``."""

    def __init__(self, width: int):
        super().__init__()
        self.embedding = torch.nn.Embedding(len(vocabulary()), width)

    def forward(self, captions: list[str]) -> torch.Tensor:
        ids = torch.tensor([token_ids(c) for c in captions], device=self.embedding.weight.device)
        return self.embedding(ids)


def build(spec: Spec, dtype: torch.dtype = torch.float32, device=None):
    """(BaseModel, TextEmbedding, PatchCodec) of ``spec``, untrained."""
    model = model_config(spec, dtype).get_model({}, device=device)
    return model, TextEmbedding(spec.context_dim), new_codec(spec)


def state_dict(model, text: TextEmbedding, codec: PatchCodec, dtype=torch.float16) -> dict:
    sd = {f"model.{k}": v.to(dtype) for k, v in model.diffusion_model.state_dict().items()}
    sd.update({f"text.{k}": v.float() for k, v in text.state_dict().items()})
    sd.update({f"codec.{k}": v.float() for k, v in codec.state_dict().items()})
    return sd


@dataclasses.dataclass
class Fixture:
    spec: Spec
    patcher: object  # comfy.model_patcher.ModelPatcher
    vae: object  # PatchVAE (comfy.sd.VAE)
    text: TextEmbedding
    codec: PatchCodec

    def conditioning(self, caption: str, batch: int = 1) -> list:
        """A CONDITIONING of ComfyUI (as a text encoder node returns it) for ``caption``."""
        with torch.no_grad():
            tokens = self.text([caption]).float().cpu().repeat(batch, 1, 1)
        extras = {"pooled_output": tokens.mean(1)} if self.spec.pooled else {}
        return [[tokens, extras]]

    def latent_size(self, px: int | None = None) -> int:
        return (px or self.spec.native_px) // PATCH


def load(name: str, dtype: torch.dtype = torch.float32, folder: Path | None = None) -> Fixture:
    """A trained fixture: its model as a ModelPatcher on ComfyUI's device, its VAE, its text."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.utils

    spec = SPECS[name]
    path = (folder or TRAINED) / f"{name}.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: train it with python3 devtools/train_fixtures.py {name}")
    sd = comfy.utils.load_torch_file(str(path))
    model, text, codec = build(spec, dtype)
    # Through the host's own renaming, as its loaders do (0.33 names Flux's norms .weight, the file .scale).
    weights = model.model_config.process_unet_state_dict(
        {k[6:]: v.to(dtype) for k, v in sd.items() if k.startswith("model.")})
    model.diffusion_model.load_state_dict(weights)
    text.load_state_dict({k[5:]: v for k, v in sd.items() if k.startswith("text.")})
    codec.load_state_dict({k[6:]: v for k, v in sd.items() if k.startswith("codec.")})
    model.eval()
    text.eval()
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=comfy.model_management.get_torch_device(),
                                               offload_device=comfy.model_management.unet_offload_device())
    return Fixture(spec, patcher, _vae_class()(codec), text, codec)


def held_out_images(px: int) -> torch.Tensor:
    """The held-out photos' centre squares, as a ComfyUI IMAGE [B, px, px, 3]."""
    return torch.stack([square(load_photo(p.name), px) for p in PHOTOS if p.held_out]).movedim(1, -1)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = ((a - b) ** 2).mean().item()
    return 10 * math.log10(1.0 / max(mse, 1e-12))


@torch.no_grad()
def denoise_gain(name: str, folder: Path | None = None, px: int | None = None, seed: int = 0) -> dict:
    """The usefulness bar: on the held-out photos, at the middle noise level of the model's
    schedule (sigma at t = 0.5), how much closer (PSNR, decoded by the fixture's VAE) the model's
    denoised estimate is to the photo than the noisy input (as the model receives it) is.
    Caption: the empty one (the held-out photos' own: the unconditional prediction)."""
    fixture = load(name, folder=folder)
    px = px or fixture.spec.native_px
    photos = held_out_images(px)
    model = fixture.patcher.model
    clean = model.process_latent_in(fixture.vae.encode(photos))
    sampling = model.model_sampling
    sigma = sampling.sigmas[len(sampling.sigmas) // 2].reshape(1).repeat(len(photos))
    noise = torch.randn(clean.shape, generator=torch.Generator().manual_seed(seed))
    noisy = sampling.noise_scaling(sigma, noise, clean)
    cond = fixture.conditioning(EMPTY, len(photos))[0]
    extras = {"y": cond[1]["pooled_output"]} if fixture.spec.pooled else {}
    denoised = model.apply_model(noisy, sigma, c_crossattn=cond[0], **extras)
    seen = sampling.calculate_input(sigma, noisy)  # the input as the network sees it
    decode = lambda latent: fixture.vae.decode(model.process_latent_out(latent))  # noqa: E731
    ceiling = psnr(decode(clean), photos)
    before, after = psnr(decode(seen), photos), psnr(decode(denoised), photos)
    return {"caption": EMPTY, "noise_seed": seed, "px": px, "sigma": round(float(sigma[0]), 4), "noisy_psnr": round(before, 2),
            "denoised_psnr": round(after, 2), "gain_db": round(after - before, 2), "codec_psnr": round(ceiling, 2)}


# --- sampling, as KSampler does ----------------------------------------------------------------

CFG = {"flux": 1.0, "sd15": 2.0}  # Flux.1 [schnell] samples without CFG; the UNet with it


@torch.no_grad()
def start_latent(fixture: Fixture, image: torch.Tensor | None = None, px: int | None = None) -> torch.Tensor:
    """The latent a sample starts from: empty (text to image, at ``px`` or the native size), or
    ``image`` (an IMAGE [1, H, W, 3]) encoded by the fixture's VAE (image to image)."""
    if image is None:
        size = fixture.latent_size(px)
        return torch.zeros(1, fixture.spec.latent_channels, size, size)
    return fixture.vae.encode(image)


def sample(fixture: Fixture, patcher, caption: str, seed: int, steps: int, image: torch.Tensor | None = None,
           denoise: float = 1.0, px: int | None = None, sampler: str = "euler", scheduler: str = "simple") -> torch.Tensor:
    """One image as ComfyUI's KSampler makes it (``comfy.sample.sample``, its noise from ``seed``)
    and VAEDecode decodes it: text to image, or image to image from ``image`` (an IMAGE
    [1, H, W, 3]) at ``denoise``. ``patcher``: the fixture's model or a patched clone of it."""
    import comfy.sample

    latent = start_latent(fixture, image, px)
    noise = comfy.sample.prepare_noise(latent, seed)
    positive = fixture.conditioning(caption)
    negative = fixture.conditioning(EMPTY)
    out = comfy.sample.sample(patcher, noise, steps, CFG[fixture.spec.name], sampler, scheduler, positive, negative,
                              latent, denoise=denoise, seed=seed, disable_pbar=True)
    return fixture.vae.decode(out)
