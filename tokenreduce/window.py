"""The part of sampling in which a patch is active, in noise level (sigma).

Hosts express it as percents of sampling (0 = first step, highest noise; 1 = the end) and turn
them into sigmas with their model's schedule; a step is inside when its sigma lies between the
two, both ends included. Measured in model time, not step index, so the same window means the
same thing for any step count, sampler or denoise.
"""

from __future__ import annotations

from dataclasses import dataclass


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
