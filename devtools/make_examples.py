"""Write the UI-format example workflows in ``example_workflows/``: txt2img graphs for SD1.5 and
SDXL with each patch node between the checkpoint loader and the sampler, and ToDo on the DiTs
most users run: Wan 2.1 text to video, Wan 2.1 VACE (1.3B), Wan 2.2 A14B text to video (two
experts, a ToDo node on each, lightx2v's 4-step LoRAs), LTX-Video text to video, LTX-2 text to
video with audio (ComfyUI 0.33: ``NEEDS``, said in a Note in the example) and Flux.1 [dev] text to image, with the
loaders, file names and sizes of ComfyUI's own templates for them, and a long Wan 2.1 clip
sampled in ComfyUI's context windows. And A/B examples for SD1.5, SDXL, Flux.1 [dev] and Wan 2.1
(``AB_EXAMPLES``): one seed sampled without and with ToDo, both decoded and saved, Image Compare
(TokenReduce) between them, and a Note saying why ToDo and where to read both sampling times.

    python3 devtools/make_examples.py

The test suite checks that the committed files are what this script writes, that every node
type in them exists and that their widget values fit the nodes' current inputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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
                                     False, "whole grid (tomesd)", "auto", 1, 1, False, 0.05, 0.0, False], 508),
    "todo": ("TokenReduceToDo", "ToDo", [2.0, 1.0, "auto", "nearest", 0.0, 1.0, 1.0, 1, 1, "auto", False, 0.05], 310),
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


class Graph:
    """A UI-format graph built node by node: ``add`` places a node (its inputs linked to
    ``(node id, output slot)`` of nodes added before), ``flow`` the workflow with its links."""

    def __init__(self):
        self.nodes, self.links = [], []

    def add(self, node_id, node_type, pos, size, widgets, outputs=(), inputs=(), widget_inputs=(), **extra):
        """``outputs``: (name, type) per output slot; ``inputs``: (name, type, (from id, slot)),
        or (name, type, None) for an optional input left unconnected; ``widget_inputs``: the
        names among them that are widgets fed by a link (the frontend marks those)."""
        node = _node(node_id, node_type, pos, size, [], [], list(widgets), len(self.nodes), **extra)
        for name, kind in outputs:
            node["outputs"].append(_out(name, kind, [], len(node["outputs"])))
        for name, kind, source in inputs:
            if source is None:
                node["inputs"].append({"name": name, "shape": 7, "type": kind, "link": None})
                continue
            source, slot = source
            link_id = len(self.links) + 1
            self.links.append([link_id, source, slot, node_id, len(node["inputs"]), kind])
            node["inputs"].append({"name": name, "type": kind, "link": link_id})
            if name in widget_inputs:
                node["inputs"][-1]["widget"] = {"name": name}
            (origin,) = [n for n in self.nodes if n["id"] == source]
            origin["outputs"][slot]["links"].append(link_id)
        self.nodes.append(node)
        return node_id

    def flow(self, name: str) -> dict:
        for node in self.nodes:
            for output in node["outputs"]:
                if not output["links"]:
                    output["links"] = None
        return {"last_node_id": max(n["id"] for n in self.nodes), "last_link_id": len(self.links),
                "nodes": self.nodes, "links": self.links, "groups": [], "config": {}, "extra": {"info": {"name": name}},
                "version": 0.4}


WAN_PROMPT = ("a lighthouse on a rocky cliff at sunset, waves crashing against the rocks, the camera slowly "
              "circles the tower, cinematic, highly detailed")
WAN_NEGATIVE = "blurry, static, low quality, watermark, text, deformed, jittery motion"


def _todo_node(graph, model_source, pos):
    node_type, _, widgets, height = PATCHES["todo"]
    return graph.add(PATCH, node_type, pos, [340, height], widgets, [("MODEL", "MODEL"), ("info", "STRING")],
                     [("model", "MODEL", model_source)], color="#233", bgcolor="#355")


def _wan_loaders(g, model_file):
    """The Wan 2.1 templates' loaders: the diffusion model, umt5-xxl (fp8) and the Wan 2.1 VAE."""
    unet = g.add(1, "UNETLoader", [40, 60], [340, 82], [model_file, "default"], [("MODEL", "MODEL")])
    clip = g.add(2, "CLIPLoader", [40, 190], [340, 106], ["umt5_xxl_fp8_e4m3fn_scaled.safetensors", "wan", "default"],
                 [("CLIP", "CLIP")])
    vae = g.add(3, "VAELoader", [40, 340], [340, 58], ["wan_2.1_vae.safetensors"], [("VAE", "VAE")])
    return unet, clip, vae


