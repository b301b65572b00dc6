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
