"""The GPU table of the issues in one command, for a lent GPU (issue #37):

    python3 devtools/benchmark.py --gpu-table OUT --comfyui /path/to/ComfyUI [--deadline 480] [--rows KEY ...]
    python3 devtools/benchmark.py --gpu-table OUT --tiny [--deadline 20]     # the same rows, tiny models, CPU
    python3 devtools/benchmark.py --gpu-table OUT --plan                     # the rows, budgets, expected time

Each row of ``ROWS`` is one model at one size: the unpatched model (or the reference stack: an
attention backend, HyperTile, compiling) and its patched variants, side by side in this process.
A row builds its model (kept for the next rows of the same model), runs each variant once untimed
(its first run: ``reduce_when auto``'s measuring, or compiling), then whole sampling runs (4 euler
steps) in alternating rounds, the order rotated each round, until it has ``min_rounds`` and its
timed share of the budget is spent (at most ``max_rounds``). Medians count; the spread of the
per-round speed-ups says how far noise goes.

Every measured line is written when its row ends, to ``gpu_table.jsonl`` (one JSON object a line)
and ``gpu_table.md`` (one table line), each flushed and fsynced: a run that is cut keeps every row
it finished. A row runs under its budget (a timer interrupts it: "over budget, not measured", with
what it had measured, its compile seconds say); the whole run under ``--deadline`` (rows it cannot
start are written as "deadline: not run"). Build, first-run and compile seconds are reported apart
from the timed runs.

A later row is one line of ``ROWS``; ``pending`` names why it is not measured yet.

The video preset (issue #39) is a second table with its own deadline, the 720p and longer rows
whose single step takes tens of seconds at full size (Wan 2.1 14B, the layout of each Wan 2.2
A14B expert, at 1280x720 and 81 frames; LTX-2 19B at 1280x704 and 121 frames with its audio):

    python3 devtools/benchmark.py --gpu-table-video OUT --comfyui /path/to/ComfyUI [--plan]

Its rows time one sampling step (``steps``): each variant's first run is its warm-up (and
auto's measuring), then the rounds time one step each, unpatched and patched side by side.
A variant the node refuses is written "refused: <the node's reason>".

The ToMe preset (issue #38) is a third table with its own deadline: ToMe through whole blocks
against ToDo at about one megapixel, where most images are made (Flux.1 1024 px, SDXL 1024 px,
Qwen-Image 1328 px, Wan 2.1 1.3B 480p 81 frames, SD1.5 1024 px; on the UNets also ToMe's tile
matching, the MLP and cross-attention, and deeper levels):

    python3 devtools/benchmark.py --gpu-table-tome OUT --comfyui /path/to/ComfyUI [--plan]

The peaks preset (issue #50) is a fourth: each of that issue's settings beside the old one at the
same token count, all ``reduce_when always`` (ToDo's window against nearest at 1 MP and 2 MP, on
Wan 2.1 and the UNets; ToMe's proportional attention, ``min_similarity`` and ``correct_from_whole``
beside plain ToMe); on CUDA every line also has the allocator's peak over the variant's first run:

    python3 devtools/benchmark.py --gpu-table-peaks OUT --comfyui /path/to/ComfyUI [--plan]

Every line of every preset says whether its variant is on the row's Pareto front (speed-up against
relative error, unpatched counted at 1x and 0; ``tome_dit_table._pareto``) or which variants are
both faster and closer, and, where the row has ToDo factor 3, the variant's error as a multiple of
its. A ToMe variant's Amdahl bound on a DiT is that of whole-block merging (the merged blocks'
share s of the unpatched forward, timed with hooks, at f = merged tokens / tokens:
1 / (1 - s + s * f)); stacked with ToDo, the bound of both savings added: 1 / (1 / b_ToMe + 1 / b_ToDo - 1).
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

UNPATCHED = "unpatched"  # configs.UNPATCHED's name (configs imports the pack, hence torch: not at import)

STEPS = 4  # euler, simple schedule, as gpu-h200.md
TINY_STEPS = 2  # --tiny: a check of the table on a CPU in seconds, not a timing
MIN_START = 5.0  # seconds: a row is not started with less left before the deadline
DEFAULT_DEADLINE = 480.0  # 8 minutes: leaves the device machine's start and a rerun inside its 15
TABLE, VIDEO, TOME_PRESET, PEAKS = "table", "video", "tome", "peaks"  # --gpu-table, -video, -tome, -peaks


class OverBudget(Exception):
    """Raised by the row timer."""


class Refused(Exception):
    """A variant's node refused the model: its reason."""


@dataclass(frozen=True)
class ModelSpec:
    """A random-weight model as the table builds it: ComfyUI's own classes, released layout."""

    label: str
    family: str  # random_dits family, or a UNet family of random_models ("SD15", "SDXL")
    full: dict = field(default_factory=dict)  # unet_config of the released model (DiTs)
    text: int = 0  # the text encoder's width at full size (DiTs; 0: the family's own)
    pooled: int = 0  # the pooled text's width at full size (Flux: CLIP-L 768)
    dtype: str = "bfloat16"
    cfg: float = 5.0
    tiny_size: str = "64"  # the size and latent frames a --tiny run uses instead
    tiny_frames: int = 9  # video frames
    audio: bool = False  # an audio latent beside the video (LTX-2: a nested latent, as LTXVConcatAVLatent)

    @property
    def unet(self) -> bool:
        return self.family in ("SD15", "SDXL", "SD21")


