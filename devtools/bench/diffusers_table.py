"""The table of diffusers' ToMe documentation, for diffusers pipelines patched by tokenreduce.diffusers.

    python3 devtools/benchmark.py --diffusers                   # tiny random SD1.5-shaped pipeline, CPU
    python3 devtools/benchmark.py --diffusers --full --device cuda --sizes 512 1024 2048 --batches 1 2 4

diffusers' docs time whole pipeline runs of SD1.5 per resolution and batch size, vanilla against
tomesd and tomesd + xFormers. Here the same shape: seconds per pipeline run (all steps, CFG on,
latents out: no VAE decode) of

- vanilla: the unpatched UNet with the classic attention processor (``AttnProcessor``: the
  attention written out in matmuls, as diffusers ran it when those docs were written);
- ToMe: ``apply_patch(pipe, "ToMe", ratio=0.5)`` on that processor;
- ToMe + SDPA: the same with ``AttnProcessor2_0`` (torch's fused scaled_dot_product_attention,
  today's default and the role xFormers played then);
- ToDo: ``apply_patch(pipe, "ToDo", factor=2)`` with SDPA;
- SDPA alone, so each method's own gain can be read off too;

and the speed-ups against vanilla. The runs of all configurations are interleaved round by round
(drift of the machine hits all alike); the median of the rounds is shown. Random weights, built
from config (``--full``: SD1.5's UNet config; default: a tiny UNet of the same shape): nothing is
downloaded, and the times are those of the real architecture.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from . import REPO

if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # the tokenreduce package of this checkout

CONFIGS = ("vanilla", "SDPA", "ToMe", "ToMe + SDPA", "ToDo")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--diffusers", action="store_true", help="this table (the flag that selects it)")
    p.add_argument("--sizes", nargs="+", type=int, default=[256, 384], help="px, square")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2], help="images per prompt batch")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2,
                   help="timed rounds after one untimed warm-up round (0: one timed round, no warm-up: a smoke test)")
    p.add_argument("--full", action="store_true", help="SD1.5's full-size UNet (random weights) instead of a tiny one")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: the process's CPU seconds (all its threads) instead of wall-clock seconds; steadier "
                        "than wall time on a CPU shared with other work")
    return p


def _pipeline(full: bool, device: str):
    from diffusers import UNet2DConditionModel

    from tokenreduce.diffusers import tiny

    pipe = tiny.pipeline()
    if full:  # SD1.5's UNet: diffusers' default config with SD1.5's text width
        unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8)
        pipe.register_modules(unet=tiny._random_weights(unet, 0))
    dtype = torch.float16 if device == "cuda" else torch.float32
    return pipe.to(device, dtype)


def _configure(pipe, config: str, args):
    """Set the processor and the patch of one configuration; returns the patch (or None)."""
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    from tokenreduce.diffusers import apply_patch, remove_patch

    remove_patch(pipe)
    pipe.unet.set_attn_processor(AttnProcessor2_0() if config in ("SDPA", "ToMe + SDPA", "ToDo") else AttnProcessor())
    if config.startswith("ToMe"):
        return apply_patch(pipe, "ToMe", ratio=args.ratio, reduce_when="always")
    if config == "ToDo":
        return apply_patch(pipe, "ToDo", factor=args.factor, reduce_when="always")
    return None


def _run_seconds(pipe, size: int, batch: int, args) -> float:
    from tokenreduce.diffusers import tiny

    embeds = tiny.prompt(pipe, batch)
    text_width = pipe.unet.config.cross_attention_dim
    if embeds["prompt_embeds"].shape[-1] != text_width:  # the full-size UNet reads wider text
        embeds = {k: torch.zeros(*v.shape[:-1], text_width) + v.mean() for k, v in embeds.items()}
    embeds = {k: v.to(pipe.device, pipe.unet.dtype) for k, v in embeds.items()}
    sync = torch.cuda.synchronize if pipe.device.type == "cuda" else (lambda: None)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    sync()
    start = clock()
    pipe(**embeds, num_inference_steps=args.steps, guidance_scale=7.5, height=size, width=size,
         generator=torch.Generator().manual_seed(0), output_type="latent")
    sync()
    return clock() - start


def measure(args) -> list[dict]:
    pipe = _pipeline(args.full, args.device)
    rows = []
    for size in args.sizes:
        for batch in args.batches:
            times = {config: [] for config in CONFIGS}
            warmup = 1 if args.repeats else 0
            for round_ in range(max(1, args.repeats) + warmup):
                for config in CONFIGS:
                    _configure(pipe, config, args)
                    seconds = _run_seconds(pipe, size, batch, args)
                    if round_ >= warmup:
                        times[config].append(seconds)
            rows.append({"size": size, "batch": batch, **{c: statistics.median(t) for c, t in times.items()}})
            print(table([rows[-1]]).splitlines()[-1], file=sys.stderr, flush=True)
    _configure(pipe, "SDPA", args)
    from tokenreduce.diffusers import remove_patch
    remove_patch(pipe)
    return rows


def table(rows: list[dict]) -> str:
    head = ("| Resolution | Batch size | Vanilla | SDPA | ToMe | ToMe + SDPA | ToDo | ToMe speed-up | "
            "ToMe + SDPA speed-up | ToDo speed-up |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        v = r["vanilla"]
        lines.append(f"| {r['size']} | {r['batch']} | {v:.2f} s | {r['SDPA']:.2f} s | {r['ToMe']:.2f} s | "
                     f"{r['ToMe + SDPA']:.2f} s | {r['ToDo']:.2f} s | {v / r['ToMe']:.2f}x | "
                     f"{v / r['ToMe + SDPA']:.2f}x | {v / r['ToDo']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"tokenreduce.diffusers on {'SD1.5' if args.full else 'a tiny SD1.5-shaped'} UNet (random weights), "
          f"{name}, {args.steps} steps with CFG, ToMe ratio {args.ratio:g}, ToDo factor {args.factor:g}; "
          f"{'CPU ' if args.clock == 'cpu' else ''}seconds per pipeline run, median of {max(1, args.repeats)}:",
          flush=True)
    print(table(measure(args)))
    return 0
