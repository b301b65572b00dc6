"""The ToMe patch node: MODEL -> MODEL with token merging on a clone."""

from __future__ import annotations

from comfy_api.latest import io

from ..tokenreduce import stride_ratio_cap
from .common import (WINDOW_RANGES, builtin_tome_applied, done, model_input, node_id_of, outputs, patched_clone,
                     refuse_or_unchanged, refuse_stacking, window_inputs)
from .model_info import LEVEL_CHOICES, patch_target
from .preflight import tome_strides
from .tome_patch import ToMePatch, ToMeSettings
from .validation import check_choices, check_present, check_ranges, check_window, first_problem, is_number

NODE_ID = "TokenReduceToMe"  # public and permanent: saved workflows refer to it
MODE_FULL = "q, k, v (tomesd)"
MODE_QUERIES = "queries only (ComfyUI built-in)"
MODES = [MODE_FULL, MODE_QUERIES]
MATCH_WHOLE_GRID = "whole grid (tomesd)"
MATCHING = {MATCH_WHOLE_GRID: None, "3x3 cells": 1, "5x5 cells": 2}  # option -> reach in cells (None: every dst)
RANGES = {"ratio": (0.0, 1.0), "stride_x": (1, 8), "stride_y": (1, 8), **WINDOW_RANGES}


def _check_settings(ratio, stride_x, stride_y, max_downsample, mode, merge_attn, merge_crossattn, merge_mlp,
                    start_percent, end_percent, matching=None) -> str | None:
    """The reason these settings cannot work, or None. Shared by validation and execution."""
    return first_problem(
        check_choices({"max_downsample": max_downsample, "mode": mode, "matching": matching},
                      {"max_downsample": LEVEL_CHOICES, "mode": MODES, "matching": list(MATCHING)}),
        check_ranges({"ratio": ratio, "stride_x": stride_x, "stride_y": stride_y, "start_percent": start_percent,
                      "end_percent": end_percent}, RANGES),
        _check_cap(ratio, stride_x, stride_y),
        "nothing to merge: turn on at least one of merge_attn, merge_crossattn, merge_mlp."
        if (merge_attn, merge_crossattn, merge_mlp) == (False, False, False) else None,
        check_window(start_percent, end_percent),
    )


