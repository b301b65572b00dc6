"""The ToMe patch node: MODEL -> MODEL with token merging on a clone."""

from __future__ import annotations

import logging

from comfy_api.latest import io

from ..tokenreduce import stride_ratio_cap
from .model_info import describe_sites, patch_target
from .session import PatchSession
from .tome_patch import ToMePatch, ToMeSettings

LOG = logging.getLogger("tokenreduce")

NODE_ID = "TokenReduceToMe"  # public and permanent: saved workflows refer to it
MAX_DOWNSAMPLE_CHOICES = ["auto", "1", "2", "4", "8"]
MODE_FULL = "q, k, v (tomesd)"
MODE_QUERIES = "queries only (ComfyUI built-in)"
MODES = [MODE_FULL, MODE_QUERIES]
# Declared once for the schema and for validate_inputs: ComfyUI skips its own min/max check for
# every input that a node's validate_inputs takes, so the node checks those ranges itself.
RANGES = {"ratio": (0.0, 1.0), "stride_x": (1, 8), "stride_y": (1, 8), "start_percent": (0.0, 1.0),
          "end_percent": (0.0, 1.0)}


def _check_settings(ratio, stride_x, stride_y, max_downsample, mode, merge_attn, merge_crossattn, merge_mlp,
                    start_percent, end_percent) -> str | None:
    """The reason these settings cannot work, or None. Shared by validation and execution.
    Values that are links (None at validation time) are checked when the node runs."""
    # This ComfyUI does not check V3 combo values against their options: we do.
    for name, value, options in (("max_downsample", max_downsample, MAX_DOWNSAMPLE_CHOICES),
                                 ("mode", mode, MODES)):
        if value is not None and value not in options:
            return f"{name} {value!r} is not one of {', '.join(map(repr, options))}."
    given = {"ratio": ratio, "stride_x": stride_x, "stride_y": stride_y, "start_percent": start_percent,
             "end_percent": end_percent}
    for name, value in given.items():
        low, high = RANGES[name]
        if value is not None and not low <= value <= high:
            return f"{name} {value:g} is out of range: it must be between {low:g} and {high:g}."
    if None not in (ratio, stride_x, stride_y):
        cap = stride_ratio_cap(stride_x, stride_y)
        if ratio > cap + 1e-9:
            return (f"ratio {ratio:g} cannot be reached with strides {stride_x}x{stride_y}: one token in "
                    f"every {stride_x}x{stride_y} cell stays a merge target, so at most "
                    f"1 - 1/({stride_x}*{stride_y}) = {cap:.4g} of the tokens can merge. "
                    f"Lower the ratio to {cap:.4g} or less, or raise the strides.")
    if merge_attn is False and merge_crossattn is False and merge_mlp is False:
        return "nothing to merge: turn on at least one of merge_attn, merge_crossattn, merge_mlp."
    if None not in (start_percent, end_percent) and start_percent > end_percent:
        return (f"start_percent {start_percent:g} is after end_percent {end_percent:g}: "
                f"merging would never be active.")
    return None


