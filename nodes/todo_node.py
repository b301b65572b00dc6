"""The ToDo patch node: MODEL -> MODEL with key/value downsampling on a clone."""

from __future__ import annotations

from comfy_api.latest import io

from ..tokenreduce import DOWNSAMPLE_METHODS
from .common import (WINDOW_RANGES, done, model_input, node_id_of, outputs, patched_clone, refuse_or_unchanged,
                     refuse_stacking, window_inputs)
from .model_info import LEVEL_CHOICES, patch_target
from .preflight import todo_factors
from .todo_patch import ToDoPatch, ToDoSettings
from .validation import check_choices, check_present, check_ranges, check_window, first_problem

NODE_ID = "TokenReduceToDo"  # public and permanent: saved workflows refer to it
RANGES = {"factor": (1.0, 8.0), "factor_next": (1.0, 8.0), **WINDOW_RANGES}


def _check_settings(factor, factor_next, level, method, start_percent, end_percent) -> str | None:
    return first_problem(
        check_choices({"level": level, "method": method}, {"level": LEVEL_CHOICES, "method": list(DOWNSAMPLE_METHODS)}),
        check_ranges({"factor": factor, "factor_next": factor_next, "start_percent": start_percent,
                      "end_percent": end_percent}, RANGES),
        "nothing to downsample: factor and factor_next are both 1. Set factor to 2 or more."
        if factor == 1 and factor_next == 1 else None,
        check_window(start_percent, end_percent),
    )


def _level_factors(level: int, factor: float, factor_next: float) -> list[tuple[str, int, float]]:
    """(input name, downsample level, factor) of each factor that pools (> 1)."""
    return [(name, lv, f) for name, lv, f in (("factor", level, factor), ("factor_next", level * 2, factor_next))
            if f > 1]


class ToDoPatchNode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name="Token Downsampling (ToDo, TokenReduce)",
            category="model_patches/unet",
            description=(
                "Speeds up sampling by letting self-attention read keys and values pooled on the token grid "
                "(ToDo); every query stays. No matching, nothing to unmerge, deterministic. Works on SD1.x, "
                "SD2.x and SDXL; reports what it patched."
            ),
            inputs=[
                model_input(),
                io.Float.Input("factor", default=2.0, min=RANGES["factor"][0], max=RANGES["factor"][1], step=0.1,
                               tooltip="Pooling factor per side for keys/values at the first patched level: 2 gives "
                                       "4x fewer keys. Non-integer factors work (the grid is rounded up). 1 = off."),
                io.Float.Input("factor_next", default=1.0, min=RANGES["factor_next"][0], max=RANGES["factor_next"][1],
                               step=0.1, tooltip="Pooling factor per side at the next coarser level (twice the "
                                                 "downsample of the first). 1 = off."),
                io.Combo.Input("level", options=LEVEL_CHOICES, default="auto",
                               tooltip="The first patched level, as downsample of its feature map relative to the "
                                       "latent. auto: the finest level with transformer blocks in this model (1 for "
                                       "SD1.x/2.x, 2 for SDXL), so the same settings mean the same on both."),
                io.Combo.Input("method", options=list(DOWNSAMPLE_METHODS), default="nearest",
                               tooltip="How keys/values are pooled on the grid: nearest (strided subsampling, "
                                       "fastest), average (mean of each cell), bilinear or bicubic (antialiased "
                                       "interpolation)."),
                *window_inputs("Downsampling"),
            ],
            outputs=outputs(),
            hidden=[io.Hidden.unique_id],  # the graph node its run reports go to
        )

    @classmethod
    def validate_inputs(cls, factor=None, factor_next=None, level=None, method=None, start_percent=None,
                        end_percent=None) -> bool | str:
        problem = _check_settings(factor, factor_next, level, method, start_percent, end_percent)
        return True if problem is None else problem

    @classmethod
    def execute(cls, model, factor, factor_next, level, method, start_percent, end_percent) -> io.NodeOutput:
        problem = first_problem(
            check_present(dict(factor=factor, factor_next=factor_next, level=level, method=method,
                               start_percent=start_percent, end_percent=end_percent)),
            _check_settings(factor, factor_next, level, method, start_percent, end_percent))
        if problem is not None:
            raise ValueError(f"{NODE_ID}: {problem}")
        refuse_stacking(model, NODE_ID)
        target = patch_target(
            model, "ToDo", "level", level,
            lambda layout, lv: tuple(s for s in layout.sites
                                     if s.downsample in {level for _, level, _ in _level_factors(lv, factor, factor_next)}))
        if target.sites is None:
            return refuse_or_unchanged(model, NODE_ID, target)
        named = _level_factors(target.level, factor, factor_next)
        present = {site.downsample for site in target.sites}
        header = target.header("ToDo")
        patched, session = patched_clone(model, NODE_ID, start_percent, end_percent, header, node_id_of(cls),
                                         preflight=todo_factors(NODE_ID, [nf for nf in named if nf[1] in present]))
        factors = {lv: f for _, lv, f in named}
        patched.set_model_attn1_patch(ToDoPatch(ToDoSettings(factors, method), session).attn1)

        described, warnings = [], []
        for name, lv, f in named:
            count = target.count_at(lv)
            if count:
                described.append(f"downsample {lv}: {count} blocks, keys/values pooled {f:g}x per side "
                                 f"(about {f * f:.3g}x fewer keys)")
            else:
                described.append(f"downsample {lv}: no transformer blocks in this model (factor {f:g} does nothing)")
                warnings.append(f"WARNING: {name} {f:g} does nothing: this {target.family} model has no transformer "
                                f"blocks at downsample {lv}.")
        return done(patched, f"ToDo on {target.family}: {'; '.join(described)}; {method} pooling; "
                             f"active from {start_percent:g} to {end_percent:g} of sampling.", header, warnings)
