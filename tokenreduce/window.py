"""The part of sampling in which a patch is active, in noise level (sigma).

Hosts express it as percents of sampling (0 = first step, highest noise; 1 = the end) and turn
them into sigmas with their model's schedule; a step is inside when its sigma lies between the
two, both ends included. Measured in model time, not step index, so the same window means the
same thing for any step count, sampler or denoise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class SigmaWindow:
    sigma_start: float  # sigma at start_percent (the larger)
    sigma_end: float  # sigma at end_percent (the smaller)

    def contains(self, sigma: float) -> bool:
        return self.sigma_end <= sigma <= self.sigma_start

    @property
    def is_empty(self) -> bool:
        return self.sigma_start < self.sigma_end


def flow_sigma(percent: float, shift: float = 1.0) -> float:
    """The sigma of a flow-matching schedule at ``percent`` of sampling, its time ``1 - percent``
    shifted by ``shift`` (``shift * t / (1 + (shift - 1) * t)``, as ComfyUI's ``percent_to_sigma``
    of its discrete-flow model sampling and diffusers' flow schedulers shift their sigmas)."""
    if percent <= 0.0:
        return 1.0
    if percent >= 1.0:
        return 0.0
    t = 1.0 - percent
    return t if shift == 1.0 else shift * t / (1 + (shift - 1) * t)


def steps_of(schedule: list[float], sigmas) -> tuple[int, ...]:
    """The 1-based steps of a sampling schedule (sigmas or timesteps, highest first, ending with
    the final one; timesteps may be negative) that the given noise levels were evaluated in. A
    step runs at its schedule sigma and, in multi-evaluation samplers, at levels between it and
    the next one; those count for it."""
    starts = schedule[:-1]
    steps = set()
    for sigma in sigmas:
        # The last step whose sigma is at or above this one, with a tolerance for rounding relative
        # to its size: below it whatever its sign (timesteps such as 250 * ln(sigma) go negative).
        inside = [i for i, start in enumerate(starts) if start >= sigma - abs(sigma) * 1e-6 - 1e-9]
        if inside:
            steps.add(inside[-1] + 1)
    return tuple(sorted(steps))


def schedule_reach(percent_to_sigma: Callable[[float], float], first_sigma: float) -> float:
    """The share of sampling a run covers, from the noise level of its first step: 1 for a run
    from pure noise (text to image), about ``denoise`` for image to image or a hires pass (0.3:
    the run starts 70 % of the way in). ``percent_to_sigma`` is the host's map from percent of
    sampling to sigma (falling; ComfyUI's answers a huge sigma at 0): bisected, no device read.
    The quality budget weighs a measured change by it (``pays.weighed_change``)."""
    if not first_sigma > 0.0:  # nothing left to sample (or not a number): no reach
        return 0.0
    low, high = 0.0, 1.0  # percents whose sigmas lie above and below first_sigma
    if percent_to_sigma(1e-6) <= first_sigma:  # at or above the schedule's start: the whole of it
        return 1.0
    for _ in range(40):  # 1e-12 of a percent: far below any step
        middle = (low + high) / 2
        if percent_to_sigma(middle) > first_sigma:
            low = middle
        else:
            high = middle
    return min(1.0, max(0.0, 1.0 - (low + high) / 2))


LATE = 0.75  # where in a run's schedule the quality budget reads a DiT block's change (docs/auto-rule.md)


def late_level(schedule, at: float = LATE) -> float | None:
    """The noise level of the step at ``at`` of a run's schedule (sigmas, highest first, ending
    with the last): step 3 of 4 at 0.75, KSampler Advanced's start step. None where the schedule
    has fewer than two steps or ends there (nothing later to read). One read per run, before any
    step (the schedule lives on the CPU)."""
    index = _late_index(schedule, at)
    if index is None:
        return None
    level = float(schedule[index])
    return level if level > 0.0 else None


def levels_to_late(schedule, at: float = LATE) -> tuple[float, ...]:
    """The noise levels of a run's steps from its first to the one ``late_level`` reads, highest
    first: where an input some steps before the late one is read (ToMe's correct_from_whole, whose
    plans and their differences are made steps before they serve). () where ``late_level`` is None."""
    if late_level(schedule, at) is None:
        return ()
    return tuple(float(s) for s in schedule[:_late_index(schedule, at) + 1])


def _late_index(schedule, at: float) -> int | None:
    """The step ``late_level`` reads: the one at ``at`` of the schedule, at least the second and
    before the last; None where the schedule has fewer than two steps."""
    if schedule is None or getattr(schedule, "numel", lambda: len(schedule))() < 3:
        return None
    steps = len(schedule) - 1
    return min(steps - 1, max(1, round(at * steps)))


def late_latent(x, sigma, denoised, late: float):
    """``x`` at noise level ``sigma`` (per row) moved to ``late`` by one Euler step along the
    model's prediction ``denoised``: in ComfyUI's sampling space this is the prediction noised
    again with the run's own noise (``x0 + late * n`` for eps models, ``(1 - late) * x0 + late *
    n`` for flow models: both follow from ``x`` and ``x0``), so no parametrization needs naming."""
    shape = (-1,) + (1,) * (x.ndim - 1)
    sigma = sigma.reshape(shape).to(torch.float32)
    step = (late - sigma) / sigma
    return (x.float() + step * (x.float() - denoised.float())).to(x.dtype)
