"""The words a node says: what it patched (its info text and the one-line header the front end
draws), and what a run did. Built from the settings, the target and the run's report, so every
host says the same thing."""

from __future__ import annotations

from typing import NamedTuple

from .layout import DIT
from .methods import (MATCH_TILE, MATCH_WHOLE_GRID, MODE_PROPORTIONAL, MODE_QUERIES, REDUCE_ALWAYS, REDUCE_REMEASURE,
                      todo_level_factors)
from .pays import FAILED, MARGIN, MEASURED
from .peak_window import HALO, HEAVY_KEYS, WINDOW
from .target import Target


class RunCalls(NamedTuple):
    """What a run's calls met, for its warnings."""
    unreached: int  # model calls in which the attention never reached the patch's override
    reduced: bool  # some call was reduced
    skipped: int  # calls left alone because their tokens were not the layout predicted
    dit: bool  # the calls went through a DiT's attention override


def margin_text() -> str:
    """The auto rule's margin as the texts say it ("3 %"), from the one constant."""
    return f"{MARGIN * 100:g} %"


def header(method: str, target: Target) -> str:
    """One line for the node: what is patched in this model."""
    blocks = f"{method} · {target.family} · {len(target.sites)} of {len(target.layout.sites)} blocks"
    if target.layout.kind == DIT:
        return blocks
    return f"{blocks} at downsample {', '.join(str(level) for level in target.levels)}"


def reduce_when_text(settings) -> str:
    """How the node decides where to reduce, for its info text."""
    if settings.reduce_when == REDUCE_ALWAYS:
        return "reduce_when always: reduced wherever set."
    again = " (measure again: timed anew once)" if settings.reduce_when == REDUCE_REMEASURE else ""
    # Made when the node executes, before a run shows on which device it samples: true on both.
    return (f"reduce_when auto{again}: on a CPU every call is reduced, untimed; on a GPU (any other device) each "
            f"kind of call is reduced only where timing it there shows that it pays, decided once and kept, and "
            f"the report shows the times." + budget_text(settings))


def budget_text(settings) -> str:
    """reduce_when auto's quality budget (max_change) for the info text; "" where there is none."""
    budget = getattr(settings, "max_change", 0)
    if not budget:
        return ""
    return (f" Quality budget max_change {_budget_percent(budget)}: on every device (the CPU too) a kind of call "
            f"whose reduction changes its output by more is left alone (measured once with the decision, kept).")


def _reuse_text(settings, dit: bool = False) -> str:
    """plan_every in the info text, after "one plan per ... model call" (``dit``: with
    correct_from_whole, which corrects whole-block merging)."""
    every = getattr(settings, "plan_every", 1)
    steps = "step" if every == 2 else f"{every - 1} steps"
    if every <= 1:
        return ". "
    corrected = ("; the step that plans also runs each merged block whole and keeps the difference, which "
                 "the steps reusing the plan add (correct_from_whole)"
                 if dit and getattr(settings, "correct_from_whole", False) else "")
    return f", reused by the calls like it of the next {steps}{corrected}. "


def _alike_text(settings) -> str:
    """min_similarity in the info text, after the ratio."""
    bound = getattr(settings, "min_similarity", 0.0) or 0.0
    return (f" at most, only tokens at least {bound:g} alike to their target (min_similarity: fewer where the "
            f"picture is not alike, the count rounded down to an eighth of ratio's)" if bound else "")


