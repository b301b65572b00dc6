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
file (keyed by device name, pack version, the runtime: torch, its CUDA/ROCm build, the driver and
attention libraries where knowable, what the host adds: its version; and the kind, which names
the attention backend and whether the model is compiled), so the same workflow on the same machine
gives the same images on every run and after a restart; removing the file (or ``reduce_when``
"auto (measure again)") measures anew. A measurement that fails (out of memory, say) reduces as
set, is said in the report of every run that meets the kind, and is kept for the process: not
tried again every run. Measuring leaves no trace: the random number generators and the options
other packs keep state in are as they were (see ``untouched_rng`` and
``measure.measuring_options``), and a model call run again to capture a DiT block's inputs
(``tome_dit.captured_blocks``) runs below every host wrapper and every other pack's block
replacement, where caches keep their state.

CPUs are not timed by default: there a forward is bound by arithmetic, not by kernel launches,
and every size we measured gained (SD1.5 512 px, 64x64 tokens: 1.13x-1.19x on 2 cores; DiTs
1.04x-2.17x); ``Decisions(measure_cpu=True)`` times them too (the benchmark does, to show it).

The quality budget (``max_change``): the same reduction changes one model a hundredfold more than
another (trained weights against random ones), so the rule can also leave a kind of call alone where
reducing it changes the unit's output by more than a budget: ``change = ||reduced - full|| /
||full||`` (relative L2 over every tensor the unit returns), computed once, from the first
(warm-up) run of the two pieces of work the ``Work`` names (or, where the timed work runs on random
inputs, of the unit run on the call's own inputs: ``Work.compare``). The change is kept with the
speed in the same entry, per model: speed is a property of the shapes, the change one of the weights
(two models of one shape, a fine-tune, a LoRA'd clone, a second expert: each changes as much as its
own weights make it), so an entry keeps its changes under ``"changes"``, one per fingerprint of the
weights the measured unit runs with (``fingerprint.py``: a strided sample of each of its parameters,
hashed, LoRA and other weight patches included as each host's adapter reads them,
``ModelCall.fingerprint``), read once per run and kind where the rule decides (``decide``'s
``model``). The budget is applied when a decision is read (``within_budget``), so one measurement
serves every budget. An entry kept without a change for the model (an older file, measured with no
budget, another model of the shape, or an entry's ``"change"`` kept without a fingerprint: not
trusted for any model) is completed: the change alone is measured (untimed) and added under the
model's fingerprint. On a CPU, with a budget, the change is measured (each side run once, untimed)
and kept the same way; without one nothing is run there. The file's format is extended, not
changed: ``"changes"`` is an object of fingerprints to changes that older versions leave as it is;
a caller that names no model (``model`` None: none of the pack's patches) keeps the one shared
``"change"`` of earlier versions.

Host-free: the host gives the path of the file; the patches give the work.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import os
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from filelock import FileLock  # a dependency of torch: present wherever torch is; locks on every OS

from .methods import AUTO_MARGIN, REDUCE_ALWAYS, REDUCE_REMEASURE
from .version import VERSION

LOG = logging.getLogger("tokenreduce")

MARGIN = AUTO_MARGIN  # the reduced work must be at least this much faster (declared with reduce_when)
WARMUP = 1  # untimed runs of each work first (kernel selection, caches, autotuning)
REPEATS = 5  # timed runs of each work, interleaved; the median counts
LEAST_SECONDS = 0.005  # one timing lasts at least this long (sub-millisecond blocks run back to back)
MOST_RUNS = 256  # at most this many back-to-back runs per timing
FILE_FORMAT = 1
LOCK_SECONDS = 60  # the longest a process waits for the decisions file's lock

# How a decision came about (the report says it).
MEASURED, KEPT, CPU, FAILED = "measured", "kept", "cpu", "failed"


class Decision(NamedTuple):
    reduce: bool
    full_ms: float | None  # the unreduced work, per run (None: not measured)
    reduced_ms: float | None
    source: str  # MEASURED (now), KEPT (earlier, from memory or the file), CPU, FAILED (now or earlier in the process)
    seconds: float = 0.0  # what measuring cost here (0 unless MEASURED)
    error: str = ""  # FAILED: why
    change: float | None = None  # relative L2 change of the unit's output reduced (None: not measured)
    budget: float = 0.0  # the max_change the decision was read under (0: none); see ``within_budget``
    reach: float = 1.0  # the share of sampling the run covers (``window.schedule_reach``), read under

    @property
    def weighed_change(self) -> float | None:
        """The change as the budget weighs it in this run (``weighed_change``)."""
        return weighed_change(self.change, self.reach) if self.change is not None else None

    @property
    def over_budget(self) -> bool:
        """Left alone because reducing changes the unit's output, weighed by the run's reach, by more
        than the budget."""
        return self.budget > 0 and self.change is not None and self.weighed_change > self.budget


class Work(NamedTuple):
    """What a patch hands over to be timed: each named piece of work is a callable run without
    arguments; ``reduced_ms(times)`` and ``full_ms(times)`` combine their times (milliseconds per
    run) into the two sides of the decision. For the quality budget, ``outputs`` names the two runs
    (unreduced, reduced) whose outputs (a tensor, or dicts, tuples and lists of them: all compared)
    give the change; ``compare``, where given, builds those two runs instead (untimed: the unit on
    the call's own inputs where the timed runs use random ones, which would say nothing of the
    model's weights)."""

    runs: dict  # name -> callable
    full_ms: Callable[[dict], float]
    reduced_ms: Callable[[dict], float]
    outputs: tuple[str, str] = ("full", "reduced")
    compare: Callable[[], tuple[Callable, Callable]] | None = None
    # the change itself, where the unit's two sides run elsewhere (a DiT block's change read in a
    # rehearsal that measures every block at once: ``late_blocks.py``); None: not knowable
    change: Callable[[], float | None] | None = None


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
              repeats: int = REPEATS, least: float = LEAST_SECONDS, warmed: tuple = ()) -> dict:
    """Median milliseconds per run of each piece of work, timed interleaved.

    A block that runs in well under a millisecond is shorter than what synchronising the device
    and reading the clock cost, so one run per timing would mostly time that overhead (the same
    for both sides, it hides the difference). Each timing therefore runs the work back to back
    enough times to last ``least`` seconds, as one untimed-per-run calibration says, and is
    divided by that count. ``warmed``: the pieces already run once (for the change): their first
    warm-up run is that one."""
    for round_ in range(warmup):
        for name, run in work.runs.items():
            if round_ or name not in warmed:
                run()
    counts = {name: _runs_per_timing(stopwatch(name, run), least) for name, run in work.runs.items()}
    samples = {name: [] for name in work.runs}
    for _ in range(repeats):
        for name, run in work.runs.items():
            samples[name].append(stopwatch(name, _back_to_back(run, counts[name])) / counts[name])
    return {name: 1000.0 * statistics.median(times) for name, times in samples.items()}


def _runs_per_timing(seconds: float, least: float) -> int:
    if seconds >= least:
        return 1
    return min(MOST_RUNS, max(1, math.ceil(least / max(seconds, 1e-9))))


def _back_to_back(run: Callable, count: int) -> Callable:
    if count == 1:
        return run

    def runs():
        for _ in range(count):
            run()
    return runs


def relative_change(full, reduced) -> float:
    """``||reduced - full|| / ||full||`` over every tensor of two outputs of the same structure
    (a tensor, or dicts, tuples and lists of them), in float32; read to a float (a device sync:
    only while measuring)."""
    pairs = list(zip(_tensors_of(full), _tensors_of(reduced)))
    if not pairs:
        raise ValueError("the measured unit returned no tensor to compare")
    if any(f.shape != r.shape for f, r in pairs):
        raise ValueError("the reduced unit's output has another shape than the unreduced one's")
    difference = sum(torch.sum((r.float() - f.float()) ** 2) for f, r in pairs)
    size = sum(torch.sum(f.float() ** 2) for f, _ in pairs)
    difference, size = float(difference), float(size)
    if size == 0.0:
        return 0.0 if difference == 0.0 else math.inf
    return math.sqrt(difference / size)


def _tensors_of(output) -> list:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for key in sorted(output, key=str) for t in _tensors_of(output[key])]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors_of(item)]
    return []


