"""Token grids of UNet levels.

A UNet halves its feature map with stride-2 convolutions padded by one, which rounds *up*:
a 65-row latent gives 33, 17 and 9 rows at downsample 2, 4 and 8. Grids here follow that
rounding, so odd and non-square sizes map to the right level.
"""

from __future__ import annotations

import functools
import math


@functools.lru_cache(maxsize=1024)  # pure; called for every block of every step
def grid_at(latent_hw: tuple[int, int], downsample: int) -> tuple[int, int]:
    """The (h, w) token grid a UNet level with this downsample has for a latent of latent_hw."""
    h, w = latent_hw
    return math.ceil(h / downsample), math.ceil(w / downsample)


@functools.lru_cache(maxsize=1024)
def downsample_of(latent_hw: tuple[int, int], grid_hw: tuple[int, int]) -> int:
    """The power-of-two downsample of a level whose grid is grid_hw, for a latent of latent_hw.

    Taken as the nearest power of two to latent/grid on the larger side, then checked against
    the ceil rounding; a grid that no power of two explains (a model that rescales inside,
    such as Kohya Deep Shrink) still gets its nearest level.
    """
    lh, lw = latent_hw
    gh, gw = grid_hw
    if gh <= 0 or gw <= 0:
        raise ValueError(f"empty grid {grid_hw}")
    ratio = max(lh / gh, lw / gw)
    level = 2 ** max(0, round(math.log2(ratio)))
    for candidate in (level, level * 2, level // 2):
        if candidate >= 1 and grid_at(latent_hw, candidate) == (gh, gw):
            return candidate
    return level
