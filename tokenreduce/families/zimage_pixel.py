"""Z-Image pixel space (NextDiTPixelSpace): Z-Image's NextDiT on RGB patches (patch 16 on the
image itself) with a per-patch MLP decoder in place of the final layer. Its refiners and layers
are NextDiT's, so its calls and token layout are Z-Image's: caption refiner (text only), noise
refiner (image only), joint layers over [caption padded to 32, pixel-patch grid padded to 32];
the decoder makes no attention call. ToMe merges its layers as Lumina 2 / Z-Image's (the same
layer calls, reached through object patches on them), its decoder reading the unmerged grid."""

from __future__ import annotations

from ..dit import Family, block_paths
from .lumina import MERGE, geometry, plan, tokens

FAMILIES = (
    Family("Z-Image pixel space", ("ZImagePixelSpace",), ("NextDiTPixelSpace",), True, False,
           lambda m: block_paths(m, "noise_refiner", "layers"), plan, lambda m: (1, m.patch_size, m.patch_size),
           tokens, geometry, merge=MERGE),
)