def _prompts(g, clip, positive, negative, pos, clip_slot=0):
    """The positive and negative prompts (nodes 4 and 5), the negative below the positive at ``pos``;
    ``clip_slot``: the CLIP's output slot of the node ``clip`` (a checkpoint loader's is 1)."""
    nodes = []
    for node_id, text, (x, y), height, title in ((4, positive, pos, 160, "Positive prompt"),
                                                 (5, negative, (pos[0], pos[1] + 200), 130, "Negative prompt")):
        nodes.append(g.add(node_id, "CLIPTextEncode", [x, y], [420, height], [text],
                           [("CONDITIONING", "CONDITIONING")], [("clip", "CLIP", (clip, clip_slot))], title=title))
    return nodes


def _wan_front(g, frames: int = 33):
    """Wan 2.1 1.3B text to video's loaders, prompts and empty latent (832x480, ``frames``), as
    ComfyUI's Wan 2.1 template has them: (model, VAE, positive, negative, latent) node ids."""
    unet, clip, vae = _wan_loaders(g, "wan2.1_t2v_1.3B_fp16.safetensors")
    positive, negative = _prompts(g, clip, WAN_PROMPT, WAN_NEGATIVE, [420, 390])
    latent = g.add(6, "EmptyHunyuanLatentVideo", [40, 440], [340, 130], [832, 480, frames, 1], [("LATENT", "LATENT")])
    return unet, vae, positive, negative, latent


def wan_workflow(frames: int = 33, windows: bool = False) -> dict:
    """Wan 2.1 1.3B text to video at 832x480, 33 frames (ComfyUI's Wan 2.1 template), with ToDo
    at its defaults between the diffusion-model loader and the sampler. ``windows``: a long clip
    (``frames``) sampled in context windows of 81 frames overlapping by 30 (the defaults of
    ComfyUI's WAN Context Windows node: the length Wan 2.1 was trained on), each window one
    model call that ToDo reduces as its own."""
    g = Graph()
    unet, vae, positive, negative, latent = _wan_front(g, frames)
    model = patch = _todo_node(g, (unet, 0), [420, 60])
    if windows:
        # The first six inputs, which ComfyUI 0.3.75 and 0.33 share (0.33 adds more, at their defaults).
        model = g.add(12, "WanContextWindowsManual", [880, 380], [315, 200],
                      [81, 30, "standard_static", 1, False, "pyramid"], [("MODEL", "MODEL")],
                      [("model", "MODEL", (patch, 0))])
    sampler = g.add(7, "KSampler", [880, 60], [315, 262], [42, "fixed", 30, 6.0, "uni_pc", "simple", 1.0],
                    [("LATENT", "LATENT")],
                    [("model", "MODEL", (model, 0)), ("positive", "CONDITIONING", (positive, 0)),
                     ("negative", "CONDITIONING", (negative, 0)), ("latent_image", "LATENT", (latent, 0))])
    decode = g.add(8, "VAEDecode", [1240, 60], [210, 46], [], [("IMAGE", "IMAGE")],
                   [("samples", "LATENT", (sampler, 0)), ("vae", "VAE", (vae, 0))])
    name = "wan21_t2v_long_context_windows_todo" if windows else "wan21_t2v_todo"
    g.add(9, "SaveAnimatedWEBP", [1240, 160], [480, 420], [f"TokenReduce_{name}", 16.0, False, 90, "default"], [],
          [("images", "IMAGE", (decode, 0))])
    return g.flow("Wan 2.1 long clip (161 frames) in context windows with ToDo" if windows else
                  "Wan 2.1 text to video with ToDo")


# Wan 2.2 A14B: the files of ComfyUI's Wan 2.2 14B text-to-video template, per expert: the model
# (fp8 scaled), lightx2v's 4-step distillation LoRA made for it, and the node ids of its chain.
A14B_EXPERTS = {  # expert -> model file, LoRA file, (loader, LoRA, shift, ToDo, sampler) node ids, row y
    "high_noise": ("wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors",
                   "wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors", (1, 14, 16, PATCH, 7), 60),
    "low_noise": ("wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors",
                  "wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors", (13, 15, 17, 18, 11), 440),
}
A14B_STEPS, A14B_SWITCH = 4, 2  # the template's 4 steps: the high-noise expert samples 0-2, the low-noise 2-4