REACH_POWER = 1 / 3  # the weight of a run's reach: chosen from ``benchmark.py --budget-reach``


def weighed_change(change: float, reach: float = 1.0) -> float:
    """A unit's measured change weighed by the share of sampling the run covers (``reach``: 1 from
    pure noise, about ``denoise`` for image to image): ``change * reach ** (1/3)``. The unit's
    change stays where it is at any denoise (its first call is as far from its input as ever) while
    the picture's change falls with the steps left, but not as fast as the reach: on the Flux
    fixture ToMe's LPIPS reads 0.59, 0.41, 0.26, 0.14 at denoise 1, 0.6, 0.3, 0.15 and ToDo
    nearest's 0.061 at 0.3. Weighed by the reach, or its square root, both would pass the budget
    there; the cube root sorts all 40 rows of the table (two fixtures, 8 and 4 steps, denoise 1 to
    0.15) as LPIPS 0.05 does (docs/quality.md#the-budget-across-denoise), with thin margins: a
    smaller power refuses more."""
    return change * min(1.0, max(0.0, reach)) ** REACH_POWER


def within_budget(decision: Decision, budget: float, reach: float = 1.0) -> Decision:
    """A kept decision read under a quality budget (``max_change``; 0: none) in a run covering
    ``reach`` of sampling: left alone where its measured change, weighed by the reach
    (``weighed_change``), is above the budget. The kept decision holds the change, not the
    verdict, so one measurement serves every budget and every denoise."""
    if budget <= 0:
        return decision
    decision = decision._replace(budget=budget, reach=reach)
    if decision.change is None:  # not known (a failed measurement; a host that cannot rehearse a call)
        return decision
    return decision._replace(reduce=decision.reduce and not decision.over_budget)


