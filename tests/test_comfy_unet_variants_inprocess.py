"""Both nodes on the host's UNet variants (issue #31), each a tiny random-weight model built with
ComfyUI's own classes (devtools/random_unets.py) and sampled with the conditioning its
extra_conds read: instruct-pix2pix (SD1.5, SDXL), Zero123, unCLIP (L, H), LotusD, the x4
upscaler, the SDXL refiner, SSD-1B, Vega, KOALA. Each node patches it, stays near the unpatched
model, reruns bit for bit and leaves the input model as it was. The video UNets (SVD, SV3D) are
refused with their reason."""

from __future__ import annotations

import pytest
import torch

import random_unets
from comfy_helpers import patched, rel_error, sample, session_of

COVERED = [name for name in random_unets.CONFIGS if not name.startswith("SV")]
VIDEO = ["SVD_img2vid", "SV3D_u", "SV3D_p"]
SIZE = 16  # latent height and width


def run(comfy, name, model):
    positive, negative = (random_unets.conditioning(name, SIZE, SIZE, seed) for seed in (1, 2))
    return sample(comfy, model, steps=1, size=(SIZE, SIZE), positive=positive, negative=negative)


def weights(model):
    return {k: v.clone() for k, v in model.model.diffusion_model.state_dict().items()}


@pytest.mark.parametrize("name", COVERED)
def test_both_nodes_patch_it(comfy, name):
    model = random_unets.make_model(name)
    before, options = weights(model), repr(model.model_options)
    unpatched = run(comfy, name, model)
    for node in ("tome", "todo"):
        clone = patched(comfy, node, model)
        first = run(comfy, name, clone)
        report = session_of(clone).last_report
        assert report.levels and not report.warnings, (node, report.warnings)
        if name == "SD_X4Upscaler":  # attn1 attends to the text at its three finer levels
            assert [level.downsample for level in report.levels] == [8], node
        assert 0 < rel_error(first, unpatched) < 0.3, node
        if node == "todo" or name in ("SD15_instructpix2pix", "SDXL_instructpix2pix"):
            assert torch.equal(run(comfy, name, clone), first), node  # reruns bit for bit
    assert repr(model.model_options) == options and not model.object_patches
    assert all(torch.equal(before[k], v) for k, v in model.model.diffusion_model.state_dict().items())


@pytest.mark.parametrize("name", VIDEO)
def test_video_unets_are_refused_with_the_reason(comfy, name):
    model = random_unets.make_model(name)
    for node in ("tome", "todo"):
        with pytest.raises(ValueError, match="temporal block") as refusal:
            patched(comfy, node, model)
        assert name in str(refusal.value)
