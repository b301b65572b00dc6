"""Checks of a node's settings against the latent being sampled.

The latent size is unknown when a node executes (the same patched model serves any size), so
these run when sampling starts, before the first step: a setting that cannot act on this
latent is refused there with a message that names the node and the value, instead of the run
quietly doing nothing; one that acts on only part of it comes back as a warning for the run's
report."""

from __future__ import annotations

from .grid import grid_at


def _px(latent_hw: tuple[int, int]) -> str:
    return f"{latent_hw[1] * 8}x{latent_hw[0] * 8} px"


def _grids(latent_hw, levels) -> str:
    return ", ".join(f"{'x'.join(map(str, grid_at(latent_hw, lv)))} at downsample {lv}" for lv in levels)


def _holds_a_cell(grid: tuple[int, int], stride_x: int, stride_y: int) -> bool:
    return grid[0] >= stride_y and grid[1] >= stride_x


def tome_strides(node_id: str, levels: tuple[int, ...], stride_x: int, stride_y: int):
    """ToMe keeps one merge target per stride_x x stride_y cell: a grid smaller than one cell
    has nothing to merge."""

    def check(latent_shape: tuple[int, ...]) -> list[str]:
        latent_hw = tuple(latent_shape[-2:])
        fits = [lv for lv in levels if _holds_a_cell(grid_at(latent_hw, lv), stride_x, stride_y)]
        if not fits:
            raise ValueError(
                f"{node_id}: stride_x {stride_x} / stride_y {stride_y} do not fit the token grids of this "
                f"{_px(latent_hw)} latent ({_grids(latent_hw, levels)}): nothing would be merged. "
                f"Use strides of at most the grid size, or a larger image.")
        missed = [str(lv) for lv in levels if lv not in fits]
        if missed:
            return [f"{node_id}: strides {stride_x}x{stride_y} are larger than the token grid at downsample "
                    f"{', '.join(missed)} for this {_px(latent_hw)} latent; those levels are not merged."]
        return []

    return check


def todo_factors(node_id: str, factors: list[tuple[str, int, float]]):
    """ToDo pools keys/values by a factor per side (``(input name, level, factor)``): a factor
    larger than the grid would pool the whole level into one token."""

    def check(latent_shape: tuple[int, ...]) -> list[str]:
        latent_hw = tuple(latent_shape[-2:])
        for name, level, factor in factors:
            h, w = grid_at(latent_hw, level)
            if factor > min(h, w):
                raise ValueError(
                    f"{node_id}: {name} {factor:g} does not fit the {h}x{w} token grid at downsample {level} of "
                    f"this {_px(latent_hw)} latent: it must be at most {min(h, w)} there. Lower {name} or use a "
                    f"larger image.")
        return []

    return check


def dit_factor(node_id: str, patch: tuple[int, int, int], factor: float):
    """ToDo on a DiT pools each frame's grid by ``factor`` per side: it must fit that grid."""

    def check(latent_shape: tuple[int, ...]) -> list[str]:
        h, w = -(-latent_shape[-2] // patch[1]), -(-latent_shape[-1] // patch[2])
        if factor > min(h, w):
            raise ValueError(f"{node_id}: factor {factor:g} does not fit the {w}x{h} token grid of this latent: it "
                             f"must be at most {min(h, w)} there. Lower factor or use a larger image.")
        return []

    return check
