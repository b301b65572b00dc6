"""The words a node says: what it patched (its info text and the one-line header the front end
draws), and what a run did. Built from the settings, the target and the run's report, so every
host says the same thing."""

from __future__ import annotations

from .methods import MATCH_WHOLE_GRID, MODE_QUERIES, todo_level_factors
from .run import RunReport
from .target import Target


def header(method: str, target: Target) -> str:
    """One line for the node: what is patched in this model."""
    levels = ", ".join(str(level) for level in target.levels)
    return f"{method} · {target.family} · {len(target.sites)} of {len(target.layout.sites)} blocks at downsample {levels}"


def tome_info(settings, target: Target) -> str:
    s = settings
    stages = [name for name, on in (("self-attention " + ("queries" if s.mode == MODE_QUERIES else "q, k, v"),
                                      s.merge_attn),
                                     ("cross-attention queries", s.merge_crossattn), ("MLP", s.merge_mlp)) if on]
    per_level = ", ".join(f"downsample {level}: {target.count_at(level)}"
                          for level in target.layout.levels if level <= target.level)
    return (f"ToMe on {target.family}: ratio {s.ratio:g}, strides {s.stride_x}x{s.stride_y}, "
            f"max_downsample {target.level}: {len(target.sites)} of {len(target.layout.sites)} "
            f"transformer blocks ({per_level}); merges {', '.join(stages)}; "
            f"active from {s.start_percent:g} to {s.end_percent:g} of sampling; "
            + (f"random targets, seed {s.seed}" if s.use_rand else "top-left targets")
            + f"; matching in the {'whole grid' if s.matching == MATCH_WHOLE_GRID else s.matching}"
            + ("; one plan per level and model call." if s.share_plans else "; one plan per block call."))


def todo_info(settings, target: Target) -> tuple[str, list[str]]:
    """The info text and the warnings (a factor at a level without blocks does nothing)."""
    described, warnings = [], []
    for name, level, factor in todo_level_factors(target.level, settings):
        count = target.count_at(level)
        if count:
            described.append(f"downsample {level}: {count} blocks, keys/values pooled {factor:g}x per side "
                             f"(about {factor * factor:.3g}x fewer keys)")
        else:
            described.append(f"downsample {level}: no transformer blocks in this model (factor {factor:g} does nothing)")
            warnings.append(f"WARNING: {name} {factor:g} does nothing: this {target.family} model has no transformer "
                            f"blocks at downsample {level}.")
    info = (f"ToDo on {target.family}: {'; '.join(described)}; {settings.method} pooling; "
            f"active from {settings.start_percent:g} to {settings.end_percent:g} of sampling.")
    return info, warnings


def _ranges(steps: tuple[int, ...]) -> str:
    """(1, 2, 3, 7, 8) -> '1-3, 7-8'."""
    spans = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def run_lines(header_line: str, report: RunReport) -> list[str]:
    """The node's lines after a run: what it patched, tokens per level, steps and time."""
    lines = [header_line]
    if report.refused:
        return lines  # the warnings say why
    for level in report.levels:
        stages = " · ".join(f"{stage} {before}→{after}" for stage, (before, after) in level.tokens.items())
        lines.append(f"ds {level.downsample} · {level.grid[1]}×{level.grid[0]} · {stages}")
    active = f"steps {_ranges(report.active_steps)} of {report.steps}" if report.active_steps else \
        f"no step of {report.steps}"
    lines.append(f"{active} · {report.sampling_seconds:.1f} s sampling"
                 + ("" if report.completed else " · interrupted"))
    return lines
