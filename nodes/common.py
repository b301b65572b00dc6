"""Schema pieces and the patch lifecycle that every TokenReduce node shares."""

from __future__ import annotations

import logging

from comfy_api.latest import io

from .report import publish_run, ui_output
from .session import PatchSession, sessions_of

LOG = logging.getLogger("tokenreduce")
WINDOW_RANGES = {"start_percent": (0.0, 1.0), "end_percent": (0.0, 1.0)}


def model_input() -> io.Model.Input:
    return io.Model.Input("model", tooltip="The diffusion model (UNet) to patch. The input model is never changed.")


def window_inputs(what: str) -> list:
    return [
        io.Float.Input("start_percent", default=0.0, min=WINDOW_RANGES["start_percent"][0],
                       max=WINDOW_RANGES["start_percent"][1], step=0.001,
                       tooltip=f"{what} starts at this point of sampling (0 = first step, highest noise), measured "
                               f"in noise level like Kohya Deep Shrink, not in steps."),
        io.Float.Input("end_percent", default=1.0, min=WINDOW_RANGES["end_percent"][0],
                       max=WINDOW_RANGES["end_percent"][1], step=0.001,
                       tooltip=f"{what} stops after this point of sampling (1 = last step)."),
    ]


def outputs() -> list:
    return [
        io.Model.Output(tooltip="The patched model (a clone)."),
        io.String.Output("info", display_name="info", tooltip="What was patched, and any warning about settings that do nothing."),
    ]


def refuse_stacking(model, node_id: str) -> None:
    """Raise if this node is already applied upstream: the second copy would see the tokens
    the first one reduced (and be skipped) or reduce them twice."""
    if any(session.label == node_id for session in sessions_of(model)):
        raise ValueError(f"{node_id} is already applied to this model (upstream in the graph). Apply it once. "
                         f"For different settings per pass (a hires-fix second pass), patch the checkpoint "
                         f"loader's model with a separate {node_id} for each pass.")


def builtin_tome_applied(model) -> bool:
    """Whether ComfyUI's built-in TomePatchModel is applied to this model."""
    patches = model.model_options.get("transformer_options", {}).get("patches", {})
    # Its module is "comfy_extras.nodes_tomesd" when imported, but the server loads extras by
    # file path and names the module after the path (".../comfy_extras/nodes_tomesd").
    return any(str(getattr(f, "__module__", "")).replace("\\", "/").replace(".", "/").endswith("comfy_extras/nodes_tomesd")
               for f in patches.get("attn1_patch", []))


def refuse_or_unchanged(model, node_id: str, target) -> io.NodeOutput:
    """For a target with nothing to patch: an error where no setting could work, else the
    input model unchanged with a warning."""
    if target.refused:
        raise ValueError(f"{node_id}: {target.message}")
    return unchanged(model, target.message)


def unchanged(model, message: str) -> io.NodeOutput:
    """Return the input model as it is, saying why (a WARNING in the log, in info and on the node)."""
    LOG.warning("%s", message)
    return io.NodeOutput(model, message, ui=ui_output(message, None, [message]))


def node_id_of(node_class) -> str | None:
    """The graph node being executed (its id in the browser), or None outside a prompt."""
    return getattr(node_class.hidden, "unique_id", None)


def patched_clone(model, label: str, start_percent: float, end_percent: float, header: str, node_id: str | None,
                  preflight=None, per_call_state: bool = False):
    """A clone of the model and the session that gives its patches per-run state and reports
    each run to the graph node ``node_id`` under ``header`` (what was patched).
    ``preflight(latent_hw)`` checks the settings against the latent when sampling starts;
    ``per_call_state``: see ``PatchSession.attach``."""
    clone = model.clone()
    session = PatchSession(label, start_percent, end_percent, preflight)
    session.header, session.node_id, session.on_report = header, node_id, publish_run
    session.attach(clone, per_call_state)
    return clone, session


def done(model, info: str, header: str, warnings: list[str] | None = None) -> io.NodeOutput:
    """Return the patched model, saying what was patched (and what part of it does nothing)."""
    LOG.info("%s", info)
    for warning in warnings or []:
        LOG.warning("%s", warning)
    return io.NodeOutput(model, info, ui=ui_output(info, header, list(warnings or [])))
