"""The side-by-side benchmark behind ``devtools/benchmark.py``, one job per module:

- ``configs``: the configurations compared, as data (the nodes and settings each applies,
  from the nodes' declared inputs, and what it reduces for the Amdahl bound);
- ``families``: the model families (how to build a random-weight model and its conditioning);
- ``environment``: ComfyUI and this pack loaded in-process, the nodes, attention backends, the machine;
- ``step``: one denoising step through ComfyUI's sampler, for any model family;
- ``timing``: interleaved timed passes with warm-up, evaluations per pass and peak memory;
- ``memory``: peak memory of a pass and the attention working set;
- ``compiled``: configurations under ComfyUI's ``torch.compile`` wrapper;
- ``amdahl``: where the unpatched forward's time goes and the bounds it sets (UNets);
- ``study``: full sampling with a real checkpoint, image MSE/PSNR and a grid;
- ``report``: the result rows, the markdown table and the JSON; ``plots``: the figures;
- ``run``: the benchmark loop; ``cli``: the command line.
- ``tome_dit_table``: ToMe's whole-block merging on DiTs against ToDo, a Pareto table per model (``--tome-dit``).

Runs inside the ComfyUI host's Python with ``devtools/`` on ``sys.path``.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACK = "tokenreduce_pack"  # the module name the pack is loaded under, as ComfyUI would
