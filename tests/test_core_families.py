"""The family registry on its own (torch only): recognition by config and module class and
their bases, refusals with reasons, and docs/models.md made from the registry."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tokenreduce.families import FAMILIES, REFUSED, recognise

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "devtools"))


def _named(name: str, *bases: type) -> type:
    return type(name, bases or (object,), {})


def test_a_listed_config_and_module_class_is_the_family():
    wan = next(family for family in FAMILIES if "WAN21_T2V" in family.configs)
    module = _named("WanModel", torch.nn.Module)()
    assert recognise(_named("WAN21_T2V")(), module) == (wan, None)
    assert recognise("WAN21_T2V", module) == (wan, None)  # a host that gives only the name (Forge)


def test_a_subclass_of_a_family_is_refused_for_that_reason_not_reduced():
    base_config, base_module = _named("WAN21_T2V"), _named("WanModel", torch.nn.Module)
    family, reason = recognise(_named("WAN99_NewStream", base_config)(), _named("NewStreamWan", base_module)())
    assert family is None and "variant of Wan 2.1 / 2.2 (WAN21_T2V)" in reason and "NewStreamWan" in reason
    family, reason = recognise(_named("WAN21_T2V")(), _named("NewStreamWan", base_module)())
    assert family is None and "but the model is a NewStreamWan, not the WanModel" in reason
    family, reason = recognise(_named("SomethingNew")(), _named("NewStreamWan", base_module)())
    assert family is None and "derives from WanModel (Wan 2.1 / 2.2)" in reason


def test_a_refused_config_says_why_and_an_unknown_model_is_not_recognised():
    config = next(iter(REFUSED))
    assert recognise(_named(config)(), torch.nn.Linear(1, 1)) == (None, REFUSED[config])
    assert recognise(_named("NotAModel")(), torch.nn.Linear(1, 1)) == (None, None)


def test_docs_models_page_is_made_from_the_registry():
    import make_model_table

    assert make_model_table.PAGE.read_text(encoding="utf-8") == make_model_table.render(), \
        "docs/models.md is not current: run python3 devtools/make_model_table.py"


# DiT families whose model (ComfyUI 0.3.75 and 0.33) calls its blocks with no block-replace
# lookup (patches_replace["dit"]) and whose block call the layer seam (DiTMerge.layer_args) does
# not describe: ToMe says what in the call it cannot follow.
DIRECT_CALLS = {"Cosmos 1.0": "[T, H, W, B, D] grid",
                "Cosmos Predict2": "[B, T, H, W, D] grid", "Cosmos Predict2 image": "[B, T, H, W, D] grid",
                "Anima": "[B, T, H, W, D] grid", "Boogu-Image": "two rotary tables",
                "Ideogram 4": "for the whole batch", "PixelDiT": "within each patch", "PiD": "within each patch"}


def test_families_tome_cannot_reach_say_why():
    families = {family.name: family for family in FAMILIES}
    for name, what in DIRECT_CALLS.items():
        reason = families[name].merge_refusal or ""
        assert families[name].merge is None and "calls its blocks directly" in reason and what in reason, name
        assert reason.count(". ") == 0, reason  # one sentence
    for family in FAMILIES:  # a family ToMe merges gives no refusal
        assert family.merge is None or family.merge_refusal is None, family.name


def test_every_dit_family_is_merged_by_tome_or_says_why_not():
    # the refusal and the model table's ToMe column give the reason (issue #38)
    unexplained = [f.name for f in FAMILIES if f.merge is None and not (f.merge_refusal or "").strip()]
    assert not unexplained, f"DiT families ToMe neither merges nor explains: {unexplained}"


def test_a_merge_that_can_leave_calls_alone_says_which_in_the_model_table():
    # a family whose merge check can leave a call alone (with a warning) names those calls, so that
    # the table's "yes" does not claim merging where it never happens (Wan HuMo with the stock node)
    silent = [f.name for f in FAMILIES if f.merge is not None and f.merge.check is not None
              and not (f.merge.leaves_alone or "").strip()]
    assert not silent, f"ToMe merges with a check but no leaves_alone: {silent}"
    claimed = [f.name for f in FAMILIES if f.merge is not None and f.merge.check is None and f.merge.leaves_alone]
    assert not claimed, f"leaves_alone without a check that leaves calls alone: {claimed}"
    humo = next(f for f in FAMILIES if f.name == "Wan HuMo")
    assert "WanHuMoImageToVideo" in humo.merge.leaves_alone
