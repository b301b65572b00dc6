"""The words of the WebUI accordion that are not an input's (those come from the methods'
declared inputs): one place, so that ``tokenreduce_forge.localization`` translates exactly
what ``ui.py`` shows. Pure Python."""

from __future__ import annotations

INTRO = ("Faster sampling with fewer tokens. Start with ToDo at its defaults. What was patched and the tokens "
         "removed per level go into the image's parameters. Hover a setting for what it does.")
# Under INTRO, one line per method: what it does on which models (a list item each, which the
# page translates whole: no inline markup in them).
INTRO_METHODS = {
    "ToDo": "ToDo (SD1.x, SD2.x, SDXL, Flux.1): self-attention reads keys and values downsampled on the token "
            "grid; every query stays.",
    "ToMe": "ToMe (SD1.x, SD2.x, SDXL): similar tokens are merged before attention and unmerged after; on Flux.1, "
            "the image tokens are merged before each block and restored after it.",
}
HIRES_PASS = "Hires. fix pass"  # the accordion of the hires. fix pass's settings
ABOUT = "About these settings"  # the accordion with every input's explanation
METHOD_INFO = {
    "ToDo": "Self-attention reads keys and values downsampled on the token grid; every query stays. Deterministic.",
    "ToMe": "Similar tokens are merged before attention and unmerged after (ToMe for SD); on Flux.1, before "
            "each merged block and restored after it.",
}
HIRES_INFO = ("The hires. fix pass: the first pass's settings, its own settings (below), or no token reduction. "
              "Its larger latent often gains more.")
