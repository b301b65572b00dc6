"""The trained photo fixtures (devtools/photo_fixtures.py, issue #44) on the real ComfyUI, in-process:
they still denoise (the usefulness bar of their model card), their latents decode through
ComfyUI's own VAEDecode node, and each node at its defaults changes their images by no more than
a bound fixed from the quality table (docs/quality.md). No timings."""

from __future__ import annotations

import pytest
import torch

from comfy_helpers import apply

# LPIPS of one node at its defaults against unpatched, text to image, 4 euler steps, two seeds of
# one caption, at the fixture's native size. Fixed from the quality table (docs/quality.md: 16 seeds
# x 4 captions; its text-to-image 4-step means in the comments): room for the two images drawn
# here, none for a change twice the table's (Flux: LPIPS saturates near 1, so its bounds are looser).
BOUNDS = {
    ("sd15", "todo"): 0.02,  # table 0.0044
    ("sd15", "tome"): 0.08,  # table 0.033
    ("flux", "todo"): 0.60,  # table 0.39
    ("flux", "tome"): 0.90,  # table 0.65
}
CAPTION = {"sd15": "an astronaut", "flux": "a rocket"}
USEFUL_DB = 3.0  # the bar: the denoised estimate >= 3 dB closer to the photo than the noisy input


@pytest.fixture(scope="module")
def fixtures(comfy):
    import photo_fixtures

    return {name: photo_fixtures.load(name) for name in ("sd15", "flux")}


@pytest.mark.parametrize("name", ["sd15", "flux"])
def test_the_unpatched_fixture_denoises_held_out_photos(comfy, name):
    import photo_fixtures

    gain = photo_fixtures.denoise_gain(name)
    assert gain["gain_db"] >= USEFUL_DB, gain
    assert gain["denoised_psnr"] <= gain["codec_psnr"] + 0.5, gain  # never above what the latent map can hold


@pytest.mark.parametrize("name", ["sd15", "flux"])
def test_latents_decode_through_comfyuis_vae_decode_node(comfy, fixtures, name):
    import nodes as comfy_nodes  # ComfyUI's own top-level nodes module

    fixture = fixtures[name]
    latent = torch.randn(2, fixture.spec.latent_channels, 8, 8, generator=torch.Generator().manual_seed(0))
    (image,) = comfy_nodes.VAEDecode().decode(fixture.vae, {"samples": latent})
    expected = ((fixture.codec.decode(latent) + 1) / 2).clamp(0, 1).movedim(1, -1)
    assert image.shape == (2, 64, 64, 3)
    torch.testing.assert_close(image, expected, atol=1e-5, rtol=1e-5)
    (encoded,) = comfy_nodes.VAEEncode().encode(fixture.vae, image)
    # The map keeps `channels` of 192 dimensions a patch: encoding the decoded image gives the latent back.
    torch.testing.assert_close(encoded["samples"], latent, atol=2e-3, rtol=2e-3)


def test_captions_outside_the_fixtures_words_are_refused(comfy, fixtures):
    with pytest.raises(ValueError, match="the fixtures know only the words"):
        fixtures["sd15"].conditioning("a dog")


@pytest.mark.parametrize("name", ["sd15", "flux"])
@pytest.mark.parametrize("node", ["todo", "tome"])
def test_each_node_at_its_defaults_stays_under_its_lpips_bound(comfy, fixtures, name, node):
    import photo_fixtures
    from quality import metrics

    fixture = fixtures[name]
    patched = apply(comfy, node, fixture.patcher).result[0]
    images = {}
    for label, model in (("unpatched", fixture.patcher), (node, patched)):
        images[label] = torch.cat([photo_fixtures.sample(fixture, model, CAPTION[name], seed, 4) for seed in (0, 1)])
    change = metrics.lpips(images[node], images["unpatched"])
    # The node reduced something (on a CPU reduce_when auto reduces without timing) ...
    assert change.min() > 1e-4, change
    # ... and changed the trained model's images no more than the table allows.
    assert change.max() < BOUNDS[(name, node)], change


def test_the_quality_table_compares_each_setting_seed_for_seed(comfy, tmp_path):
    """benchmark.py --quality in miniature (its own process: it loads the pack as the benchmark
    does): one seed, two steps, ToDo at its defaults on the SD fixture; both modes, the
    random-weight column, the H100 speed-up, the front and the picture grid."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(repo / "devtools" / "benchmark.py"), "--quality", str(tmp_path),
                           "--fixtures", "sd15", "--seeds", "1", "--steps", "2", "--random-seeds", "1",
                           "--configs", "ToDo 2", "--comfyui", str(comfy.root)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads((tmp_path / "quality.json").read_text())
    row = result["rows"]["ToDo 2"]
    assert row["images"] == 8  # 4 captions x 1 seed x 2 modes
    assert 0 < row["lpips"] < 0.05 and 0.9 < row["ssim"] < 1 and row["psnr"] > 30
    assert row["random_rel"] is not None and row["rel"] > 0
    assert row["gpu_speedup"] == pytest.approx(1.177, abs=0.001) and row["front"] is True
    assert set(row["by_cell"]) == {"t2i|2", "i2i|2"}
    assert (tmp_path / "grid_sd15.png").stat().st_size > 0
    assert "| ToDo 2 |" in done.stdout


def test_the_distribution_table_holds_each_settings_images_against_another_seeds(comfy, tmp_path):
    """benchmark.py --distribution in miniature: two images a caption, two steps, ToDo at its
    defaults on the SD fixture. The unpatched row is the floor (its images against the reference
    set of other noise; same-seed LPIPS 0); ToDo's images moved (LPIPS above 0)."""
    import json
    import math
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(repo / "devtools" / "benchmark.py"), "--distribution", str(tmp_path),
                           "--fixtures", "sd15", "--seeds", "2", "--steps", "2", "--configs", "ToDo 2",
                           "--comfyui", str(comfy.root)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads((tmp_path / "distribution.json").read_text())
    assert list(result["rows"]) == ["unpatched", "ToDo 2"]
    floor, todo = result["rows"]["unpatched"], result["rows"]["ToDo 2"]
    assert floor["images"] == todo["images"] == 8  # 4 captions x 2 images, text to image
    assert floor["lpips"] == 0 and 0 < todo["lpips"] < 0.05
    assert all(math.isfinite(row["kid"]) and row["kid_spread"] > 0 for row in (floor, todo))
    assert "| ToDo 2 |" in done.stdout and "| unpatched |" in done.stdout
