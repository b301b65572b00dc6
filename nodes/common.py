"""What every TokenReduce node shares: its schema built from the method's declared inputs, and
the steps of its story (check, refuse, find the target, patch a clone, say what was done)."""

from __future__ import annotations

import logging

from comfy_api.latest import io

from ..tokenreduce.catalog import OUTPUTS, NodeText
from ..tokenreduce.inputs import Method
from ..tokenreduce.layout import UNET, model_layout
from ..tokenreduce.measure import UNetLevels
from ..tokenreduce.pays import AutoRule, Decisions, auto_rule, decisions_at
from ..tokenreduce.target import Target, resolve_target
from .host import decisions_file, host_environment
from .report import publish_run, ui_output
from .schema import v3_inputs
from .session import PatchSession, sessions_of

LOG = logging.getLogger("tokenreduce")


class PatchNode(io.ComfyNode):
    """A node MODEL -> (MODEL, info) whose widget inputs are its method's declared inputs."""

    TEXT: NodeText  # id, title, description and tooltips (English; locales/ translates them)
    NODE_ID: str  # TEXT.node_id: public and permanent, saved workflows refer to it
    METHOD: Method

    @classmethod
    def define_schema(cls) -> io.Schema:
        text = cls.TEXT
        model_out, info_out = OUTPUTS
        return io.Schema(
            node_id=text.node_id,
            display_name=text.title,
            category="model_patches/unet",
            description=text.description,
            inputs=[io.Model.Input("model", tooltip=text.model_tooltip)] + v3_inputs(cls.METHOD),
            outputs=[
                io.Model.Output(tooltip=model_out.tooltip),
                io.String.Output(info_out.name, display_name=info_out.name, tooltip=info_out.tooltip),
            ],
            hidden=[io.Hidden.unique_id],  # the graph node its run reports go to
        )

    @classmethod
    def settings(cls, values: dict):
        """The run's settings, checked again at execution (an API client may send anything)."""
        try:
            return cls.METHOD.settings(values)
        except ValueError as problem:
            raise ValueError(f"{cls.NODE_ID}: {problem}") from None

    @classmethod
    def graph_node(cls) -> str | None:
        """The graph node being executed (its id in the browser), or None outside a prompt."""
        return getattr(cls.hidden, "unique_id", None)


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


def model_family(model) -> str:
    """The host's name for the model type (SD15, SDXL, Flux, ...)."""
    config = getattr(model.model, "model_config", None)
    return type(config).__name__ if config is not None else type(model.model).__name__


def find_target(model, method: str, setting: str, choice: str, select, kinds=(UNET,)) -> Target:
    """The sites of this model that a level setting selects (see ``resolve_target``)."""
    family = model_family(model)
    # The config object, not only its name: a family is recognised by the config's bases too.
    config = getattr(model.model, "model_config", None) or family
    layout = model_layout(model.get_model_object("diffusion_model"), config)
    return resolve_target(layout, family, method, setting, choice, select, kinds)


def refuse_or_unchanged(model, node_id: str, target: Target) -> io.NodeOutput:
    """For a target with nothing to patch: an error where no setting could work, else the
    input model unchanged with a warning (in the log, in info and on the node)."""
    if target.refused:
        raise ValueError(f"{node_id}: {target.message}")
    LOG.warning("%s", target.message)
    return io.NodeOutput(model, target.message, ui=ui_output(target.message, None, [target.message]))


def patched_clone(model, node_id: str, settings, header: str, graph_node: str | None, preflight=None):
    """A clone of the model and the session that gives its patch per-run state and reports
    each run to the graph node under ``header`` (what was patched). ``preflight(latent_hw)``
    checks the settings against the latent when sampling starts."""
    clone = model.clone()
    session = PatchSession(node_id, settings.start_percent, settings.end_percent, preflight)
    session.header, session.node_id, session.on_report = header, graph_node, publish_run
    session.measure_change = settings.measure_change
    return clone, session


def decisions() -> Decisions:
    """The auto rule's decisions for this ComfyUI: kept in memory and in its user directory."""
    return decisions_at(decisions_file(), host_environment())


def reduce_rule(settings) -> AutoRule | None:
    """What ``reduce_when`` asks for: the auto rule on this ComfyUI's decisions, or None (always)."""
    return auto_rule(settings.reduce_when, decisions(), max_change=settings.max_change)


def unet_levels(model, target: Target) -> UNetLevels:
    """The patched UNet's levels as the auto rule times them."""
    return UNetLevels(model.get_model_object("diffusion_model"), target.sites, target.family)


def done(model, info: str, header: str, warnings: list[str] | None = None) -> io.NodeOutput:
    """Return the patched model, saying what was patched (and what part of it does nothing)."""
    LOG.info("%s", info)
    for warning in warnings or []:
        LOG.warning("%s", warning)
    return io.NodeOutput(model, info, ui=ui_output(info, header, list(warnings or [])))
