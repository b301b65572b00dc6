"""The host's UNet model configs and what both nodes do on each (for the coverage test and
docs/models.md). The UNet path finds a UNet's sites by walking its modules (``layout.py``), not
by these names: this table only says, per config, what that walk gives and how it was tested."""

from __future__ import annotations

_BOTH = "ToMe and ToDo patch its self-attention (the UNet path)"

UNETS: dict[str, str] = {
    "SD15": _BOTH,
    "SD20": _BOTH,
    "SDXL": _BOTH,
}
