"""Host-free core of the TokenReduce node pack: token merging (ToMe) and token downsampling
(ToDo) for Stable Diffusion UNets.

Imports nothing but torch. Host adapters (the ComfyUI nodes in ``nodes/``) read the host's
data structures and call into this package.
"""

from .downsample import METHODS as DOWNSAMPLE_METHODS, downsample_tokens, downsampled_grid
from .bipartite import MergePlan, plan_bipartite_merge, stride_ratio_cap
from .grid import downsample_of, grid_at
from .seeding import derive_seed
from .window import SigmaWindow, steps_of

__all__ = [
    "DOWNSAMPLE_METHODS",
    "downsample_tokens",
    "downsampled_grid",
    "MergePlan",
    "plan_bipartite_merge",
    "stride_ratio_cap",
    "downsample_of",
    "grid_at",
    "derive_seed",
    "SigmaWindow",
    "steps_of",
]