def _check_cap(ratio, stride_x, stride_y) -> str | None:
    if not all(map(is_number, (ratio, stride_x, stride_y))) or min(stride_x, stride_y) < 1:
        return None  # missing, not a number or out of range: reported by the range check
    cap = stride_ratio_cap(stride_x, stride_y)
    if ratio <= cap + 1e-9:
        return None
    return (f"ratio {ratio:g} cannot be reached with strides {stride_x}x{stride_y}: one token in every "
            f"{stride_x}x{stride_y} cell stays a merge target, so at most 1 - 1/({stride_x}*{stride_y}) = {cap:.4g} "
            f"of the tokens can merge. Lower the ratio to {cap:.4g} or less, or raise the strides.")


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
                model_input(),
                io.Float.Input("ratio", default=0.5, min=RANGES["ratio"][0], max=RANGES["ratio"][1], step=0.01,
                               tooltip="Fraction of tokens merged in each patched block. At most 1 - 1/(stride_x*stride_y) "
                                       "(0.75 for 2x2); higher values are rejected, not silently capped. 0 merges nothing."),
                io.Int.Input("stride_x", default=2, min=RANGES["stride_x"][0], max=RANGES["stride_x"][1],
                             tooltip="Width of the cells that each keep one token as merge target. Larger strides allow "
                                     "higher ratios but merge tokens that are further apart."),
                io.Int.Input("stride_y", default=2, min=RANGES["stride_y"][0], max=RANGES["stride_y"][1],
                             tooltip="Height of the cells that each keep one token as merge target."),
                io.Combo.Input("max_downsample", options=LEVEL_CHOICES, default="auto",
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
                # The frontend gives every INT input named "seed" a "control after generate" widget
                # (saved in workflows after the seed); declared so that the API says so too. Our
                # extension sets it to "fixed" on new nodes: a merge seed must not change per run.
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                             tooltip="Seed of the random merge targets. The same seed gives bit-identical results on "
                                     "every run, whatever sampler or noise node is used; the global RNG is untouched. "
                                     "Keep 'control after generate' on fixed for repeatable images."),
                *window_inputs("Merging"),
                # Added after the first release: last and optional, so saved workflows load unchanged.
                io.Boolean.Input("share_plans", default=False, optional=True,
                                 tooltip="Plan the merge once per level and model call (in the level's first block) "
                                         "and reuse it in its other blocks, instead of once per block as tomesd does. "
                                         "Saves most of the planning time, which matters at small sizes on fast "
                                         "attention; off is exact tomesd."),
                io.Combo.Input("matching", options=list(MATCHING), default=MATCH_WHOLE_GRID, optional=True,
                               tooltip="Where each token looks for its merge target: in the whole grid (tomesd: its "
                                       "cost grows with the square of the tokens, like the attention it saves) or "
                                       "only in the nearby cells (cost grows with the tokens; same quality in our "
                                       "benchmarks, much faster planning at large sizes)."),
            ],
            outputs=outputs(),
            hidden=[io.Hidden.unique_id],  # the graph node its run reports go to
        )

    @classmethod
    def validate_inputs(cls, ratio=None, stride_x=None, stride_y=None, max_downsample=None, mode=None,
                        merge_attn=None, merge_crossattn=None, merge_mlp=None, start_percent=None,
                        end_percent=None, matching=None) -> bool | str:
        problem = _check_settings(ratio, stride_x, stride_y, max_downsample, mode, merge_attn, merge_crossattn,
                                  merge_mlp, start_percent, end_percent, matching)
        return True if problem is None else problem

    @classmethod
    def execute(cls, model, ratio, stride_x, stride_y, max_downsample, mode, merge_attn, merge_crossattn,
                merge_mlp, use_rand, seed, start_percent, end_percent, share_plans=False,
                matching=MATCH_WHOLE_GRID) -> io.NodeOutput:
        matching = MATCH_WHOLE_GRID if matching is None else matching  # optional: null means not given
        problem = first_problem(
            check_present(dict(ratio=ratio, stride_x=stride_x, stride_y=stride_y, max_downsample=max_downsample, mode=mode,
                               merge_attn=merge_attn, merge_crossattn=merge_crossattn, merge_mlp=merge_mlp,
                               use_rand=use_rand, seed=seed, start_percent=start_percent, end_percent=end_percent)),
            _check_settings(ratio, stride_x, stride_y, max_downsample, mode, merge_attn, merge_crossattn, merge_mlp,
                            start_percent, end_percent, matching))
        if problem is not None:
            raise ValueError(f"{NODE_ID}: {problem}")
        refuse_stacking(model, NODE_ID)
        if builtin_tome_applied(model):
            raise ValueError(f"{NODE_ID}: ComfyUI's built-in TomePatchModel is already applied to this model. It merges "
                             f"the queries before this node sees them, so this node would be skipped in every block. "
                             f"Use one of the two (this node's mode 'queries only' computes what the built-in does).")
        target = patch_target(model, "ToMe", "max_downsample", max_downsample, lambda layout, level: layout.within(level))
        if target.sites is None:
            return refuse_or_unchanged(model, NODE_ID, target)
        settings = ToMeSettings(
            ratio=ratio, stride_x=stride_x, stride_y=stride_y, max_downsample=target.level,
            queries_only=(mode == MODE_QUERIES), merge_attn=merge_attn, merge_crossattn=merge_crossattn,
            merge_mlp=merge_mlp, use_rand=use_rand, seed=seed, share_plans=bool(share_plans),
            reach=MATCHING[matching],
        )
        levels = tuple(sorted({site.downsample for site in target.sites}))
        header = target.header("ToMe")
        patched, session = patched_clone(model, NODE_ID, start_percent, end_percent, header, node_id_of(cls),
                                         preflight=tome_strides(NODE_ID, levels, stride_x, stride_y),
                                         per_call_state=settings.share_plans)
        patch = ToMePatch(settings, session)
        patched.set_model_attn1_patch(patch.attn1)
        if merge_attn:
            patched.set_model_attn1_output_patch(patch.unmerge_output)
        if merge_crossattn:
            patched.set_model_attn2_patch(patch.attn2)
            patched.set_model_attn2_output_patch(patch.unmerge_output)
        if merge_mlp:
            for site in target.sites:
                feed_forward = patched.get_model_object(f"{site.path}.ff")
                patched.add_object_patch(f"{site.path}.ff.forward", patch.mlp_forward(site, feed_forward))

        stages = [name for name, on in (("self-attention " + ("queries" if settings.queries_only else "q, k, v"), merge_attn),
                                        ("cross-attention queries", merge_crossattn), ("MLP", merge_mlp)) if on]
        per_level = ", ".join(f"downsample {level}: {target.count_at(level)}"
                              for level in target.layout.levels if level <= target.level)
        return done(patched, f"ToMe on {target.family}: ratio {ratio:g}, strides {stride_x}x{stride_y}, "
                             f"max_downsample {target.level}: {len(target.sites)} of {len(target.layout.sites)} "
                             f"transformer blocks ({per_level}); merges {', '.join(stages)}; "
                             f"active from {start_percent:g} to {end_percent:g} of sampling; "
                             + (f"random targets, seed {seed}" if use_rand else "top-left targets")
                             + f"; matching in the {'whole grid' if settings.reach is None else matching}"
                             + ("; one plan per level and model call." if share_plans else "; one plan per block call."),
                    header)