def wan22_a14b_workflow() -> dict:
    """Wan 2.2 A14B text to video at 640x640, 81 frames, wired as ComfyUI's Wan 2.2 14B template
    with the 4-step LoRAs: two experts (high noise and low noise), each its own fp8-scaled model
    through its lightx2v 4-step LoRA (strength 1) and ModelSamplingSD3 (shift 5), then ToDo at its
    defaults, then its KSamplerAdvanced: 4 steps, CFG 1, euler, simple; the high-noise expert adds
    the noise and samples steps 0-2, returning the leftover noise, the low-noise expert samples
    steps 2-4. Each ToDo node patches and reports its own expert; a window in percent
    (start_percent/end_percent) selects the same noise levels on both samplers."""
    g = Graph()
    clip = g.add(2, "CLIPLoader", [40, 820], [340, 106], ["umt5_xxl_fp8_e4m3fn_scaled.safetensors", "wan", "default"],
                 [("CLIP", "CLIP")])
    vae = g.add(3, "VAELoader", [40, 970], [340, 58], ["wan_2.1_vae.safetensors"], [("VAE", "VAE")])
    positive, negative = _prompts(g, clip, WAN_PROMPT, WAN_NEGATIVE, [420, 820])
    latent = g.add(6, "EmptyHunyuanLatentVideo", [880, 820], [340, 130], [640, 640, 81, 1], [("LATENT", "LATENT")])
    samples = (latent, 0)
    for expert, (model_file, lora_file, ids, y) in A14B_EXPERTS.items():
        loader_id, lora_id, shift_id, patch_id, sampler_id = ids
        high = expert == "high_noise"
        title = "high noise" if high else "low noise"
        unet = g.add(loader_id, "UNETLoader", [40, y], [340, 82], [model_file, "default"], [("MODEL", "MODEL")],
                     title=f"Load Diffusion Model ({title})")
        lora = g.add(lora_id, "LoraLoaderModelOnly", [420, y], [340, 82], [lora_file, 1.0], [("MODEL", "MODEL")],
                     [("model", "MODEL", (unet, 0))], title=f"4-step LoRA ({title})")
        shift = g.add(shift_id, "ModelSamplingSD3", [800, y], [250, 58], [5.0], [("MODEL", "MODEL")],
                      [("model", "MODEL", (lora, 0))])
        node_type, _, widgets, height = PATCHES["todo"]
        patch = g.add(patch_id, node_type, [1090, y], [340, height], widgets, [("MODEL", "MODEL"), ("info", "STRING")],
                      [("model", "MODEL", (shift, 0))], color="#233", bgcolor="#355", title=f"ToDo ({title})")
        start, end = (0, A14B_SWITCH) if high else (A14B_SWITCH, A14B_STEPS)
        leftover = "enable" if high else "disable"
        samples = (g.add(sampler_id, "KSamplerAdvanced", [1470, y], [315, 334],
                         [leftover, 42, "fixed", A14B_STEPS, 1.0, "euler", "simple", start, end, leftover],
                         [("LATENT", "LATENT")],
                         [("model", "MODEL", (patch, 0)), ("positive", "CONDITIONING", (positive, 0)),
                          ("negative", "CONDITIONING", (negative, 0)), ("latent_image", "LATENT", samples)],
                         title=f"KSampler (Advanced, {title})"), 0)
    decode = g.add(8, "VAEDecode", [1830, 60], [210, 46], [], [("IMAGE", "IMAGE")],
                   [("samples", "LATENT", samples), ("vae", "VAE", (vae, 0))])
    g.add(9, "SaveAnimatedWEBP", [1830, 160], [480, 420],
          ["TokenReduce_wan22_a14b_t2v_4step_lora_todo", 16.0, False, 90, "default"], [],
          [("images", "IMAGE", (decode, 0))])
    return g.flow("Wan 2.2 A14B text to video (two experts, 4-step LoRA) with ToDo")


VACE_PROMPT = ("a red fox trotting through fresh snow in a birch forest, soft morning light, the camera "
               "tracks alongside it, cinematic, highly detailed")


def wan_vace_workflow() -> dict:
    """Wan 2.1 VACE 1.3B at 832x480, 81 frames, wired as ComfyUI's VACE templates: WanVaceToVideo
    between the prompts and the sampler (its control video, control masks and reference image
    left for the user to connect: without them it generates from the text), TrimVideoLatent
    taking off the reference frames it adds; ToDo at its defaults between the diffusion-model
    loader and the sampler. The templates' CausVid LoRA (4 steps, CFG 1) is left out: 30 steps,
    CFG 6, as the Wan 2.1 text-to-video template samples."""
    g = Graph()
    unet, clip, vae = _wan_loaders(g, "wan2.1_vace_1.3B_fp16.safetensors")
    positive, negative = _prompts(g, clip, VACE_PROMPT, WAN_NEGATIVE, [40, 440])
    vace = g.add(6, "WanVaceToVideo", [500, 440], [340, 254], [832, 480, 81, 1, 1.0],
                 [("positive", "CONDITIONING"), ("negative", "CONDITIONING"), ("latent", "LATENT"),
                  ("trim_latent", "INT")],
                 [("positive", "CONDITIONING", (positive, 0)), ("negative", "CONDITIONING", (negative, 0)),
                  ("vae", "VAE", (vae, 0)), ("control_video", "IMAGE", None), ("control_masks", "MASK", None),
                  ("reference_image", "IMAGE", None)])
    patch = _todo_node(g, (unet, 0), [420, 60])
    sampler = g.add(7, "KSampler", [880, 60], [315, 262], [42, "fixed", 30, 6.0, "uni_pc", "simple", 1.0],
                    [("LATENT", "LATENT")],
                    [("model", "MODEL", (patch, 0)), ("positive", "CONDITIONING", (vace, 0)),
                     ("negative", "CONDITIONING", (vace, 1)), ("latent_image", "LATENT", (vace, 2))])
    trim = g.add(11, "TrimVideoLatent", [880, 380], [315, 58], [0], [("LATENT", "LATENT")],
                 [("samples", "LATENT", (sampler, 0)), ("trim_amount", "INT", (vace, 3))],
                 widget_inputs=("trim_amount",))
    decode = g.add(8, "VAEDecode", [1240, 60], [210, 46], [], [("IMAGE", "IMAGE")],
                   [("samples", "LATENT", (trim, 0)), ("vae", "VAE", (vae, 0))])
    g.add(9, "SaveAnimatedWEBP", [1240, 160], [480, 420], ["TokenReduce_wan21_vace_todo", 16.0, False, 90, "default"],
          [], [("images", "IMAGE", (decode, 0))])
    return g.flow("Wan 2.1 VACE video with ToDo")