def tome_info(settings, target: Target) -> str:
    s = settings
    attention = {MODE_QUERIES: "queries", MODE_PROPORTIONAL: "q, k, v (proportional attention: merged keys weighed "
                 "by their size)"}.get(s.mode, "q, k, v")
    stages = [name for name, on in (("self-attention " + attention, s.merge_attn),
                                     ("cross-attention queries", s.merge_crossattn), ("MLP", s.merge_mlp)) if on]
    per_level = ", ".join(f"downsample {level}: {target.count_at(level)}"
                          for level in target.layout.levels if level <= target.level)
    return (f"ToMe on {target.family}: ratio {s.ratio:g}{_alike_text(s)}, strides {s.stride_x}x{s.stride_y}, "
            f"max_downsample {target.level}: {len(target.sites)} of {len(target.layout.sites)} "
            f"transformer blocks ({per_level}); merges {', '.join(stages)}; "
            f"active from {s.start_percent:g} to {s.end_percent:g} of sampling; "
            + (f"random targets, seed {s.seed}" if s.use_rand else "top-left targets")
            + ("; matching within each cell (tile, fast)" if s.matching == MATCH_TILE else
               f"; matching in the {'whole grid' if s.matching == MATCH_WHOLE_GRID else s.matching}")
            + ("; one plan per level and model call" + _reuse_text(s) if s.share_plans else "; one plan per block call. ")
            + reduce_when_text(s))


def tome_dit_info(settings, target: Target, patch) -> str:
    """ToMe on a DiT: which blocks merge, how, and how reduce_when decides it."""
    s = settings
    kinds = {}
    for kind, _ in patch.replace_keys().values():
        kinds[kind] = kinds.get(kind, 0) + 1
    blocks = ", ".join(f"{count} {kind.replace('_', ' ')}s" for kind, count in kinds.items())
    return (f"ToMe on {target.family}: whole blocks merged ({blocks}; the first and last block left whole): the "
            f"image grid's tokens merge before each block and its change is restored after, text and reference "
            f"tokens never merge; ratio {s.ratio:g}{_alike_text(s)}, tiles {s.stride_x}x{s.stride_y}"
            + ((f" x {s.stride_t} latent frames" if s.stride_t > 1 else " (frames not merged: stride_t 1)")
               if target.layout.family.video else "")
            + f"; active from {s.start_percent:g} to {s.end_percent:g} of sampling; "
            + (f"random targets, seed {s.seed}" if s.use_rand else "top-left targets")
            + ("; one plan per model call" + _reuse_text(s, dit=True) if s.share_plans else "; one plan per block call. ")
            + (reduce_when_text(s) if s.reduce_when == REDUCE_ALWAYS else
               f"reduce_when auto{' (measure again: timed anew once)' if s.reduce_when == REDUCE_REMEASURE else ''}: "
               f"on a CPU every block is merged, untimed; on a GPU (any other device) each kind of block is merged "
               f"only where timing one there, unmerged and merged (plan, merge, block, restore), shows that it "
               f"pays, decided once and kept, and the report shows the times." + budget_text(s)))


def todo_info(settings, target: Target) -> tuple[str, list[str]]:
    """The info text and the warnings (a factor at a level without blocks does nothing)."""
    if target.layout.kind == DIT:
        return _todo_dit_info(settings, target)
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
    if settings.temporal_factor > 1:
        warnings.append(f"WARNING: temporal_factor {settings.temporal_factor:g} does nothing: {target.family} is not a "
                        f"video model.")
    how = f"{settings.method} pooling"
    if settings.method == WINDOW:  # peak_window.py, run by the attention override (todo_patch.py)
        how = _window_text()
    info = (f"ToDo on {target.family}: {'; '.join(described)}; {how}; "
            f"active from {settings.start_percent:g} to {settings.end_percent:g} of sampling. "
            + reduce_when_text(settings))
    return info, warnings


def _window_text() -> str:
    return (f"window: each tile of queries also sees the keys within {HALO} tokens of it exactly and the "
            f"{HEAVY_KEYS} keys with the most attention, each strided key weighted by the tokens it stands for")


def _block_ranges(target: Target) -> str:
    blocks = [site.key[1] + 1 for site in target.sites]  # 1-based, as a user counts
    return _ranges(tuple(blocks))


