"""The quality budget's unit for a DiT's blocks, read late in sampling (issue #51).

Read at a run's first call, no unit says which block the picture forgives: on the Flux fixture
the block whose reduction changes the pictures most (LPIPS 0.215) reads one of the smallest
output changes there; the peaks a reduction loses form later. Read at three quarters of sampling
the block's output change ranks the blocks (Spearman 0.89 with LPIPS over nearest's blocks,
docs/quality.md). A budget must decide before the run's first reduced call, so that the run that
measures gives the image of every later run; so the late input is rehearsed:

1. the model call is run again whole (below every host wrapper, no TokenReduce context), which
   gives the model's prediction of the clean latent;
2. that prediction is noised again with the run's own noise to the schedule's step at
   ``window.LATE`` (``window.late_latent``: one Euler step in the sampler's own space);
3. the call is run once more there, each measured block replaced by one that runs the block whole
   and reduced each way asked, keeps the changes and hands the whole output on, so every block
   is measured on the input the unreduced model gives it, in one call.

Nothing that keeps state between model calls runs in it (the host leaves its wrappers out, other
packs' block replacements are not called), the random generators are untouched (the auto rule
measures under ``pays.untouched_rng``), and nothing of the user's call is consumed (the host's
rehearsal runs on copies of the call's containers).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from .describe import graded_text, percent_text
from .measure import measuring_options
from .pays import FAILED, KEPT, LATE_SCALE, MEASURED, Decision, grade_blocks, grade_each
from .run import ModelCall, RunState
from .window import LATE, late_latent


class NotRehearsed(RuntimeError):
    """A rehearsed model call never reached a measured block: the model calls it without the
    host's key, or something skipped it. A fact of the model (the change is not known), not a
    failure of the try."""


def late_block_changes(call: ModelCall, late: float | None, wanted: dict,
                       measure: Callable[[object, dict, dict], tuple[object, dict]]) -> dict:
    """{block: what ``measure`` found} for ``wanted`` ({block: block-replace key}), each measured
    on the input the unreduced model hands it at the noise level ``late`` (None, or not below the
    call's own level: the call's own input). ``measure(block, args, extra)`` runs the block as it
    likes and returns (the whole output, handed on; what it found)."""
    if call.rehearse is None:
        raise NotRehearsed("this host cannot run a model call again")
    x, level = None, None  # the call's own input
    options = measuring_options(call)
    nested = getattr(call.x, "is_nested", False)  # streams of their own sizes (MiniMax-H3): their own input
    if late is not None and not nested and bool((call.sigmas > late).all()):  # one read, while measuring
        denoised = call.rehearse(measuring_options(call))
        x, level = late_latent(call.x, call.sigmas, denoised, late), late
        options["sigmas"] = call.sigmas.new_full(call.sigmas.shape, late)
    found = {}

    def replaced(block):
        def run(args, extra):
            whole, found[block] = measure(block, args, extra)
            return whole
        return run

    replace = options.setdefault("patches_replace", {})
    replace["dit"] = {key: replaced(block) for block, key in wanted.items()}  # ours alone: no other pack's
    call.rehearse(options, x=x, level=level)
    return reached(wanted, found)


def reached(wanted, found: dict, name=str) -> dict:
    """``found``, where the rehearsal reached every block of ``wanted``; else ``NotRehearsed``
    naming the blocks it never reached (``name``: how)."""
    missing = [block for block in wanted if block not in found]
    if missing:
        raise NotRehearsed(f"the model call, run again to measure its blocks, never reached block "
                           f"{', '.join(map(name, missing))}")
    return found


def model_block(args: dict, extra: dict):
    """The model's own block at a block-replace key (another pack's replacement there runs nowhere
    the budget measures)."""
    return extra["original_block"](args)


def once_per_run(run: RunState, key, rehearse: Callable[[], dict]) -> dict:
    """What ``rehearse()`` found ({(kind, block): {method: change}}), once per run under ``key``:
    {} where the model never reached a block (not known); a failure (out of memory, say) kept and
    raised again for each block that asks, so the rehearsal is tried once a run."""
    found = run.cache.get(key)
    if found is None:
        try:
            found = rehearse()
        except NotRehearsed:
            found = {}
        except Exception as problem:  # noqa: BLE001 - kept for the run's other blocks, raised for each
            found = problem
        run.cache[key] = found
    if isinstance(found, Exception):
        raise found
    return found


class Graded(NamedTuple):
    """A per-block decision (``grade``)."""

    choice: dict  # unit -> the method it runs (the units left alone absent)
    total: float | None  # their summed change as held against the budget (None: a failed measurement)
    options: dict  # unit -> the methods that pay for it, the most reducing first
    measured: dict  # (unit, method) -> the auto rule's Decision holding that block's change
    failed: Decision | None  # the failed measurement (reduced as set), or None


def grade(units: list, ladder: tuple, pays: Callable[[object, object], bool],
          change: Callable[[object, object], Decision], budget: float, reach: float,
          each: bool = False) -> Graded | None:
    """Per-block decisions of ``units`` under ``budget``: the first method of ``ladder`` (the
    node's) where it pays (``pays(unit, method)``), each block's change (``change(unit, method)``:
    the auto rule's decision, kept or measured) summed and counted ``LATE_SCALE`` times
    (``pays.grade_blocks``), or with ``each`` each block held against the budget alone
    (``pays.grade_each``: a UNet's blocks, read at the first call); the milder methods of the
    ladder are timed and measured only where a block was left out. None: a change not knowable
    here (the caller decides per kind)."""
    options = {unit: (ladder[0],) if pays(unit, ladder[0]) else () for unit in units}
    measured, choice, total, failed = {}, {}, 0.0, None
    for milder in (None, *ladder[1:]):
        if milder is not None:
            if len(choice) == len(units) or failed is not None:
                break
            options = {unit: (*methods, milder) if pays(unit, milder) else methods
                       for unit, methods in options.items()}
        for unit, methods in options.items():
            for method in methods:
                if (unit, method) not in measured and failed is None:  # one failure is said, not one a block
                    measured[(unit, method)] = decision = change(unit, method)
                    failed = decision if decision.source == FAILED else None
        if failed is None and any(d.change is None for d in measured.values()):
            return None
        if failed is None:
            changes = {k: d.change for k, d in measured.items()}
            choice, total = grade_each(options, changes, budget, reach) if each else \
                grade_blocks(options, changes, budget, reach, LATE_SCALE)
    if failed is not None:  # reduced as set where it pays; said every run
        choice, total = {unit: methods[0] for unit, methods in options.items() if methods}, None
    return Graded(choice, total, options, measured, failed)


def say_graded(run: RunState, device, site: str, graded: Graded, units: list, keys: dict, budget: float,
               where: str, label: Callable[[object], str] = str, name_kinds: bool = True,
               each: bool = False) -> None:
    """The report's line of a per-block decision (nothing where nothing paid: the speed decisions
    say so), and a decision under ``site`` for the run's warnings and websocket message: reduced
    where any block reduces; else left alone with the smallest change a block would make, counted
    as the budget counts it (every block alone was over the budget); a failure, said every run.
    ``each``: graded by ``grade_each`` (read at the first call, each block alone)."""
    if not graded.measured:
        return
    measured = graded.measured.values()
    source = FAILED if graded.failed is not None else (
        MEASURED if any(d.source == MEASURED for d in measured) else KEPT)
    seconds = sum(d.seconds for d in measured)
    if graded.failed is not None:
        decision = graded.failed._replace(seconds=seconds)
    elif graded.choice:
        decision = Decision(True, None, None, source, seconds, change=graded.total, budget=budget, reach=run.reach)
    else:
        smallest = min((d.change for (unit, method), d in graded.measured.items()
                        if method == graded.options[unit][-1]), default=None)
        decision = Decision(False, None, None, source, seconds,
                            change=smallest * (1.0 if each else LATE_SCALE) if smallest is not None else None,
                            budget=budget, reach=run.reach)
    run.decided(site, device, decision, where)
    # Graded each block alone (a UNet's), a line only where the budget changed what runs: as a UNet's
    # level within the budget said no more (measure_change's readout says what the reduction changed).
    changed = not each or any(graded.choice.get(unit) != (graded.options[unit] or (None,))[0] for unit in units)
    if graded.failed is None and changed:
        choice = {unit: label(method) for unit, method in graded.choice.items()}
        options = {unit: tuple(label(m) for m in methods) for unit, methods in graded.options.items()}
        how = "each block alone" if each else f"read at {percent_text(LATE)} of sampling, counted {LATE_SCALE:g}x"
        run.note_once(f"auto · {site}, {how} · " + graded_text(choice, units, options, keys, graded.total, budget,
                                                                name_kinds, each))
