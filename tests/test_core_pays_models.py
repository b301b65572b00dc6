"""The quality budget's change is kept per model (issue #51, reproduced defect 1), torch only: a
decision's speed is the kind's, its change is kept under the fingerprint of the weights the
measured unit runs with (``tokenreduce/fingerprint.py``), in memory and in the decisions file;
an entry's change kept without a fingerprint is not trusted for a model; two processes merging
one kind keep every model's change, the file's own winning."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from test_core_pays import GPU_LIKE, KIND, Changing, FakeClock, store
from tokenreduce import fingerprint, pays

A, B = "wA", "wB"


def file_entry(tmp_path) -> dict:
    (entry,) = json.loads((tmp_path / "tokenreduce" / "auto_decisions.json").read_text())["decisions"].values()
    return entry


def test_two_models_of_one_kind_keep_their_own_change_and_share_the_speed(tmp_path):
    decisions = store(tmp_path, 10.0, 8.0)
    rule = pays.AutoRule(decisions, max_change=0.1)
    first = rule.decide(GPU_LIKE, KIND, Changing(0.03), "site", model=A)
    built = Changing(0.4)
    second = rule.decide(GPU_LIKE, KIND, built, "site", model=lambda: B)  # read lazily, as the patches hand it
    assert (first.reduce, first.change, first.source) == (True, 0.03, pays.MEASURED)
    assert (second.reduce, second.over_budget, second.change, second.source) == (False, True, 0.4, pays.MEASURED)
    assert (second.full_ms, second.reduced_ms) == (10.0, 8.0)
    assert decisions.stopwatch.timed.count("full") == 1 + pays.REPEATS  # timed once, for the kind
    assert built.runs == {"full": 1, "reduced": 1}  # B: its change alone, untimed
    entry = file_entry(tmp_path)
    assert entry["changes"] == {A: 0.03, B: 0.4} and "change" not in entry
    again = Changing(0.9)
    restarted = pays.AutoRule(store(tmp_path, 10.0, 50.0), max_change=0.1)  # a new process
    assert restarted.decide(GPU_LIKE, KIND, again, "site", model=B)[:4] == (False, 10.0, 8.0, pays.KEPT)
    assert restarted.decide(GPU_LIKE, KIND, again, "site", model=A).change == 0.03 and again.builds == 0


def test_the_model_is_read_only_where_a_budget_applies():
    read = []
    decision = store(None).decide(GPU_LIKE, KIND, Changing(0.2), model=lambda: read.append(1) or A)
    assert decision.change is None and read == []


def test_a_change_kept_without_a_fingerprint_is_not_trusted_for_a_model(tmp_path):
    store(tmp_path).decide(GPU_LIKE, KIND, Changing(0.03), change=True)  # an earlier version: one change per kind
    assert file_entry(tmp_path)["change"] == 0.03
    clock = FakeClock(50.0, 1.0)
    built = Changing(0.4)
    decision = pays.Decisions(tmp_path / "tokenreduce" / "auto_decisions.json", stopwatch=clock).decide(
        GPU_LIKE, KIND, built, change=True, model=B)
    assert (decision.change, decision.source, decision.full_ms, clock.timed) == (0.4, pays.MEASURED, 10.0, [])
    assert file_entry(tmp_path)["changes"] == {B: 0.4}


def test_on_merge_every_models_change_is_kept_and_the_files_own_wins(tmp_path):
    first, second = store(tmp_path, 10.0, 8.0), store(tmp_path, 10.0, 12.0)
    first.decide(GPU_LIKE, KIND, Changing(0.03), change=True, model=A)
    second._refresh = lambda: None  # second measured at the same time: it had not read first's yet
    lost = second.decide(GPU_LIKE, KIND, Changing(0.4), change=True, model=B)
    # the speed is the file's (first's); B's change is second's own, kept beside A's
    assert (lost.reduce, lost.full_ms, lost.reduced_ms, lost.change, lost.source) == (True, 10.0, 8.0, 0.4, pays.KEPT)
    assert file_entry(tmp_path)["changes"] == {A: 0.03, B: 0.4}
    third = store(tmp_path)
    third._refresh = lambda: None  # measured A too, at the same time: the file's A wins
    kept = third.decide(GPU_LIKE, KIND, Changing(0.5), change=True, model=A)
    assert (kept.change, kept.source) == (0.03, pays.KEPT) and file_entry(tmp_path)["changes"] == {A: 0.03, B: 0.4}
    assert first.decide(GPU_LIKE, KIND, Changing(0.9), change=True, model=B).change == 0.4  # read from the file


def test_measure_again_replaces_the_models_change_and_keeps_the_others(tmp_path):
    decisions = store(tmp_path)
    decisions.decide(GPU_LIKE, KIND, Changing(0.03), change=True, model=A)
    decisions.decide(GPU_LIKE, KIND, Changing(0.4), change=True, model=B)
    again = decisions.decide(GPU_LIKE, KIND, Changing(0.05), change=True, model=A, fresh=True)
    assert (again.change, again.source) == (0.05, pays.MEASURED)
    assert file_entry(tmp_path)["changes"] == {A: 0.05, B: 0.4}


def test_entries_whose_changes_are_not_numbers_per_fingerprint_are_not_decisions():
    entry = {"reduce": True, "full_ms": 1.0, "reduced_ms": 0.5}
    text = json.dumps({"format": 1, "decisions": {
        "a": {**entry, "changes": {A: 0.1, B: None}}, "b": {**entry, "changes": []},
        "c": {**entry, "changes": {A: "much"}}, "d": {**entry, "changes": {A: -1}}}})
    usable, unusable = pays.read_entries(text)
    assert sorted(usable) == ["a"] and unusable == 3


def block(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8, bias=False))


def test_the_fingerprint_is_the_weights_values_not_the_objects():
    one, two = block(), block()
    assert fingerprint.module_fingerprint(one) == fingerprint.module_fingerprint(two)  # another object, same weights
    with torch.no_grad():
        two[2].weight.mul_(3.0)  # sharper: another model
    assert fingerprint.module_fingerprint(one) != fingerprint.module_fingerprint(two)
    assert fingerprint.module_fingerprint(one) != fingerprint.module_fingerprint(block(seed=1))
    assert fingerprint.module_fingerprint(one) != fingerprint.module_fingerprint(copy.deepcopy(one).to(torch.bfloat16))  # the dtype
    # a patch's strength and tensors count: (strength, adapter-like, strength_model, offset, function)
    up = torch.randn(64, 2)
    base = [("w", one[2].weight)]
    assert fingerprint.fingerprint(base + [("p", (1.0, (up,), 1.0, None, None))]) != \
        fingerprint.fingerprint(base + [("p", (0.5, (up,), 1.0, None, None))]) != fingerprint.fingerprint(base)
    assert len(fingerprint.sampled(torch.zeros(10_000))[2]) == fingerprint.SAMPLES


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the same weights on another device")
def test_the_fingerprint_is_the_same_on_every_device():
    assert fingerprint.module_fingerprint(block()) == fingerprint.module_fingerprint(block().cuda())