# A DiT block's change read late (``late_blocks.py``) against the budget: doubled. Read at 3/4 of
# sampling a block's output changes about half as much as at the first call for the same picture:
# on the Flux fixture 0.025 sorts all twelve rows of single blocks (nearest and window) as LPIPS
# 0.05 does (docs/quality.md, "Per block"); summed at 1x, 0.05 let two nearest blocks through
# (LPIPS 0.07-0.20, ``benchmark.py --budgets``).
LATE_SCALE = 2.0


def grade_blocks(options: dict, changes: dict, budget: float, reach: float = 1.0,
                 scale: float = 1.0) -> tuple[dict, float]:
    """Per-block decisions under one quality budget (issue #51): ``options`` ({unit: the methods
    that pay for it on this device, the most reducing first, e.g. ``("nearest", "window")``}; the
    units are the blocks a model call would reduce, any sortable keys), ``changes[(unit, method)]``
    (the unit's measured change with that block alone reduced so). Returns ({unit: method} for the
    units that reduce, their summed change weighed by the run's ``reach`` and by ``scale``: what is
    held against the budget, ``LATE_SCALE`` for a change read late).

    The blocks' changes are taken to add up: on the Flux fixture the six blocks' LPIPS one at a
    time sum to 0.036 with the window where all six windowed read 0.024-0.040, and to 0.77 with
    nearest where all six read 0.32 (docs/quality.md), so the sum errs on the side of the picture.
    Graded: first as many blocks as fit with their mildest option, the smallest changes first;
    then blocks step up to the stronger options where the added change still fits, the smallest
    added change first. Ties go to the earlier unit, so the same changes give the same choice."""
    weight = weighed_change(1.0, reach) * scale
    total, chosen = 0.0, {}
    mildest = {unit: methods[-1] for unit, methods in options.items() if methods}
    for unit in sorted(mildest, key=lambda u: (changes[(u, mildest[u])], u)):
        change = changes[(unit, mildest[unit])] * weight
        if total + change <= budget:
            chosen[unit] = mildest[unit]
            total += change
    for _ in range(1, max((len(m) for m in options.values()), default=0)):  # one step stronger a round
        def stronger(unit):
            methods = options[unit]
            place = methods.index(chosen[unit])
            return methods[place - 1] if place > 0 else None

        def added(unit):
            return (changes[(unit, stronger(unit))] - changes[(unit, chosen[unit])]) * weight
        for unit in sorted((u for u in chosen if stronger(u) is not None), key=lambda u: (added(u), u)):
            if total + added(unit) <= budget:
                total += added(unit)
                chosen[unit] = stronger(unit)
    return chosen, total