WAN_13B = {"image_model": "wan2.1", "dim": 1536, "ffn_dim": 8960, "num_heads": 12, "num_layers": 30,
           "text_dim": 4096, "in_dim": 16, "out_dim": 16, "freq_dim": 256, "patch_size": (1, 2, 2),
           "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}
# Wan 2.1 14B (t2v; i2v with 36 input channels and CLIP-vision tokens); each expert of Wan 2.2
# A14B (high noise, low noise) has this layout (i2v: 36 input channels, no CLIP-vision tokens).
WAN_14B = {**WAN_13B, "model_type": "t2v", "dim": 5120, "ffn_dim": 13824, "num_heads": 40, "num_layers": 40}
WAN22_5B = {**WAN_13B, "model_type": "t2v", "dim": 3072, "ffn_dim": 14336, "num_heads": 24, "num_layers": 30,
            "in_dim": 48, "out_dim": 48}  # Wan 2.2 TI2V 5B: 48-channel latent, 16x VAE
# LTX-2 19B (ComfyUI 0.33's LTXAV): what detection reads off the file (48 blocks, video heads of 128,
# text cross-attention 4096) with the file's "config" metadata; the audio stream and the text
# connectors at the released widths (LTXAVModel's defaults).
LTX2_19B = {"image_model": "ltxav", "num_layers": 48, "attention_head_dim": 128, "num_attention_heads": 32,
            "cross_attention_dim": 4096, "caption_channels": 3840, "in_channels": 128, "out_channels": 128,
            "audio_in_channels": 128, "audio_attention_head_dim": 64, "audio_num_attention_heads": 32,
            "audio_cross_attention_dim": 2048, "connector_attention_head_dim": 128,
            "connector_num_attention_heads": 30, "connector_num_layers": 2,
            "use_keyframes_abs_pos_embedding": False}
MODELS = {
    "wan21": ModelSpec("Wan 2.1 1.3B", "wan21_t2v", WAN_13B, text=4096, tiny_size="96x64"),
    "wan21_vace": ModelSpec("Wan 2.1 VACE 1.3B", "wan21_vace",
                            {**WAN_13B, "model_type": "vace", "vace_layers": 15, "vace_in_dim": 96},
                            text=4096, tiny_size="96x64"),
    "flux_dev": ModelSpec("Flux.1 [dev]", "flux_dev",
                          {"hidden_size": 3072, "num_heads": 24, "depth": 19, "depth_single_blocks": 38,
                           "context_in_dim": 4096, "vec_in_dim": 768, "axes_dim": [16, 56, 56]},
                          text=4096, pooled=768, cfg=1.0),
    "ltxv": ModelSpec("LTX-Video 2B", "ltxv",
                      {"image_model": "ltxv", "num_layers": 28, "attention_head_dim": 64, "num_attention_heads": 32,
                       "cross_attention_dim": 2048, "caption_channels": 4096, "in_channels": 128,
                       "out_channels": 128},
                      text=4096, cfg=3.0, tiny_size="96x64", tiny_frames=9),
    "wan21_14b": ModelSpec("Wan 2.1 14B", "wan21_t2v", WAN_14B, text=4096, tiny_size="96x64"),
    "wan21_14b_i2v": ModelSpec("Wan 2.1 I2V 14B", "wan21_i2v", {**WAN_14B, "model_type": "i2v", "in_dim": 36},
                               text=4096, tiny_size="96x64"),
    "wan22_a14b_i2v": ModelSpec("Wan 2.2 I2V A14B expert", "wan22_i2v_a14b", {**WAN_14B, "in_dim": 36}, text=4096,
                                tiny_size="96x64"),
    "wan22_5b": ModelSpec("Wan 2.2 TI2V 5B", "wan22_ti2v_5b", WAN22_5B, text=4096, tiny_size="96x64"),
    # the text as its connectors give it: video and audio halves, caption_channels each
    "ltx2": ModelSpec("LTX-2 19B", "ltxav", LTX2_19B, text=2 * 3840, cfg=3.0, tiny_size="96x64", tiny_frames=9,
                      audio=True),
    # Qwen-Image 20B (20.4B parameters): what detection reads off the file (64 input channels, 60
    # blocks) and the model's released defaults (24 heads of 128, Qwen2.5-VL text 3584); its latent is
    # 5-D with one frame (Wan 2.1's format); CFG 2.5 as ComfyUI's template
    "qwen_image": ModelSpec("Qwen-Image", "qwen_image",
                            {"image_model": "qwen_image", "in_channels": 64, "out_channels": 16, "num_layers": 60,
                             "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
                             "axes_dims_rope": (16, 56, 56)},
                            text=3584, cfg=2.5, tiny_frames=1),
    "sd15": ModelSpec("SD1.5", "SD15", dtype="float16", cfg=7.0),
    "sdxl": ModelSpec("SDXL", "SDXL", dtype="float16", cfg=7.0),
}


@dataclass(frozen=True)
class RowSpec:
    key: str
    model: str  # a key of MODELS
    size: str  # "1024" (square) or "832x480" px
    configs: tuple[str, ...] = ()  # the patched variants: names in configs.BY_NAME
    frames: int = 1  # video frames (Wan's 81, LTX's 121)
    attention: str = "sdpa"  # every variant's backend, the reference's too (sage: SageAttention)
    hypertile: bool = False  # ComfyUI's HyperTile at its defaults under every variant, the reference's too
    compile: bool = False  # compiled (inductor) reference and variants, against eager unpatched
    h200_seconds: float = 0.0  # unpatched s/run on the H200 (gpu-h200.md): the expected time
    speedups: tuple[float, ...] = ()  # the variants' speed-ups there (for the expected time)
    budget: float = 60.0  # seconds for the row, its first runs and compiling included (not its model's build)
    timed: float = 6.0  # seconds of alternating rounds to aim for, past min_rounds
    min_rounds: int = 2
    max_rounds: int = 25
    note: str = ""  # what the row is for
    pending: str = ""  # not measured yet: why ("not yet supported")
    steps: int = STEPS  # sampling steps a run times (1: the one-step rows of the video preset)
    preset: str = TABLE  # its table: --gpu-table (TABLE), --gpu-table-video (VIDEO), --gpu-table-tome (TOME_PRESET)


TODO, TOME = "ToDo 2", "ToMe 0.5"  # the nodes at their defaults (reduce_when auto)
TOME_TODO = "ToMe 0.5 + ToDo 2"  # both at their defaults, ToMe first
# ToMe's candidates on the UNets at 1024 px (issue #38): tile matching, with the MLP and
# cross-attention merged too, and down to downsample 4
UNET_TOME = ("ToMe 0.5 tile", "ToMe 0.5 tile + MLP + cross", "ToMe 0.5 to downsample 4")
# A plan reused across steps (plan_every 4 with share_plans): Flux.1 and SDXL at 1024 px
TOME_REUSE, UNET_TOME_REUSE = "ToMe 0.5 shared plans every 4", "ToMe 0.5 tile shared plans every 4"
# Issue #50: both nodes at their defaults and ToDo's window, run on every call (no auto rule)
TODO_ALWAYS, WINDOW_ALWAYS, TOME_ALWAYS = "ToDo 2 always", "ToDo 2 window always", "ToMe 0.5 always"
ROWS: tuple[RowSpec, ...] = (
    RowSpec("wan21-81f", "wan21", "832x480", (TODO, "ToDo 3", "ToDo 2 + time 2"), frames=81, h200_seconds=4.44,
            speedups=(1.74, 2.03, 1.99), budget=75),
    RowSpec("wan21-81f-sage", "wan21", "832x480", (TODO,), frames=81, attention="sage", h200_seconds=5.28,
            speedups=(1.91,), budget=50, note="Sage + ToDo over Sage alone"),
    RowSpec("wan21-vace-81f", "wan21_vace", "832x480", (TODO,), frames=81, h200_seconds=6.72, speedups=(1.74,),
            budget=60),
    RowSpec("flux-2048", "flux_dev", "2048", (TODO,), h200_seconds=3.24, speedups=(1.38,), budget=45),
    RowSpec("flux-2048-sage", "flux_dev", "2048", (TODO,), attention="sage", h200_seconds=3.74, speedups=(1.49,),
            budget=40, note="Sage + ToDo over Sage alone"),
    RowSpec("flux-1024", "flux_dev", "1024", (TODO,), h200_seconds=0.64, speedups=(1.09,), budget=25),
    RowSpec("ltxv-121f", "ltxv", "768x512", (TODO,), frames=121, h200_seconds=0.54, speedups=(1.24,), budget=25),
    RowSpec("sd15-2048", "sd15", "2048", (TODO, TOME), h200_seconds=1.22, speedups=(1.90, 1.62), budget=40),
    RowSpec("sd15-1024", "sd15", "1024", (TODO, TOME), h200_seconds=0.143, speedups=(1.0, 1.0), budget=25),
    RowSpec("sd15-768", "sd15", "768", (TODO, TOME), h200_seconds=0.119, speedups=(1.08, 0.98), budget=25,
            timed=8.0, max_rounds=40, note="auto leaves ToMe alone: target >= 0.995x"),
    RowSpec("sd15-1024-hypertile", "sd15", "1024", (TODO, TOME), hypertile=True, h200_seconds=0.143,
            speedups=(0.88, 0.94), budget=25, timed=8.0, max_rounds=40,
            note="under ComfyUI's HyperTile: auto leaves both alone, target >= 0.995x"),
    RowSpec("sdxl-1024", "sdxl", "1024", (TODO, TOME), h200_seconds=0.232, speedups=(1.02, 0.98), budget=30,
            timed=8.0, max_rounds=40, note="auto leaves both alone: target >= 0.995x"),
    RowSpec("sd15-2048-compiled", "sd15", "2048", (TODO,), compile=True, h200_seconds=1.22, speedups=(1.9,),
            budget=150, min_rounds=2, max_rounds=3, timed=0.0,
            note="compiled (inductor): what compiling costs and whether it pays"),
    # The video preset (--gpu-table-video): one step each, after a warm-up. Expected seconds: estimates
    # from the FLOPs (Wan 14B at 720p, 81 frames: 75,600 tokens, ~1.4e16 FLOPs a CFG step, two thirds
    # of them attention), not measured yet.
    RowSpec("wan21-14b-720p-1step", "wan21_14b", "1280x720", (TODO,), frames=81, steps=1, preset=VIDEO,
            h200_seconds=30.0, speedups=(1.8,), budget=240, timed=0.0,
            note="one step after a warm-up (the layout of each Wan 2.2 A14B expert): target >= 2.2x"),
    RowSpec("wan21-14b-720p-1step-sage", "wan21_14b", "1280x720", (TODO,), frames=81, steps=1, preset=VIDEO,
            attention="sage", h200_seconds=22.0, speedups=(1.6,), budget=200, timed=0.0,
            note="Sage + ToDo over Sage alone, one step: target >= 2x"),
    RowSpec("ltx2-704p-121f-1step", "ltx2", "1280x704", (TODO,), frames=121, steps=1, preset=VIDEO,
            h200_seconds=4.0, speedups=(1.2,), budget=90, timed=0.0,
            note="one step after a warm-up, audio present: target >= 1.4x"),
    # The ToMe preset (--gpu-table-tome, issue #38), the most important rows first. Expected seconds:
    # gpu-h200.md's unpatched s/run (Qwen-Image: an estimate from the FLOPs, ~1.1e15 a run of 4 CFG
    # steps at 6,889 image tokens, at the ~650 TFLOP/s Flux 1024 px reached); the speed-ups are guesses.
    RowSpec("flux-1024-tome", "flux_dev", "1024", (TODO, "ToDo 3", TOME, TOME_TODO, TOME_REUSE), preset=TOME_PRESET,
            h200_seconds=0.64, speedups=(1.09, 1.15, 1.3, 1.35, 1.35), budget=50, timed=15.0,
            note="issue #38: ToMe defaults >= 1.3x, on the Pareto front at no more error than ToDo 3"),
    RowSpec("sdxl-1024-tome", "sdxl", "1024", (TODO, "ToDo 3", TOME) + UNET_TOME + (UNET_TOME_REUSE,),
            preset=TOME_PRESET, h200_seconds=0.232, speedups=(1.02, 1.05, 1.0, 1.1, 1.2, 1.0, 1.15), budget=45,
            timed=15.0, max_rounds=40,
            note="issue #38: ToMe >= 1.3x at 1024 px, on the Pareto front at no more error than ToDo 3"),
    RowSpec("qwen-image-1328-tome", "qwen_image", "1328", (TODO, "ToDo 3", TOME, TOME_TODO), preset=TOME_PRESET,
            h200_seconds=1.7, speedups=(1.1, 1.15, 1.3, 1.35), budget=80, timed=20.0, min_rounds=3,
            note="issue #38: ToMe defaults >= 1.3x, on the Pareto front at no more error than ToDo 3"),
    RowSpec("wan21-81f-tome", "wan21", "832x480", (TODO, "ToDo 3", TOME, TOME_TODO), frames=81, preset=TOME_PRESET,
            h200_seconds=4.44, speedups=(1.74, 2.03, 1.5, 2.3), budget=110, timed=0.0, min_rounds=3,
            note="issue #38: ToMe + ToDo >= 2.3x, on the Pareto front at no more error than ToDo 3"),
    RowSpec("sd15-1024-tome", "sd15", "1024", (TODO, "ToDo 3", TOME) + UNET_TOME, preset=TOME_PRESET,
            h200_seconds=0.143, speedups=(1.0, 1.05, 1.0, 1.1, 1.2, 1.0), budget=40, timed=15.0, max_rounds=40,
            note="issue #38: ToMe >= 1.2x at 1024 px, on the Pareto front at no more error than ToDo 3"),
    # The peaks preset (--gpu-table-peaks, issue #50): each new setting beside the old one at the same
    # token count, all reduce_when always (the speed of the setting, not of auto's decision): ToDo's
    # window against nearest at 1 MP and 2 MP (Flux.1, Wan 2.1, the UNets), ToMe's proportional
    # attention, min_similarity's device read, correct_from_whole's whole runs against the same plans.
    RowSpec("flux-1024-peaks", "flux_dev", "1024", (TODO_ALWAYS, WINDOW_ALWAYS), preset=PEAKS, h200_seconds=0.64,
            speedups=(1.1, 1.0), budget=50, timed=10.0,
            note="issue #50: the window within 10 % of nearest's speed-up at 1 MP"),
    RowSpec("flux-1024-tome-peaks", "flux_dev", "1024", (TOME_ALWAYS, "ToMe 0.5 shared plans every 2 always",
                                                        "ToMe 0.5 shared plans every 2 corrected always",
                                                        "ToMe 0.5 min_similarity 0.01 always"),
            preset=PEAKS, h200_seconds=0.64, speedups=(1.2, 1.3, 1.0, 1.2), budget=60, timed=12.0,
            note="issue #50: ToMe's new settings beside plain ToMe at the same merged count"),
    RowSpec("flux-2048-peaks", "flux_dev", "2048", (TODO_ALWAYS, WINDOW_ALWAYS), preset=PEAKS, h200_seconds=3.24,
            speedups=(1.38, 1.2), budget=50, timed=10.0,
            note="issue #50: the window within 10 % of nearest's speed-up at 2 MP"),
    RowSpec("wan21-81f-peaks", "wan21", "832x480", (TODO_ALWAYS, WINDOW_ALWAYS), frames=81, preset=PEAKS,
            h200_seconds=4.44, speedups=(1.74, 1.5), budget=70, timed=0.0, min_rounds=3,
            note="issue #50: the window (in time too) within 10 % of nearest's speed-up"),
    RowSpec("sdxl-1024-peaks", "sdxl", "1024",
            (TODO_ALWAYS, WINDOW_ALWAYS, TOME_ALWAYS, "ToMe 0.5 proportional always"), preset=PEAKS, h200_seconds=0.232, speedups=(1.0, 0.9, 1.0, 1.0), budget=40, timed=10.0, max_rounds=40,
            note="issue #50: the window beside nearest; proportional attention beside plain ToMe"),
    RowSpec("sd15-2048-peaks", "sd15", "2048", (TODO_ALWAYS, WINDOW_ALWAYS), preset=PEAKS, h200_seconds=1.22,
            speedups=(1.9, 1.6), budget=40, timed=8.0,
            note="issue #50: the window within 10 % of nearest's speed-up on a UNet at 4 MP"),
)
BY_KEY = {row.key: row for row in ROWS}


def expected_seconds(row: RowSpec) -> float:
    """The row's expected seconds on the H200 from gpu-h200.md's unpatched s/run: one first run of
    each variant and the reference, then its rounds (the compiled row: its budget, compiling
    unknown)."""
    if row.pending:
        return 0.0
    if row.compile:
        return row.budget
    per_round = row.h200_seconds * (1 + sum(1 / s for s in row.speedups))
    rounds = min(row.max_rounds, max(row.min_rounds, int(row.timed // per_round) if per_round else 0))
    share_pass = row.h200_seconds / 2 if row.preset == TOME_PRESET and not MODELS[row.model].unet else 0.0
    # + the Amdahl pass (about one run); ToMe on a DiT: its blocks' share (two steps, half a run)
    return per_round * (1 + rounds) + row.h200_seconds + share_pass


def plan_text(rows: list[RowSpec], deadline: float) -> str:
    lines = ["| row | model, size | variants | steps | budget s | expected s (H200) |", "|---|---|---|---|---|---|"]
    for row in rows:
        spec = MODELS.get(row.model)
        where = f"{spec.label if spec else row.model}, {row.size} px" + (f", {row.frames} frames" if row.frames > 1
                                                                         else "")
        lines.append(f"| {row.key} | {where} | {', '.join(row.configs)} | {row.steps} | {row.budget:.0f} | "
                     + (row.pending if row.pending else f"{expected_seconds(row):.0f}") + " |")
    total = sum(expected_seconds(r) for r in rows)
    lines += ["", f"Expected: {total:.0f} s of rows plus the model builds, under a deadline of {deadline:.0f} s."]
    return "\n".join(lines)


# --- the files, written line by line --------------------------------------------------------------

class Output:
    """gpu_table.jsonl and gpu_table.md, each line flushed and fsynced as it is written."""

    HEADER = ("| row | model, size | variant | attention | reference s/run | s/run | speed-up (per-round range) | "
              "rel. error | Amdahl bound | auto's decision | build s | first run s | compile s | rounds | status | Pareto front |")

    def __init__(self, out: Path, machine: str, settings: str):
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out / "gpu_table.jsonl", "a", encoding="utf-8")
        self.md = open(out / "gpu_table.md", "a", encoding="utf-8")
        self._write(self.md, f"Machine: {machine}\n\n{settings}\n\n{self.HEADER}\n|" + "---|" * 16 + "\n")

    @staticmethod
    def _write(handle, text: str) -> None:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())

    def line(self, record: dict) -> None:
        self._write(self.jsonl, json.dumps(record) + "\n")
        markdown = to_markdown(record)
        self._write(self.md, markdown + "\n")
        print(markdown, flush=True)

    def close(self) -> None:
        self.jsonl.close()
        self.md.close()


def _f(value, pattern: str = "{:.3f}") -> str:
    return "-" if value is None else pattern.format(value)


def to_markdown(r: dict) -> str:
    spread = (f"{r['speedup']:.3f}x ({r['speedup_low']:.3f}-{r['speedup_high']:.3f})"
              if r.get("speedup") is not None else "-")
    return (f"| {r['row']} | {r['where']} | {r.get('variant') or '-'} | {r.get('attention') or '-'} | "
            f"{_f(r.get('reference_seconds'), '{:.4g}')} | {_f(r.get('seconds'), '{:.4g}')} | {spread} | "
            f"{_f(r.get('rel_error'), '{:.4f}')} | {_f(r.get('bound'), '{:.2f}x')} | {r.get('decision') or '-'} | "
            f"{_f(r.get('build_seconds'), '{:.1f}')} | {_f(r.get('first_seconds'), '{:.2f}')} | "
            f"{_f(r.get('compile_seconds'), '{:.1f}')} | {r.get('rounds') or '-'} | {r['status']} | {_pareto_cell(r)} |")


def _pareto_cell(r: dict) -> str:
    if r.get("pareto") is None:
        return "-"
    versus = r.get("error_vs_todo3")
    return r["pareto"] + ("" if versus is None else f"; error {versus:.2f}x ToDo 3's")


def with_pareto(lines: list[dict]) -> list[dict]:
    """Each measured line with whether it is on its row's Pareto front of speed-up against relative
    error (unpatched counted at 1x and 0; compiled lines, against another reference, left out), or
    which lines are both faster and closer; and its error as a multiple of ToDo factor 3's there."""
    from .tome_dit_table import _pareto, _where

    measured = {line["variant"]: line for line in lines if line.get("speedup") is not None
                and line.get("versus") == UNPATCHED and not line.get("compiled")}
    if not measured:
        return lines
    dominated = _pareto({UNPATCHED: (1.0, 0.0), **{name: (line["speedup"], line["rel_error"])
                                                    for name, line in measured.items()}})
    todo3 = measured.get("ToDo 3")
    for name, line in measured.items():
        line["pareto"] = _where(name, dominated)
        if todo3 is not None and name != "ToDo 3" and todo3["rel_error"] > 0:
            line["error_vs_todo3"] = line["rel_error"] / todo3["rel_error"]
    return lines


# --- models ---------------------------------------------------------------------------------------

class Models:
    """The model of the rows in hand, built once and dropped when a row needs another."""

    def __init__(self, tiny: bool, device):
        self.tiny, self.device = tiny, device
        self.key, self.model = None, None

    def get(self, key: str):
        """(model, seconds its build took; 0.0 when it was there)."""
        if key == self.key:
            return self.model, 0.0
        self.drop()
        import torch

        spec = MODELS[key]
        start = time.perf_counter()
        dtype = torch.float32 if self.tiny else getattr(torch, spec.dtype)
        device = None if self.tiny else self.device  # full size: built and filled on the GPU
        on = {} if device is None else {"device": device}
        if spec.unet:
            import random_models

            model = random_models.make_model(spec.family, tiny=self.tiny, seed=0, dtype=dtype, **on)
        else:
            import random_dits
            from .families import DIT_DEPTH, _fixture_depth

            if self.tiny:
                fixture = random_dits.FIXTURES.get(spec.family)
                layout = _fixture_depth(fixture) if fixture else DIT_DEPTH.get(spec.family, {})
            else:
                layout = spec.full
            model = random_dits.make_dit(spec.family, seed=0, dtype=dtype, **on, **layout)
        if device is not None:
            model.offload_device = device  # nothing to move back to the CPU when it is dropped
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.key, self.model = key, model
        return model, time.perf_counter() - start

    def drop(self) -> None:
        if self.model is None:
            return
        import comfy.model_management as mm

        self.key, self.model = None, None
        mm.unload_all_models()
        gc.collect()
        mm.soft_empty_cache()


def _conditioning(spec: ModelSpec, tiny: bool, size: str, frames: int, seed: int):
    """Random text conditioning (and the family's image inputs, VACE's frames sized to the latent),
    at the released text widths at full size."""
    import torch

    if spec.unet:
        import random_models

        return random_models.conditioning(spec.family, tiny, seed=seed)
    import random_dits
    from .families import dims

    width, height = dims(_parse(size))
    positive, _ = random_dits.conditioning(spec.family, seed=seed, frames=frames, height_px=height, width_px=width,
                                           **({} if tiny or spec.family in random_dits.FIXTURES else
                                              {"text_dim": spec.text, **({"pooled_dim": spec.pooled}
                                                                         if spec.pooled else {})}))
    if tiny or not spec.text:
        return positive
    generator = torch.Generator().manual_seed(seed + 100)
    widened = []
    for context, extras in positive:  # a fixture's tiny text width: the released encoder's
        if context.shape[-1] != spec.text:
            context = torch.randn(*context.shape[:-1], spec.text, generator=generator)
        widened.append([context, extras])
    return widened


def _parse(size: str):
    from .families import parse_size

    return parse_size(size)


# --- one row ----------------------------------------------------------------------------------------

class _Timer:
    """Raises OverBudget in the main thread after ``seconds`` (SIGALRM; between Python bytecodes,
    so a long compile is interrupted at its next Python step)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        def expire(_signum, _frame):
            raise OverBudget()

        self.previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, max(0.01, self.seconds))
        return self

    def __exit__(self, *exc):
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous)
        return False


def _times(d) -> str:
    """A kind's times, and the change max_change reads (the budget is applied when read, not here)."""
    times = f"{d.full_ms:.2f} -> {d.reduced_ms:.2f} ms" if d.full_ms is not None else "untimed"
    return times + (f", change {100 * d.change:.3g} %" if d.change is not None else "")


def _decision(log: list) -> tuple[str | None, bool | None, float | None]:
    """auto's decisions as text, whether it left every site alone, and what measuring cost."""
    if not log:
        return None, None, None
    text = "; ".join(f"{site}: {_times(d)}, {'reduced' if d.reduce else 'left alone'}" for site, d in log)
    return text, not any(d.reduce for _, d in log), sum(d.seconds for _, d in log)


class RowRun:
    """One row measured: its models, their first runs and rounds, its result lines."""

    def __init__(self, args, host, row: RowSpec, model, build_seconds: float):
        from . import compiled, environment
        from .configs import BY_NAME
        from .stacks import SampledRun

        self.args, self.host, self.row = args, host, row
        self.spec = MODELS[row.model]
        size = _parse(self.spec.tiny_size if args.tiny else row.size)
        self.size = size
        video_frames = (self.spec.tiny_frames if args.tiny else row.frames)
        self.latent_frames = 1
        self.build_seconds = build_seconds
        conditioning = (_conditioning(self.spec, args.tiny, str(size), video_frames, 1),
                        _conditioning(self.spec, args.tiny, str(size), video_frames, 2))
        from .families import latent_shape

        shape = latent_shape(model, 1, size, self._downscale(), 1)
        if len(shape) == 5:  # a video: latent frames as its VAE gives them
            time_down = self._time_down()
            self.latent_frames = (video_frames - 1) // time_down + 1
        self.conditioning = conditioning
        self.steps = min(row.steps, TINY_STEPS) if args.tiny else row.steps  # what each timed run samples
        self.run = SampledRun(model, size, conditioning, self.steps, downscale=self._downscale(),
                              frames=self.latent_frames, cfg=self.spec.cfg)
        self.run.evals = 1  # seconds per whole run, not per step
        if self.spec.audio:
            self._with_audio(model, video_frames)
        backend = environment.attention_backends([row.attention])[row.attention]
        base = environment.with_attention(model, backend)
        if row.hypertile:
            base = _hypertile(base)
        self.base = base
        self.models: dict[str, object] = {}
        self.reference = ("compiled " if row.compile else "") + UNPATCHED
        if row.compile:
            compiled.make_room(2 + len(row.configs))
            self.models[UNPATCHED] = base  # eager unpatched: does compiling pay
            self.models[self.reference] = compiled.compiled(base, args.compile_backend)
        else:
            self.models[UNPATCHED] = base
        self.configs: dict = {}  # name -> configs.Config
        for name in row.configs:
            config = BY_NAME[name]
            try:
                patched = config.apply(base, host.appliers)
            except ValueError as reason:  # the node's refusal, said in the table
                raise Refused(str(reason)) from None
            self.configs[name] = config
            if row.compile:
                self.models[name] = patched
                self.models["compiled " + name] = compiled.compiled(patched, args.compile_backend)
            else:
                self.models[name] = patched
        self.first: dict[str, float] = {}
        self.peak_gib: dict[str, float] = {}  # CUDA: the allocator's peak over each variant's first run
        self.in_first, self.running = None, None  # the variant whose first run is under way, since when
        self.times: dict[str, list] = {name: [] for name in self.models}
        self.outs: dict[str, object] = {}

    def _with_audio(self, model, video_frames: int) -> None:
        from .step import with_audio

        self.run.latent, self.run.noise = with_audio(model, self.run.latent, self.run.noise, video_frames)

    def _downscale(self) -> int:
        if self.spec.unet:
            return 8
        import random_dits

        return random_dits.FAMILY_SPECS[self.spec.family].space_down if self.spec.family in random_dits.FAMILY_SPECS \
            else random_dits.FIXTURES[self.spec.family].spec.space_down

    def _time_down(self) -> int:
        import random_dits

        spec = (random_dits.FAMILY_SPECS.get(self.spec.family) or random_dits.FIXTURES[self.spec.family].spec)
        return spec.time_down

    def _one(self, name: str) -> float:
        random.seed(0)  # HyperTile draws its tile sizes from Python's random: the same every run
        start = self.running = time.perf_counter()
        out = self.run(self.models[name])
        seconds = time.perf_counter() - start
        if getattr(out, "is_nested", False):  # video and audio: one flat tensor for the error
            import torch

            out = torch.cat([t.reshape(t.shape[0], -1) for t in out.unbind()], dim=-1)
        self.outs[name] = out
        return seconds

    def measure(self) -> None:
        """First runs, then alternating rounds; fills first, times and outs as it goes (an
        interrupted row keeps what it had)."""
        import torch

        cuda = torch.cuda.is_available() and not self.args.tiny
        for name in self.models:
            self.in_first = name
            if cuda:  # the first run's peak: the weights and what the variant keeps (correct_from_whole's outputs)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.first[name] = self._one(name)
            if cuda:
                self.peak_gib[name] = torch.cuda.max_memory_allocated() / 2 ** 30
        self.in_first = None
        names = list(self.models)
        started, row = time.perf_counter(), self.row
        # Tiny models: one round, a check of the table, not a timing.
        timed, least = (0.0, 1) if self.args.tiny else (row.timed, row.min_rounds)
        for round_ in range(row.max_rounds):
            if round_ >= least and time.perf_counter() - started >= timed:
                break
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                self.times[name].append(self._one(name))

    def bound(self, name: str) -> float | None:
        """The per-forward Amdahl bound of a variant at its reduction (eager rows, models with a layout)."""
        from . import amdahl
        from .configs import TOME_NODE
        from .step import OneStep

        if self.row.compile or self.spec.audio:  # the Amdahl pass samples a plain latent
            return None
        if not hasattr(self, "_parts"):
            base = self.base
            config = getattr(base.model, "model_config", None)
            layout = self.host.model_layout(base.get_model_object("diffusion_model"), type(config).__name__)
            self._step = OneStep(base, self.size, self.conditioning, downscale=self._downscale(),
                                 frames=self.latent_frames)
            self._parts = amdahl.part_times(base, self._step, 0, layout, self.host.unet_kind)
        bounds = amdahl.amdahl(self._parts, self.configs[name]) if self._parts else None
        if bounds is None or self._parts.video is None or not any(n.kind == TOME_NODE for n in self.configs[name].nodes):
            return bounds.bound_at if bounds else None
        whole = self._whole_block_bound(name)  # ToMe on a DiT: its bound, with ToDo's savings added
        rest = 1 / whole + 1 / bounds.bound_at - 1 if whole else 0.0
        return 1 / rest if rest > 0 else None

    def _whole_block_bound(self, name: str) -> float | None:
        """1 / (1 - s + s * f): s the share of the unpatched forward in the blocks the variant's ToMe
        merges (timed with hooks; kept per set of blocks), f its merged tokens over its tokens (its report)."""
        from .tome_dit_table import _merged_share

        session = next((s for s in self.host.sessions_of(self.models[name])
                        if type(s.patch).__name__ == "ToMeDiTPatch"), None)
        report = getattr(session, "last_report", None)
        if session is None or report is None or not report.levels:
            return None
        before, after = next(iter(report.levels[0].tokens.values()))
        blocks = tuple(session.patch.replace_keys())
        shares = self.__dict__.setdefault("_shares", {})
        if blocks not in shares:
            shares[blocks] = _merged_share(self.base, self._step, session.patch, time.perf_counter)
        share = shares[blocks]
        return 1 / (1 - share + share * after / before)

    def lines(self, status: str = "measured") -> list[dict]:
        """One record per variant (and, compiled, the compiled reference against eager)."""
        from . import environment

        row, where = self.row, _where(self.row, self.spec, self.args.tiny, self.size, self.latent_frames)
        reference = self.times.get(self.reference) or []
        records = []
        variants = list(self.configs)
        if row.compile:  # compiled unpatched against eager unpatched, and each config eager and compiled
            variants = [self.reference] + [v for name in self.configs for v in (name, "compiled " + name)]
        for name in variants:
            times, base_times = self.times.get(name) or [], reference
            versus = self.reference
            if row.compile and name == self.reference:
                base_times, versus = self.times.get(UNPATCHED) or [], UNPATCHED
            record = dict(row=row.key, where=where, variant=name, versus=versus, attention=row.attention,
                          hypertile=row.hypertile, compiled=row.compile and name.startswith("compiled"),
                          build_seconds=self.build_seconds if not records else None,
                          first_seconds=self.first.get(name), reference_first_seconds=self.first.get(versus),
                          status=status, note=row.note, rounds=min(len(times), len(base_times)) or None,
                          steps=self.steps, peak_gib=self.peak_gib.get(name),
                          reference_peak_gib=self.peak_gib.get(versus))
            if name == self.in_first:  # cut in its first run (compiling, say): it took at least this long
                record["first_seconds_at_least"] = time.perf_counter() - self.running
            if times and base_times:
                n = min(len(times), len(base_times))
                ratios = [b / t for b, t in zip(base_times[:n], times[:n])]
                seconds, base_seconds = statistics.median(times), statistics.median(base_times)
                reference_out, out = self.outs[versus], self.outs[name]
                record.update(seconds=seconds, reference_seconds=base_seconds, speedup=base_seconds / seconds,
                              speedup_low=min(ratios), speedup_high=max(ratios), repeats=times,
                              reference_repeats=base_times,
                              rel_error=float((out - reference_out).norm() / reference_out.norm()))
                if record["first_seconds"] is not None and name.startswith("compiled"):
                    record["compile_seconds"] = max(0.0, record["first_seconds"] - seconds)
            config_name = name[len("compiled "):] if name.startswith("compiled ") else name
            if config_name in self.configs and not name.startswith("compiled"):
                text, left_alone, cost = _decision(environment.auto_log(self.models[name], self.host.sessions_of))
                record.update(decision=text, left_alone=left_alone, auto_seconds=cost)
                if left_alone and record.get("speedup") is not None:
                    record["target"] = 0.995
                    record["meets_target"] = record["speedup"] >= 0.995
            records.append(record)
        return records


def _where(row: RowSpec, spec: ModelSpec, tiny: bool, size, latent_frames: int) -> str:
    from .families import size_label

    text = f"{spec.label}{' (tiny)' if tiny else ''}, {size_label(size)} px"
    if latent_frames > 1:
        text += f", {latent_frames} latent frames"
    return text + (", HyperTile" if row.hypertile else "") + (", compiled" if row.compile else "")


def _hypertile(model):
    """ComfyUI's HyperTile node at its declared defaults."""
    from comfy_extras.nodes_hypertile import HyperTile

    defaults = {spec.id: spec.default for spec in HyperTile.define_schema().inputs
                if getattr(spec, "default", None) is not None}
    out = HyperTile.execute(model, **defaults)
    return out[0] if isinstance(out, tuple) else out.result[0]  # 0.3.75's returns a plain tuple


def _stub(row: RowSpec, tiny: bool, status: str, build_seconds: float | None = None, **extra) -> dict:
    spec = MODELS.get(row.model)
    if spec is None:  # a later row's model
        where = f"{row.model}, {row.size} px" + (f", {row.frames} frames" if row.frames > 1 else "")
    else:
        from .families import size_label

        size = _parse(spec.tiny_size if tiny else row.size)
        where = (f"{spec.label}{' (tiny)' if tiny else ''}, {size_label(size)} px"
                 + (f", {spec.tiny_frames if tiny else row.frames} frames" if row.frames > 1 else ""))
    return dict(row=row.key, where=where, attention=row.attention, status=status, note=row.note,
                build_seconds=build_seconds, **extra)


def run_row(args, host, models: Models, row: RowSpec, seconds: float) -> list[dict]:
    """The lines of one row, measured within ``seconds`` (its build inside the same timer)."""
    if row.pending:
        return [_stub(row, args.tiny, row.pending)]
    missing = _missing_family(MODELS[row.model])
    if missing:
        return [_stub(row, args.tiny, missing)]
    if row.attention != "sdpa":
        from . import environment

        try:
            environment.attention_backends([row.attention])
        except SystemExit as reason:
            return [_stub(row, args.tiny, f"skipped: {reason}")]
    state = {}
    try:
        with _Timer(seconds):
            model, state["build"] = models.get(row.model)
            state["run"] = RowRun(args, host, row, model, state["build"])
            state["run"].measure()
            lines = state["run"].lines()
            for line in lines:
                if line.get("variant") in state["run"].configs and line.get("seconds") is not None:
                    line["bound"] = state["run"].bound(line["variant"])
            return with_pareto(lines)
    except Refused as reason:
        return [_stub(row, args.tiny, f"refused: {reason}", state.get("build"))]
    except OverBudget:
        status = f"over budget ({seconds:.0f} s), not measured"
        if "run" in state:
            return [{**line, "status": status, **{k: None for k in ("speedup", "seconds", "rel_error")}}
                    for line in state["run"].lines(status)]
        return [_stub(row, args.tiny, status, state.get("build"))]
    except Exception as error:  # noqa: BLE001 - said in the table, the next rows go on
        return [_stub(row, args.tiny, f"failed: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}",
                      state.get("build"))]
    finally:
        if row.compile:
            import torch._dynamo

            torch._dynamo.reset()


def _missing_family(spec: ModelSpec) -> str:
    """Why this tree cannot build the model ("" where it can): a DiT family of later ComfyUI trees."""
    if spec.unet:
        return ""
    import random_dits

    if spec.family not in random_dits.FAMILY_SPECS:
        return f"not yet supported: no {spec.family} model in devtools/random_dits.py"
    if not random_dits.available(spec.family):
        return (f"skipped: this ComfyUI has no {random_dits.FAMILY_SPECS[spec.family].config} "
                f"({spec.label}: run it with --comfyui PATH of a tree that has it, 0.33 or later)")
    return ""


def preset_rows(args) -> list[RowSpec]:
    """``--rows`` in their order, else the rows of the preset asked for (--gpu-table-video: VIDEO)."""
    if args.rows:
        return [BY_KEY[key] for key in args.rows]
    return [row for row in ROWS if row.preset == preset_of(args)]


def preset_of(args) -> str:
    if getattr(args, "gpu_table_video", None) is not None:
        return VIDEO
    if getattr(args, "gpu_table_peaks", None) is not None:
        return PEAKS
    return TOME_PRESET if getattr(args, "gpu_table_tome", None) is not None else TABLE


def main(args) -> int:
    """Run the rows of ``args.rows`` (the preset's by default) in order, under ``args.deadline``."""
    import torch

    from . import environment

    rows = preset_rows(args)
    if args.plan:
        print(plan_text(rows, args.deadline))
        return 0
    started = time.perf_counter()
    stubbed = _stub_video_io()
    host = environment.load(Path(args.comfyui))
    machine = environment.machine()
    steps = sorted({min(row.steps, TINY_STEPS) if args.tiny else row.steps for row in rows if not row.pending})
    settings = (f"Whole sampling runs of {' or '.join(map(str, steps)) or STEPS} euler step(s) (simple schedule, "
                "as each row says), random weights "
                + ("(tiny models, float32)" if args.tiny else "(released layouts; bf16 DiTs, fp16 UNets)")
                + "; per row: one first run of each variant (reduce_when auto measures in it; compiled: it "
                  "compiles), then alternating rounds, the order rotated each round; medians. Speed-up: reference "
                  "s/run over the variant's (in brackets the lowest and highest of the per-round ratios); rel. "
                  "error: relative L2 of the final latent against the reference. Amdahl bound: per forward, at "
                  "the variant's reduction (ToMe on a DiT: of whole-block merging; with ToDo, both savings "
                  "added). Pareto front: speed-up against rel. error in the row, unpatched at 1x and 0. Deadline "
                + f"{args.deadline:.0f} s; ComfyUI loaded in {time.perf_counter() - started:.1f} s"
                + ("; PyAV not installed: an empty stand-in (no video is decoded here)." if stubbed else "."))
    out = Output(args.out, machine, settings)
    device = torch.device("cuda") if torch.cuda.is_available() else None
    models = Models(args.tiny, device)
    deadline = started + args.deadline
    try:
        for index, row in enumerate(rows):
            left = deadline - time.perf_counter()
            if left < MIN_START and not row.pending:
                for rest in rows[index:]:
                    out.line(_stub(rest, args.tiny, rest.pending or "deadline: not run"))
                break
            budget = min((row.budget + (_BUILD_BUDGET if models.key != row.model else 0)) * args.budget_scale, left)
            for line in run_row(args, host, models, row, budget):
                out.line(line)
            if index + 1 < len(rows) and rows[index + 1].model != row.model:
                models.drop()
    finally:
        models.drop()
        out.close()
    print(f"\nwrote {args.out / 'gpu_table.md'} and {args.out / 'gpu_table.jsonl'} "
          f"in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


def _stub_video_io() -> bool:
    """ComfyUI's comfy_api imports PyAV (``av``) for its video types; a lent GPU's Python lacks it
    and nothing here reads or writes video: where it does not import, an empty stand-in module
    (any attribute a placeholder class) lets ComfyUI load. Returns whether it stood in."""
    import importlib.abc
    import importlib.machinery
    import sys
    import types

    try:
        import av  # noqa: F401
        return False
    except ImportError:
        pass

    class StandIn(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {"__init__": lambda self, *args, **kwargs: None})

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            return importlib.machinery.ModuleSpec(name, self, is_package=True) if name.split(".")[0] == "av" else None

        def create_module(self, spec):
            module = StandIn(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, Finder())
    return True


_BUILD_BUDGET = 60.0  # seconds a model's build may add to the first row that needs it


def add_arguments(p) -> None:
    p.add_argument("--gpu-table", dest="gpu_table", type=Path, metavar="OUT",
                   help="the GPU table of the issues (bench/gpu_table.py): writes OUT/gpu_table.md and .jsonl row by row")
    p.add_argument("--gpu-table-video", dest="gpu_table_video", type=Path, metavar="OUT",
                   help="the video preset of the GPU table (720p and longer, one step each: Wan 2.1 14B, LTX-2 19B), "
                        "its own run under --deadline")
    p.add_argument("--gpu-table-tome", dest="gpu_table_tome", type=Path, metavar="OUT",
                   help="the ToMe preset of the GPU table (issue #38: ToMe through whole blocks against ToDo at about "
                        "one megapixel: Flux.1, SDXL, Qwen-Image, Wan 2.1 1.3B, SD1.5), its own run under --deadline")
    p.add_argument("--gpu-table-peaks", dest="gpu_table_peaks", type=Path, metavar="OUT",
                   help="the peaks preset of the GPU table (issue #50: ToDo's window against nearest at 1 and 2 MP, "
                        "ToMe's proportional attention, min_similarity and correct_from_whole beside plain ToMe), "
                        "its own run under --deadline")
    p.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE,
                   help=f"with --gpu-table: seconds for the whole run (default {DEFAULT_DEADLINE:.0f})")
    p.add_argument("--rows", nargs="+", choices=list(BY_KEY), help="with --gpu-table: only these rows, in this order")
    p.add_argument("--budget-scale", type=float, default=1.0,
                   help="with --gpu-table: multiply every row's budget (a test: 0.001 runs every row over budget)")
    p.add_argument("--plan", action="store_true", help="with --gpu-table: print the rows and expected times, run nothing")


