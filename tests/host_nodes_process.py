"""The node types a ComfyUI knows once it has loaded its nodes as its server does (its own, those
of comfy_extras/, and this pack loaded as a custom-node folder), printed as a JSON list on the
last line of stdout. A process of its own: loading every node module of a host is not undone.

    python tests/host_nodes_process.py COMFYUI_TREE
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(root: str) -> None:
    sys.path.insert(0, root)
    import torch
    from comfy.cli_args import args

    args.cpu = not torch.cuda.is_available()
    try:  # main.py imports it first: comfy/ has a module named utils too, which would shadow it
        import utils.extra_config  # noqa: F401
    except ImportError:
        pass
    import nodes

    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    if not asyncio.run(nodes.load_custom_node(str(REPO))):
        raise SystemExit(f"ComfyUI at {root} could not load the pack at {REPO}")
    print(json.dumps(sorted(nodes.NODE_CLASS_MAPPINGS)))


if __name__ == "__main__":
    main(*sys.argv[1:])
