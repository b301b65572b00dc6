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

from typing import Callable

from .measure import measuring_options
from .run import ModelCall
from .window import late_latent


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
    missing = [block for block in wanted if block not in found]
    if missing:
        raise NotRehearsed(f"the model call, run again to measure its blocks, never reached block "
                           f"{', '.join(map(str, missing))}")
    return found