LTXV_PROMPT = ("a lighthouse on a rocky cliff at sunset, waves crashing against the rocks below, seagulls "
               "circling the tower, the camera slowly pushes in, warm golden light, real-life footage")
LTX2_PROMPT = ("a lighthouse on a rocky cliff at sunset, waves crashing against the rocks below, seagulls "
               "circling and calling, the camera slowly pushes in, the roar of the surf and the wind, real-life footage")
LTXV_NEGATIVE = ("low quality, worst quality, deformed, distorted, disfigured, motion smear, motion artifacts, "
                 "fused fingers, bad anatomy, weird hand, ugly")


def ltxv_workflow() -> dict:
    """LTX-Video 2B text to video at 768x512, 121 frames, wired as ComfyUI's LTXV text-to-video
    template: the checkpoint (model and VAE) with the T5-XXL text encoder, LTXVConditioning at 25
    fps, LTXVScheduler (30 steps) and SamplerCustom (euler, CFG 3); ToDo at its defaults between
    the checkpoint loader and the sampler."""
    g = Graph()
    checkpoint = g.add(1, "CheckpointLoaderSimple", [40, 60], [340, 98], ["ltx-video-2b-v0.9.safetensors"],
                       [("MODEL", "MODEL"), ("CLIP", "CLIP"), ("VAE", "VAE")])
    clip = g.add(2, "CLIPLoader", [40, 210], [340, 106], ["t5xxl_fp16.safetensors", "ltxv", "default"],
                 [("CLIP", "CLIP")])
    positive, negative = _prompts(g, clip, LTXV_PROMPT, LTXV_NEGATIVE, [40, 360])
    conditioning = g.add(11, "LTXVConditioning", [500, 440], [315, 78], [25.0],
                         [("positive", "CONDITIONING"), ("negative", "CONDITIONING")],
                         [("positive", "CONDITIONING", (positive, 0)), ("negative", "CONDITIONING", (negative, 0))])
    latent = g.add(6, "EmptyLTXVLatentVideo", [40, 730], [340, 130], [768, 512, 121, 1], [("LATENT", "LATENT")])
    scheduler = g.add(12, "LTXVScheduler", [500, 560], [315, 154], [30, 2.05, 0.95, True, 0.1],
                      [("SIGMAS", "SIGMAS")], [("latent", "LATENT", (latent, 0))])
    select = g.add(13, "KSamplerSelect", [500, 750], [315, 58], ["euler"], [("SAMPLER", "SAMPLER")])
    patch = _todo_node(g, (checkpoint, 0), [420, 60])
    sampler = g.add(7, "SamplerCustom", [880, 60], [315, 230], [True, 42, "fixed", 3.0],
                    [("output", "LATENT"), ("denoised_output", "LATENT")],
                    [("model", "MODEL", (patch, 0)), ("positive", "CONDITIONING", (conditioning, 0)),
                     ("negative", "CONDITIONING", (conditioning, 1)), ("sampler", "SAMPLER", (select, 0)),
                     ("sigmas", "SIGMAS", (scheduler, 0)), ("latent_image", "LATENT", (latent, 0))])
    decode = g.add(8, "VAEDecode", [1240, 60], [210, 46], [], [("IMAGE", "IMAGE")],
                   [("samples", "LATENT", (sampler, 0)), ("vae", "VAE", (checkpoint, 2))])
    g.add(9, "SaveAnimatedWEBP", [1240, 160], [480, 420], ["TokenReduce_ltxv_t2v_todo", 24.0, False, 90, "default"],
          [], [("images", "IMAGE", (decode, 0))])
    return g.flow("LTX-Video text to video with ToDo")


# LTX-2 (ComfyUI 0.33's LTXAV; 0.3.75 has none of these nodes): the files of ComfyUI's LTX-2
# templates, the 19B dev checkpoint in fp8 (model, video VAE and audio VAE) and Gemma 3 12B.
LTX2_CHECKPOINT = "ltx-2-19b-dev-fp8.safetensors"
LTX2_FPS = 24.0