def grade_each(options: dict, changes: dict, budget: float, reach: float = 1.0) -> tuple[dict, float]:
    """Per-block decisions where each block is held against the budget alone (a UNet's blocks,
    read at the run's first call: ``unet_blocks.py``): each unit runs the most reducing of its
    ``options`` whose change, weighed by the run's ``reach``, is within ``budget``, or is left
    alone. Returns ({unit: method}, the largest weighed change of what runs).

    Not summed as a DiT's late blocks are (``grade_blocks``): the UNet's unit was the level's first
    block alone, and it tracks the SD fixture's pictures (docs/quality.md); summed over a level's
    five blocks the fixture's ToDo (1.9-2.4 % a block, LPIPS 0.003) would be refused as if it moved
    the picture. Per block, a level whose first block reads within the budget and whose others
    do not no longer runs them all, and one whose first block reads over it no longer leaves the
    others alone."""
    weight = weighed_change(1.0, reach)
    chosen, largest = {}, 0.0
    for unit, methods in options.items():
        method = next((m for m in methods if changes[(unit, m)] * weight <= budget), None)
        if method is not None:
            chosen[unit] = method
            largest = max(largest, changes[(unit, method)] * weight)
    return chosen, largest


def device_name(device: torch.device) -> str:
    """What the decisions file calls a device: its model name where torch knows it."""
    if device.type == "cpu":
        return f"cpu {platform.machine()} {platform.processor()}".strip()
    backend = getattr(torch, device.type, None)
    try:
        return f"{device.type} {backend.get_device_name(device)}"
    except Exception:  # noqa: BLE001 - MPS and others have no name query: the type must do
        return device.type


def untouched_rng(device: torch.device):
    """Leaves the CPU's and ``device``'s random number generators as it found them: what runs
    inside (other packs' patches in a timed block: ComfyUI's HyperTile draws its tiling from the
    global generator) must not change what the sampler draws after it, or the run that measured
    would give another image than every later run that reuses the decision."""
    return _RngStates(device)


class _RngStates:
    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        self.cpu = torch.get_rng_state()
        backend = getattr(torch, self.device.type, None) if self.device.type != "cpu" else None
        self.backend, self.state = backend, None
        if backend is not None and hasattr(backend, "get_rng_state") and hasattr(backend, "set_rng_state"):
            try:
                self.state = backend.get_rng_state(self.device) if self.device.index is not None \
                    else backend.get_rng_state()
            except (RuntimeError, TypeError):  # a device without a generator of its own
                self.state = None
        return self

    def __exit__(self, *exc):
        torch.set_rng_state(self.cpu)
        if self.state is not None:
            if self.device.index is not None:
                self.backend.set_rng_state(self.state, self.device)
            else:
                self.backend.set_rng_state(self.state)
        return False


