"""The trained photo fixtures through the diffusers adapter (issue #51: a trained model through
diffusers is reduced within the quality budget or left alone with the report saying why), their
weights in diffusers' FluxTransformer2DModel and UNet2DConditionModel (``devtools/diffusers_fixture.py``).
No timings: on the CPU auto decides ToDo's nearest and ToMe by the budget alone (the window is
timed, and its decision either way must be said)."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def flux(comfy):
    import diffusers_fixture
    import photo_fixtures

    fixture = photo_fixtures.load("flux")
    return fixture, diffusers_fixture.flux_transformer(fixture)


@pytest.fixture(scope="module")
def sd15(comfy):
    import diffusers_fixture
    import photo_fixtures

    fixture = photo_fixtures.load("sd15")
    return fixture, diffusers_fixture.sd_unet(fixture)


@pytest.fixture()
def own_store(monkeypatch):
    """A decisions store of the test's own, in memory: the first call measures."""
    from tokenreduce import pays
    from tokenreduce.diffusers import api

    monkeypatch.setattr(api, "decisions_at", lambda path: pays.Decisions(None))


def test_the_diffusers_model_computes_comfyuis_call_and_images(flux):
    import diffusers_fixture
    import photo_fixtures

    fixture, model = flux
    x = torch.randn(1, 16, 32, 32, generator=torch.Generator().manual_seed(0))
    text = fixture.text(["a cat"]).float()
    with torch.no_grad():
        ours = fixture.patcher.model.diffusion_model(x, torch.tensor([0.6]), text, y=text.mean(1))
    theirs = diffusers_fixture.velocity(model, fixture, x, 0.6, "a cat")
    assert ((theirs - ours).norm() / ours.norm()) < 1e-5
    image = diffusers_fixture.sample(model, fixture, "a cat", 0, 2, px=256)
    torch.testing.assert_close(image, photo_fixtures.sample(fixture, fixture.patcher, "a cat", 0, 2, px=256),
                               rtol=0, atol=1e-5)
    photo = photo_fixtures.held_out_images(256)[:1]  # image to image: the last 2 of 4 steps
    image = diffusers_fixture.sample(model, fixture, "a cat", 0, 2, image=photo, denoise=0.5, px=256)
    torch.testing.assert_close(image, photo_fixtures.sample(fixture, fixture.patcher, "a cat", 0, 2, image=photo,
                                                            denoise=0.5, px=256), rtol=0, atol=1e-5)


def _percent(line: str) -> float:
    return float(re.search(r"changes its output ([\d.]+) %", line).group(1))


@pytest.mark.parametrize("method", ["ToDo", "ToMe"])
def test_the_budget_on_the_trained_fixture_reduces_within_it_or_leaves_alone_and_says_why(flux, own_store, method):
    """At the defaults (auto, max_change 0.05) the trained fixture is reduced within the budget or
    left alone, the report saying why. ToDo decides per block on a late input (the model called
    without its pipeline: the unshifted schedule's 3/4): the blocks that run fit the budget, the
    line says what ran where, and a run that reduces nothing is the unpatched image with every
    block's change over the budget said (the window is among a block's options only where it is
    timed faster here, which a loaded CPU can make either way). ToMe, per block too (at its ratio
    and half of it): every block over 5 % even at half, left alone, the smallest change said. With
    the budget off the same reduction runs and moves the image."""
    import diffusers_fixture
    from tokenreduce.diffusers import apply_patch

    fixture, model = flux
    unpatched = diffusers_fixture.sample(model, fixture, "a rocket", 1, 2)
    with apply_patch(model, method) as patch:
        image = diffusers_fixture.sample(model, fixture, "a rocket", 1, 2)
        lines = patch.report_lines()
        decisions = patch.report().decisions
    decided = [line for line in " | ".join(lines).split(" | ") if line.startswith("auto · ")]
    over = [line for line in decided if "left alone: changes its output" in line]
    assert all(_percent(line) > 5 for line in over), lines
    if method == "ToDo":
        (graded,) = [d for site, d in decisions if site.endswith("per block")]
        (line,) = [line for line in decided if line.startswith("auto · 32×32 grid, per block, read at 75 % of sampling")]
        if graded.reduce:
            assert graded.change <= 0.05 and line.endswith("of the 5.0 % budget"), lines
            assert not torch.equal(image, unpatched)
        else:
            assert graded.over_budget and over and torch.equal(image, unpatched), lines
    else:  # every block over the budget, even at half the ratio: the unpatched image
        assert any(line.startswith("auto · Flux blocks, 32×32 grid, per block, read at 75 % of sampling")
                   for line in decided), lines
        assert over and torch.equal(image, unpatched)
    with apply_patch(model, method, max_change=0.0, reduce_when="always"):
        assert not torch.equal(diffusers_fixture.sample(model, fixture, "a rocket", 1, 2), unpatched)


def test_the_diffusers_unet_gives_comfyuis_images(sd15):
    """The SD fixture's UNet through diffusers' converter: ComfyUI's images (CFG 2, cond and uncond
    in one batch), text and image to image."""
    import diffusers_fixture
    import photo_fixtures

    fixture, model = sd15
    image = diffusers_fixture.sample(model, fixture, "a cat", 0, 2)
    torch.testing.assert_close(image, photo_fixtures.sample(fixture, fixture.patcher, "a cat", 0, 2), rtol=0, atol=1e-5)
    photo = photo_fixtures.held_out_images(256)[:1]
    image = diffusers_fixture.sample(model, fixture, "a cat", 0, 2, image=photo, denoise=0.5)
    torch.testing.assert_close(image, photo_fixtures.sample(fixture, fixture.patcher, "a cat", 0, 2, image=photo,
                                                            denoise=0.5), rtol=0, atol=1e-5)


@pytest.mark.parametrize("method", ["ToDo", "ToMe"])
def test_the_budget_reduces_the_flat_trained_unet(sd15, own_store, method):
    """The SD fixture's attention is flat: at the defaults both methods reduce every block (the image
    moves), as in the ComfyUI node: ToDo within 5 % everywhere; ToMe block by block (issue #51): its
    two blocks over it at 0.5 (input 2 and output 9, 6.5-7 %) step down to half the ratio, and are
    left alone where that is over it too."""
    import diffusers_fixture
    from tokenreduce.diffusers import apply_patch

    fixture, model = sd15
    unpatched = diffusers_fixture.sample(model, fixture, "a rocket", 1, 2)
    with apply_patch(model, method) as patch:
        image = diffusers_fixture.sample(model, fixture, "a rocket", 1, 2)
        lines = patch.report_lines()
    assert not torch.equal(image, unpatched)
    left = [line for line in lines if "left alone" in line]
    if method == "ToDo":
        assert not left, lines
    else:  # input 2 and output 9 at ratio 0.5 (6.8-7 %), and input 2 at 0.25 where that is over too (5.0 %)
        assert 2 <= len(left) <= 3 and all(", block " in line for line in left), lines
