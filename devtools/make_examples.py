"""Write the UI-format example workflows in ``example_workflows/``: txt2img graphs for SD1.5 and
SDXL with each patch node between the checkpoint loader and the sampler.

    python3 devtools/make_examples.py

The test suite checks that the committed files are what this script writes, that every node
type in them exists and that their widget values fit the nodes' current inputs.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "example_workflows"

PROMPT = "a lighthouse on a rocky cliff at sunset, dramatic sky, highly detailed photograph"
NEGATIVE = "blurry, low quality, watermark"
FAMILIES = {  # checkpoint name users most likely have, size, steps, cfg
    "sd15": ("v1-5-pruned-emaonly.safetensors", 512, 20, 7.0),
    "sdxl": ("sd_xl_base_1.0.safetensors", 1024, 25, 6.0),
}
# Widget values in input order, as the frontend saves them (ToMe's seed is followed by its
# "control after generate" value); the recommended defaults (README).
PATCHES = {  # node type, method, widget values, node height (room for the report drawn below it)
    "tome": ("TokenReduceToMe", "ToMe", [0.5, 2, 2, "auto", "q, k, v (tomesd)", True, False, False, True, 0, "fixed", 0.0, 1.0,
                                     False, "whole grid (tomesd)", "auto"], 460),
    "todo": ("TokenReduceToDo", "ToDo", [2.0, 1.0, "auto", "nearest", 0.0, 1.0, 1.0, 1, 1, "auto"], 310),
}
LOADER, PATCH, POSITIVE, NEGATIVE_ID, LATENT, SAMPLER, DECODE, SAVE = 4, 10, 6, 7, 5, 3, 8, 9


def _node(node_id, node_type, pos, size, inputs, outputs, widgets, order, **extra):
    return {"id": node_id, "type": node_type, "pos": pos, "size": size, "flags": {}, "order": order, "mode": 0,
            "inputs": inputs, "outputs": outputs, "properties": {"Node name for S&R": node_type},
            "widgets_values": widgets, **extra}


def _out(name, kind, links, slot=0):
    return {"name": name, "type": kind, "links": links, "slot_index": slot}


def workflow(family: str, patch: str) -> dict:
    checkpoint, size, steps, cfg = FAMILIES[family]
    node_type, method, widgets, height = PATCHES[patch]
    links = [  # id, from node, from slot, to node, to slot, type
        [1, LOADER, 0, PATCH, 0, "MODEL"], [2, PATCH, 0, SAMPLER, 0, "MODEL"], [3, LOADER, 1, POSITIVE, 0, "CLIP"],
        [5, LOADER, 1, NEGATIVE_ID, 0, "CLIP"], [4, POSITIVE, 0, SAMPLER, 1, "CONDITIONING"],
        [6, NEGATIVE_ID, 0, SAMPLER, 2, "CONDITIONING"], [7, LATENT, 0, SAMPLER, 3, "LATENT"],
        [9, SAMPLER, 0, DECODE, 0, "LATENT"], [8, LOADER, 2, DECODE, 1, "VAE"], [10, DECODE, 0, SAVE, 0, "IMAGE"],
    ]
    nodes = [
        _node(LOADER, "CheckpointLoaderSimple", [40, 60], [315, 98], [],
              [_out("MODEL", "MODEL", [1]), _out("CLIP", "CLIP", [3, 5], 1), _out("VAE", "VAE", [8], 2)],
              [checkpoint], 0),
        _node(PATCH, node_type, [480, 60], [340, height], [{"name": "model", "type": "MODEL", "link": 1}],
              [_out("MODEL", "MODEL", [2]), {"name": "info", "type": "STRING", "links": None}], widgets, 1,
              color="#233", bgcolor="#355"),
        _node(POSITIVE, "CLIPTextEncode", [40, 220], [400, 160], [{"name": "clip", "type": "CLIP", "link": 3}],
              [_out("CONDITIONING", "CONDITIONING", [4])], [PROMPT], 2, title="Positive prompt"),
        _node(NEGATIVE_ID, "CLIPTextEncode", [40, 420], [400, 130], [{"name": "clip", "type": "CLIP", "link": 5}],
              [_out("CONDITIONING", "CONDITIONING", [6])], [NEGATIVE], 3, title="Negative prompt"),
        _node(LATENT, "EmptyLatentImage", [40, 590], [315, 106], [], [_out("LATENT", "LATENT", [7])],
              [size, size, 1], 4),
        _node(SAMPLER, "KSampler", [880, 60], [315, 262],
              [{"name": "model", "type": "MODEL", "link": 2}, {"name": "positive", "type": "CONDITIONING", "link": 4},
               {"name": "negative", "type": "CONDITIONING", "link": 6},
               {"name": "latent_image", "type": "LATENT", "link": 7}],
              [_out("LATENT", "LATENT", [9])], [42, "fixed", steps, cfg, "euler", "normal", 1.0], 5),
        _node(DECODE, "VAEDecode", [1240, 60], [210, 46],
              [{"name": "samples", "type": "LATENT", "link": 9}, {"name": "vae", "type": "VAE", "link": 8}],
              [_out("IMAGE", "IMAGE", [10])], [], 6),
        _node(SAVE, "SaveImage", [1240, 160], [400, 420], [{"name": "images", "type": "IMAGE", "link": 10}], [],
              [f"TokenReduce_{family}_{patch}"], 7),
    ]
    return {"last_node_id": 10, "last_link_id": 10, "nodes": nodes, "links": links, "groups": [], "config": {},
            "extra": {"info": {"name": f"{family.upper()} txt2img with {method}"}}, "version": 0.4}


def examples() -> dict[str, dict]:
    return {f"{family}_txt2img_{patch}.json": workflow(family, patch) for family in FAMILIES for patch in PATCHES}


def render(flow: dict) -> str:
    return json.dumps(flow, indent=1) + "\n"


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for name, flow in examples().items():
        (OUT / name).write_text(render(flow))
        print(OUT / name)


if __name__ == "__main__":
    main()
