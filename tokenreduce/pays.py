"""Where token reduction pays for itself (``reduce_when auto``), decided by measurement on the
device the model runs on.

Why measure: whether fewer keys make a call faster depends on the device, the attention kernel,
the shapes and the model width, not on one threshold. A fixed rule (no reduction below 128x128
tokens, from SD1.5/SDXL on one H100) threw away measured gains elsewhere on that same H100
(bf16, SDPA, one forward, plain 2x2 key/value subsampling in every block):

    Wan 2.1 1.3B 480p 33 frames (14,040 tokens): attention 42 % of the forward, 1.32x, left alone
    Wan 2.1 1.3B 480p 81 frames (32,760 tokens): 62 %, 1.78x, reduced
    Flux.1 1024 px (4,096 tokens): 18 %, 1.02x;  Flux.1 2048 px (16,384 tokens): 38 %, 1.32x
    SD1.5 768 px (96x96 at level 1): 0.67-0.94x;  SDXL 2048 px (128x128 at level 2): 1.13x

and nobody knows where the line lies on an RTX 3060, a 5090, ROCm or Apple GPUs.

How: the first time a patch meets a *kind* of call (what decides its speed: the shapes, the
dtype, the attention backend, the reduction), it hands this module two pieces of work: the unit
of the model it changes, run as it would run unreduced and as it runs reduced, through the real
patch (our own pooling, index selects and Python included). Both are timed on the device,
synchronised, interleaved after a warm-up, and the reduction is kept only where the reduced work
is faster by ``MARGIN``. A decision is made once per kind and kept for the process and in a JSON
file (keyed by device name, torch version, pack version and the kind), so the same workflow on
the same machine gives the same images on every run and after a restart; removing the file (or
``reduce_when`` "auto (measure again)") measures anew.

CPUs are not measured by default: there a forward is bound by arithmetic, not by kernel launches,
and every size we measured gained (SD1.5 512 px, 64x64 tokens: 1.13x-1.19x on 2 cores; DiTs
1.04x-2.17x); ``Decisions(measure_cpu=True)`` measures them too (the benchmark does, to show it).

Host-free: the host gives the path of the file; the patches give the work.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from .methods import REDUCE_ALWAYS, REDUCE_REMEASURE
from .version import VERSION

LOG = logging.getLogger("tokenreduce")

MARGIN = 0.03  # the reduced work must be at least this much faster
WARMUP = 1  # untimed runs of each work first (kernel selection, caches, autotuning)
REPEATS = 5  # timed runs of each work, interleaved; the median counts
FILE_FORMAT = 1

# How a decision came about (the report says it).
MEASURED, KEPT, CPU, FAILED = "measured", "kept", "cpu", "failed"


class Decision(NamedTuple):
    reduce: bool
    full_ms: float | None  # the unreduced work, per run (None: not measured)
    reduced_ms: float | None
    source: str  # MEASURED (now), KEPT (earlier, from memory or the file), CPU, FAILED
    seconds: float = 0.0  # what measuring cost here (0 unless MEASURED)
    error: str = ""  # FAILED: why


class Work(NamedTuple):
    """What a patch hands over to be timed: each named piece of work is a callable run without
    arguments; ``reduced_ms(times)`` and ``full_ms(times)`` combine their times (milliseconds per
    run) into the two sides of the decision."""

    runs: dict  # name -> callable
    full_ms: Callable[[dict], float]
    reduced_ms: Callable[[dict], float]


def pair(full: Callable, reduced: Callable) -> Work:
    """The common case: one unreduced and one reduced piece of work."""
    return Work({"full": full, "reduced": reduced}, lambda t: t["full"], lambda t: t["reduced"])


def synchronizer(device: torch.device) -> Callable[[], None]:
    """Waits for the device's queued work (CUDA and ROCm, XPU, MPS, ...); nothing on the CPU."""
    if device.type == "cpu":
        return lambda: None
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        return lambda: accelerator.synchronize(device)
    backend = getattr(torch, device.type, None)
    sync = getattr(backend, "synchronize", None)
    return (lambda: sync()) if sync is not None else (lambda: None)


class Stopwatch:
    """Times one run of a piece of work on a device, synchronised before and after."""

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter):
        self.sync = synchronizer(device)
        self.clock = clock

    def __call__(self, name: str, work: Callable) -> float:
        self.sync()
        start = self.clock()
        work()
        self.sync()
        return self.clock() - start


def time_work(work: Work, stopwatch: Callable[[str, Callable], float], warmup: int = WARMUP,
              repeats: int = REPEATS) -> dict:
    """Median milliseconds per run of each piece of work, timed interleaved."""
    for _ in range(warmup):
        for run in work.runs.values():
            run()
    samples = {name: [] for name in work.runs}
    for _ in range(repeats):
        for name, run in work.runs.items():
            samples[name].append(stopwatch(name, run))
    return {name: 1000.0 * statistics.median(times) for name, times in samples.items()}


def device_name(device: torch.device) -> str:
    """What the decisions file calls a device: its model name where torch knows it."""
    if device.type == "cpu":
        return f"cpu {platform.machine()} {platform.processor()}".strip()
    backend = getattr(torch, device.type, None)
    try:
        return f"{device.type} {backend.get_device_name(device)}"
    except Exception:  # noqa: BLE001 - MPS and others have no name query: the type must do
        return device.type


