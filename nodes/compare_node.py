"""The image-compare node: two IMAGE batches -> a heat map of where they differ, and PSNR, SSIM and
(where its weights are installed) LPIPS per image pair and their mean, shown on the node.

The metrics are the ones the project's quality tables use (``docs/quality.md``): PSNR and SSIM
from kornia (which ComfyUI requires), in float64, SSIM with an 11x11 Gaussian window over its
valid positions; LPIPS v0.1 (AlexNet) from ``tokenreduce/lpips.py`` on weights found on this
machine, never downloaded here (``lpips_weights_file``).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch
from comfy_api.latest import io

from ..tokenreduce import lpips as lpips_net
from ..tokenreduce.catalog import COMPARE_NODE
from .report import UI_KEY

LOG = logging.getLogger("tokenreduce")
SSIM_WINDOW = 11  # kornia's Gaussian window has sigma 1.5 at every size
GAIN_DEFAULT, GAIN_MIN, GAIN_MAX = 4.0, 1.0, 100.0
# The heat map's colours from no difference to full heat: black, dark red, red, yellow, white.
HEAT = ((0.0, 0.0, 0.0), (0.5, 0.0, 0.0), (1.0, 0.1, 0.0), (1.0, 0.9, 0.0), (1.0, 1.0, 1.0))
LPIPS_MISSING = ("LPIPS: not installed (the help page says how: a file {file} in ComfyUI's models/lpips or "
                 "in ~/.cache/comfyui-tokenreduce)")


def lpips_folders() -> list[Path]:
    """Where the LPIPS weights are looked for: ComfyUI's ``models/lpips``, then the project's cache
    (where ``devtools/quality/metrics.py`` writes them; ``TOKENREDUCE_HOST_CACHE`` moves it)."""
    folders = []
    try:
        import folder_paths  # ComfyUI's; absent outside a host

        folders.append(Path(folder_paths.models_dir) / "lpips")
    except ImportError:
        pass
    folders.append(Path(os.environ.get("TOKENREDUCE_HOST_CACHE") or Path.home() / ".cache" / "comfyui-tokenreduce"))
    return folders


def lpips_weights_file() -> Path | None:
    """The installed LPIPS weights, or None (nothing is downloaded)."""
    return next((folder / lpips_net.WEIGHTS_FILE for folder in lpips_folders()
                 if (folder / lpips_net.WEIGHTS_FILE).is_file()), None)


def check_batches(image_a: torch.Tensor, image_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two batches as pairs matched by index: one image against N is repeated; anything else
    that does not pair up is refused, saying what to change."""
    for name, image in (("image_a", image_a), ("image_b", image_b)):
        if image.dim() != 4 or image.shape[-1] != 3:
            raise ValueError(f"{COMPARE_NODE.node_id}: {name} is not an RGB IMAGE batch [B, H, W, 3] "
                             f"(its shape: {tuple(image.shape)})")
    (na, ha, wa, _), (nb, hb, wb, _) = image_a.shape, image_b.shape
    if (ha, wa) != (hb, wb):
        raise ValueError(f"{COMPARE_NODE.node_id}: image_a is {wa}x{ha} px and image_b {wb}x{hb} px: compare images "
                         f"of one size (scale one of them first, e.g. with Upscale Image)")
    if na != nb and 1 not in (na, nb):
        raise ValueError(f"{COMPARE_NODE.node_id}: image_a has {na} images and image_b {nb}: they are compared by "
                         f"index, so give both as many images (or one of them a single image, compared with each "
                         f"of the other's)")
    count = max(na, nb)
    return image_a.expand(count, -1, -1, -1), image_b.expand(count, -1, -1, -1)


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """PSNR in dB per image pair (peak 1, MSE over pixels and channels; identical: inf): float64 [B]."""
    import kornia.metrics

    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    return torch.stack([kornia.metrics.psnr(x, y, 1.0) for x, y in zip(a64, b64)])


def ssim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """Mean SSIM per image pair (11x11 Gaussian window, sigma 1.5, data range 1, valid positions):
    float64 [B]; None for images smaller than the window."""
    import kornia.metrics

    if min(a.shape[1:3]) < SSIM_WINDOW:
        return None
    index = kornia.metrics.ssim(a.to(torch.float64).permute(0, 3, 1, 2), b.to(torch.float64).permute(0, 3, 1, 2),
                                SSIM_WINDOW, max_val=1.0, eps=0.0, padding="valid")
    return index.mean(dim=(1, 2, 3))


