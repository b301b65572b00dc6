"""What an attention patch learns about the block it runs in, from ComfyUI's extra_options."""

from __future__ import annotations

from ..tokenreduce import downsample_of


def site_key(extra_options: dict) -> tuple | None:
    """(block kind, block number, index in its SpatialTransformer), as in TransformerSite.key."""
    block = extra_options.get("block")
    if block is None:
        return None
    return (block[0], block[1], extra_options.get("block_index", 0))


def block_level(extra_options: dict) -> tuple[tuple[int, int], int] | None:
    """The block's token grid and its downsample relative to the latent, from the actual
    activations (not guessed from token counts); None where the host gives no shapes.
    Callers check that the tokens they received are that grid (``h * w`` of them): another
    patch may have reshaped them, or the block may be temporal attention."""
    activations = extra_options.get("activations_shape")
    original = extra_options.get("original_shape")
    if activations is None or original is None:
        return None
    grid = (activations[-2], activations[-1])
    return grid, downsample_of((original[-2], original[-1]), grid)