class Decisions:
    """Decisions of the auto rule, kept in memory for the process and in a JSON file.

    Thread-safe: a kind met by two threads at once is measured once. The file is read again when
    it changed or vanished (a removed file measures anew without a restart), and written whole
    (atomically) after each new decision; an unreadable file is said and replaced."""

    def __init__(self, path: Path | None, measure_cpu: bool = False, margin: float = MARGIN,
                 stopwatch: Callable[[torch.device], Callable] = Stopwatch, warmup: int = WARMUP,
                 repeats: int = REPEATS):
        self.path = Path(path) if path is not None else None
        self.measure_cpu = measure_cpu
        self.margin = margin
        self.stopwatch = stopwatch  # device -> stopwatch(name, work) -> seconds
        self.warmup = warmup
        self.repeats = repeats
        self._lock = threading.RLock()
        self._kept: dict = {}  # key -> stored entry (dict)
        self._file_state = None  # (mtime_ns, size) of the file as last read or written; None: none
        self._names: dict = {}  # device -> device_name
        self.log: list = []  # (site, Decision) of every kind this store measured, in order (benchmarks read it)

    @property
    def measurements(self) -> int:
        return len(self.log)

    def measures(self, device: torch.device) -> bool:
        return device.type != "cpu" or self.measure_cpu

    def key(self, device: torch.device, kind: tuple) -> str:
        name = self._names.get(device)
        if name is None:
            name = self._names[device] = device_name(device)
        return json.dumps([name, torch.__version__, VERSION, *kind], separators=(",", ":"))

    def decide(self, device: torch.device, kind: tuple, work: Callable[[], Work], site: str = "",
               fresh: bool = False) -> Decision:
        """Whether to reduce calls of ``kind`` on ``device``: kept, or measured now with the work
        ``work()`` builds (only built when measuring). ``fresh``: measure even if kept."""
        if not self.measures(device):
            return Decision(True, None, None, CPU)
        key = self.key(device, kind)
        with self._lock:
            self._refresh()
            entry = None if fresh else self._kept.get(key)
            if entry is not None:
                return Decision(entry["reduce"], entry["full_ms"], entry["reduced_ms"], KEPT)
            decision = self._measure(device, work)
            if decision.source == MEASURED:
                self.log.append((site, decision))
                self._kept[key] = {"reduce": decision.reduce, "full_ms": decision.full_ms,
                                   "reduced_ms": decision.reduced_ms, "site": site,
                                   "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
                self._save()
            return decision

    def _measure(self, device: torch.device, build: Callable[[], Work]) -> Decision:
        start = time.perf_counter()
        try:
            with torch.no_grad():
                work = build()
                times = time_work(work, self.stopwatch(device), self.warmup, self.repeats)
            full, reduced = work.full_ms(times), work.reduced_ms(times)
        except Exception as problem:  # noqa: BLE001 - a failed measurement must not fail the run
            LOG.warning("TokenReduce: could not measure whether reduction pays (%s: %s); reducing as set.",
                        type(problem).__name__, problem)
            return Decision(True, None, None, FAILED, time.perf_counter() - start, f"{type(problem).__name__}: {problem}")
        # Rounded as the file keeps them: a kept decision reads the same as when it was measured.
        return Decision(reduced < full * (1.0 - self.margin), round(full, 4), round(reduced, 4), MEASURED,
                        time.perf_counter() - start)

    # --- the file ------------------------------------------------------------------------------
    def _stat(self):
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return (stat.st_mtime_ns, stat.st_size)

    def _refresh(self) -> None:
        if self.path is None:
            return
        state = self._stat()
        if state == self._file_state:
            return
        self._file_state = state
        self._kept = self._read() if state is not None else {}

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if data.get("format") != FILE_FORMAT or not isinstance(data.get("decisions"), dict):
                raise ValueError(f"not a format-{FILE_FORMAT} decisions file")
            return {key: entry for key, entry in data["decisions"].items()
                    if isinstance(entry, dict) and {"reduce", "full_ms", "reduced_ms"} <= entry.keys()}
        except (OSError, ValueError) as problem:
            LOG.warning("TokenReduce: ignoring the auto rule's decisions in %s (%s); they will be measured again "
                        "and the file rewritten.", self.path, problem)
            return {}

    def _save(self) -> None:
        if self.path is None:
            return
        # Another process may have added decisions since we read the file: keep them too.
        current = self._read() if self._stat() not in (None, self._file_state) else {}
        merged = {**current, **self._kept}
        data = {"format": FILE_FORMAT, "about": "TokenReduce reduce_when auto: measured decisions per device and "
                "kind of call. Delete this file to measure again.", "decisions": merged}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            temporary.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
            os.replace(temporary, self.path)
        except OSError as problem:
            LOG.warning("TokenReduce: could not keep the auto rule's decisions in %s (%s); they hold for this "
                        "process only.", self.path, problem)
            return
        self._kept = merged
        self._file_state = self._stat()


def auto_rule(reduce_when: str, decisions: Decisions) -> AutoRule | None:
    """The rule a node's ``reduce_when`` asks for: None for always (reduce wherever set)."""
    if reduce_when == REDUCE_ALWAYS:
        return None
    return AutoRule(decisions, remeasure=reduce_when == REDUCE_REMEASURE)


class AutoRule:
    """``reduce_when`` of one node output: auto (a store of decisions) or, with ``remeasure``,
    auto that measures each kind anew the first time this node output meets it."""

    def __init__(self, decisions: Decisions, remeasure: bool = False):
        self.decisions = decisions
        self.remeasure = remeasure
        self._remeasured: set = set()
        self._lock = threading.Lock()

    def __deepcopy__(self, memo):
        return self

    def decide(self, device: torch.device, kind: tuple, work: Callable[[], Work], site: str) -> Decision:
        fresh = False
        if self.remeasure:
            with self._lock:
                fresh = (device, kind) not in self._remeasured
                self._remeasured.add((device, kind))
        return self.decisions.decide(device, kind, work, site, fresh=fresh)
