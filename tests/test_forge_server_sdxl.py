"""The extension on SDXL in a real Forge (``devtools/run_tests.py --forge PATH``): a random-weight
SDXL checkpoint, its UNet stored in bfloat16 (``--unet-in-bf16``; about 14 GB of memory at peak
on a CPU instead of more than 20). Both methods act on SDXL (auto picks its first attention
level, downsample 2) and change the image; a setting that does nothing there is said."""

from __future__ import annotations

import numpy as np
import pytest

from forge_helpers import generate, skip_without_forge, start_forge

skip_without_forge()

SDXL = "· SDXL · 10 of 70 blocks at downsample 2"


@pytest.fixture(scope="module")
def forge(tmp_path_factory):
    server = start_forge(tmp_path_factory.mktemp("forge-sdxl"), "SDXL", args=["--unet-in-bf16"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain(forge):
    return generate(forge)


def test_todo_changes_the_sdxl_image_and_says_where(forge, plain):
    result = generate(forge, [{"ToDo": True}])
    assert not np.array_equal(result.pixels, plain.pixels)
    assert result.ours()["TokenReduce ToDo report"] == (
        f"ToDo {SDXL} | ds 2 · 16×16 · q 256→256 · k/v 256→64 | steps 1-2 of 2")


def test_tome_changes_the_sdxl_image_and_repeats_bit_for_bit(forge, plain):
    args = [{"ToMe": True}]
    result = generate(forge, args)
    assert not np.array_equal(result.pixels, plain.pixels)
    assert result.ours()["TokenReduce ToMe report"] == (
        f"ToMe {SDXL} | ds 2 · 16×16 · q 256→128 · k/v 256→128 | steps 1-2 of 2")
    assert np.array_equal(generate(forge, args).pixels, result.pixels)


def test_a_level_without_attention_is_said_not_silently_ignored(forge, plain):
    result = generate(forge, [{"ToMe": {"max_downsample": "1"}}])
    assert np.array_equal(result.pixels, plain.pixels)
    assert result.ours()["TokenReduce warnings"].startswith(
        "TokenReduce ToMe: WARNING: ToMe does nothing on this SDXL model with max_downsample 1: its transformer "
        "blocks are at downsample 2, 4.")
