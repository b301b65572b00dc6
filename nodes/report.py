"""What a patch node tells the user in the graph: a few short lines drawn on the node by the
front end (``js/tokenreduce.js``), sent through ComfyUI's own server messages.

When the node executes it reports what it patched (or why nothing) in its UI output, which the
host sends as ``executed`` and re-sends when the node is cached. When a sampling run with the
patched model ends, the run's report goes to the client that queued the prompt as a
``tokenreduce.run`` message: tokens per level before and after, the steps in which the patch
was active, the sampling time and any warning. No polling, no extra HTTP route.
"""

from __future__ import annotations

import logging
import sys

from ..tokenreduce.describe import run_lines
from ..tokenreduce.run import RunReport
from .session import PatchSession

LOG = logging.getLogger("tokenreduce")
RUN_EVENT = "tokenreduce.run"
UI_KEY = "tokenreduce"  # key of the node's UI output the front end reads


def ui_output(info: str, header: str | None, warnings: list[str]) -> dict:
    """The node's UI output: its info text, and the lines the front end draws."""
    return {"text": [info], UI_KEY: [{"lines": [header] if header else [], "warnings": warnings}]}


def run_message(session: PatchSession, report: RunReport) -> dict:
    return {
        "node": session.node_id,
        "node_type": session.label,
        "lines": run_lines(session.header, report),
        "warnings": list(report.warnings),
        "completed": report.completed,
        "steps": report.steps,
        "active_steps": list(report.active_steps),
        "sampling_seconds": report.sampling_seconds,
        "levels": [{"downsample": lv.downsample, "grid": list(lv.grid),
                    "tokens": {stage: list(counts) for stage, counts in lv.tokens.items()}} for lv in report.levels],
        "auto": [{"site": site, "reduce": d.reduce, "full_ms": d.full_ms, "reduced_ms": d.reduced_ms,
                  "source": d.source, "change": d.change, "max_change": d.budget,
                  "reach": d.reach} for site, d in report.decisions],
        "measure_seconds": report.measure_seconds,
        "notes": list(report.notes),
        "windows": [list(window) for window in report.windows],
        "prediction_change": None if report.prediction_change is None else report.prediction_change._asdict(),
    }


def _prompt_server():
    """ComfyUI's running server, if this process is one (not in scripts or in-process tests).
    Looked up, never imported: importing ``server`` would start building one."""
    module = sys.modules.get("server")
    return getattr(getattr(module, "PromptServer", None), "instance", None)


def publish_run(session: PatchSession, report: RunReport) -> None:
    """Send a finished run's report to the client whose prompt ran it. Never raises: a report
    that cannot be sent must not fail the user's run."""
    server = _prompt_server()
    if server is None or session.node_id is None:
        return
    try:
        message = run_message(session, report)
        message["prompt_id"] = getattr(server, "last_prompt_id", None)
        server.send_sync(RUN_EVENT, message, getattr(server, "client_id", None))
    except Exception:  # noqa: BLE001 - reporting is best effort, the run's result is not
        LOG.exception("%s: could not send the run report to the browser", session.label)
