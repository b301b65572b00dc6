"""The README's picture: speed-up against error for ToMe, ToDo and ComfyUI's built-in ToMe.

    python3 devtools/plot_readme.py [--out docs/img/readme_speed_vs_error.png]

Reads only measured results in docs/results/ (written by devtools/benchmark.py; see
docs/benchmarks.md for how they were taken): SD1.5 at 2048 px on an NVIDIA H100 and SD1.5 at
1024 px on a 2-core CPU, both with PyTorch SDPA attention. No number is typed here.
Needs matplotlib (the test host has it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PANELS = [  # (results file, panel title)
    ("gpu_h100_sd15_2048.json", "SD1.5, 2048 px, NVIDIA H100 (GPU), SDPA, fp16"),
    ("sd15_1024_sdpa.json", "SD1.5, 1024 px, 2-core Intel Xeon (CPU), SDPA, fp32"),
]
GROUPS = [  # (label, colour, marker, which `method` values of results.json)
    ("ComfyUI built-in ToMe", "#7f7f7f", "s", {"builtin"}),
    ("ToMe (this pack)", "#9467bd", "o", {"tome", "tome-3x3", "tome-shared", "tome-queries", "tome-queries-3x3",
                                          "tome-queries-shared", "tome-mlp"}),
    ("ToDo (this pack)", "#2ca02c", "D", {"todo", "todo-next"}),
    ("ToMe + ToDo", "#ff7f0e", "^", {"combined"}),
]
LABELLED = {"built-in ToMe 0.5": (8, -12), "ToDo 2": (8, -3), "ToDo 3 + next 2": (8, -3),
            "ToMe 0.5 queries only 3x3": (8, 4), "ToMe 0.5 3x3": (-10, 8)}  # label -> offset in points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img" / "readme_speed_vs_error.png",
                        help="the PNG to write")
    args = parser.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(12, 4.4))
    for ax, (name, title) in zip(axes, PANELS):
        rows = json.loads((REPO / "docs" / "results" / name).read_text())["rows"]
        for label, colour, marker, methods in GROUPS:
            mine = [r for r in rows if r["method"] in methods]
            ax.scatter([r["rel_error"] for r in mine], [r["speedup"] for r in mine], c=colour, marker=marker,
                       s=46, label=label, edgecolors="black", linewidths=0.4, zorder=3)
            for r in mine:
                if r["config"] in LABELLED:
                    ax.annotate(r["config"], (r["rel_error"], r["speedup"]), textcoords="offset points",
                                xytext=LABELLED[r["config"]], fontsize=8)
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("relative error against the unpatched model (lower is better)")
        ax.set_ylabel("speed-up per model forward (higher is better)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle("Speed against error: up and to the left is better (docs/benchmarks.md)", fontsize=11)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