def _todo_dit_info(settings, target: Target) -> tuple[str, list[str]]:
    family = target.layout.family
    s = settings
    warnings = []
    time = ""
    if family.video and s.temporal_factor > 1:
        time = f" and {s.temporal_factor:g}x along time"
    elif s.temporal_factor > 1:
        warnings.append(f"WARNING: temporal_factor {s.temporal_factor:g} does nothing: {family.name} is an image model.")
    if s.factor_next > 1:
        warnings.append(f"WARNING: factor_next {s.factor_next:g} does nothing on a DiT: {family.name} attends over one "
                        f"token grid; factor sets its pooling.")
    reduction = (s.factor ** 2) * (s.temporal_factor if family.video else 1)
    how = s.method
    if s.method == WINDOW:  # peak_window.py
        how = _window_text()
    info = (f"ToDo on {target.family} ({family.name}, DiT): keys/values of the {'video' if family.video else 'image'} "
            f"tokens of self-attention downsampled {s.factor:g}x per side{time} (about {reduction:.3g}x fewer), "
            f"{how}, in blocks {_block_ranges(target)} of {len(target.layout.sites)}; queries, text and "
            f"reference tokens untouched; active from {s.start_percent:g} to {s.end_percent:g} of sampling. "
            + reduce_when_text(s))
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


def grid_text(grid: tuple[int, ...]) -> str:
    """(h, w) -> 'w×h'; a video grid (t, h, w) -> 't frames × w×h'."""
    if len(grid) == 3:
        return f"{grid[0]} frames × {grid[2]}×{grid[1]}"
    return f"{grid[1]}×{grid[0]}"


def level_text(level: int, grid: tuple[int, int]) -> str:
    """A UNet level as the report names it: 'downsample 1 (96×96)'."""
    return f"downsample {level} ({grid_text(grid)})"


def decision_lines(report, timing: bool = True) -> list[str]:
    """What the auto rule measured and decided in a run (``report``: a ``run.RunReport``; this
    module imports nothing of run.py, which words its warnings with it), one line per level or
    kind of DiT call (``timing`` False: without what measuring cost and whether it happened now, which differ
    between identical runs)."""
    lines = []
    listed = [(site, decision) for site, decision in report.decisions
              # untimed (a CPU) and reduced: nothing to say (the change is in the websocket message)
              if decision.full_ms is not None or decision.over_budget]  # else not measured: the warnings say so
    for site, decision in listed:
        times = f" · {decision.full_ms:.2f} → {decision.reduced_ms:.2f} ms" if decision.full_ms is not None else ""
        lines.append(f"auto · {site}{times} · {verdict_text(decision)}")
    measured = sum(1 for _, decision in listed if decision.source == MEASURED)
    if timing and measured:
        kept = f"kept in {report.decisions_file}" if report.decisions_file else "kept for this process"
        lines.append(f"auto · measured {measured} kind{'s' if measured > 1 else ''} of call now in "
                     f"{report.measure_seconds:.2f} s; {kept}")
    return lines


def block_names(keys: list) -> str:
    """Block-replace keys as a report names them, consecutive ones as ranges:
    [("double_block", 0), ("double_block", 1), ("single_block", 3)] -> 'double 0-1, single 3'."""
    groups = {}
    for key in keys:
        name = key[0].removesuffix("_block").replace("_", " ") if isinstance(key, tuple) else "block"
        groups.setdefault(name, []).append(key[-1] if isinstance(key, tuple) else key)
    parts = []
    for name, indices in groups.items():
        spans = _ranges(tuple(sorted(indices)))
        parts.append(f"{name} {spans}")
    return ", ".join(parts)


