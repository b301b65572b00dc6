"""One denoising step through ComfyUI's sampler, the unit every timed pass runs."""

from __future__ import annotations

from .families import latent_shape

AUDIO_LATENTS_PER_SECOND = 25  # LTX-2's audio VAE: 16 kHz, mel hop 160, 4x down (LTXVEmptyLatentAudio)
FRAME_RATE = 25  # LTX-2's default frame rate (its extra_conds' default)


def with_audio(model, latent, noise, video_frames: int) -> tuple:
    """The latent and noise with LTX-2's audio beside the video (a nested latent, as
    LTXVConcatAVLatent makes it): LTXVEmptyLatentAudio's length for the video's frames at
    FRAME_RATE, the model's audio channels and frequency bins."""
    import comfy.nested_tensor
    import torch

    diffusion_model = model.get_model_object("diffusion_model")
    audio = (latent.shape[0], diffusion_model.num_audio_channels,
             round(video_frames / FRAME_RATE * AUDIO_LATENTS_PER_SECOND), diffusion_model.audio_frequency_bins)
    audio_noise = torch.randn(audio, generator=torch.Generator().manual_seed(13))
    return (comfy.nested_tensor.NestedTensor((latent, torch.zeros(audio))),
            comfy.nested_tensor.NestedTensor((noise, audio_noise)))


class OneStep:
    """Runs one CFG denoising step through ComfyUI's sampler (so wrappers and per-run state work
    as in real sampling) and returns the model's raw noise predictions for the cond and uncond
    halves of the batch (before CFG, which would amplify differences by the cfg scale).

    Any diffusion model: the latent's shape comes from the model's latent format, the text
    conditioning is given (``(positive, negative)``, or a function of the latent's shape giving
    them: inputs sized for the latent, as Wan S2V's reference and motion frames). ``audio``: an
    audio latent beside the video (LTX-2), as ``with_audio`` makes it.

    With ``evals`` > 1 the step evaluates the model that many times at the same sigma inside one
    sampling run: on a GPU a forward takes tens of milliseconds, and the sampler's per-run setup
    (model loading checks, conditioning) would otherwise be timed as if it were part of every
    step. Each evaluation plans its merges afresh (plans never outlive a model call)."""

    def __init__(self, model, size: int, conditioning: tuple, *, batch_images: int = 1, sigma_percent: float = 0.5,
                 evals: int = 1, downscale: int = 8, frames: int = 1, audio: bool = False):
        import comfy.samplers
        import random_models
        import torch

        self.torch = torch
        shape = latent_shape(model, batch_images, size, downscale, frames)
        video = dict(frames=shape[2]) if len(shape) == 5 else {}
        self.latent = random_models.smooth_latent(shape[0], shape[-2], shape[-1], seed=11, channels=shape[1], **video)
        self.noise = random_models.smooth_latent(shape[0], shape[-2], shape[-1], seed=12, channels=shape[1], **video)
        if audio:
            time_down = model.get_model_object("latent_format").temporal_downscale_ratio
            self.latent, self.noise = with_audio(model, self.latent, self.noise, (shape[2] - 1) * time_down + 1)
        self.positive, self.negative = conditioning(shape) if callable(conditioning) else conditioning
        self.sigma_percent = sigma_percent
        self.evals = evals
        self.sampler = comfy.samplers.KSAMPLER(self._evaluate)
        self._raw = None

    def _evaluate(self, model, x, sigmas, extra_args=None, callback=None, disable=None):
        sigma = sigmas[0] * x.new_ones([x.shape[0]])
        for _ in range(self.evals):
            denoised = model(x, sigma, **(extra_args or {}))
        return denoised

    def _record(self, args):
        x = args["input"]
        sigma = args["sigma"].reshape(-1, *[1] * (x.ndim - 1))
        self._raw = self.torch.cat([(x - args["cond_denoised"]) / sigma, (x - args["uncond_denoised"]) / sigma])
        return args["denoised"]

    def __call__(self, model):
        import comfy.sample

        recording = model.clone()
        recording.set_model_sampler_post_cfg_function(self._record)
        sigma = model.get_model_object("model_sampling").percent_to_sigma(self.sigma_percent)
        sigmas = self.torch.tensor([sigma, 0.0])
        with self.torch.inference_mode():  # as ComfyUI runs its nodes
            comfy.sample.sample_custom(recording, self.noise, 5.0, self.sampler, sigmas, self.positive,
                                       self.negative, self.latent, disable_pbar=True, seed=0)
        if self.torch.cuda.is_available():
            self.torch.cuda.synchronize()
        return self._raw.float().cpu()