@dataclass(frozen=True)
class Needs:
    """What an example needs beyond the pinned ComfyUI (0.3.75): ``what`` (a ComfyUI version or a
    package), why, and the node types that are missing without it. The example carries it as a
    Note node (``NEEDS_TITLE``), so that a user who opens it where those nodes are missing reads
    why; the tests check every example's node types against the ComfyUI they run on: known
    there, or named by such a Note."""

    what: str
    why: str
    nodes: tuple[str, ...]

    def note(self) -> str:
        return (f"Needs {self.what}: {self.why}. Without it these nodes show as missing: "
                f"{', '.join(self.nodes)}.")


NEEDS_TITLE = "Needs"  # the title of the Note nodes that say what an example needs
NEEDS = {
    "ltx2_t2v_audio_todo.json": (
        Needs("ComfyUI 0.33 (tested; 0.3.75 has no LTX-2)",
              "LTX-2 (ComfyUI's LTXAV model) and its text, audio and audio-video latent nodes came after ComfyUI "
              "0.3.75; update ComfyUI to use this example (every other example runs on 0.3.75)",
              ("LTXAVTextEncoderLoader", "LTXVAudioVAELoader", "LTXVEmptyLatentAudio", "LTXVConcatAVLatent",
               "LTXVSeparateAVLatent", "LTXVAudioVAEDecode")),
        Needs("torchaudio", "PreviewAudio is one of ComfyUI's audio nodes, which ComfyUI leaves out where torchaudio "
              "is not installed (ComfyUI's requirements.txt installs it)", ("PreviewAudio",)),
    ),
}


def lacking_nodes(file_name: str, has_node) -> str | None:
    """Why the example ``file_name`` (``<name>.json``) cannot be used on a ComfyUI where
    ``has_node(type)`` tells which node types exist (None: it can): the tests' skip reason."""
    for needs in NEEDS.get(file_name, ()):
        missing = [node for node in needs.nodes if not has_node(node)]
        if missing:
            return (f"this ComfyUI has no {', '.join(missing)}: the example needs {needs.what}; run with --comfyui "
                    f"of such a tree")
    return None


def add_needs_notes(g: "Graph", file_name: str, first_id: int, pos) -> None:
    """The example's Note nodes saying what it needs (``NEEDS``), one under the other from ``pos``."""
    x, y = pos
    for offset, needs in enumerate(NEEDS.get(file_name, ())):
        g.add(first_id + offset, "Note", [x, y], [340, 150], [needs.note()], title=NEEDS_TITLE, color="#432",
              bgcolor="#653")
        y += 180


def ltx2_workflow() -> dict:
    """LTX-2 19B text to video with audio at 1280x704, 121 frames, 24 fps: the checkpoint (model
    and video VAE), its audio VAE (LTXVAudioVAELoader) and Gemma 3 12B with the checkpoint's text
    projection (LTXAVTextEncoderLoader); LTXVConditioning at 24 fps; the empty video latent and an
    empty audio latent of the same length (LTXVEmptyLatentAudio) joined by LTXVConcatAVLatent into
    the one latent the model denoises; LTXVScheduler (20 steps) on it and SamplerCustom (euler,
    CFG 4); ToDo at its defaults between the checkpoint loader and the sampler (it reduces the
    video self-attention only: the audio stream and the audio<->video cross-attention are left
    alone); LTXVSeparateAVLatent, the video decoded by the checkpoint's VAE and saved (animated
    WEBP, as the other video examples), the audio decoded by the audio VAE into PreviewAudio
    (play or save it there; CreateVideo + SaveVideo join both into one file)."""
    g = Graph()
    checkpoint = g.add(1, "CheckpointLoaderSimple", [40, 60], [340, 98], [LTX2_CHECKPOINT],
                       [("MODEL", "MODEL"), ("CLIP", "CLIP"), ("VAE", "VAE")])
    clip = g.add(2, "LTXAVTextEncoderLoader", [40, 210], [340, 106],
                 ["gemma_3_12B_it.safetensors", LTX2_CHECKPOINT, "default"], [("CLIP", "CLIP")])
    audio_vae = g.add(3, "LTXVAudioVAELoader", [40, 360], [340, 58], [LTX2_CHECKPOINT], [("Audio VAE", "VAE")])
    positive, negative = _prompts(g, clip, LTX2_PROMPT, LTXV_NEGATIVE, [40, 460])
    conditioning = g.add(11, "LTXVConditioning", [500, 540], [315, 78], [LTX2_FPS],
                         [("positive", "CONDITIONING"), ("negative", "CONDITIONING")],
                         [("positive", "CONDITIONING", (positive, 0)), ("negative", "CONDITIONING", (negative, 0))])
    video = g.add(6, "EmptyLTXVLatentVideo", [40, 830], [340, 130], [1280, 704, 121, 1], [("LATENT", "LATENT")])
    audio = g.add(14, "LTXVEmptyLatentAudio", [40, 1000], [340, 130], [121, LTX2_FPS, 1], [("Latent", "LATENT")],
                  [("audio_vae", "VAE", (audio_vae, 0))])
    latent = g.add(15, "LTXVConcatAVLatent", [500, 660], [315, 46], [], [("latent", "LATENT")],
                   [("video_latent", "LATENT", (video, 0)), ("audio_latent", "LATENT", (audio, 0))])
    scheduler = g.add(12, "LTXVScheduler", [500, 760], [315, 154], [20, 2.05, 0.95, True, 0.1],
                      [("SIGMAS", "SIGMAS")], [("latent", "LATENT", (latent, 0))])
    select = g.add(13, "KSamplerSelect", [500, 950], [315, 58], ["euler"], [("SAMPLER", "SAMPLER")])
    patch = _todo_node(g, (checkpoint, 0), [420, 60])
    sampler = g.add(7, "SamplerCustom", [880, 60], [315, 230], [True, 42, "fixed", 4.0],
                    [("output", "LATENT"), ("denoised_output", "LATENT")],
                    [("model", "MODEL", (patch, 0)), ("positive", "CONDITIONING", (conditioning, 0)),
                     ("negative", "CONDITIONING", (conditioning, 1)), ("sampler", "SAMPLER", (select, 0)),
                     ("sigmas", "SIGMAS", (scheduler, 0)), ("latent_image", "LATENT", (latent, 0))])
    separate = g.add(16, "LTXVSeparateAVLatent", [1240, 60], [250, 66], [],
                     [("video_latent", "LATENT"), ("audio_latent", "LATENT")], [("av_latent", "LATENT", (sampler, 0))])
    decode = g.add(8, "VAEDecode", [1240, 180], [210, 46], [], [("IMAGE", "IMAGE")],
                   [("samples", "LATENT", (separate, 0)), ("vae", "VAE", (checkpoint, 2))])
    sound = g.add(17, "LTXVAudioVAEDecode", [1240, 280], [250, 66], [], [("Audio", "AUDIO")],
                  [("samples", "LATENT", (separate, 1)), ("audio_vae", "VAE", (audio_vae, 0))])
    g.add(9, "SaveAnimatedWEBP", [1560, 60], [480, 420], ["TokenReduce_ltx2_t2v_audio_todo", LTX2_FPS, False, 90,
                                                          "default"], [], [("images", "IMAGE", (decode, 0))])
    g.add(18, "PreviewAudio", [1560, 520], [480, 100], [], [], [("audio", "AUDIO", (sound, 0))])
    add_needs_notes(g, "ltx2_t2v_audio_todo.json", 19, (880, 340))
    return g.flow("LTX-2 text to video with audio with ToDo")