def graded_text(graded: dict, units: list, options: dict, keys: dict, total: float | None, budget: float,
                name_kinds: bool = True, each: bool = False) -> str:
    """What a per-block decision ran (``pays.grade_blocks``): 'window double 1, single 0-3 · left
    alone double 0 · 3.9 % of the 5 % budget' (units: (kind, block); ``keys``: block -> its
    block-replace key; the kind is named where a model call has several and ``name_kinds``: ToDo's
    kinds of attention call, not ToMe's kinds of block, which the keys name). ``each``: each block
    held against the budget alone (``pays.grade_each``): '... · at most 3.9 % a block, budget 5 %'."""
    several = name_kinds and len({kind for kind, _ in units}) > 1

    def names(chosen):
        kinds = sorted({kind for kind, _ in chosen})
        if not several:  # one list, the keys naming the blocks
            return block_names([keys[b] for _, b in sorted(chosen, key=lambda u: (keys[u[1]], u))])
        return "; ".join(f"{kind} " + block_names([keys[b] for k, b in chosen if k == kind]) for kind in kinds)
    methods = []
    for unit in units:
        for method in options[unit]:
            if method not in methods:
                methods.append(method)
    parts = [f"{method} {names([u for u in units if graded.get(u) == method])}"
             for method in methods if any(graded.get(u) == method for u in units)]
    left = [unit for unit in units if unit not in graded]
    if left:
        parts.append(f"left alone {names(left)}")
    if total is not None and graded:
        parts.append(f"at most {percent_text(total)} a block, budget {percent_text(budget)}" if each
                     else f"{percent_text(total)} of the {percent_text(budget)} budget")
    return " · ".join(parts)


REACH_SAID = 0.995  # a run covering less of sampling than this has its weighed change said


def verdict_text(decision) -> str:
    """What the auto rule did with a kind of call, and the quality budget's part in it: 'reduced',
    'left alone', 'left alone: changes its output 41 % > 10 %', in a run that covers part of
    sampling (image to image) 'left alone: changes its output 41 % (27.4 % weighed by the 30 % of
    sampling this run covers) > 10 %' (within the budget it says no more: the readout of
    measure_change says what the reduction changed)."""
    if decision.over_budget:
        weighed = "" if decision.reach >= REACH_SAID else (
            f" ({_budget_percent(decision.weighed_change)} weighed by the {percent_text(decision.reach)} of sampling "
            f"this run covers)")
        return (f"left alone: changes its output {_budget_percent(decision.change)}{weighed} > "
                f"{_budget_percent(decision.budget)}")
    if decision.budget and decision.change is None and decision.source != FAILED:
        return ("reduced (max_change not applied: the change cannot be measured for this model on this host)"
                if decision.reduce else "left alone")
    return "reduced" if decision.reduce else "left alone"


def _budget_percent(fraction: float) -> str:
    return f"{100 * fraction:.3g} %"


def window_line(windows: tuple[tuple[int, ...], ...]) -> str:
    """'context windows · 3 of 5 frames (frames 0-4, 3-7, 6-10)': each reduced as its own call."""
    sizes = sorted({len(w) for w in windows})
    size = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
    spans = ", ".join(f"{w[0]}-{w[-1]}" for w in windows[:6] if w) + (", ..." if len(windows) > 6 else "")
    return f"context windows · {len(windows)} of {size} frames (frames {spans}), each its own call"


def percent_text(fraction: float) -> str:
    """0.018 -> '1.8 %', 0.96 -> '96 %', 0.0043 -> '0.43 %': two significant digits, never an exponent."""
    percent = fraction * 100
    if percent >= 10:
        return f"{percent:.0f} %"
    if percent >= 1:
        return f"{percent:.1f} %"
    return f"{percent:.2g} %" if percent >= 1e-4 else ("0 %" if percent == 0 else "< 0.0001 %")


def change_line(change, steps: int) -> str:
    """measure_change's readout as the report says it (``change``: a ``run.PredictionChange``)."""
    where = f"step {change.step} of {steps}, " if change.step is not None else ""
    return (f"prediction change {percent_text(change.change)} ({where}one model call; not the final image's "
            f"change)")