def runtime() -> tuple:
    """What besides the device and the pack decides how fast a kind of call runs, where torch and
    the system say it: torch, its CUDA or ROCm build, the GPU driver, the attention libraries
    installed (another SageAttention or FlashAttention build changes the kernels)."""
    parts = [f"torch {torch.__version__}"]
    for name in ("cuda", "hip"):
        version = getattr(torch.version, name, None)
        if version:
            parts.append(f"{name} {version}")
    try:  # Linux with NVIDIA's driver: its version; elsewhere not knowable without vendor tools
        parts.append(Path("/proc/driver/nvidia/version").read_text(encoding="utf-8").splitlines()[0].strip())
    except (OSError, IndexError):
        pass
    for library in ("sageattention", "flash_attn", "xformers"):
        try:
            parts.append(f"{library} {importlib.metadata.version(library)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return tuple(parts)


class UnusableFile(ValueError):
    """A decisions file this version cannot use (its reason says why)."""


def read_entries(text: str) -> tuple[dict, int]:
    """The usable decisions of a file's text and how many entries were not; raises UnusableFile
    for a file that is not a decisions file of this format (a newer one included)."""
    try:
        data = json.loads(text)
    except ValueError as problem:
        raise UnusableFile(f"not JSON: {problem}") from None
    if not isinstance(data, dict) or not isinstance(data.get("decisions"), dict):
        raise UnusableFile("not a decisions file (no object of decisions)")
    form = data.get("format")
    if isinstance(form, int) and not isinstance(form, bool) and form > FILE_FORMAT:
        raise UnusableFile(f"written by a newer TokenReduce (format {form}, this one reads {FILE_FORMAT})")
    if form != FILE_FORMAT:
        raise UnusableFile(f"not a format-{FILE_FORMAT} decisions file")
    usable = {key: entry for key, entry in data["decisions"].items() if _usable_entry(entry)}
    return usable, len(data["decisions"]) - len(usable)


def _usable_entry(entry) -> bool:
    def number(value):
        return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
    def change(value):
        return number(value) and (value is None or value >= 0)
    # "change" came later (the quality budget), "changes" (per model) later still: an entry
    # without them is usable for speed.
    changes = entry.get("changes", {}) if isinstance(entry, dict) else None
    return (isinstance(entry, dict) and isinstance(entry.get("reduce"), bool) and "full_ms" in entry
            and "reduced_ms" in entry and number(entry["full_ms"]) and number(entry["reduced_ms"])
            and change(entry.get("change")) and isinstance(changes, dict)
            and all(isinstance(k, str) and change(v) for k, v in changes.items()))


def _has_change(entry: dict, model: str | None) -> bool:
    """Whether ``entry`` holds the change of ``model`` (None: the kind's one shared change)."""
    return "change" in entry if model is None else model in (entry.get("changes") or {})


def _decision_of(entry: dict, source: str, model: str | None = None) -> Decision:
    change = entry.get("change") if model is None else (entry.get("changes") or {}).get(model)
    return Decision(entry["reduce"], entry["full_ms"], entry["reduced_ms"], source, change=change)


class Decisions:
    """Decisions of the auto rule, kept in memory for the process and in a JSON file.

    A decision made or read in this process stays for the process: another process sharing the
    file (two ComfyUI instances on one user directory) may add kinds, never change one this
    process already uses, so two runs of one workflow never switch decisions in between. In the
    file the first decision of a kind wins (measure again replaces it): a process that measured a
    kind another process wrote meanwhile uses the file's decision from that run on, as it would
    after a restart. Each new decision is merged in under a lock (``filelock``, on every OS: the
    file ``.auto_decisions.json.lock`` beside it) and written atomically (a temporary file swapped
    in), so racing writers keep the file valid and lose none. Removing the file forgets every decision (measured anew without
    a restart). A file this version cannot use (not JSON, the wrong shape, a newer format) or a
    place it cannot write is said once; the decisions then hold in memory only, and the file is
    left as it is. Thread-safe: a kind met by two threads at once is measured once."""

    def __init__(self, path: Path | None, measure_cpu: bool = False, margin: float = MARGIN,
                 stopwatch: Callable[[torch.device], Callable] = Stopwatch, warmup: int = WARMUP,
                 repeats: int = REPEATS, environment: tuple = ()):
        self.path = Path(path) if path is not None else None
        self.measure_cpu = measure_cpu
        self.margin = margin
        self.stopwatch = stopwatch  # device -> stopwatch(name, work) -> seconds
        self.warmup = warmup
        self.repeats = repeats
        # In every key: what the host knows decides speed too (its version, compiled or not is per kind).
        self.environment = runtime() + tuple(environment)
        self._lock = threading.RLock()
        self._kept: dict = {}  # key -> stored entry (dict): what this process decided or read
        self._failed: dict = {}  # (key, model) -> the Decision (FAILED) of a kind whose measuring failed, for the process
        self._file_state = None  # (mtime_ns, size) of the file as last read or written; None: none
        self._memory_only = False  # the file cannot be used or written: said once, never touched
        self._said: set = set()
        self._remeasure: dict = {}  # max_change -> the process's "measure again" rule
        self._names: dict = {}  # device -> device_name
        self.log: list = []  # (site, Decision) of every kind this store measured, in order (benchmarks read it)

    @property
    def measurements(self) -> int:
        return len(self.log)

    @property
    def where(self) -> str:
        """The file the decisions are kept in, as the report says it; "" where they hold for this
        process only."""
        return "" if self.path is None or self._memory_only else str(self.path)

    def remeasure_rule(self, max_change: float = 0.0) -> AutoRule:
        """The process's one "measure again" rule on this store per budget (see ``auto_rule``)."""
        with self._lock:
            rule = self._remeasure.get(max_change)
            if rule is None:
                rule = self._remeasure[max_change] = AutoRule(self, remeasure=True, max_change=max_change)
            return rule

    def measures(self, device: torch.device) -> bool:
        return device.type != "cpu" or self.measure_cpu

    def key(self, device: torch.device, kind: tuple) -> str:
        name = self._names.get(device)
        if name is None:
            name = self._names[device] = device_name(device)
        return json.dumps([name, VERSION, *self.environment, *kind], separators=(",", ":"))

    def decide(self, device: torch.device, kind: tuple, work: Callable[[], Work], site: str = "",
               fresh: bool = False, change: bool = False, model: str | Callable[[], str] | None = None,
               time_cpu: bool = False, untimed: bool = False) -> Decision:
        """Whether to reduce calls of ``kind`` on ``device``: kept, or measured now with the work
        ``work()`` builds (only built when measuring). ``fresh``: measure even if kept. ``change``:
        the decision must hold the change reducing makes (a quality budget applies): an entry kept
        without it has the change measured and added (untimed), and on a CPU, where nothing is
        timed, the change alone is measured and kept. ``model``: the fingerprint of the weights the
        measured unit runs with (or what makes it: called only where a change is asked for), under
        which the change is kept and read; the speed is the kind's, whatever the model. None: the
        kind's one shared change (callers that cannot name the weights). A kind whose measuring failed is not
        measured again in this process (a failure is not worth a try per run, and a try may cost a
        model call): its FAILED decision, reducing as set, is handed out again with its reason for
        each run to say; ``fresh`` or removing the file tries anew. ``time_cpu``: time this kind on
        a CPU too, for a reduction that can cost more than it saves there (ToDo's window on a small
        grid: more work than full attention). ``untimed``: the change alone, on any device (one
        block's change where its kind's speed is decided apart: ``grade_blocks``)."""
        timed = not untimed and (self.measures(device) or time_cpu)
        if not timed and not change:
            return Decision(True, None, None, CPU)
        key = self.key(device, kind)
        model = (model() if callable(model) else model) if change else None  # read once, where it matters
        with self._lock:
            self._refresh()
            entry = None if fresh else self._kept.get(key)
            lacks_time = timed and (entry is None or entry["full_ms"] is None)
            lacks_change = change and (entry is None or not _has_change(entry, model))  # None: not knowable here
            if entry is not None and not lacks_time and not lacks_change:
                return _decision_of(entry, KEPT, model)
            failed = None if fresh else self._failed.get((key, model))
            if failed is not None:  # tried once in this process: said again, not measured again
                return failed._replace(seconds=0.0)
            decision = self._measure(device, work, lacks_time, lacks_change)
            if decision.source == FAILED:
                self._failed[(key, model)] = decision
                return decision
            self._failed.pop((key, model), None)
            measured = {}
            if lacks_change and model is None:
                measured["change"] = decision.change
            elif lacks_change:  # the other models' changes of the kind stay (measure again included)
                others = (self._kept.get(key) or {}).get("changes") or {}
                measured["changes"] = {**others, model: decision.change}
            if lacks_time or entry is None:
                measured.update(reduce=decision.reduce, full_ms=decision.full_ms, reduced_ms=decision.reduced_ms)
            self._kept[key] = {**(entry or {}), **measured, "site": site,
                               "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
            decision = _decision_of(self._kept[key], MEASURED, model)._replace(seconds=decision.seconds)
            self.log.append((site, decision))
            kept = self._save(key, replace=fresh, model=model)
            if kept is not None:  # another process decided this kind first: its decision, from this run on
                return _decision_of(kept, KEPT, model)
            return decision

    def _measure(self, device: torch.device, build: Callable[[], Work], timed: bool, change: bool) -> Decision:
        """Times the work (``timed``) and measures the change reducing makes (``change``); what is
        not measured is None (untimed: reduce)."""
        start = time.perf_counter()
        try:
            with torch.no_grad(), untouched_rng(device):
                work = build()
                moved, warmed = (self._change(work) if change else (None, ()))
                times = time_work(work, self.stopwatch(device), self.warmup, self.repeats, warmed=warmed) \
                    if timed else None
            full, reduced = (work.full_ms(times), work.reduced_ms(times)) if timed else (None, None)
        except Exception as problem:  # noqa: BLE001 - a failed measurement must not fail the run
            LOG.warning("TokenReduce: could not measure whether reduction pays (%s: %s); reducing as set. Not "
                        "measured again in this process (restart, remove the decisions file or set reduce_when "
                        "'auto (measure again)' to try again).", type(problem).__name__, problem)
            return Decision(True, None, None, FAILED, time.perf_counter() - start, f"{type(problem).__name__}: {problem}")
        # Rounded as the file keeps them: a kept decision reads the same as when it was measured.
        seconds = time.perf_counter() - start
        moved = round(moved, 6) if moved is not None else None
        if not timed:
            return Decision(True, None, None, MEASURED, seconds, change=moved)
        return Decision(reduced < full * (1.0 - self.margin), round(full, 4), round(reduced, 4), MEASURED,
                        seconds, change=moved)

    @staticmethod
    def _change(work: Work) -> tuple[float | None, tuple]:
        """The change reducing makes, from one run of each side (the timed runs' first warm-up
        where they are the ones compared: those names are returned, their warm-up is done)."""
        if work.change is not None:
            return work.change(), ()
        if work.compare is not None:
            sides = work.compare()
            if sides is None:  # the host cannot give the unit's own inputs: not known, kept so
                return None, ()
            return relative_change(sides[0](), sides[1]()), ()
        names = work.outputs
        return relative_change(work.runs[names[0]](), work.runs[names[1]]()), tuple(names)

    # --- the file ------------------------------------------------------------------------------
    def _say_once(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            LOG.warning("%s", message)

    def _give_up_file(self, why: str) -> None:
        self._memory_only = True
        self._say_once(f"TokenReduce: cannot use the auto rule's decisions file {self.path} ({why}); decisions "
                       f"are measured and kept for this process only, and the file is left as it is. Remove or "
                       f"fix it to keep decisions across restarts again.")

    def _stat(self):
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return (stat.st_mtime_ns, stat.st_size)

    def _refresh(self) -> None:
        if self.path is None or self._memory_only:
            return
        state = self._stat()
        if state == self._file_state:
            return
        if state is None:  # removed: measure anew (what failed too)
            self._file_state, self._kept, self._failed = None, {}, {}
            return
        entries = self._read()
        if entries is None:
            return
        self._file_state = state
        for key, entry in entries.items():  # another process's kinds are added; ours stay as they are
            ours = self._kept.setdefault(key, entry)
            if ours is not entry:  # ... and its models' changes of a kind we hold, for models we have none of
                self._kept[key] = _with_changes(ours, entry, ours=True)

    def _read(self) -> dict | None:
        """The file's usable decisions ({} where there is none yet); None: the file cannot be used."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError) as problem:
            self._give_up_file(f"unreadable: {problem}")
            return None
        try:
            entries, unusable = read_entries(text)
        except UnusableFile as problem:
            self._give_up_file(str(problem))
            return None
        if unusable:
            self._say_once(f"TokenReduce: ignoring {unusable} entries of the auto rule's decisions file {self.path} "
                           f"that are not decisions; those kinds are measured again.")
        return entries

    def _save(self, key: str, replace: bool, model: str | None = None) -> dict | None:
        """Merge this process's decision of ``key`` into the file: the file's own wins unless
        ``replace`` (measure again), for the speed and for each model's change; the models' changes
        the other side lacks are added both ways (a measure again replaces ``model``'s, not the
        other models'). Returns the file's entry where it won for the speed or for ``model``'s change
        (another process wrote it meanwhile): this process adopts it, so a restart changes nothing;
        else None."""
        if self.path is None or self._memory_only:
            return None
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        won = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Held for one read and one write; a lock that cannot be had (an old filelock retries a
            # folder it cannot write forever) ends in Timeout, an OSError: kept for this process.
            with FileLock(str(self.path.with_name(f".{self.path.name}.lock")), timeout=LOCK_SECONDS):
                current = self._read()
                if current is None:
                    return None
                if key not in current:
                    current[key] = self._kept[key]
                elif replace:  # ours, with the changes of models the file has and we do not
                    current[key] = self._kept[key] = _with_changes(self._kept[key], current[key], ours=True)
                else:  # the file's measurements win; what it lacks (a change, times) is added from ours
                    ours = self._kept[key]
                    known = {name: value for name, value in current[key].items()
                             if value is not None and name != "changes"}
                    merged = _with_changes({**ours, **known}, current[key], ours=False)
                    # ours completed the file's own entry (a change added to it): not another process's
                    # (.get: an entry measured without a budget has no change, in the file nor here)
                    won = merged if any(merged.get(k) != ours.get(k) for k in ("reduce", "full_ms", "reduced_ms",
                                                                                "change")) \
                        or _decision_of(merged, KEPT, model).change != _decision_of(ours, KEPT, model).change else None
                    current[key] = self._kept[key] = merged
                for known, entry in current.items():
                    self._kept.setdefault(known, entry)
                data = {"format": FILE_FORMAT, "about": "TokenReduce reduce_when auto: measured decisions per "
                        "device and kind of call. Delete this file to measure again.", "decisions": current}
                temporary.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
                os.replace(temporary, self.path)
                self._file_state = self._stat()
            return won
        except OSError as problem:
            self._memory_only = True
            self._say_once(f"TokenReduce: could not keep the auto rule's decisions in {self.path} ({problem}); "
                           f"they hold for this process only.")
        finally:
            try:
                temporary.unlink(missing_ok=True)
            except OSError:  # no folder to have left it in
                pass


def _with_changes(entry: dict, other: dict, ours: bool) -> dict:
    """``entry`` with the models' changes of both: ``entry``'s win where ``ours``, else ``other``'s
    (a change not known, None, never wins over a number)."""
    mine, theirs = entry.get("changes") or {}, other.get("changes") or {}
    first, second = (mine, theirs) if ours else (theirs, mine)
    changes = {**second, **{m: c for m, c in first.items() if c is not None or second.get(m) is None}}
    return {**entry, "changes": changes} if changes else entry


_STORES: dict = {}  # path -> Decisions: the rule's memory, one store per file for the process
_STORES_LOCK = threading.Lock()


def decisions_at(path: Path, environment: tuple = ()) -> Decisions:
    """The process's one store of decisions for the file at ``path`` (the hosts' nodes share it)."""
    with _STORES_LOCK:
        store = _STORES.get(path)
        if store is None:
            store = _STORES[path] = Decisions(path, environment=environment)
        return store


def auto_rule(reduce_when: str, decisions: Decisions, per_process: bool = False,
              max_change: float = 0.0) -> AutoRule | None:
    """The rule a node's ``reduce_when`` asks for: None for always (reduce wherever set).
    ``per_process``: measure again once per kind for the process, not per rule (a host that makes
    a rule per generation, as the WebUI does, would otherwise measure on every generation).
    ``max_change``: the quality budget (0: none; see ``within_budget``)."""
    if reduce_when == REDUCE_ALWAYS:
        return None
    if reduce_when == REDUCE_REMEASURE and per_process:
        return decisions.remeasure_rule(max_change)
    return AutoRule(decisions, remeasure=reduce_when == REDUCE_REMEASURE, max_change=max_change)


class AutoRule:
    """``reduce_when`` of one node output: auto (a store of decisions) or, with ``remeasure``,
    auto that measures each kind anew the first time this node output meets it; with a
    ``max_change`` above 0, kinds whose reduction changes the unit's output by more are left alone."""

    def __init__(self, decisions: Decisions, remeasure: bool = False, max_change: float = 0.0):
        self.decisions = decisions
        self.remeasure = remeasure
        self.max_change = max_change
        self._remeasured: set = set()
        self._lock = threading.Lock()

    def __deepcopy__(self, memo):
        return self

    def decide(self, device: torch.device, kind: tuple, work: Callable[[], Work], site: str,
               model: str | Callable[[], str] | None = None, time_cpu: bool = False, reach: float = 1.0,
               budgeted: bool = True, untimed: bool = False) -> Decision:
        """``model``, ``time_cpu``, ``untimed``: see ``Decisions.decide``; ``reach``: the share of
        sampling the run covers, which weighs the change against the budget (``within_budget``).
        ``budgeted`` False: speed alone, or with ``untimed`` the change alone, unweighed (the
        budget is applied by the caller: ``grade_blocks``)."""
        fresh = False
        if self.remeasure:
            with self._lock:
                fresh = (device, kind) not in self._remeasured
                self._remeasured.add((device, kind))
        change = self.max_change > 0 and (budgeted or untimed)
        decision = self.decisions.decide(device, kind, work, site, fresh=fresh, change=change,
                                         model=model, time_cpu=time_cpu, untimed=untimed)
        return within_budget(decision, self.max_change, reach) if budgeted else decision