def lpips(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
    """LPIPS per image pair (float32 [B]) where the weights are installed and the images large
    enough; else None and the reason."""
    if min(a.shape[1:3]) < lpips_net.MIN_SIZE:
        return None, f"LPIPS: needs images of at least {lpips_net.MIN_SIZE}x{lpips_net.MIN_SIZE} px"
    path = lpips_weights_file()
    if path is None:
        return None, LPIPS_MISSING.format(file=lpips_net.WEIGHTS_FILE)
    from safetensors.torch import load_file

    weights = load_file(str(path), device=str(a.device))
    problem = lpips_net.weights_problem(weights)
    if problem:
        return None, f"LPIPS: {path} is not usable ({problem})"
    return lpips_net.lpips(a, b, {name: tensor.float() for name, tensor in weights.items()}), None


def heat_map(a: torch.Tensor, b: torch.Tensor, gain: float) -> torch.Tensor:
    """Per pixel the mean absolute difference over channels, times ``gain``, through ``HEAT``:
    an IMAGE batch [B, H, W, 3] in 0..1 (float32)."""
    level = ((a.float() - b.float()).abs().mean(dim=-1) * gain).clamp(0.0, 1.0) * (len(HEAT) - 1)
    colours = torch.tensor(HEAT, dtype=torch.float32, device=level.device)
    low = level.floor().long().clamp(max=len(HEAT) - 2)
    weight = (level - low).unsqueeze(-1)
    return colours[low] * (1 - weight) + colours[low + 1] * weight


def _figures(psnr_db: float, ssim_value: float | None, lpips_value: float | None) -> str:
    parts = ["PSNR ∞ dB" if math.isinf(psnr_db) else f"PSNR {psnr_db:.2f} dB"]  # ∞: identical
    if ssim_value is not None:
        parts.append(f"SSIM {ssim_value:.4f}")
    if lpips_value is not None:
        parts.append(f"LPIPS {lpips_value:.4f}")
    return " · ".join(parts)


def report_lines(psnr_db: list[float], ssim_values: list[float] | None, lpips_values: list[float] | None,
                 notes: list[str]) -> list[str]:
    """One line per image pair and one for the mean (of the per-image values), then what is missing."""
    count = len(psnr_db)
    ssim_of = (lambda i: ssim_values[i]) if ssim_values is not None else (lambda i: None)
    lpips_of = (lambda i: lpips_values[i]) if lpips_values is not None else (lambda i: None)
    lines = [f"image {i + 1}: {_figures(psnr_db[i], ssim_of(i), lpips_of(i))}" for i in range(count)]
    mean = lambda values: sum(values) / count if values is not None else None  # noqa: E731
    lines.append(f"mean of {count}: {_figures(mean(psnr_db), mean(ssim_values), mean(lpips_values))}")
    return lines + notes


class ImageCompareNode(io.ComfyNode):
    """IMAGE, IMAGE -> (difference heat map, report), the report also drawn on the node."""

    TEXT = COMPARE_NODE
    NODE_ID = COMPARE_NODE.node_id

    @classmethod
    def define_schema(cls) -> io.Schema:
        text = cls.TEXT
        image_a, image_b, gain = text.inputs
        difference, report = text.outputs
        return io.Schema(
            node_id=text.node_id,
            display_name=text.title,
            category="image/analysis",
            description=text.description,
            inputs=[
                io.Image.Input(image_a.name, tooltip=image_a.tooltip),
                io.Image.Input(image_b.name, tooltip=image_b.tooltip),
                io.Float.Input(gain.name, default=GAIN_DEFAULT, min=GAIN_MIN, max=GAIN_MAX, step=0.5,
                               tooltip=gain.tooltip),
            ],
            outputs=[
                io.Image.Output(difference.name, display_name=difference.name, tooltip=difference.tooltip),
                io.String.Output(report.name, display_name=report.name, tooltip=report.tooltip),
            ],
        )

    @classmethod
    def execute(cls, image_a, image_b, gain=GAIN_DEFAULT) -> io.NodeOutput:
        if not GAIN_MIN <= gain <= GAIN_MAX:
            raise ValueError(f"{cls.NODE_ID}: gain {gain} is out of range [{GAIN_MIN}, {GAIN_MAX}]")
        a, b = check_batches(image_a, image_b)
        notes = []
        if image_a.shape[0] != image_b.shape[0]:
            single = "image_a" if image_a.shape[0] == 1 else "image_b"
            notes.append(f"{single}'s one image compared with each of the other's {a.shape[0]}")
        with torch.no_grad():
            psnr_db = psnr(a, b).tolist()
            ssim_values = ssim(a, b)
            if ssim_values is None:
                notes.append(f"SSIM: needs images of at least {SSIM_WINDOW}x{SSIM_WINDOW} px")
            lpips_values, missing = lpips(a, b)
            if missing:
                notes.append(missing)
            difference = heat_map(a, b, gain)
        lines = report_lines(psnr_db, None if ssim_values is None else ssim_values.tolist(),
                             None if lpips_values is None else lpips_values.tolist(), notes)
        text = "\n".join(lines)
        LOG.info("%s: %s", cls.NODE_ID, text.replace("\n", "; "))
        # As the patch nodes' UI output: the text, and the lines the front end draws on the node.
        return io.NodeOutput(difference, text, ui={"text": [text], UI_KEY: [{"lines": lines, "warnings": []}]})