def _flux_front(g):
    """Flux.1 [dev] text to image's loaders, conditioning and empty latent (1024x1024), as ComfyUI's
    Flux dev template has them: (model, VAE, positive, negative, latent) node ids."""
    unet = g.add(1, "UNETLoader", [40, 60], [340, 82], ["flux1-dev.safetensors", "default"], [("MODEL", "MODEL")])
    clip = g.add(2, "DualCLIPLoader", [40, 190], [340, 130],
                 ["t5xxl_fp16.safetensors", "clip_l.safetensors", "flux", "default"], [("CLIP", "CLIP")])
    vae = g.add(3, "VAELoader", [40, 370], [340, 58], ["ae.safetensors"], [("VAE", "VAE")])
    positive = g.add(4, "CLIPTextEncode", [420, 390], [420, 160], [PROMPT], [("CONDITIONING", "CONDITIONING")],
                     [("clip", "CLIP", (clip, 0))], title="Positive prompt")
    guidance = g.add(11, "FluxGuidance", [420, 590], [317, 58], [3.5], [("CONDITIONING", "CONDITIONING")],
                     [("conditioning", "CONDITIONING", (positive, 0))])
    negative = g.add(5, "ConditioningZeroOut", [420, 690], [317, 26], [], [("CONDITIONING", "CONDITIONING")],
                     [("conditioning", "CONDITIONING", (positive, 0))])
    latent = g.add(6, "EmptySD3LatentImage", [40, 470], [340, 106], [1024, 1024, 1], [("LATENT", "LATENT")])
    return unet, vae, guidance, negative, latent


def flux_workflow() -> dict:
    """Flux.1 [dev] text to image at 1024x1024 (ComfyUI's Flux dev template: FluxGuidance 3.5,
    CFG 1, the negative zeroed out), with ToDo at its defaults between the diffusion-model
    loader and the sampler."""
    g = Graph()
    unet, vae, guidance, negative, latent = _flux_front(g)
    patch = _todo_node(g, (unet, 0), [420, 60])
    sampler = g.add(7, "KSampler", [880, 60], [315, 262], [42, "fixed", 20, 1.0, "euler", "simple", 1.0],
                    [("LATENT", "LATENT")],
                    [("model", "MODEL", (patch, 0)), ("positive", "CONDITIONING", (guidance, 0)),
                     ("negative", "CONDITIONING", (negative, 0)), ("latent_image", "LATENT", (latent, 0))])
    decode = g.add(8, "VAEDecode", [1240, 60], [210, 46], [], [("IMAGE", "IMAGE")],
                   [("samples", "LATENT", (sampler, 0)), ("vae", "VAE", (vae, 0))])
    g.add(9, "SaveImage", [1240, 160], [400, 420], ["TokenReduce_flux_todo"], [], [("images", "IMAGE", (decode, 0))])
    return g.flow("Flux.1 dev txt2img with ToDo")