def run_lines(header_line: str, report, timing: bool = True) -> list[str]:
    """The node's lines after a run (``report``: a ``run.RunReport``): what it patched, tokens
    per level, steps and time (``timing`` False: without the time, for a record of the image such as the WebUI's
    infotext, which identical runs should repeat)."""
    lines = [header_line]
    if report.refused:
        return lines  # the warnings say why
    for level in report.levels:
        stages = " · ".join(f"{stage} {before}→{after}" for stage, (before, after) in level.tokens.items())
        lines.append(f"ds {level.downsample} · {grid_text(level.grid)} · {stages}")
    lines += decision_lines(report, timing)
    if report.windows:
        lines.append(window_line(report.windows))
    lines += list(report.notes)
    if report.prediction_change is not None:
        lines.append(change_line(report.prediction_change, report.steps))
    active = f"steps {_ranges(report.active_steps)} of {report.steps}" if report.active_steps else \
        f"no step of {report.steps}"
    lines.append(active + (f" · {report.sampling_seconds:.1f} s sampling" if timing else "")
                 + ("" if report.completed else " · interrupted"))
    return lines


def run_warnings(label: str, calls: RunCalls, decided: tuple, steps: int, active: tuple, start_percent: float,
                 end_percent: float, completed: bool) -> list[str]:
    """What a run's report warns of, beyond what its calls warned of as they ran (``calls``: what
    the run's calls met, as plain counts)."""
    warnings = []
    # where a budget decided, its verdicts say what ran (per block: a kind's speed alone, read under
    # no budget, says nothing of whether a block reduced)
    verdicts = [d for d in decided if d.decision.budget > 0] or decided
    all_left = bool(verdicts) and not any(d.decision.reduce for d in verdicts)
    if all_left and any(d.decision.over_budget for d in verdicts):
        warnings.append(f"{label}: reduce_when auto left every grid of this run unreduced: reducing changed the "
                        f"output of some by more than max_change (the report says how much), the others were not "
                        f"at least {margin_text()} faster. Raise max_change (0: no budget) or set reduce_when to "
                        f"always to reduce anyway.")
    elif all_left:
        warnings.append(f"{label}: reduce_when auto left every grid of this run unreduced: on this device the "
                        f"reduced calls were not at least {margin_text()} faster (the times are in the report). Set "
                        f"reduce_when to always to reduce anyway.")
    elif calls.unreached and not calls.reduced:
        # Never a silent no-op: step caches that replace the model's forward (TeaCache's and
        # MagCache's) call its blocks without ComfyUI's transformer options.
        warnings.append(f"{label} did nothing: in {calls.unreached} model calls the model's attention never "
                        f"reached its attention override. Another node replaced the model's forward with one that "
                        f"does not pass ComfyUI's transformer options to its blocks (the TeaCache and MagCache "
                        f"nodes do), so no attention override can act there (nor a SageAttention patch). For a "
                        f"step cache that keeps the model's forward, use ComfyUI's EasyCache or LazyCache.")
    elif completed and steps and not active:
        warnings.append(f"{label} was active in none of the {steps} steps: no step's noise level lies "
                        f"between start_percent {start_percent:g} and end_percent {end_percent:g}, "
                        f"or no block could be reduced.")
    if calls.skipped and calls.dit:
        # A DiT's grid attention call whose keys are not the layout predicted for the model.
        warnings.append(f"{label} left {calls.skipped} attention calls of this run unreduced: their keys "
                        f"were not the token layout it predicts for this model. An attention patch applied "
                        f"before it changed them, or the model added tokens {label} does not know (extra "
                        f"reference images, say). Apply {label} before other attention patches; if there are "
                        f"none, please report the model and workflow.")
    elif calls.skipped:
        # Never a silent no-op: another attention patch that runs before ours reshaped the
        # tokens (HyperTile tiles the queries, for example).
        warnings.append(f"{label} was skipped in {calls.skipped} block calls of this run: the tokens "
                        f"it received were not the block's grid: an attention patch applied before it reshaped "
                        f"them (HyperTile tiles the queries; ToMe in its q, k, v mode merges keys and values). "
                        f"Apply {label} before that patch (closer to the checkpoint loader).")
    warnings += [f"{label}: could not measure {d.site} ({d.decision.error}); reduced as set."
                 for d in decided if d.decision.source == FAILED]
    return warnings
