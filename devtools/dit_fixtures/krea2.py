"""A tiny Krea 2 (ComfyUI 0.33): one single-stream block (2 query heads, 1 key/value head), a
text fusion over a 2-layer text stack 32 wide; Wan 2.1 latent format (5-D, T = 1)."""

from __future__ import annotations

import torch

from random_dits import TEXT_TOKENS, Fixture, Spec

TXT_LAYERS, TXT_DIM = 2, 32
_CONFIG = {"image_model": "krea2", "features": 64, "channels": 16, "patch": 2, "layers": 1, "heads": 2,
           "kvheads": 1, "txtlayers": TXT_LAYERS, "txtdim": TXT_DIM, "txtheads": 2, "txtkvheads": 2, "multiplier": 2}


def _text(generator, batch, shape):
    # the text encoder's layers side by side: [B, tokens, layers * width]
    return torch.randn(batch, TEXT_TOKENS, TXT_LAYERS * TXT_DIM, generator=generator), {}


def _zero_centred(model) -> None:
    """Krea 2's RMSNorm weighs by 1 + scale and its modulation adds a learned table to the
    timestep's (both stored zero-centred): randomize_'s 1.0 would double every norm and the
    modulation, making the attention far peakier than a real model's."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".scale") or name.endswith("mod.lin") or name.endswith("modulation.lin"):
                param.zero_()


def _reference(generator, shape) -> dict:
    # ReferenceLatent with FluxKontextMultiReferenceLatentMethod: a 64x64 px reference (Wan 2.1
    # latent, T = 1) appended after the image with the zero-timestep modulation.
    return {"reference_latents": [torch.randn([1, 16, 1, 8, 8], generator=generator)],
            "reference_latents_method": "index_timestep_zero"}


FIXTURES = {
    # 2 layerwise + 2 refiner text-fusion calls (left alone), then the single-stream block
    "krea2": Fixture(Spec("Krea2", 16, 8, False, five_d=True), _CONFIG, "Krea 2", 1, "----g", (8, 6), text=_text,
                     weights=_zero_centred),
    # the same over [text, image, reference]
    "krea2_edit": Fixture(Spec("Krea2", 16, 8, False, five_d=True), _CONFIG, "Krea 2", 1, "----g", (8, 6),
                          text=_text, shared=_reference, weights=_zero_centred),
}
