"""One process of test_core_pays.py's two-process test: waits for a given moment, then decides 10
kinds of its own and 10 shared ones on one decisions file (a scripted clock makes this process
decide ``reduce`` = reduced ms < 10 ms); prints each shared kind's decision as first decided and
again after the other process wrote.

    python tests/decisions_process.py FILE START_TIME NAME REDUCED_MS
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tokenreduce import pays  # noqa: E402


def main(path: str, start: str, name: str, reduced: str) -> None:
    times = {"full": 0.010, "reduced": float(reduced) / 1000.0}
    store = pays.Decisions(Path(path), stopwatch=lambda device: (lambda which, work: times[which]))
    device = torch.device("meta")
    kinds = [(f"shared {i}",) for i in range(10)] + [(f"{name} {i}",) for i in range(10)]
    built = lambda: pays.pair(lambda: None, lambda: None)  # noqa: E731
    time.sleep(max(0.0, float(start) - time.time()))
    first = [store.decide(device, kind, built).reduce for kind in kinds]
    time.sleep(0.5)  # the other process has written by now
    again = [store.decide(device, kind, built).reduce for kind in kinds]
    print(json.dumps({"first": first, "again": again}))


if __name__ == "__main__":
    main(*sys.argv[1:])
