"""The image-compare node: two IMAGE batches -> a heat map of where they differ, and PSNR, SSIM and
(where its weights are installed) LPIPS per image pair and their mean, shown on the node.

The metrics are the ones the project's quality tables use (``docs/quality.md``): PSNR and SSIM
from kornia (which ComfyUI requires), SSIM with an 11x11 Gaussian window over its valid
positions; LPIPS v0.1 (AlexNet) from ``tokenreduce/lpips.py`` on weights found on this machine
(``install.py`` installs them; never downloaded here: ``lpips_weights_file``).

Every metric runs one image pair at a time, so a video's frames cost the memory of one frame
whatever their number (SSIM in float64 over the batch took 0.35 GB a 720p frame, 28 GB for 81):
PSNR from each pair's mean squared error in float64, SSIM in float32 (within 1e-4 of float64,
its map averaged in float64), LPIPS in float32. The mean's PSNR is that of the mean squared error
over all pairs, not the mean of their dB, so one identical pair (a video's clean first frame)
does not make it infinite.
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
MEAN_PSNR_NOTE = "the mean's PSNR: of the mean squared error over all {count} images (not the mean of their dB)"
LPIPS_MISSING = ("LPIPS: not installed (the pack's install.py downloads it: run it again with ComfyUI's Python "
                 "when online; it puts {file} in ComfyUI's models/lpips)")


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
    """The installed LPIPS weights, or None (nothing is downloaded here: install.py does that)."""
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


def pairs(a: torch.Tensor, b: torch.Tensor):
    """The batches' image pairs one at a time, each [1, H, W, 3] (views, nothing copied): what each
    metric computes at once, so its memory is one pair's whatever the batch size."""
    return ((a[i:i + 1], b[i:i + 1]) for i in range(a.shape[0]))


def mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mean squared error per image pair over pixels and channels, in float64: [B] (float64)."""
    import torch.nn.functional as F

    return torch.stack([F.mse_loss(x.to(torch.float64), y.to(torch.float64)) for x, y in pairs(a, b)])


def psnr_of(error: torch.Tensor) -> torch.Tensor:
    """PSNR in dB (peak 1) of each mean squared error (0: inf), worked as ``kornia.metrics.psnr``
    works it from its own, one 0-d value at a time as there, so the dB are kornia's to the bit."""
    return torch.stack([10.0 * torch.log10(1.0 / value) for value in error.reshape(-1)]).reshape(error.shape)


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """PSNR in dB per image pair (peak 1, MSE over pixels and channels; identical: inf): float64 [B]."""
    return psnr_of(mse(a, b))


def mean_psnr(error: torch.Tensor) -> float:
    """The PSNR of the batch: of the mean squared error over all its pairs (all images have one
    size, so that is the mean of theirs), not the mean of their dB, where one identical pair
    would make it infinite; inf only where every pair is identical."""
    return float(psnr_of(error.mean()))


def ssim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """Mean SSIM per image pair (11x11 Gaussian window, sigma 1.5, data range 1, valid positions):
    float64 [B]; None for images smaller than the window. kornia's, one pair at a time in float32
    (its maps of one 720p frame: tens of MB), each map averaged in float64."""
    import kornia.metrics

    if min(a.shape[1:3]) < SSIM_WINDOW:
        return None

    def one(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        index = kornia.metrics.ssim(x.to(torch.float32).permute(0, 3, 1, 2).contiguous(),
                                    y.to(torch.float32).permute(0, 3, 1, 2).contiguous(),
                                    SSIM_WINDOW, max_val=1.0, eps=0.0, padding="valid")
        return index.mean(dtype=torch.float64)

    return torch.stack([one(x, y) for x, y in pairs(a, b)])


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
    an IMAGE batch [B, H, W, 3] in 0..1 (float32), filled one pair at a time (the temporaries
    of one frame only)."""
    out = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    for i, (x, y) in enumerate(pairs(a, b)):
        out[i] = _heat(x[0], y[0], gain)
    return out


def _heat(x: torch.Tensor, y: torch.Tensor, gain: float) -> torch.Tensor:
    """One pair's heat map [H, W, 3]."""
    level = ((x.float() - y.float()).abs().mean(dim=-1) * gain).clamp(0.0, 1.0) * (len(HEAT) - 1)
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


def report_lines(psnr_db: list[float], mean_psnr_db: float, ssim_values: list[float] | None,
                 lpips_values: list[float] | None, notes: list[str]) -> list[str]:
    """One line per image pair and one for the batch: ``mean_psnr_db`` (of the mean squared error,
    said where there is more than one pair) and the mean SSIM and LPIPS; then what is missing."""
    count = len(psnr_db)
    ssim_of = (lambda i: ssim_values[i]) if ssim_values is not None else (lambda i: None)
    lpips_of = (lambda i: lpips_values[i]) if lpips_values is not None else (lambda i: None)
    lines = [f"image {i + 1}: {_figures(psnr_db[i], ssim_of(i), lpips_of(i))}" for i in range(count)]
    mean = lambda values: sum(values) / count if values is not None else None  # noqa: E731
    lines.append(f"mean of {count}: {_figures(mean_psnr_db, mean(ssim_values), mean(lpips_values))}")
    if count > 1:
        lines.append(MEAN_PSNR_NOTE.format(count=count))
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
            error = mse(a, b)
            psnr_db = psnr_of(error).tolist()
            ssim_values = ssim(a, b)
            if ssim_values is None:
                notes.append(f"SSIM: needs images of at least {SSIM_WINDOW}x{SSIM_WINDOW} px")
            lpips_values, missing = lpips(a, b)
            if missing:
                notes.append(missing)
            difference = heat_map(a, b, gain)
        lines = report_lines(psnr_db, mean_psnr(error), None if ssim_values is None else ssim_values.tolist(),
                             None if lpips_values is None else lpips_values.tolist(), notes)
        text = "\n".join(lines)
        LOG.info("%s: %s", cls.NODE_ID, text.replace("\n", "; "))
        # As the patch nodes' UI output: the text, and the lines the front end draws on the node.
        return io.NodeOutput(difference, text, ui={"text": [text], UI_KEY: [{"lines": lines, "warnings": []}]})