# --- A/B: the same seed sampled without and with ToDo, compared -----------------------------------

@dataclass(frozen=True)
class AB:
    """An A/B example of a family: its name and title, its front (the template's loaders,
    conditioning and empty latent), where its ToDo node goes, its sampler's steps, CFG, sampler
    and scheduler, its save node and why ToDo is the node it tries (said in its Note)."""

    name: str
    title: str
    front: object  # Graph -> (model, VAE, positive, negative, latent): (node id, output slot) each
    todo_pos: tuple[int, int]
    sampling: tuple  # steps, cfg, sampler, scheduler
    save: str  # SaveImage or SaveAnimatedWEBP
    why: str


def _checkpoint_front(family: str):
    """A checkpoint's loader, prompts and empty latent, as the txt2img examples have them."""
    def front(g):
        checkpoint, size, _, _ = FAMILIES[family]
        loader = g.add(1, "CheckpointLoaderSimple", [40, 60], [315, 98], [checkpoint],
                       [("MODEL", "MODEL"), ("CLIP", "CLIP"), ("VAE", "VAE")])
        positive, negative = _prompts(g, loader, PROMPT, NEGATIVE, [40, 200], clip_slot=1)
        latent = g.add(6, "EmptyLatentImage", [40, 580], [315, 106], [size, size, 1], [("LATENT", "LATENT")])
        return (loader, 0), (loader, 2), (positive, 0), (negative, 0), (latent, 0)
    return front


def _first_outputs(front):
    """A front returning node ids (each's first output) as one returning (node id, slot) pairs."""
    return lambda g: tuple((node, 0) for node in front(g))


AB_EXAMPLES = {
    "sd15": AB("sd15_txt2img_ab_todo", "SD1.5 A/B: unpatched against ToDo, compared", _checkpoint_front("sd15"),
               (500, 60), (20, 7.0, "euler", "normal"), "SaveImage",
               "on the SD1.5-class model trained here its defaults moved the images least of the nodes' defaults "
               "(ToDo, ToMe, both; LPIPS 0.003: docs/quality.md), and at 1 MP on an H100 they were also the faster"),
    "sdxl": AB("sdxl_txt2img_ab_todo", "SDXL A/B: unpatched against ToDo, compared", _checkpoint_front("sdxl"),
               (500, 60), (25, 6.0, "euler", "normal"), "SaveImage",
               "it reduces SDXL's attention at level auto (downsample 2), where ComfyUI's built-in ToMe does "
               "nothing; no SDXL-class model was trained here, so what it costs SDXL's images is unmeasured: this "
               "A/B measures it on yours"),
    "flux": AB("flux_txt2img_ab_todo", "Flux.1 dev A/B: unpatched against ToDo, compared", _first_outputs(_flux_front),
               (420, 60), (20, 1.0, "euler", "simple"), "SaveImage",
               "on the Flux.1-class model trained here its defaults moved the images least of the nodes' defaults "
               "(ToDo, ToMe, both) and were the faster at 1 MP on an H100, yet visibly (LPIPS 0.32: detail turns "
               "blocky; docs/quality.md); if details suffer here too, try start_percent 0.4 or a lower factor"),
    "wan": AB("wan21_t2v_ab_todo", "Wan 2.1 A/B: unpatched against ToDo, compared", _first_outputs(_wan_front),
              (420, 60), (30, 6.0, "uni_pc", "simple"), "SaveAnimatedWEBP",
              "it is the measured speed-up on Wan 2.1 1.3B (1.74x at 832x480, 81 frames on an H100: "
              "docs/benchmarks.md); no video model was trained here, so what it costs the frames is unmeasured: "
              "this A/B measures it on yours"),
}
# The node ids past the fronts' (1-6; Flux's guidance 11): the ToDo chain as in the single-node
# examples (sampler 7, decode 8, save 9, ToDo 10), the unpatched chain, the seed, the comparison.
AB_IDS = {"B": (7, 8, 9), "A": (12, 13, 14)}
AB_SEED, AB_COMPARE, AB_HEAT_MAP, AB_NOTE = 15, 16, 17, 18
AB_SEED_VALUE = 42
AB_NOTE_TITLE = "About this A/B"
COMPARE_GAIN = 4.0  # the compare node's default