class ToMePatchNode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name="Token Merging (ToMe, TokenReduce)",
            category="model_patches/unet",
            description=(
                "Speeds up sampling by merging similar tokens before the UNet's attention and "
                "unmerging after (ToMe for SD). Works on SD1.x, SD2.x and SDXL; reports what it patched."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model (UNet) to patch. The input model is never changed."),
                io.Float.Input("ratio", default=0.5, min=RANGES["ratio"][0], max=RANGES["ratio"][1], step=0.01,
                               tooltip="Fraction of tokens merged in each patched block. At most 1 - 1/(stride_x*stride_y) "
                                       "(0.75 for 2x2); higher values are rejected, not silently capped. 0 merges nothing."),
                io.Int.Input("stride_x", default=2, min=RANGES["stride_x"][0], max=RANGES["stride_x"][1],
                             tooltip="Width of the cells that each keep one token as merge target. Larger strides allow "
                                     "higher ratios but merge tokens that are further apart."),
                io.Int.Input("stride_y", default=2, min=RANGES["stride_y"][0], max=RANGES["stride_y"][1],
                             tooltip="Height of the cells that each keep one token as merge target."),
                io.Combo.Input("max_downsample", options=MAX_DOWNSAMPLE_CHOICES, default="auto",
                               tooltip="Patch transformer blocks whose feature map is downsampled at most this much "
                                       "from the latent. auto: the finest level that has transformer blocks in this "
                                       "model (1 for SD1.x/2.x, 2 for SDXL). A value that patches no block is reported."),
                io.Combo.Input("mode", options=MODES, default=MODE_FULL,
                               tooltip="What self-attention computes from merged tokens: queries, keys and values "
                                       "(tomesd, fastest) or only the queries with full keys and values (ComfyUI's "
                                       "built-in TomePatchModel, closer to the unpatched model)."),
                io.Boolean.Input("merge_attn", default=True,
                                 tooltip="Merge tokens for self-attention (the main speed-up)."),
                io.Boolean.Input("merge_crossattn", default=False,
                                 tooltip="Also merge the queries of cross-attention (text). Small gain, costs quality."),
                io.Boolean.Input("merge_mlp", default=False,
                                 tooltip="Also merge the feed-forward input. Some gain at large sizes, costs quality."),
                io.Boolean.Input("use_rand", default=True,
                                 tooltip="Pick the merge target in each cell at random (better quality) from a private "
                                         "generator seeded by `seed`; off: always the top-left token."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF,
                             tooltip="Seed of the random merge targets. The same seed gives bit-identical results on "
                                     "every run, whatever sampler or noise node is used; the global RNG is untouched."),
                io.Float.Input("start_percent", default=0.0, min=RANGES["start_percent"][0], max=RANGES["start_percent"][1], step=0.001,
                               tooltip="Merging starts at this point of sampling (0 = first step, highest noise), "
                                       "measured in noise level like Kohya Deep Shrink, not in steps."),
                io.Float.Input("end_percent", default=1.0, min=RANGES["end_percent"][0], max=RANGES["end_percent"][1], step=0.001,
                               tooltip="Merging stops after this point of sampling (1 = last step)."),
            ],
            outputs=[
                io.Model.Output(tooltip="The patched model (a clone)."),
                io.String.Output("info", display_name="info", tooltip="What was patched, and any warning about settings that do nothing."),
            ],
        )

    @classmethod
    def validate_inputs(cls, ratio=None, stride_x=None, stride_y=None, max_downsample=None, mode=None,
                        merge_attn=None, merge_crossattn=None, merge_mlp=None, start_percent=None,
                        end_percent=None) -> bool | str:
        problem = _check_settings(ratio, stride_x, stride_y, max_downsample, mode, merge_attn, merge_crossattn,
                                  merge_mlp, start_percent, end_percent)
        return True if problem is None else problem

    @classmethod
    def execute(cls, model, ratio, stride_x, stride_y, max_downsample, mode, merge_attn, merge_crossattn,
                merge_mlp, use_rand, seed, start_percent, end_percent) -> io.NodeOutput:
        problem = _check_settings(ratio, stride_x, stride_y, max_downsample, mode, merge_attn, merge_crossattn,
                                  merge_mlp, start_percent, end_percent)
        if problem is not None:
            raise ValueError(f"{NODE_ID}: {problem}")
        target = patch_target(model, "ToMe", max_downsample)
        if target.sites is None:
            LOG.warning("%s", target.message)
            return io.NodeOutput(model, target.message, ui={"text": [target.message]})
        settings = ToMeSettings(
            ratio=ratio, stride_x=stride_x, stride_y=stride_y, max_downsample=target.max_downsample,
            queries_only=(mode == MODE_QUERIES), merge_attn=merge_attn, merge_crossattn=merge_crossattn,
            merge_mlp=merge_mlp, use_rand=use_rand, seed=seed,
        )
        patched = model.clone()
        session = PatchSession(f"{NODE_ID}", start_percent, end_percent)
        patch = ToMePatch(settings, session)
        patched.set_model_attn1_patch(patch.attn1)
        if merge_attn:
            patched.set_model_attn1_output_patch(patch.attn1_output)
        if merge_crossattn:
            patched.set_model_attn2_patch(patch.attn2)
            patched.set_model_attn2_output_patch(patch.attn2_output)
        if merge_mlp:
            for site in target.sites:
                feed_forward = patched.get_model_object(f"{site.path}.ff")
                patched.add_object_patch(f"{site.path}.ff.forward", patch.mlp_forward(site, feed_forward))
        session.attach(patched)

        stages = [name for name, on in (("self-attention " + ("queries" if settings.queries_only else "q, k, v"), merge_attn),
                                        ("cross-attention queries", merge_crossattn), ("MLP", merge_mlp)) if on]
        info = (f"ToMe on {target.family}: ratio {ratio:g}, strides {stride_x}x{stride_y}, "
                f"{describe_sites(target)}; merges {', '.join(stages)}; "
                f"active from {start_percent:g} to {end_percent:g} of sampling; "
                + (f"random targets, seed {seed}." if use_rand else "top-left targets."))
        LOG.info("%s", info)
        return io.NodeOutput(patched, info, ui={"text": [info]})
