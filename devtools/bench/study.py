"""With a real checkpoint (``--checkpoint``): full sampling runs per configuration, the decoded
image's MSE and PSNR against the unpatched one, and a grid of the images."""

from __future__ import annotations

from pathlib import Path
from .families import latent_shape

PROMPT = "a lighthouse on a rocky cliff at sunset, dramatic sky, highly detailed photograph"
NEGATIVE = "blurry, low quality, watermark"


def encode(clip, text: str):
    return clip.encode_from_tokens_scheduled(clip.tokenize(text))


def conditioning(clip) -> tuple:
    return encode(clip, PROMPT), encode(clip, NEGATIVE)


def image_study(patched: dict, reductions: dict, vae, size: int, steps: int, conditioning: tuple, out: Path,
                label: str) -> dict:
    """Full sampling (euler, normal schedule, the same seed) of each model in ``patched`` (by
    config name, "unpatched" among them): MSE and PSNR of the decoded image against the
    unpatched one, and a grid image with the baseline on the left and reductions
    (``reductions[name]``) rising to the right."""
    import comfy.sample
    import numpy as np
    import torch
    from PIL import Image

    positive, negative = conditioning
    shape = latent_shape(patched["unpatched"], 1, size)
    noise = torch.randn(*shape, generator=torch.Generator().manual_seed(42))
    images = {}
    for name in sorted(patched, key=lambda n: (n != "unpatched", reductions[n])):
        with torch.inference_mode():
            latent = comfy.sample.sample(patched[name], noise, steps, 7.0, "euler", "normal", positive, negative,
                                         torch.zeros_like(noise), disable_pbar=True, seed=42)
            pixels = vae.decode(latent)[0].clamp(0, 1).float().cpu().numpy()
        images[name] = pixels
    reference = images["unpatched"]
    scores = {}
    for name, pixels in images.items():
        mse = float(((pixels - reference) ** 2).mean())
        scores[name] = (mse, float("inf") if mse == 0 else 10 * np.log10(1.0 / mse))
    tiles = [(np.asarray(p) * 255).round().astype("uint8") for p in images.values()]
    Image.fromarray(np.concatenate(tiles, axis=1)).save(out / f"grid_{label}.png")
    (out / f"grid_{label}.txt").write_text("left to right: " + ", ".join(images) + "\n")
    return scores

