"""The quality budget decided per block (issue #51), host-free: the grading rule
(``pays.grade_blocks``) and the late input it reads the blocks' changes on
(``window.late_level``, ``window.late_latent``)."""

from __future__ import annotations

import pytest
import torch

from tokenreduce import describe, pays
from tokenreduce.window import late_latent, late_level, levels_to_late

# The Flux fixture's six blocks, rehearsed late (docs/quality.md, "Per block"): nearest, window.
FLUX = {"double 0": (0.061, 0.014), "double 1": (0.076, 0.007), "single 0": (0.029, 0.003),
        "single 1": (0.074, 0.006), "single 2": (0.024, 0.012), "single 3": (0.058, 0.011)}
LADDER = ("nearest", "window")


def changes_of(table: dict) -> dict:
    return {(unit, method): value[i] for unit, value in table.items() for i, method in enumerate(LADDER)}


def test_blocks_fill_the_budget_with_their_mildest_step_first_smallest_first():
    chosen, total = pays.grade_blocks({u: LADDER for u in FLUX}, changes_of(FLUX), 0.05)
    # the windows sum to 0.053: the largest (double 0, 0.014) does not fit; no step up fits after
    assert chosen == {u: "window" for u in FLUX if u != "double 0"}
    assert total == pytest.approx(0.039)


def test_blocks_step_up_where_the_added_change_fits_the_smallest_first():
    chosen, total = pays.grade_blocks({u: LADDER for u in FLUX}, changes_of(FLUX), 0.07)
    # every window (0.053), then single 2 (+0.012); single 0 (+0.026) no longer fits
    assert chosen == {**{u: "window" for u in FLUX}, "single 2": "nearest"}
    assert total == pytest.approx(0.065)
    everything, total = pays.grade_blocks({u: LADDER for u in FLUX}, changes_of(FLUX), 1.0)
    assert set(everything.values()) == {"nearest"} and total == pytest.approx(0.322)


def test_nothing_fits_under_a_budget_below_every_mildest_step_and_blocks_without_options_never_run():
    assert pays.grade_blocks({u: LADDER for u in FLUX}, changes_of(FLUX), 0.002) == ({}, 0.0)
    options = {**{u: LADDER for u in FLUX}, "single 0": (), "single 1": ("window",)}
    chosen, _ = pays.grade_blocks(options, changes_of(FLUX), 1.0)
    assert "single 0" not in chosen and chosen["single 1"] == "window" and chosen["single 2"] == "nearest"


def test_the_runs_reach_weighs_every_blocks_change():
    changes = changes_of(FLUX)
    full, _ = pays.grade_blocks({u: LADDER for u in FLUX}, changes, 0.05)
    # a hires pass covering 1/8 of sampling weighs each change by 1/2: the budget holds twice as much
    half, total = pays.grade_blocks({u: LADDER for u in FLUX}, changes, 0.05, reach=0.125)
    same, _ = pays.grade_blocks({u: LADDER for u in FLUX}, changes, 0.10)
    assert half == same and len(half) > len(full) and total <= 0.05


def test_a_change_read_late_counts_twice_against_the_budget():
    changes = changes_of(FLUX)
    doubled, total = pays.grade_blocks({u: LADDER for u in FLUX}, changes, 0.05, scale=pays.LATE_SCALE)
    assert doubled == pays.grade_blocks({u: LADDER for u in FLUX}, changes, 0.025)[0]
    assert doubled == {u: "window" for u in ("single 0", "single 1", "double 1")} and total == pytest.approx(0.032)


def test_ties_go_to_the_earlier_block_so_the_same_changes_give_the_same_choice():
    equal = {(unit, "window"): 0.01 for unit in "abcd"}
    chosen, _ = pays.grade_blocks({unit: ("window",) for unit in "dcba"}, equal, 0.025)
    assert chosen == {"a": "window", "b": "window"}


def test_the_report_names_what_ran_where_with_ranges():
    keys = {0: ("double_block", 0), 1: ("double_block", 1), 2: ("single_block", 0), 3: ("single_block", 1),
            4: ("single_block", 2)}
    units = [("joint", b) for b in range(5)]
    graded = {("joint", 1): "window", ("joint", 2): "window", ("joint", 3): "window", ("joint", 4): "nearest"}
    text = describe.graded_text(graded, units, {u: LADDER for u in units}, keys, 0.041, 0.05)
    assert text == "nearest single 2 · window double 1, single 0-1 · left alone double 0 · 4.1 % of the 5.0 % budget"