def ab_note(ab: AB) -> str:
    steps = ab.sampling[0]
    return (f"A/B on your own model: the same model, prompts and seed sampled twice. KSampler A takes the model "
            f"straight from the loader, KSampler B through Token Downsampling (ToDo) at its defaults. Both take "
            f"their seed from the Seed node: change it there, not on one sampler.\n\n"
            f"Why ToDo: it is the node to start with (README, 'Which one when'): {ab.why}. To try ToMe instead, put "
            f"Token Merging (ToMe) in its place.\n\n"
            f"What it cost the image: Image Compare (TokenReduce) shows PSNR, SSIM and, where its weights are "
            f"installed, LPIPS of B against A on the node, and where they differ in the heat map's preview.\n\n"
            f"What it saved: after the run the ToDo node's report ends with B's time ('steps 1-{steps} of {steps} "
            f"· ... s sampling', timed from the sampler's start: it includes moving the model to the GPU when B "
            f"runs first). A, unpatched, has no report of its own: read both times in ComfyUI's console, where "
            f"each sampler prints a progress bar ending in its time and speed ('{steps}/{steps} [mm:ss<00:00, "
            f"...it/s]'), in the order they ran (the frontend outlines the sampler that is running). The first "
            f"run after loading a model also warms up: queue again with another seed and compare that run.")


def ab_workflow(family: str) -> dict:
    """The family's template (``AB_EXAMPLES``) sampled twice from one Seed node: KSampler A on the
    model straight from the loader, KSampler B on the model through ToDo at its defaults; both
    decoded and saved, Image Compare (TokenReduce) between them (A against B) with a Preview
    Image of its heat map, and a Note saying why ToDo and where to read both sampling times."""
    ab = AB_EXAMPLES[family]
    steps, cfg, sampler_name, scheduler = ab.sampling
    g = Graph()
    model, vae, positive, negative, latent = ab.front(g)
    todo = _todo_node(g, model, list(ab.todo_pos))
    seed = g.add(AB_SEED, "PrimitiveInt", [880, 700], [315, 82], [AB_SEED_VALUE, "fixed"], [("INT", "INT")],
                 title="Seed (both samplers)")
    images = {}
    for label, source, y, what in (("A", model, 60, "unpatched"), ("B", (todo, 0), 380, "ToDo")):
        sampler_id, decode_id, save_id = AB_IDS[label]
        sampler = g.add(sampler_id, "KSampler", [880, y], [315, 262],
                        [AB_SEED_VALUE, "fixed", steps, cfg, sampler_name, scheduler, 1.0], [("LATENT", "LATENT")],
                        [("model", "MODEL", source), ("positive", "CONDITIONING", positive),
                         ("negative", "CONDITIONING", negative), ("latent_image", "LATENT", latent),
                         ("seed", "INT", (seed, 0))], widget_inputs=("seed",), title=f"KSampler {label}: {what}")
        images[label] = g.add(decode_id, "VAEDecode", [1240, y], [210, 46], [], [("IMAGE", "IMAGE")],
                              [("samples", "LATENT", (sampler, 0)), ("vae", "VAE", vae)], title=f"VAE Decode {label}")
        prefix = f"TokenReduce_{ab.name}/{label}_{what.lower()}"
        widgets = [prefix] if ab.save == "SaveImage" else [prefix, 16.0, False, 90, "default"]
        g.add(save_id, ab.save, [1480, y], [360, 300], widgets, [], [("images", "IMAGE", (images[label], 0))],
              title=f"{label}: {what}")
    compare = g.add(AB_COMPARE, "TokenReduceImageCompare", [1880, 60], [360, 200], [COMPARE_GAIN],
                    [("difference", "IMAGE"), ("report", "STRING")],
                    [("image_a", "IMAGE", (images["A"], 0)), ("image_b", "IMAGE", (images["B"], 0))],
                    color="#233", bgcolor="#355")
    g.add(AB_HEAT_MAP, "PreviewImage", [1880, 300], [360, 380], [], [], [("images", "IMAGE", (compare, 0))],
          title="Where A and B differ")
    g.add(AB_NOTE, "Note", [1240, 720], [640, 330], [ab_note(ab)], title=AB_NOTE_TITLE)
    return g.flow(ab.title)


def examples() -> dict[str, dict]:
    flows = {f"{family}_txt2img_{patch}.json": workflow(family, patch) for family in FAMILIES for patch in PATCHES}
    flows["wan21_t2v_todo.json"] = wan_workflow()
    flows["wan21_t2v_long_context_windows_todo.json"] = wan_workflow(frames=161, windows=True)
    flows["wan21_vace_todo.json"] = wan_vace_workflow()
    flows["wan22_a14b_t2v_4step_lora_todo.json"] = wan22_a14b_workflow()
    flows["ltxv_t2v_todo.json"] = ltxv_workflow()
    flows["ltx2_t2v_audio_todo.json"] = ltx2_workflow()
    flows["flux_txt2img_todo.json"] = flux_workflow()
    for family, ab in AB_EXAMPLES.items():
        flows[f"{ab.name}.json"] = ab_workflow(family)
    return flows


def render(flow: dict) -> str:
    return json.dumps(flow, indent=1) + "\n"


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for name, flow in examples().items():
        (OUT / name).write_text(render(flow))
        print(OUT / name)


if __name__ == "__main__":
    main()
