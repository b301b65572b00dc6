"""The quality budget weighs a measured change by the share of sampling the run covers (issue #51):
a unit's change stays where it is at any denoise, the picture's change falls with the steps left,
so an image-to-image run or a hires pass (denoise 0.3) is not refused as hard as text to image."""

from __future__ import annotations


import pytest

from tokenreduce import describe, pays
from tokenreduce.window import flow_sigma, schedule_reach


def comfy_like(percent: float) -> float:
    """A falling percent -> sigma as ComfyUI's discrete model sampling answers it (huge at 0)."""
    if percent <= 0.0:
        return 999999999.9
    if percent >= 1.0:
        return 0.0
    return 14.6 * (1.0 - percent) ** 3 + 0.03 * (1.0 - percent)


@pytest.mark.parametrize("percent", [0.0, 0.1, 0.4, 0.7, 0.85, 0.99])
def test_the_reach_is_the_share_of_sampling_left_at_the_first_sigma(percent):
    first = comfy_like(percent) if percent > 0 else 14.63  # text to image starts at the largest sigma
    assert schedule_reach(comfy_like, first) == pytest.approx(1.0 - percent, abs=1e-9)


def test_the_reach_of_a_flow_schedule_unshifts_its_sigmas():
    shifted = lambda percent: flow_sigma(percent, 3.0)  # noqa: E731
    assert schedule_reach(shifted, flow_sigma(0.7, 3.0)) == pytest.approx(0.3, abs=1e-9)
    assert flow_sigma(0.7, 3.0) > 0.5  # the shifted sigma itself is no reach


def test_a_schedule_starting_above_the_models_largest_sigma_reaches_all_and_one_at_zero_nothing():
    assert schedule_reach(comfy_like, 80.0) == 1.0
    assert schedule_reach(comfy_like, 0.0) == 0.0


def measured(change: float) -> pays.Decision:
    return pays.Decision(True, None, None, pays.KEPT, change=change)


def test_the_budget_weighs_the_change_by_the_cube_root_of_the_reach():
    decision = measured(0.09)
    assert pays.within_budget(decision, 0.05).over_budget  # text to image: 9 % > 5 %
    assert not pays.within_budget(decision, 0.05).reduce
    half = pays.within_budget(decision, 0.05, reach=0.5)  # 0.09 * 0.794 = 7.1 %: still over
    assert half.over_budget and half.weighed_change == pytest.approx(0.09 * 0.5 ** (1 / 3))
    hires = pays.within_budget(decision, 0.05, reach=0.125)  # 4.5 %: within
    assert hires.reduce and not hires.over_budget and hires.reach == 0.125
    assert hires.weighed_change == pytest.approx(0.045)


def test_within_the_budget_a_slower_reduction_stays_left_alone():
    slower = pays.Decision(False, 10.0, 11.0, pays.KEPT, change=0.01)
    assert not pays.within_budget(slower, 0.05, reach=0.3).reduce


def test_the_report_says_the_weighed_change_where_the_run_covers_part_of_sampling():
    whole = pays.within_budget(measured(0.41), 0.1)
    assert describe.verdict_text(whole) == "left alone: changes its output 41 % > 10 %"
    part = pays.within_budget(measured(0.41), 0.1, reach=0.3)
    assert describe.verdict_text(part) == ("left alone: changes its output 41 % (27.4 % weighed by the 30 % of "
                                           "sampling this run covers) > 10 %")
