"""Train the photo fixtures (devtools/photo_fixtures.py): seeded, reproducible, once; never in CI.

    python3 devtools/train_fixtures.py                      # both, the preset of this machine's device
    python3 devtools/train_fixtures.py flux --preset cpu    # one; cpu: within 90 minutes on 2 cores
    python3 devtools/train_fixtures.py --preset gpu --out DIR --minutes 3

Data: the training photos of ``photo_fixtures.PHOTOS`` (skimage.data, CC0 / public domain),
random resized crops (short side 1-2x the crop) and horizontal flips, drawn from a seeded
generator; each sample's caption is its photo's, replaced by the empty caption one time in ten
(so the empty caption is the unconditional one, as CFG needs). The latent map (principal
components of the photos' 8x8 patches) is fitted first, deterministically.

Objective, through the model's real path (``BaseModel.apply_model``: the model sampling's input
scaling, timestep and denoised output): the noisy latent is the model sampling's own
``noise_scaling`` at a noise level drawn uniformly from its schedule, and the loss is
``((denoised - clean) / sigma) ** 2``, which is the epsilon MSE of SD's objective for the UNet and
the velocity MSE of flow matching for Flux. AdamW, linear warm-up, an exponential moving average
of the weights (the average is what is saved, in float16, beside the text embedding and the
latent map in float32).

Presets: ``gpu`` trains at the native size throughout; ``cpu`` trains at half size and finishes
at the native size. ``--minutes`` caps each fixture's training time (the step count then says
where it stopped: runs on other machines stop elsewhere; the saved card records it).
At the end each fixture's usefulness is checked on the held-out photos (``denoise_gain``) and
written into its card.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import host  # noqa: E402  (devtools/host.py)

try:  # the pinned host's Python has torch; the system Python only re-executes into it
    import torch
    from torch.overrides import TorchFunctionMode
except ImportError:  # pragma: no cover
    TorchFunctionMode = object

PRESETS = {
    # name: {fixture: (batch, steps at half size, steps at native size, learning rate)}
    "gpu": {"flux": (32, 0, 6000, 4e-4), "sd15": (64, 0, 6000, 4e-4)},
    "cpu": {"flux": (8, 700, 150, 4e-4), "sd15": (16, 1200, 300, 4e-4)},
}
WARMUP = 200
EMA = 0.998
CAPTION_DROP = 0.1


def _init_weights(module, spec) -> None:
    """ComfyUI's layers skip torch's initialisation (weights are always loaded there): apply
    torch's defaults to every layer torch has one for, ones to the remaining norm scales, and
    zero the output layer so training starts from a zero prediction."""
    import torch

    done = set()
    for m in module.modules():
        for base in (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv1d, torch.nn.Embedding, torch.nn.LayerNorm,
                     torch.nn.GroupNorm):
            if isinstance(m, base):
                base.reset_parameters(m)
                done.update(id(p) for p in m.parameters(recurse=False))
                break
    for name, p in module.named_parameters():
        if id(p) not in done:  # e.g. the RMSNorm scales of Flux's query/key norms
            torch.nn.init.ones_(p) if name.endswith(("scale", "weight")) else torch.nn.init.zeros_(p)
    dm = module.diffusion_model
    last = dm.final_layer.linear if spec.name == "flux" else dm.out[-1]
    torch.nn.init.zeros_(last.weight)
    torch.nn.init.zeros_(last.bias)


class _OutOfPlaceAdds(TorchFunctionMode):
    """ComfyUI's Flux blocks add residuals in place (``img += ...``), which is right for inference
    and breaks autograd (a normalisation saved the tensor before the add). In training ``+=``
    returns a new tensor instead: Python rebinds the name, the values are the same."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.add_ and torch.is_grad_enabled():  # what ``+=`` dispatches to
            return torch.add(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class Crops:
    """Random resized crops of the training photos, from a seeded generator."""

    def __init__(self, generator, largest: int, device: str):
        import photo_fixtures as pf

        # Each photo once at the largest scale a crop needs (short side 2x the largest crop), on
        # the training device: a crop is then a small resize there.
        self.photos = [(self._shrink(pf.load_photo(p.name), 2 * largest).to(device), p.caption)
                       for p in pf.PHOTOS if not p.held_out]
        self.generator = generator

    @staticmethod
    def _shrink(photo, short: int):
        import torch

        _, h, w = photo.shape
        scale = min(1.0, short / min(h, w))
        size = (max(1, round(h * scale)), max(1, round(w * scale)))
        return torch.nn.functional.interpolate(photo[None], size=size, mode="bilinear", antialias=True,
                                               align_corners=False)[0]

    def batch(self, size: int, count: int):
        import torch

        images, captions = [], []
        g = self.generator
        for _ in range(count):
            index = int(torch.randint(len(self.photos), (1,), generator=g))
            photo, caption = self.photos[index]
            _, h, w = photo.shape
            short = size * (1 + float(torch.rand(1, generator=g)))
            scale = short / min(h, w)
            nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
            resized = torch.nn.functional.interpolate(photo[None], size=(nh, nw), mode="bilinear", antialias=True,
                                                      align_corners=False)[0]
            top = int(torch.randint(nh - size + 1, (1,), generator=g))
            left = int(torch.randint(nw - size + 1, (1,), generator=g))
            crop = resized[:, top:top + size, left:left + size]
            if float(torch.rand(1, generator=g)) < 0.5:
                crop = crop.flip(-1)
            images.append(crop.clamp(0, 1))
            captions.append("" if float(torch.rand(1, generator=g)) < CAPTION_DROP else caption)
        return torch.stack(images), captions


def train(name: str, preset: str, device: str, seed: int, minutes: float, out: Path, log=print) -> dict:
    import torch

    import photo_fixtures as pf

    spec = pf.SPECS[name]
    batch, half_steps, native_steps, lr = PRESETS[preset][name]
    torch.manual_seed(seed)  # the weights' initialisation (a script of its own: no node runs here)
    model, text, codec = pf.build(spec, torch.float32)
    _init_weights(model, spec)
    torch.nn.init.normal_(text.embedding.weight, std=1.0)
    codec.fit([pf.square(pf.load_photo(p.name), 512) for p in pf.PHOTOS if not p.held_out])
    model.to(device).train()
    text.to(device).train()
    codec.to(device)
    params = list(model.diffusion_model.parameters()) + list(text.parameters())
    ema = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.99))
    generator = torch.Generator().manual_seed(seed + 1)
    crops = Crops(generator, spec.native_px, device)
    sampling = model.model_sampling
    sigmas = sampling.sigmas.to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else torch.autocast(
        "cpu", enabled=False)
    start = time.monotonic()
    schedule = [spec.native_px // 2] * half_steps + [spec.native_px] * native_steps
    losses, step = [], 0
    for step, size in enumerate(schedule, 1):
        if time.monotonic() - start > minutes * 60:
            step -= 1
            log(f"{name}: time limit ({minutes} min) at step {step} of {len(schedule)}")
            break
        images, captions = crops.batch(size, batch)
        with torch.no_grad():
            clean = model.process_latent_in(codec.encode(images * 2 - 1))
            noise = torch.randn(clean.shape, generator=generator).to(device)
            sigma = sigmas[torch.randint(len(sigmas), (batch,), generator=generator).to(device)]
            noisy = sampling.noise_scaling(sigma, noise, clean)
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, step / WARMUP)
        tokens = text(captions)
        extras = {"y": tokens.mean(1)} if spec.pooled else {}
        with autocast, _OutOfPlaceAdds():
            denoised = model.apply_model(noisy, sigma, c_crossattn=tokens, **extras)
        loss = (((denoised.float() - clean) / sigma.view(-1, 1, 1, 1)) ** 2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        with torch.no_grad():
            decay = min(EMA, (1 + step) / (10 + step))
            for e, p in zip(ema, params):
                e.lerp_(p.detach(), 1 - decay)
        losses.append(loss.item())
        if step % 100 == 0 or step == len(schedule):
            log(f"{name}: step {step}/{len(schedule)} size {size} loss {sum(losses[-100:]) / len(losses[-100:]):.4f} "
                f"{time.monotonic() - start:.0f} s")
    with torch.no_grad():
        for e, p in zip(ema, params):
            p.copy_(e)
    model.to("cpu").eval()
    text.to("cpu").eval()
    codec.to("cpu")
    out.mkdir(parents=True, exist_ok=True)
    import comfy.utils

    comfy.utils.save_torch_file(pf.state_dict(model, text, codec), str(out / f"{name}.safetensors"))
    return {"fixture": name, "preset": preset, "device": _device_name(device), "seed": seed, "batch": batch,
            "steps": step, "planned_steps": len(schedule), "half_size_steps": min(step, half_steps),
            "learning_rate": lr, "seconds": round(time.monotonic() - start, 1),
            "final_loss": round(sum(losses[-100:]) / max(1, len(losses[-100:])), 4),
            "parameters": sum(p.numel() for p in model.diffusion_model.parameters()),
            "torch": torch.__version__}


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(0)
    return f"CPU ({torch.get_num_threads()} threads)"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent.parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("fixtures", nargs="*", default=["flux", "sd15"])
    parser.add_argument("--preset", choices=sorted(PRESETS))
    parser.add_argument("--device")
    parser.add_argument("--seed", type=int, default=44)
    parser.add_argument("--minutes", type=float, default=44.0, help="per fixture (cpu: 2 x 44 < 90 minutes)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--comfyui", help="a ComfyUI tree to import (a lent GPU's copy); else the pinned host")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(args.comfyui).resolve() if args.comfyui else host.host_location().comfyui))
    import torch
    from comfy.cli_args import args as comfy_args

    comfy_args.cpu = not torch.cuda.is_available()

    import photo_fixtures as pf

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    preset = args.preset or ("gpu" if device.startswith("cuda") else "cpu")
    out = args.out or pf.TRAINED
    cards = {}
    for name in args.fixtures:
        card = train(name, preset, device, args.seed, args.minutes, out)
        card["commit"] = _commit()
        card["usefulness"] = pf.denoise_gain(name, out)
        print(json.dumps(card), flush=True)
        cards[name] = card
        (out / f"{name}.json").write_text(json.dumps(card, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    if "--comfyui" not in " ".join(sys.argv[1:]):
        host.run_inside_host(__file__)
    sys.exit(main(sys.argv[1:]))
