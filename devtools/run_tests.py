"""Run the whole test suite on the pinned ComfyUI host: ``python3 devtools/run_tests.py``.

Builds the host on first use (cached outside the clone, see devtools/host.py), then runs
pytest with the host's Python. Extra arguments go to pytest (e.g. ``-k tome -x``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "devtools"))

import host  # noqa: E402


def main() -> int:
    built = host.ensure_host()
    env = {**os.environ, "TOKENREDUCE_COMFYUI": str(built.comfyui), "PYTHONUNBUFFERED": "1"}
    cmd = [str(built.python), "-m", "pytest", "-c", str(REPO / "tests" / "pytest.ini"), str(REPO / "tests"),
           *sys.argv[1:]]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=REPO, env=env)


if __name__ == "__main__":
    sys.exit(main())