def test_the_late_level_is_the_step_at_three_quarters_of_the_schedule():
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    assert late_level(sigmas) == 0.25  # step 3 of 4: KSampler Advanced's start step
    assert late_level(torch.linspace(14.6, 0.0, 9)) == pytest.approx(14.6 * 2 / 8)  # step 6 of 8
    assert late_level(torch.tensor([1.0, 0.0])) is None  # one step: nothing later to read
    assert late_level(None) is None


def test_the_levels_to_the_late_one_are_the_schedules_steps_up_to_it():
    """Where an input some steps before the late one is read (ToMe's correct_from_whole: its plan's
    step, plan_every - 1 steps back at the most)."""
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    assert levels_to_late(sigmas) == (1.0, 0.75, 0.5, 0.25)
    assert levels_to_late(sigmas)[-1] == late_level(sigmas)
    assert levels_to_late(torch.tensor([1.0, 0.0])) == () and levels_to_late(None) == ()


@pytest.mark.parametrize("flow", [False, True])
def test_the_late_input_is_the_prediction_noised_again_with_the_runs_own_noise(flow):
    """One Euler step along the prediction in the sampler's space is the prediction noised again
    with the run's own noise, for eps models (x = x0 + s n) and flow models (x = (1 - s) x0 + s n)
    alike: the host need not name its parametrization."""
    generator = torch.Generator().manual_seed(0)
    clean, noise = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 4, 8, 8, generator=generator)
    sigma, late = (torch.tensor([0.9, 0.9]), 0.3) if flow else (torch.tensor([14.6, 14.6]), 1.2)

    def noised(level):
        return (1 - level) * clean + level * noise if flow else clean + level * noise

    x = noised(sigma.view(-1, 1, 1, 1))
    assert torch.allclose(late_latent(x, sigma, clean, late), noised(late), atol=1e-5)
    assert late_latent(x.half(), sigma, clean, late).dtype == torch.float16


def test_tomes_kinds_of_block_are_named_by_their_keys_alone():
    keys = {1: ("double_block", 1), 2: ("single_block", 0), 3: ("single_block", 1)}
    units = [("double_block", 1), ("single_block", 2), ("single_block", 3)]
    options = {u: ("ratio 0.5", "ratio 0.25") for u in units}
    graded = {("single_block", 2): "ratio 0.5", ("double_block", 1): "ratio 0.25"}
    text = describe.graded_text(graded, units, options, keys, 0.16, 0.2, name_kinds=False)
    assert text == "ratio 0.5 single 0 · ratio 0.25 double 1 · left alone single 1 · 16 % of the 20 % budget"
    assert describe.graded_text({}, units, options, keys, 0.0, 0.05, name_kinds=False) == \
        "left alone double 1, single 0-1"



def test_each_block_alone_runs_its_most_reducing_step_within_the_budget():
    """UNets (issue #51): each block held against the budget alone, not summed."""
    changes = {("a", "nearest"): 0.04, ("a", "window"): 0.01, ("b", "nearest"): 0.08, ("b", "window"): 0.03,
               ("c", "nearest"): 0.12, ("c", "window"): 0.07}
    options = {u: LADDER for u in "abc"}
    chosen, largest = pays.grade_each(options, changes, 0.05)
    assert chosen == {"a": "nearest", "b": "window"} and largest == pytest.approx(0.04)
    weighed, _ = pays.grade_each(options, changes, 0.05, reach=0.125)  # halved by the cube root
    assert weighed == {"a": "nearest", "b": "nearest", "c": "window"}
    assert pays.grade_each({"a": ("nearest",), "b": ()}, changes, 1.0) == ({"a": "nearest"}, 0.04)


def test_unet_blocks_are_named_by_their_transformer_and_index_where_it_has_several():
    from tokenreduce.describe import block_names
    from tokenreduce.layout import Site
    from tokenreduce.unet_blocks import block_names as unet_names

    sites = [Site(("input", 1, 0), 1, ""), Site(("input", 2, 0), 1, ""), Site(("output", 9, 0), 1, ""),
             Site(("input", 7, 0), 2, ""), Site(("input", 7, 1), 2, ""), Site(("input", 7, 2), 2, "")]
    names = unet_names(sites)
    assert block_names([names[s.key] for s in sites[:3]]) == "input 1-2, output 9"
    assert block_names([names[s.key] for s in sites[3:]]) == "input 7 blocks 0-2"
