"""Host-free tests of a run's state and report (tokenreduce/run.py) under ComfyUI's multi-GPU
split: work units on two devices, several worker threads noting at once, a decision per device."""

from __future__ import annotations

import threading

import pytest
import torch

from tokenreduce.pays import MEASURED, Decision
from tokenreduce.run import CallPatch, RunState
from tokenreduce.window import SigmaWindow

SCHEDULE = torch.tensor([3.0, 2.0, 1.0, 0.0])


class OnSecondDevice(torch.Tensor):
    """A CPU tensor that says it lives on a second device, as a work unit's sigmas on ``cuda:1``
    do: results of ops on it stay there, and ``torch.stack`` refuses to mix it with another
    device's tensors, as torch does with real devices; ``.cpu()`` brings it back."""

    @property
    def device(self):
        return torch.device("cuda", 1)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.stack and len({str(t.device) for t in args[0]}) > 1:
            raise RuntimeError("Expected all tensors to be on the same device")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func is torch.Tensor.cpu or not isinstance(out, torch.Tensor):
            return out
        return out.as_subclass(cls)


def test_the_report_reads_the_noise_levels_of_calls_on_two_devices():
    run = RunState(SigmaWindow(10.0, 0.0))
    run.reduced_sigmas = [torch.tensor([3.0]), torch.tensor([2.0]).as_subclass(OnSecondDevice),
                          torch.tensor([1.0]).as_subclass(OnSecondDevice)]
    report = run.report("ToDo", 0.0, 1.0, 1.0, True, SCHEDULE)
    assert report.active_steps == (1, 2, 3) and not report.warnings


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_report_reads_the_noise_levels_of_calls_on_the_cpu_and_a_gpu():
    run = RunState(SigmaWindow(10.0, 0.0))
    run.reduced_sigmas = [torch.tensor([3.0]), torch.tensor([2.0], device="cuda")]
    assert run.report("ToDo", 0.0, 1.0, 1.0, True, SCHEDULE).active_steps == (1, 2)


class Preempted(list):
    """A list whose membership test waits (briefly) before answering for a second thread to test too, as a
    free-threaded interpreter or a thread switch may interleave two threads between checking for
    a message and adding it. Where the callers hold a lock the second never comes: the wait times
    out and the barrier stays broken."""

    def __init__(self):
        super().__init__()
        self.meet = threading.Barrier(2, timeout=0.3)

    def __contains__(self, item):
        answer = super().__contains__(item)
        try:
            self.meet.wait()
        except threading.BrokenBarrierError:
            pass
        return answer


def test_warnings_and_notes_met_by_concurrent_workers_are_said_once():
    run = RunState(SigmaWindow(10.0, 0.0), warnings=Preempted())
    run.notes = Preempted()

    def meet():
        run.warn_once("a warning")
        run.note_once("a note")

    threads = [threading.Thread(target=meet) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert run.warnings == ["a warning"] and run.notes == ["a note"]


class PerDevice:
    """An auto rule whose decision depends on the device (two GPU models in one multi-GPU run)."""

    class decisions:
        where = "/somewhere/auto_decisions.json"

    def __init__(self, reduce_on: set):
        self.reduce_on = reduce_on

    def decide(self, device, kind, work, site, model=None, time_cpu=False, reach=1.0, budgeted=True, untimed=False):
        return Decision(str(device) in self.reduce_on, 10.0, 8.0, MEASURED)


@pytest.mark.parametrize("reduce_on,expected", [
    ({"cuda:0", "cuda:1"}, [("downsample 1 (32×32)", True)]),
    ({"cuda:0"}, [("downsample 1 (32×32) on cuda:0", True), ("downsample 1 (32×32) on cuda:1", False)]),
])
def test_the_report_shows_each_devices_decision_where_they_differ(reduce_on, expected):
    patch = CallPatch("tokenreduce.test", "ToDo", PerDevice(reduce_on))
    run = RunState(SigmaWindow(10.0, 0.0))
    for device in (torch.device("cuda", 0), torch.device("cuda", 1)):
        patch.pays(run, device, ("kind",), lambda: ("downsample 1 (32×32)", None))
    report = run.report("ToDo", 0.0, 1.0, 1.0, True, SCHEDULE)
    assert [(site, decision.reduce) for site, decision in report.decisions] == expected
    assert report.decisions_file == "/somewhere/auto_decisions.json"


@pytest.mark.parametrize("where,said", [("/somewhere/auto_decisions.json", "kept in /somewhere/auto_decisions.json"),
                                        ("", "kept for this process")])
def test_the_report_says_where_the_decisions_are_kept(where, said):
    from tokenreduce.describe import run_lines

    run = RunState(SigmaWindow(10.0, 0.0))
    run.decided("downsample 1 (32×32)", torch.device("cuda", 0), Decision(True, 10.0, 8.0, MEASURED, 0.5), where)
    lines = run_lines("ToDo", run.report("ToDo", 0.0, 1.0, 1.0, True, SCHEDULE))
    assert any(line.startswith("auto · measured 1 kind of call now in 0.50 s; ") and line.endswith(said)
               for line in lines), lines


def test_steps_are_distinct_noise_levels_and_kept_plans_serve_the_next_steps():
    """plan_every's bookkeeping: a step is a noise level (cond, uncond and windows at one level share
    it); what a planning call kept serves calls like it for ``every`` steps, then none; a new run
    keeps nothing."""
    from tokenreduce.run import ModelCall, plan_key

    run = RunState(SigmaWindow(10.0, 0.0))
    levels = [torch.tensor([3.0]), torch.tensor([3.0]), torch.tensor([2.0]), torch.tensor([1.0]), torch.tensor([0.5])]
    assert [run.step(s) for s in levels] == [0, 0, 1, 2, 3]
    x = torch.zeros(2, 4, 8, 8)
    cond, uncond = (ModelCall(x, None, {}, {"cond_or_uncond": rows}, levels[0]) for rows in ([0, 1], [1, 0]))
    assert plan_key(cond) != plan_key(uncond)
    assert plan_key(cond) != plan_key(ModelCall(x[:1], None, {}, {"cond_or_uncond": [0]}, levels[0]))
    plans = {"planned": True}
    run.keep_plans(plan_key(cond), 0, plans)
    assert [run.kept_plans(plan_key(cond), step, 3) for step in (0, 1, 2, 3)] == [plans, plans, plans, None]
    assert run.kept_plans(plan_key(uncond), 1, 3) is None
    assert RunState(SigmaWindow(10.0, 0.0)).kept_plans(plan_key(cond), 1, 3) is None


@pytest.mark.parametrize("values,problem", [
    ({"plan_every": 4, "share_plans": True}, None),
    ({"plan_every": 1}, None),
    ({"plan_every": 4}, "plan_every 4 reuses the shared plan across steps, and share_plans is off"),
    ({"plan_every": 0, "share_plans": True}, "plan_every 0 is out of range"),
])
def test_plan_every_needs_shared_plans(values, problem):
    from tokenreduce.methods import TOME

    said = TOME.problem({**TOME.defaults(), **values})
    assert (said is None) if problem is None else said.startswith(problem), said
    if problem is not None:
        with pytest.raises(ValueError, match="plan_every"):
            TOME.settings({**TOME.defaults(), **values})
