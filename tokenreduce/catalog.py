"""What the hosts show of each node, in English: its permanent id, title, description, the
model input's and the outputs' tooltips, and its method's declared inputs.

The ComfyUI schema (``nodes/``) and the translation tables (``tokenreduce.locales``, the
``locales/`` folder) are both built from here, so a text changed here is a translation that the
tests call out of date.
"""

from __future__ import annotations

from dataclasses import dataclass

from .inputs import Method
from .methods import TODO, TOME


@dataclass(frozen=True)
class Output:
    name: str  # as the node shows it
    tooltip: str


@dataclass(frozen=True)
class NodeText:
    node_id: str  # public and permanent: saved workflows refer to it
    title: str
    description: str
    model_tooltip: str
    method: Method


OUTPUTS = (
    Output("MODEL", "The patched model (a clone)."),
    Output("info", "What was patched, and any warning about settings that do nothing."),
)

TOME_NODE = NodeText(
    "TokenReduceToMe", "Token Merging (ToMe, TokenReduce)",
    "Speeds up sampling by merging similar tokens and unmerging after (ToMe for SD): before the attention of SD1.x, "
    "SD2.x and SDXL UNets, and before whole blocks of most DiTs (Flux.1, Qwen-Image, SD3 / SD3.5, Wan 2.1 / 2.2, "
    "HunyuanVideo, ...); reports what it patched.",
    "The diffusion model (UNet or DiT) to patch. The input model is never changed.",
    TOME)

TODO_NODE = NodeText(
    "TokenReduceToDo", "Token Downsampling (ToDo, TokenReduce)",
    "Speeds up sampling by letting self-attention read keys and values downsampled on the token grid (ToDo); "
    "every query stays. No matching, nothing to unmerge, deterministic. Works on SD1.x, SD2.x and SDXL UNets and "
    "on DiTs (Flux, Wan, Qwen-Image, Lumina 2 / Z-Image, SD3, HunyuanVideo); reports what it patched.",
    "The diffusion model (UNet or DiT) to patch. The input model is never changed.",
    TODO)

NODES = (TOME_NODE, TODO_NODE)


@dataclass(frozen=True)
class ToolText:
    """A node of the pack that patches no model: its permanent id, title, description, and each
    input's and output's name and tooltip (``Output`` pairs)."""

    node_id: str
    title: str
    description: str
    inputs: tuple[Output, ...]
    outputs: tuple[Output, ...]


COMPARE_NODE = ToolText(
    "TokenReduceImageCompare", "Image Compare (TokenReduce)",
    "What a reduction cost your image: compares two image batches image by image (the same seed with and "
    "without a TokenReduce node, say) and reports PSNR, SSIM and, where its weights are installed, LPIPS per "
    "image and for the batch (SSIM and LPIPS their mean; PSNR that of the mean squared error, so one "
    "identical pair does not make it infinite), with a heat map of where they differ.",
    (Output("image_a", "The reference images, e.g. decoded from the sampler without TokenReduce. Matched to "
                       "image_b by index; one image is compared with each of image_b's."),
     Output("image_b", "The images to compare with image_a, e.g. from the same seed with a TokenReduce node. The "
                       "same size as image_a, and as many images (or one, compared with each of image_a's)."),
     Output("gain", "How strongly the heat map shows differences: a pixel whose channels differ by 1/gain on "
                    "average (0.25 at gain 4) is at full heat. The same gain keeps heat maps comparable.")),
    (Output("difference", "A heat map per image pair, black where the two agree, through red and yellow to white "
                          "where they differ by 1/gain or more. Connect a Preview Image."),
     Output("report", "PSNR (dB, higher: closer), SSIM (1: same structure) and LPIPS (0: perceptually the same) "
                      "per image and for the batch (PSNR of the mean squared error, SSIM and LPIPS their mean), as text.")),
)

TOOLS = (COMPARE_NODE,)
