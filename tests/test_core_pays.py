"""The auto rule's decisions (tokenreduce/pays.py), torch only: timed with a fake clock, decided
with the margin, kept in memory and in a file, measured again when asked or when the file goes,
safe under threads; the CPU reduces without measuring unless told to measure."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from tokenreduce import pays
from tokenreduce.methods import REDUCE_ALWAYS, REDUCE_AUTO, REDUCE_REMEASURE
from tokenreduce.version import VERSION

CPU = torch.device("cpu")
GPU_LIKE = torch.device("meta")  # a device that is not the CPU: measured by default
KIND = ("unet", "SD15", 1, 96, 96, "torch.float16", "ToDo", 2.0, "nearest")


class FakeClock:
    """Stopwatch factory: every kind takes (full ms, reduced ms); counts the runs it timed."""

    def __init__(self, full: float, reduced: float):
        self.times = {"full": full / 1000.0, "reduced": reduced / 1000.0}
        self.timed = []

    def __call__(self, device):
        def stopwatch(name, work):
            work()
            self.timed.append(name)
            return self.times[name]
        return stopwatch


class Built:
    """A work builder that counts how often it was built and run."""

    def __init__(self):
        self.builds = 0
        self.runs = {"full": 0, "reduced": 0}

    def __call__(self) -> pays.Work:
        self.builds += 1

        def run(name):
            def go():
                self.runs[name] += 1
            return go
        return pays.pair(run("full"), run("reduced"))


def store(tmp_path: Path | None, full=10.0, reduced=8.0, **options) -> pays.Decisions:
    path = None if tmp_path is None else tmp_path / "tokenreduce" / "auto_decisions.json"
    return pays.Decisions(path, stopwatch=FakeClock(full, reduced), **options)


@pytest.mark.parametrize("reduced,reduces", [(8.0, True), (9.6, True), (9.8, False), (10.0, False), (12.0, False)])
def test_reduces_only_where_the_reduced_work_is_three_percent_faster(reduced, reduces):
    decision = store(None, 10.0, reduced).decide(GPU_LIKE, KIND, Built())
    assert decision.reduce is reduces
    assert (decision.full_ms, decision.reduced_ms, decision.source) == (10.0, reduced, pays.MEASURED)


def test_both_works_run_after_a_warm_up_and_are_timed_interleaved():
    decisions = store(None)
    built = Built()
    decisions.decide(GPU_LIKE, KIND, built)
    assert built.builds == 1 and built.runs == {"full": pays.WARMUP + pays.REPEATS, "reduced": pays.WARMUP + pays.REPEATS}
    assert decisions.stopwatch.timed == ["full", "reduced"] * pays.REPEATS


def test_the_median_counts():
    samples = iter([0.010, 0.008, 0.500, 0.008, 0.010, 0.300, 0.010, 0.008, 0.011, 0.009])  # outliers on both sides
    times = pays.time_work(pays.pair(lambda: None, lambda: None), lambda name, work: next(samples), warmup=0)
    assert times == {"full": pytest.approx(10.0), "reduced": pytest.approx(8.0)}


def test_a_decision_is_kept_and_the_work_not_built_again(tmp_path):
    decisions = store(tmp_path)
    decisions.decide(GPU_LIKE, KIND, Built())
    again = Built()
    decision = decisions.decide(GPU_LIKE, KIND, again)
    assert (decision.reduce, decision.full_ms, decision.reduced_ms, decision.source) == (True, 10.0, 8.0, pays.KEPT)
    assert again.builds == 0 and decisions.measurements == 1
    other = decisions.decide(GPU_LIKE, KIND[:-1] + ("average",), Built())  # another kind: measured
    assert other.source == pays.MEASURED and decisions.measurements == 2


def test_the_file_is_keyed_by_device_torch_pack_and_kind_and_read_by_the_next_process(tmp_path):
    store(tmp_path).decide(GPU_LIKE, KIND, Built(), site="downsample 1 (96×96)")
    path = tmp_path / "tokenreduce" / "auto_decisions.json"
    data = json.loads(path.read_text())
    (key, entry), = data["decisions"].items()
    assert json.loads(key) == [pays.device_name(GPU_LIKE), torch.__version__, VERSION, *KIND]
    assert entry["reduce"] is True and entry["full_ms"] == 10.0 and entry["site"] == "downsample 1 (96×96)"
    restarted = store(tmp_path, 10.0, 50.0)  # a new process: its clock would say otherwise
    built = Built()
    assert restarted.decide(GPU_LIKE, KIND, built).source == pays.KEPT and built.builds == 0


def test_removing_the_file_measures_again_without_a_restart(tmp_path):
    decisions = store(tmp_path)
    decisions.decide(GPU_LIKE, KIND, Built())
    (tmp_path / "tokenreduce" / "auto_decisions.json").unlink()
    assert decisions.decide(GPU_LIKE, KIND, Built()).source == pays.MEASURED and decisions.measurements == 2


def test_an_unreadable_file_is_said_measured_again_and_rewritten(tmp_path, caplog):
    path = tmp_path / "tokenreduce" / "auto_decisions.json"
    path.parent.mkdir(parents=True)
    path.write_text("{ not json")
    with caplog.at_level(logging.WARNING, logger="tokenreduce"):
        decision = store(tmp_path).decide(GPU_LIKE, KIND, Built())
    assert decision.source == pays.MEASURED and "ignoring" in caplog.text
    assert json.loads(path.read_text())["format"] == pays.FILE_FORMAT


def test_decisions_of_another_process_written_meanwhile_are_kept(tmp_path):
    first, second = store(tmp_path), store(tmp_path)
    first.decide(GPU_LIKE, KIND, Built())
    second.decide(GPU_LIKE, KIND[:-1] + ("average",), Built())  # read the file, then added its own
    time.sleep(0.01)
    first.decide(GPU_LIKE, KIND[:-1] + ("bilinear",), Built())
    assert len(json.loads((tmp_path / "tokenreduce" / "auto_decisions.json").read_text())["decisions"]) == 3


def test_an_unwritable_place_keeps_decisions_for_the_process(tmp_path, caplog):
    blocker = tmp_path / "tokenreduce"
    blocker.write_text("a file where the folder should be")
    decisions = store(tmp_path)
    with caplog.at_level(logging.WARNING, logger="tokenreduce"):
        assert decisions.decide(GPU_LIKE, KIND, Built()).reduce
    assert "for this process only" in caplog.text
    assert decisions.decide(GPU_LIKE, KIND, Built()).source == pays.KEPT


def test_measure_again_measures_each_kind_once_per_rule_and_replaces_the_kept_decision(tmp_path):
    decisions = store(tmp_path)
    decisions.decide(GPU_LIKE, KIND, Built())
    decisions.stopwatch.times["reduced"] = 0.012  # the device got slower at this kind
    rule = pays.auto_rule(REDUCE_REMEASURE, decisions)
    assert rule.decide(GPU_LIKE, KIND, Built(), "site").source == pays.MEASURED
    assert rule.decide(GPU_LIKE, KIND, Built(), "site").source == pays.KEPT
    assert store(tmp_path).decide(GPU_LIKE, KIND, Built()).reduce is False  # the file holds the new decision


def test_the_options_of_reduce_when():
    decisions = store(None)
    assert pays.auto_rule(REDUCE_ALWAYS, decisions) is None
    assert pays.auto_rule(REDUCE_AUTO, decisions).remeasure is False
    assert pays.auto_rule(REDUCE_REMEASURE, decisions).remeasure is True


def test_the_cpu_reduces_without_measuring_unless_told():
    built = Built()
    decision = store(None, 10.0, 50.0).decide(CPU, KIND, built)
    assert (decision.reduce, decision.source, built.builds) == (True, pays.CPU, 0)
    assert store(None, 10.0, 50.0, measure_cpu=True).decide(CPU, KIND, Built()).reduce is False


def test_a_failed_measurement_reduces_as_set_says_why_and_is_not_kept(caplog):
    def broken():
        raise RuntimeError("out of memory")
    decisions = store(None)
    with caplog.at_level(logging.WARNING, logger="tokenreduce"):
        decision = decisions.decide(GPU_LIKE, KIND, broken)
    assert (decision.reduce, decision.source, decision.error) == (True, pays.FAILED, "RuntimeError: out of memory")
    assert "could not measure" in caplog.text
    assert decisions.decide(GPU_LIKE, KIND, Built()).source == pays.MEASURED


def test_a_kind_met_by_several_threads_at_once_is_measured_once(tmp_path):
    decisions = pays.Decisions(tmp_path / "d.json", stopwatch=lambda device: (lambda name, work: (work(), 0.001)[1]))
    barrier = threading.Barrier(4)
    built = Built()
    results = []

    def meet():
        barrier.wait()
        results.append(decisions.decide(GPU_LIKE, KIND, built).source)

    threads = [threading.Thread(target=meet) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert built.builds == 1 and sorted(results) == [pays.KEPT] * 3 + [pays.MEASURED]


def test_the_real_stopwatch_times_on_the_cpu():
    decision = pays.Decisions(None, measure_cpu=True).decide(
        CPU, KIND, lambda: pays.pair(lambda: time.sleep(0.004), lambda: time.sleep(0.001)))
    assert decision.reduce and decision.full_ms > decision.reduced_ms > 0.5
    assert 0 < decision.seconds < 1


def test_the_pack_version_is_the_one_pyproject_declares():
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == VERSION
