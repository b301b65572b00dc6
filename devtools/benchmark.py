"""Side-by-side benchmark of token reduction in one process and one run.

    python3 devtools/benchmark.py                        # pinned ComfyUI, random weights, CPU or GPU
    python3 devtools/benchmark.py --quick                # a short subset
    python3 devtools/benchmark.py --compile              # also every config under torch.compile
    python3 devtools/benchmark.py --gpu-table OUT        # the GPU table of the issues, row by row, in 8 minutes
    python3 devtools/benchmark.py --gpu-table-video OUT  # its video preset: Wan 2.1 14B 720p, LTX-2, one step each
    python3 devtools/benchmark.py --gpu-table-tome OUT   # its ToMe preset (#38): ToMe vs ToDo at ~1 MP, Pareto fronts
    python3 devtools/benchmark.py --gpu-table-peaks OUT  # its peaks preset (#50): the window vs nearest, ToMe's new settings
    python3 devtools/benchmark.py --quality OUT          # trained photo fixtures: LPIPS, SSIM, PSNR per setting
        [--fixtures sd15 flux] [--seeds 16] [--long-seeds N] [--steps 20 4] [--modes t2i i2i] [--candidates]
    python3 devtools/benchmark.py --distribution OUT     # the same settings' images as sets: KID against unpatched
        [--fixtures sd15 flux] [--seeds 32] [--steps 4]
    python3 devtools/benchmark.py --unit-blocks OUT      # the budget's candidate units per Flux fixture block
    python3 devtools/benchmark.py --peakedness           # attention peakedness per layer of the photo fixtures
    python3 devtools/benchmark.py --window-speed         # ToDo's window against nearest, one attention call (CPU)
    python3 devtools/benchmark.py --corrected-speed OUT  # ToMe's correct_from_whole in whole sampling runs (Flux fixture)
    python3 devtools/benchmark.py --diffusers-fixture OUT  # the trained photo fixtures through the diffusers adapter
    python3 devtools/benchmark.py --budget-reach OUT     # the quality budget across denoise (photo fixtures)
    python3 devtools/benchmark.py --prediction-change OUT  # measure_change's readout beside LPIPS (photo fixtures)
    python3 devtools/benchmark.py --tome-dit [--clock cpu]  # ToMe on DiTs vs ToDo: Pareto table per tiny DiT
        [--families Flux Wan21] [--size 512] [--repeats N] [--threads N]
    python3 devtools/benchmark.py --diffusers            # diffusers pipelines: the table of diffusers' ToMe docs
        [--full] [--device cuda] [--sizes 512 1024] [--batches 1 2] [--steps N] [--repeats N] [--clock cpu]
    /path/to/ComfyUI/venv/python devtools/benchmark.py --comfyui /path/to/ComfyUI [--checkpoint ckpt.safetensors]

For each model family, size and attention backend it runs one denoising step (one model call
per CFG half, batch 2 as with CFG) of every configuration through ComfyUI's own sampler path,
on the same spatially smooth input, and reports:

- seconds per model forward (median of repeats after warm-up runs; the repeats of all
  configurations interleaved round by round, so drift of the machine's speed hits all alike)
  and the speed-up against the unpatched model measured in the same run;
- peak memory of each pass (CUDA: the allocator's peak; CPU: the peak resident set above the
  pass's start), the attention working set (the largest q + k + v + attention scores the
  backend holds at once of any attention call), and the time spent planning merges (ToMe);
- quality: relative L2 error of the model output (noise prediction) against unpatched;
- the Amdahl bound (UNets): the share of the unpatched forward spent in the parts a
  configuration reduces (self-attention's projections and the attention itself, the MLP, per
  level), the speed-up that share allows if those parts cost nothing, and the speed-up it
  allows if each reduced part cost in proportion to the tokens it keeps (keys/values pooled
  4x: the attention and the key/value projections at a quarter, the query and output
  projections unchanged); the measured speed-up as a fraction of that second bound is what
  the implementation's own overhead (planning, gathers, pooling) costs;
- with --compile, every configuration also compiled through ComfyUI's own
  set_torch_compile_wrapper (its TorchCompileModel node): speed-up against compiled
  unpatched in the same run, and compiled against eager per configuration.

Writes ``results.md``, ``results.json`` and PNG plots (per family, size and attention: the
curves against the ratio, and speed-up against error with the Pareto front) to ``--out``.
The code is in ``devtools/bench/``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import host  # noqa: E402  (devtools/host.py)
from bench import cli  # noqa: E402


def main() -> int:
    if "--diffusers" in sys.argv[1:]:  # diffusers pipelines: their own table (bench/diffusers_table.py)
        host.run_inside_host(__file__)
        from bench import diffusers_table
        return diffusers_table.main(sys.argv[1:])
    if "--tome-dit" in sys.argv[1:]:  # ToMe on DiTs against ToDo: per model a Pareto table (bench/tome_dit_table.py)
        # with --comfyui: that tree, in this Python (its venv's); else the pinned host
        other = any(arg == "--comfyui" or arg.startswith("--comfyui=") for arg in sys.argv[1:])
        pinned = None if other else host.run_inside_host(__file__)
        from bench import tome_dit_table
        return tome_dit_table.main(sys.argv[1:], pinned and pinned.comfyui)
    if "--quality" in sys.argv[1:]:  # the trained photo fixtures: LPIPS, SSIM, PSNR per setting (bench/quality_table.py)
        other = any(arg == "--comfyui" or arg.startswith("--comfyui=") for arg in sys.argv[1:])
        pinned = None if other else host.run_inside_host(__file__)
        from bench import quality_table
        return quality_table.main(sys.argv[1:], pinned and pinned.comfyui)
    if "--distribution" in sys.argv[1:]:  # the photo fixtures' images as sets: KID per setting (bench/distribution_table.py)
        other = any(arg == "--comfyui" or arg.startswith("--comfyui=") for arg in sys.argv[1:])
        pinned = None if other else host.run_inside_host(__file__)
        from bench import distribution_table
        return distribution_table.main(sys.argv[1:], pinned and pinned.comfyui)
    if "--budgets" in sys.argv[1:]:  # reduce_when auto's quality budget on the photo fixtures (bench/budget_table.py)
        other = any(arg == "--comfyui" or arg.startswith("--comfyui=") for arg in sys.argv[1:])
        pinned = None if other else host.run_inside_host(__file__)
        from bench import budget_table
        return budget_table.main(sys.argv[1:], pinned and pinned.comfyui)
    if "--budget-reach" in sys.argv[1:]:  # the budget across denoise on the photo fixtures (bench/reach_table.py)
        other = any(arg == "--comfyui" or arg.startswith("--comfyui=") for arg in sys.argv[1:])
        pinned = None if other else host.run_inside_host(__file__)
        from bench import reach_table
        return reach_table.main(sys.argv[1:], pinned and pinned.comfyui)
    if "--prediction-change" in sys.argv[1:]:  # measure_change's readout beside LPIPS (bench/prediction_change.py)
        pinned = host.run_inside_host(__file__)
        from bench import prediction_change
        return prediction_change.main(sys.argv[1:], pinned.comfyui)
    if "--unit-blocks" in sys.argv[1:]:  # which budget unit ranks the Flux fixture's blocks (bench/unit_blocks.py)
        pinned = host.run_inside_host(__file__)
        from bench import unit_blocks
        return unit_blocks.main(sys.argv[1:], pinned.comfyui)
    if "--corrected-speed" in sys.argv[1:]:  # ToMe's correct_from_whole in whole runs (bench/corrected_runs.py)
        other = any(arg == "--comfyui" or arg.startswith("--comfyui=") for arg in sys.argv[1:])
        pinned = None if other else host.run_inside_host(__file__)
        from bench import corrected_runs
        return corrected_runs.main(sys.argv[1:], pinned and pinned.comfyui)
    if "--diffusers-fixture" in sys.argv[1:]:  # the trained photo fixtures through diffusers (bench/diffusers_fixture_table.py)
        other = any(arg == "--comfyui" or arg.startswith("--comfyui=") for arg in sys.argv[1:])
        pinned = None if other else host.run_inside_host(__file__)
        from bench import diffusers_fixture_table
        return diffusers_fixture_table.main(sys.argv[1:], pinned and pinned.comfyui)
    if "--window-speed" in sys.argv[1:]:  # ToDo's window against nearest, one attention call (bench/window_speed.py)
        if "cuda" not in sys.argv[1:]:  # a lent GPU has no pinned host: its own Python and torch (host-free)
            host.run_inside_host(__file__)
        from bench import window_speed
        return window_speed.main(sys.argv[1:])
    if "--peakedness" in sys.argv[1:]:  # attention peakedness per layer of the photo fixtures (bench/peakedness.py)
        pinned = host.run_inside_host(__file__)
        from bench import peakedness
        return peakedness.main(sys.argv[1:], pinned.comfyui)
    pinned = None
    if {"--gpu-table", "--gpu-table-video", "--gpu-table-tome", "--gpu-table-peaks"} & set(sys.argv[1:]) and os.environ.get("TOKENREDUCE_COMFYUI") and "--comfyui" not in sys.argv[1:]:
        sys.argv[1:1] = ["--comfyui", os.environ["TOKENREDUCE_COMFYUI"]]  # a lent GPU: its tree, this Python
    if not any(arg == "--comfyui" or arg.startswith("--comfyui=") for arg in sys.argv[1:]):
        # Into the pinned host before parsing: the tiny DiT fixtures (--families) import torch.
        pinned = host.run_inside_host(__file__)
    parser = cli.parser(__doc__)
    args = parser.parse_args()
    if args.comfyui is None:
        args.comfyui = pinned.comfyui
    cli.complete(parser, args)
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
