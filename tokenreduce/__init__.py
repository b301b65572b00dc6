"""Host-free core of the TokenReduce pack: token merging (ToMe) and token downsampling (ToDo)
for diffusion models.

Imports nothing but torch. The algorithms (bipartite matching, grid pooling, grids, seeds,
step windows), the methods' inputs, where a model's attention sites are, and the attention
patches that ComfyUI and the WebUI call the same way; host adapters (``nodes/`` for ComfyUI,
``scripts/`` for the WebUI) only wire these into their host.
"""

from .bipartite import MergePlan, Partition, partition_grid, plan_bipartite_merge, plan_merge, stride_ratio_cap
from .downsample import METHODS as DOWNSAMPLE_METHODS, downsample_tokens, downsampled_grid
from .grid import downsample_of, grid_at
from .seeding import derive_seed
from .window import SigmaWindow, steps_of

__all__ = [
    "DOWNSAMPLE_METHODS",
    "downsample_tokens",
    "downsampled_grid",
    "MergePlan",
    "Partition",
    "partition_grid",
    "plan_bipartite_merge",
    "plan_merge",
    "stride_ratio_cap",
    "downsample_of",
    "grid_at",
    "derive_seed",
    "SigmaWindow",
    "steps_of",
]
