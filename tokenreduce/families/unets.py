"""The host's UNet model configs that both nodes patch, and what they do on each (for the
coverage test and docs/models.md). The UNet path finds a UNet's sites by walking its modules
(``layout.py``), not by these names: this table says, per config, what that walk gives. Each is
sampled on a tiny model: SD15, SD20 (as SD2.1) and SDXL by the node tests, the others by
tests/test_comfy_unet_variants_inprocess.py. The UNets refused (SVD, SV3D, Stable Cascade) are in
``refusals.py`` with their reasons."""

from __future__ import annotations

_BOTH = "ToMe and ToDo patch its self-attention"
_CONCAT = f"{_BOTH} (the image comes as extra input channels; tokens are the same grid)"
_SDXL_LIKE = f"{_BOTH} at downsample 2, its finest level with attention (as SDXL)"

UNETS: dict[str, str] = {
    "SD15": _BOTH,
    "SD20": _BOTH,
    "SDXL": f"{_BOTH}; its finest level with attention is downsample 2",
    "SD15_instructpix2pix": _CONCAT,
    "SDXL_instructpix2pix": f"{_CONCAT}; downsample 2",
    "Stable_Zero123": _CONCAT,
    "SD21UnclipL": f"{_BOTH} (image embeddings join the time embedding, not the tokens)",
    "SD21UnclipH": f"{_BOTH} (image embeddings join the time embedding, not the tokens)",
    "LotusD": _BOTH,
    "SD_X4Upscaler": ("ToMe and ToDo patch the self-attention at downsample 8 only: its finer levels' "
                      "transformer blocks attend to the text, not to the grid (disable_self_attn), and are left alone"),
    "SDXLRefiner": _SDXL_LIKE,
    "SSD1B": _SDXL_LIKE,
    "Segmind_Vega": _SDXL_LIKE,
    "KOALA_700M": _SDXL_LIKE,
    "KOALA_1B": _SDXL_LIKE,
}
