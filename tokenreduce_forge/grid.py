"""Where Forge differs from ComfyUI for the patches, in one place: the grid of a block call.

ComfyUI passes attention patches the block's ``activations_shape``; Forge (2.0, 2025) passes
only ``original_shape``, the latent's. The token grid of a UNet level is the latent's size
halved that many times, rounding up (``tokenreduce.grid``), so a block's grid follows from the
latent and the number of tokens the block received: at most one level has that many tokens.
``supply_activations_shape`` is registered as the first of TokenReduce's attention patches and
writes the inferred shape where ComfyUI's would be, so the shared patches in ``tokenreduce/``
run unchanged. Tokens that no level has (another patch reshaped them, or a model that rescales
inside by a factor that is not a power of two) get the nearest level's grid: the patches see
that the tokens are not that grid, leave the block alone and report it, as on ComfyUI.
"""

from __future__ import annotations

import math

from tokenreduce.grid import grid_at

ACTIVATIONS_SHAPE = "activations_shape"


def grid_of(latent_hw: tuple[int, int], tokens: int) -> tuple[int, int]:
    """The (h, w) grid of the UNet level that has ``tokens`` tokens for a latent of
    ``latent_hw``; where none has, the nearest level's grid (then ``h * w != tokens``)."""
    level = 1
    while True:
        h, w = grid_at(latent_hw, level)
        if h * w == tokens:
            return h, w
        if h * w < tokens or (h, w) == (1, 1):
            break
        level *= 2
    ratio = math.sqrt(latent_hw[0] * latent_hw[1] / max(tokens, 1))
    return grid_at(latent_hw, 2 ** max(0, round(math.log2(max(ratio, 1.0)))))


def supply_activations_shape(n, context, value, extra_options):
    """An ``attn1_patch`` that gives this block call the ``activations_shape`` a ComfyUI host
    would pass (nothing where the host passes one already)."""
    if ACTIVATIONS_SHAPE not in extra_options:
        original = extra_options.get("original_shape")
        if original is not None and n.ndim == 3:
            h, w = grid_of((int(original[-2]), int(original[-1])), n.shape[1])
            extra_options[ACTIVATIONS_SHAPE] = [n.shape[0], n.shape[2], h, w]
    return n, context, value
