"""The auto rule's decisions (tokenreduce/pays.py), torch only: timed with a fake clock, decided
with the margin, kept in memory and in a file, measured again when asked or when the file goes,
safe under threads; the CPU reduces without measuring unless told to measure."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
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
    runs = pays.WARMUP + 1 + pays.REPEATS  # warm-up, one calibrating timing, the timed runs
    assert built.builds == 1 and built.runs == {"full": runs, "reduced": runs}
    assert decisions.stopwatch.timed == ["full", "reduced"] * (1 + pays.REPEATS)


def test_the_median_counts():
    samples = iter([0.010, 0.008, 0.010, 0.008, 0.500, 0.008, 0.010, 0.300, 0.010, 0.008, 0.011, 0.009])  # outliers on both sides
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
    assert json.loads(key) == [pays.device_name(GPU_LIKE), VERSION, f"torch {torch.__version__}", *pays.runtime()[1:],
                               *KIND]
    assert entry["reduce"] is True and entry["full_ms"] == 10.0 and entry["site"] == "downsample 1 (96×96)"
    restarted = store(tmp_path, 10.0, 50.0)  # a new process: its clock would say otherwise
    built = Built()
    assert restarted.decide(GPU_LIKE, KIND, built).source == pays.KEPT and built.builds == 0


def test_removing_the_file_measures_again_without_a_restart(tmp_path):
    decisions = store(tmp_path)
    decisions.decide(GPU_LIKE, KIND, Built())
    (tmp_path / "tokenreduce" / "auto_decisions.json").unlink()
    assert decisions.decide(GPU_LIKE, KIND, Built()).source == pays.MEASURED and decisions.measurements == 2


@pytest.mark.parametrize("text", [
    "{ not json", '{"format": 1, "decisions": {"a": {"reduce": tr', "[]", "null", '"text"', "3",
    '{"format": 1, "decisions": []}', '{"format": "1", "decisions": {}}', '{"decisions": {}}',
    '{"format": 2, "decisions": {}, "more": "a newer pack"}', b"\xff\xfe not utf-8"])
def test_a_file_it_cannot_use_is_said_once_measured_in_memory_and_left_as_it_is(tmp_path, caplog, text):
    """Wrong shape (valid JSON that is a list, null, ...), truncated, not text, or written by a
    newer pack version: never fails a run, says so once, keeps decisions in memory."""
    path = tmp_path / "tokenreduce" / "auto_decisions.json"
    path.parent.mkdir(parents=True)
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    decisions = store(tmp_path)
    with caplog.at_level(logging.WARNING, logger="tokenreduce"):
        first = decisions.decide(GPU_LIKE, KIND, Built())
        other = decisions.decide(GPU_LIKE, KIND[:-1] + ("average",), Built())
        again = decisions.decide(GPU_LIKE, KIND, Built())
    assert (first.source, other.source, again.source) == (pays.MEASURED, pays.MEASURED, pays.KEPT)
    assert caplog.text.count("cannot use the auto rule's decisions file") == 1 and str(path) in caplog.text
    assert (path.read_bytes() if isinstance(text, bytes) else path.read_text()) == text  # untouched
    assert sorted(p.name for p in path.parent.iterdir()) == ["auto_decisions.json"]  # no temporary file


def test_entries_of_the_wrong_types_are_ignored_once_and_the_rest_kept(tmp_path, caplog):
    decisions = store(tmp_path)
    decisions.decide(GPU_LIKE, KIND, Built())
    path = tmp_path / "tokenreduce" / "auto_decisions.json"
    data = json.loads(path.read_text())
    good = next(iter(data["decisions"]))
    data["decisions"].update({"x": [], "y": {"reduce": "yes", "full_ms": 1, "reduced_ms": 1},
                              "z": {"reduce": True, "full_ms": "1", "reduced_ms": None}})
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="tokenreduce"):
        restarted = store(tmp_path, 10.0, 50.0)
        assert restarted.decide(GPU_LIKE, KIND, Built()).source == pays.KEPT
        restarted.decide(GPU_LIKE, KIND[:-1] + ("average",), Built())
    assert caplog.text.count("ignoring 3 entries") == 1
    assert good in json.loads(path.read_text())["decisions"]


def test_an_unreadable_file_never_fails_a_run(tmp_path, caplog):
    path = tmp_path / "tokenreduce" / "auto_decisions.json"
    path.mkdir(parents=True)  # a folder where the file should be: reading it fails with an OSError
    with caplog.at_level(logging.WARNING, logger="tokenreduce"):
        decisions = store(tmp_path)
        assert decisions.decide(GPU_LIKE, KIND, Built()).source == pays.MEASURED
        assert decisions.decide(GPU_LIKE, KIND, Built()).source == pays.KEPT
    assert caplog.text.count("TokenReduce:") == 1


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes read-only folders")
def test_a_read_only_folder_keeps_decisions_in_memory_and_leaves_no_temporary_file(tmp_path, caplog):
    folder = tmp_path / "tokenreduce"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with caplog.at_level(logging.WARNING, logger="tokenreduce"):
            decisions = store(tmp_path)
            decisions.decide(GPU_LIKE, KIND, Built())
            decisions.decide(GPU_LIKE, KIND[:-1] + ("average",), Built())
        assert caplog.text.count("for this process only") == 1 and list(folder.iterdir()) == []
    finally:
        folder.chmod(0o700)


def test_a_failed_write_leaves_no_temporary_file(tmp_path, caplog, monkeypatch):
    def refuse(*args):
        raise PermissionError("read-only file system")
    monkeypatch.setattr(pays.os, "replace", refuse)
    decisions = store(tmp_path)
    with caplog.at_level(logging.WARNING, logger="tokenreduce"):
        assert decisions.decide(GPU_LIKE, KIND, Built()).source == pays.MEASURED
    left = [p.name for p in (tmp_path / "tokenreduce").iterdir()]
    assert "for this process only" in caplog.text and left in ([], [LOCK])  # filelock's lock file, no temporary
    assert decisions.decide(GPU_LIKE, KIND, Built()).source == pays.KEPT


def test_a_decision_made_in_a_process_stays_when_another_process_writes_another(tmp_path):
    """Two processes on one file: neither switches to the other's decision of a kind it already
    uses; in the file the first decision of a kind wins."""
    path = tmp_path / "tokenreduce" / "auto_decisions.json"
    first, second = store(tmp_path, 10.0, 8.0), store(tmp_path, 10.0, 12.0)
    second.decide(GPU_LIKE, KIND[:-1] + ("average",), Built())  # second has read the (empty) file
    assert first.decide(GPU_LIKE, KIND, Built()).reduce is True  # first writes its decision
    assert second.decide(GPU_LIKE, KIND, Built()).reduce is True  # ... which second reads: not measured
    time.sleep(0.01)
    data = json.loads(path.read_text())
    key = first.key(GPU_LIKE, KIND)
    data["decisions"][key]["reduce"] = False  # someone changes the file
    path.write_text(json.dumps(data))
    assert first.decide(GPU_LIKE, KIND, Built()).reduce is True and second.decide(GPU_LIKE, KIND, Built()).reduce


def test_on_merge_the_first_decision_of_a_kind_wins(tmp_path):
    path = tmp_path / "tokenreduce" / "auto_decisions.json"
    first, second = store(tmp_path, 10.0, 8.0), store(tmp_path, 10.0, 12.0)
    first.decide(GPU_LIKE, KIND[:-1] + ("x",), Built())
    second.decide(GPU_LIKE, KIND[:-1] + ("y",), Built())
    assert first.decide(GPU_LIKE, KIND, Built()).reduce is True
    second._refresh = lambda: None  # second measured at the same time: it had not read first's yet
    lost = second.decide(GPU_LIKE, KIND, Built())
    # It lost the race: it uses the file's decision from this run on, as it will after a restart.
    assert (lost.reduce, lost.full_ms, lost.reduced_ms, lost.source) == (True, 10.0, 8.0, pays.KEPT)
    del second._refresh
    assert second.decide(GPU_LIKE, KIND, Built()).reduce is True
    assert store(tmp_path, 10.0, 12.0).decide(GPU_LIKE, KIND, Built()).reduce is True  # restarted: the same
    entry = json.loads(path.read_text())["decisions"][first.key(GPU_LIKE, KIND)]
    assert entry["reduce"] is True and len(json.loads(path.read_text())["decisions"]) == 3


def test_two_processes_measuring_at_once_keep_one_valid_file_with_every_kind(tmp_path):
    """Two real processes decide 20 kinds each at the same moment, 10 of them shared, on one file."""
    path = tmp_path / "auto_decisions.json"
    start = time.time() + 1.5
    script = Path(__file__).with_name("decisions_process.py")
    workers = [subprocess.Popen([sys.executable, str(script), str(path), str(start), name, reduced],
                                stdout=subprocess.PIPE, text=True, cwd=str(script.parents[1]))
               for name, reduced in (("a", "8.0"), ("b", "12.0"))]
    outputs = [json.loads(worker.communicate(timeout=60)[0]) for worker in workers]
    assert all(worker.returncode == 0 for worker in workers)
    decisions = json.loads(path.read_text())["decisions"]
    assert len(decisions) == 30 and sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK) == [
        "auto_decisions.json"]
    for output in outputs:  # each process kept what it decided or read first, for all its runs
        assert output["first"] == output["again"]
    # Each kind's entry is one process's whole decision, as its clock made it (10 ms unreduced; a:
    # 8 ms reduced, so reduce; b: 12 ms, so not), never a mix of the two.
    made = {"a": (True, 10.0, 8.0), "b": (False, 10.0, 12.0)}
    entry = {key: (value["reduce"], value["full_ms"], round(value["reduced_ms"], 6)) for key, value in decisions.items()}
    for name, decision in made.items():
        own = [entry[key] for key in decisions if f'"{name} ' in key]
        assert own == [decision] * 10, name
    shared = [entry[key] for key in decisions if '"shared' in key]
    assert len(shared) == 10 and all(decision in made.values() for decision in shared), shared
    # The one that lost the race for a shared kind uses the winner's decision, as after a restart.
    in_file = {json.loads(key)[-1]: value["reduce"] for key, value in decisions.items() if '"shared' in key}
    assert all(output["first"][:10] == [in_file[f"shared {i}"] for i in range(10)] for output in outputs)


LOCK = ".auto_decisions.json.lock"  # the lock file beside the decisions (filelock's, on every OS)


def test_the_file_is_written_under_a_filelock_lock_on_every_os(tmp_path):
    """Writers exclude each other through filelock (locks on Windows too), not POSIX flock."""
    import ast

    import filelock

    for source in Path(pays.__file__).parent.rglob("*.py"):
        tree = ast.parse(source.read_text(encoding="utf-8"))
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "fcntl" not in imported, source
    decisions = store(tmp_path)
    (tmp_path / "tokenreduce").mkdir()
    finished = threading.Event()
    with filelock.FileLock(str(tmp_path / "tokenreduce" / LOCK)):  # another writer holds it: ours waits
        worker = threading.Thread(target=lambda: (decisions.decide(GPU_LIKE, KIND, Built()), finished.set()))
        worker.start()
        assert not finished.wait(0.5) and not (tmp_path / "tokenreduce" / "auto_decisions.json").exists()
    worker.join(10)
    assert finished.is_set() and (tmp_path / "tokenreduce" / "auto_decisions.json").exists()


class OverheadClock:
    """A device where a timing costs 50 µs of synchronisation beyond the runs it times."""

    def __init__(self, costs: dict):
        self.costs = costs
        self.ran = 0

    def __call__(self, device):
        def stopwatch(name, work):
            self.ran = 0
            work()
            return 0.00005 + self.ran * self.costs[name]
        return stopwatch

    def work(self):
        def run():
            self.ran += 1
        return pays.pair(run, run)


def test_sub_millisecond_blocks_are_timed_by_their_runs_not_by_the_synchronisation():
    clock = OverheadClock({"full": 0.00002, "reduced": 0.00001})  # 20 µs and 10 µs a run
    decision = pays.Decisions(None, stopwatch=clock).decide(GPU_LIKE, KIND, clock.work)
    assert decision.full_ms == pytest.approx(0.02, rel=0.1) and decision.reduced_ms == pytest.approx(0.01, rel=0.1)


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


def test_a_failed_measurement_reduces_as_set_says_why_and_is_kept_for_the_process(caplog):
    def broken():
        raise RuntimeError("out of memory")
    decisions = store(None)
    with caplog.at_level(logging.WARNING, logger="tokenreduce"):
        decision = decisions.decide(GPU_LIKE, KIND, broken)
    assert (decision.reduce, decision.source, decision.error) == (True, pays.FAILED, "RuntimeError: out of memory")
    assert "could not measure" in caplog.text
    built = Built()  # not tried again (each run would pay the try), said again with its reason
    assert decisions.decide(GPU_LIKE, KIND, built) == decision._replace(seconds=0.0) and built.builds == 0
    assert decisions.decide(GPU_LIKE, KIND, built, fresh=True).source == pays.MEASURED  # measure again tries anew


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


# --- the quality budget (max_change, issue #46) ------------------------------------------------
class Changing:
    """A work builder whose reduced side changes the output by ``change`` (relative L2); its outputs
    are ``shape``d tensors, or DiT-block-like dicts of them; counts its builds and runs."""

    def __init__(self, change: float = 0.25, as_dict: bool = False):
        self.change, self.as_dict = change, as_dict
        self.builds = 0
        self.runs = {"full": 0, "reduced": 0}

    def __call__(self) -> pays.Work:
        self.builds += 1
        base = torch.arange(1.0, 13.0).reshape(3, 4)

        def run(name, value):
            def go():
                self.runs[name] += 1
                return {"img": value, "txt": value[:1]} if self.as_dict else value
            return go
        return pays.pair(run("full", base), run("reduced", base * (1.0 + self.change)))


def test_relative_change_compares_every_tensor_of_the_outputs():
    a, b = torch.ones(2, 3), torch.zeros(4)
    assert pays.relative_change(a, a * 1.5) == pytest.approx(0.5)
    both = pays.relative_change({"img": a, "txt": (b + 1.0,)}, {"img": a, "txt": (b + 2.0,)})
    assert both == pytest.approx((4 / 10) ** 0.5)
    assert pays.relative_change(torch.zeros(3), torch.zeros(3)) == 0.0
    with pytest.raises(ValueError, match="no tensor"):
        pays.relative_change(None, None)


@pytest.mark.parametrize("as_dict", [False, True])
def test_the_change_is_measured_with_the_speed_from_the_warm_up_run_and_kept(as_dict):
    built, plain = Changing(0.25, as_dict), Built()
    decisions = store(None, 10.0, 8.0)
    decision = decisions.decide(GPU_LIKE, KIND, built, change=True)
    assert decision.change == pytest.approx(0.25) and decision.reduce and decision.source == pays.MEASURED
    store(None, 10.0, 8.0).decide(GPU_LIKE, KIND, plain)
    assert built.runs == plain.runs  # the change read from the first warm-up run: no extra run
    kept = decisions.decide(GPU_LIKE, KIND, Changing(), change=True)
    assert (kept.source, kept.change) == (pays.KEPT, decision.change)


def test_the_budget_is_applied_when_the_decision_is_read_so_one_measurement_serves_every_budget():
    decisions = store(None, 10.0, 8.0)
    built = Changing(0.25)
    tight = pays.AutoRule(decisions, max_change=0.1).decide(GPU_LIKE, KIND, built, "site")
    assert not tight.reduce and tight.over_budget and (tight.change, tight.budget) == (0.25, 0.1)
    loose = pays.AutoRule(decisions, max_change=0.3).decide(GPU_LIKE, KIND, built, "site")
    assert loose.reduce and not loose.over_budget and loose.source == pays.KEPT and built.builds == 1
    off = pays.AutoRule(decisions).decide(GPU_LIKE, KIND, built, "site")
    assert off.reduce and off.budget == 0.0
    slow = store(None, 10.0, 9.9)  # speed says no: left alone whatever the budget; not for the change
    left = pays.AutoRule(slow, max_change=0.5).decide(GPU_LIKE, KIND, Changing(0.25), "site")
    assert not left.reduce and not left.over_budget
    assert pays.auto_rule(REDUCE_AUTO, decisions, max_change=0.2).max_change == 0.2
    assert pays.auto_rule(REDUCE_REMEASURE, decisions, per_process=True, max_change=0.2) is \
        decisions.remeasure_rule(0.2) is not decisions.remeasure_rule(0.0)


def test_the_change_is_kept_in_the_file_and_read_after_a_restart(tmp_path):
    store(tmp_path).decide(GPU_LIKE, KIND, Changing(0.25), site="downsample 1 (96×96)", change=True)
    path = tmp_path / "tokenreduce" / "auto_decisions.json"
    data = json.loads(path.read_text())
    assert data["format"] == 1 and [e["change"] for e in data["decisions"].values()] == [0.25]
    built = Changing(0.9)
    restarted = store(tmp_path).decide(GPU_LIKE, KIND, built, change=True)
    assert (restarted.source, restarted.change, built.builds) == (pays.KEPT, 0.25, 0)


def test_an_entry_kept_without_a_change_gets_the_change_alone_measured_untimed(tmp_path):
    store(tmp_path, 10.0, 8.0).decide(GPU_LIKE, KIND, Built())  # as an older version kept it: no change
    path = tmp_path / "tokenreduce" / "auto_decisions.json"
    assert "change" not in next(iter(json.loads(path.read_text())["decisions"].values()))
    assert store(tmp_path).decide(GPU_LIKE, KIND, Built()).source == pays.KEPT  # usable for speed
    clock = FakeClock(50.0, 1.0)
    completed = pays.Decisions(path, stopwatch=clock)
    built = Changing(0.4)
    decision = completed.decide(GPU_LIKE, KIND, built, change=True)
    assert clock.timed == [] and built.runs == {"full": 1, "reduced": 1}  # not timed again
    assert (decision.full_ms, decision.reduced_ms, decision.change, decision.source) == (10.0, 8.0, 0.4, pays.MEASURED)
    entry = next(iter(json.loads(path.read_text())["decisions"].values()))
    assert (entry["full_ms"], entry["change"]) == (10.0, 0.4)


def test_entries_with_a_change_that_is_no_number_are_not_decisions():
    entry = {"reduce": True, "full_ms": 1.0, "reduced_ms": 0.5}
    text = json.dumps({"format": 1, "decisions": {"a": entry, "b": {**entry, "change": 0.1},
                                                  "c": {**entry, "change": "much"}, "d": {**entry, "change": -1}}})
    usable, unusable = pays.read_entries(text)
    assert sorted(usable) == ["a", "b"] and unusable == 2


def test_on_the_cpu_a_budget_measures_the_change_untimed_and_keeps_it(tmp_path):
    clock = FakeClock(10.0, 8.0)
    decisions = pays.Decisions(tmp_path / "d.json", stopwatch=clock)
    built = Changing(0.25)
    assert pays.AutoRule(decisions).decide(CPU, KIND, built, "s").source == pays.CPU and built.builds == 0
    decision = pays.AutoRule(decisions, max_change=0.1).decide(CPU, KIND, built, "s")
    assert (decision.reduce, decision.full_ms, decision.change, decision.source) == (False, None, 0.25, pays.MEASURED)
    assert built.runs == {"full": 1, "reduced": 1} and clock.timed == []
    again = pays.AutoRule(decisions, max_change=0.5).decide(CPU, KIND, built, "s")
    assert (again.reduce, again.source, built.builds) == (True, pays.KEPT, 1)
    assert pays.Decisions(tmp_path / "d.json").decide(CPU, KIND, built, change=True).change == 0.25


def test_a_compare_builder_gives_the_change_where_the_timed_work_runs_on_other_inputs():
    def build():
        work = Built()()
        return work._replace(compare=lambda: (lambda: torch.ones(4), lambda: torch.ones(4) * 1.5))
    decision = store(None).decide(GPU_LIKE, KIND, build, change=True)
    assert decision.change == pytest.approx(0.5) and decision.full_ms == 10.0


def test_two_processes_measuring_a_kind_alike_without_a_budget_keep_it(tmp_path):
    """Issue #51, point 9: neither entry has a change (no budget), the times round alike: merging
    into the file must not fail the run (it raised KeyError: 'change' out of decide())."""
    first, second = store(tmp_path, 10.0, 8.0), store(tmp_path, 10.0, 8.0)
    assert first.decide(GPU_LIKE, KIND, Built()).source == pays.MEASURED  # first writes its decision, no change
    second._refresh = lambda: None  # second measured at the same time: it had not read first's yet
    decision = second.decide(GPU_LIKE, KIND, Built())
    assert (decision.reduce, decision.full_ms, decision.reduced_ms, decision.change) == (True, 10.0, 8.0, None)
    entry = json.loads((tmp_path / "tokenreduce" / "auto_decisions.json").read_text())["decisions"][first.key(
        GPU_LIKE, KIND)]
    assert (entry["reduce"], entry["full_ms"], entry["reduced_ms"]) == (True, 10.0, 8.0) and "change" not in entry
