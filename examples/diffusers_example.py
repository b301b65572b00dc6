"""TokenReduce on a diffusers pipeline: ToMe, then ToDo, with each run's report.

    python examples/diffusers_example.py                      # tiny random SD1.5-shaped pipeline, CPU, no download
    python examples/diffusers_example.py --model stable-diffusion-v1-5/stable-diffusion-v1-5 --device cuda

By default the pipeline is built from config with random weights (``tokenreduce.diffusers.tiny``):
it runs anywhere in seconds and shows the API and the reports, not images worth looking at. With
``--model`` it loads that pipeline with ``DiffusionPipeline.from_pretrained`` (downloaded by
diffusers) and saves the images.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without `pip install .`

from tokenreduce.diffusers import apply_patch, tiny  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a diffusers pipeline to load (default: a tiny random one, no download)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt", default="a photo of an astronaut riding a horse on mars")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    if args.model:
        from diffusers import DiffusionPipeline

        dtype = torch.float16 if args.device == "cuda" else torch.float32
        pipe = DiffusionPipeline.from_pretrained(args.model, torch_dtype=dtype).to(args.device)
        def run():
            return pipe(args.prompt, num_inference_steps=args.steps, generator=torch.Generator().manual_seed(0))
    else:
        pipe = tiny.pipeline()
        def run():
            return tiny.generate(pipe, steps=args.steps, size=128)

    # ToMe: the ComfyUI node's inputs, by name; what it patched is in .info.
    with apply_patch(pipe, "ToMe", ratio=0.5, seed=0) as patch:
        print(patch.info)
        output = run()
        print("\n".join(patch.report_lines()))
    if args.model:
        output.images[0].save("tome.png")

    # ToDo: every query stays, keys/values pooled 2x per side; on UNets and DiTs.
    with apply_patch(pipe, "ToDo", factor=2) as patch:
        output = run()
        print("\n".join(patch.report_lines()))
    if args.model:
        output.images[0].save("todo.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
