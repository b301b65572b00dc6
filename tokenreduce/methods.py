"""ToMe and ToDo as the hosts show them: every input declared once (name, kind, default,
range or options, tooltip, whether it came later, whether it is an expert one), and the rules
across inputs. The ComfyUI nodes and the WebUI extension build their controls, validation and
settings from these.

The design card's inputs come first: ToMe's ratio, strides and max_downsample, ToDo's factor,
and both nodes' step window and reduce_when are shown; the rest are ``advanced`` (a host that
folds inputs shows them on request)."""

from __future__ import annotations

from .bipartite import stride_ratio_cap
from .downsample import METHODS as DOWNSAMPLE_METHODS
from .inputs import BOOL, CHOICE, FLOAT, INT, SEED, SEED_MAX, Input, Method, is_number
from .layout import DIT
from .peak_window import WINDOW

LEVEL_CHOICES = ("auto", "1", "2", "4", "8")  # downsample of a UNet level; auto: the model's finest

MODE_FULL = "q, k, v (tomesd)"
MODE_QUERIES = "queries only (ComfyUI built-in)"
MODE_PROPORTIONAL = "q, k, v + proportional attention"  # ToMe's own: a merged key weighs as its tokens
MATCH_WHOLE_GRID = "whole grid (tomesd)"
MATCHING_REACH = {MATCH_WHOLE_GRID: None, "3x3 cells": 1, "5x5 cells": 2}  # option -> reach in cells
MATCH_TILE = "tile (fast)"  # within its own stride cell, merged and restored as tome_dit does (no scatter)
MATCHING_CHOICES = (*MATCHING_REACH, MATCH_TILE)


REDUCE_AUTO, REDUCE_ALWAYS, REDUCE_REMEASURE = "auto", "always", "auto (measure again)"
AUTO_MARGIN = 0.03  # reduce_when auto: the reduced work must be at least this much faster (pays.MARGIN)


def reduce_when_input() -> Input:
    return Input("reduce_when", CHOICE, REDUCE_AUTO, options=(REDUCE_AUTO, REDUCE_ALWAYS, REDUCE_REMEASURE),
                 optional=True,
                 tooltip="auto: reduce only where it pays on this device. The first time a kind of attention call is "
                         "met, it is timed on the device, unreduced and reduced (a few milliseconds), and reduced only "
                         f"where that is at least {AUTO_MARGIN * 100:g} % faster; the decision is kept in a file, so "
                         "identical runs give identical images, also after a restart. The decisions are kept in "
                         "ComfyUI's user directory, tokenreduce/auto_decisions.json (Forge: its data directory); the "
                         "report names the file. CPUs reduce every size without timing (it paid "
                         "at every size measured; max_change still applies). Where it measures, the node's report shows the times. always: "
                         "reduce wherever the other settings say. auto (measure again): as auto, but time each kind "
                         "anew once and replace the kept decisions.")


def measure_change_input() -> Input:
    return Input("measure_change", BOOL, False, optional=True, advanced=True,
                 tooltip="Also run the model once unreduced at the first reduced step and report how much the "
                         "reduction changed its prediction (relative L2 of that one model call's output: one step, "
                         "not the final image's change). Costs one model call per run and the memory of an "
                         "unreduced call; the image is unchanged.")


MAX_CHANGE_DEFAULT = 0.05  # reduce_when auto's quality budget (docs/quality.md, "A quality budget for auto")


def max_change_input() -> Input:
    return Input("max_change", FLOAT, MAX_CHANGE_DEFAULT, low=0.0, high=2.0, step=0.01, optional=True, advanced=True,
                 tooltip="reduce_when auto's quality budget: a kind of call whose reduction changes the output of "
                         "the block it reduces by more than this (relative L2: 0.05 = 5 %) is left alone; measured "
                         "once with the speed decision and kept with it (the block on the model call's own inputs), "
                         "and the report says so. A run covering part of sampling (image to image, a hires pass: "
                         "denoise below 1) weighs the change by the cube root of that share, so denoise 0.125 "
                         "halves it. Applies on a CPU too (each side run once, untimed). Each block is decided on "
                         "its own: ToDo's nearest, else the window, else nothing; ToMe's ratio, else half of it, "
                         "else nothing. On UNets a block's change is read at the first step and held against the "
                         "budget alone; on DiTs it is read at 3/4 of sampling, counted twice, and the blocks' "
                         "changes are summed within the budget. 0 = no budget: speed alone decides. reduce_when "
                         "always ignores it.")


def window_inputs(what: str) -> tuple[Input, Input]:
    return (
        Input("start_percent", FLOAT, 0.0, low=0.0, high=1.0, step=0.001,
              tooltip=f"{what} starts at this point of sampling (0 = first step, highest noise), measured "
                      f"in noise level like Kohya Deep Shrink, not in steps."),
        Input("end_percent", FLOAT, 1.0, low=0.0, high=1.0, step=0.001,
              tooltip=f"{what} stops after this point of sampling (1 = last step)."),
    )


def _window_order(values: dict) -> str | None:
    start, end = values.get("start_percent"), values.get("end_percent")
    if is_number(start) and is_number(end) and start > end:
        return f"start_percent {start:g} is after end_percent {end:g}: the patch would never be active."
    return None


def _ratio_within_cap(values: dict) -> str | None:
    ratio, stride_x, stride_y = values.get("ratio"), values.get("stride_x"), values.get("stride_y")
    stride_t = values.get("stride_t")
    stride_t = 1 if stride_t is None else stride_t  # optional: missing means its default
    if not all(map(is_number, (ratio, stride_x, stride_y, stride_t))) or min(stride_x, stride_y, stride_t) < 1:
        return None  # missing, not a number or out of range: said by the input's own check
    cap = stride_ratio_cap(stride_x, stride_y, stride_t)
    if ratio <= cap + 1e-9:
        return None
    if stride_t == 1:
        return (f"ratio {ratio:g} cannot be reached with strides {stride_x}x{stride_y}: one token in every "
                f"{stride_x}x{stride_y} cell stays a merge target, so at most 1 - 1/({stride_x}*{stride_y}) = "
                f"{cap:.4g} of the tokens can merge. Lower the ratio to {cap:.4g} or less, or raise the strides.")
    return (f"ratio {ratio:g} cannot be reached with strides {stride_x}x{stride_y} and stride_t {stride_t}: one token "
            f"in every tile of {stride_t} latent frames x {stride_x}x{stride_y} stays a merge target, so at most "
            f"1 - 1/({stride_t}*{stride_x}*{stride_y}) = {cap:.4g} of the tokens can merge (on video DiTs; "
            f"{stride_ratio_cap(stride_x, stride_y):.4g} on image models). Lower the ratio to {cap:.4g} or less, "
            f"or raise the strides.")


def tome_without_frames(label: str, settings, model: str) -> list[str]:
    """ToMe on a model without latent frames (image DiTs, UNets), where stride_t does nothing:
    the warning that says so (none at stride_t 1); a ratio only stride_t made reachable is
    refused (ValueError), never quietly merged less."""
    s = settings
    if s.stride_t <= 1:
        return []
    cap = stride_ratio_cap(s.stride_x, s.stride_y)
    if s.ratio > cap + 1e-9:
        raise ValueError(f"{label}: ratio {s.ratio:g} cannot be reached on this {model} model: it has no latent "
                         f"frames, so stride_t {s.stride_t} does nothing, and with strides {s.stride_x}x{s.stride_y} "
                         f"at most 1 - 1/({s.stride_x}*{s.stride_y}) = {cap:.4g} of the tokens can merge. Lower the "
                         f"ratio to {cap:.4g} or less, or raise stride_x / stride_y.")
    return [f"WARNING: stride_t {s.stride_t} does nothing: {model} has no latent frames (only video DiTs merge "
            f"across frames)."]


# ToMe's inputs that whole-block merging on DiTs does not read (their tooltips say "UNets only")
TOME_UNET_ONLY = ("max_downsample", "mode", "merge_attn", "merge_crossattn", "merge_mlp", "matching")
UNETS_ONLY = " UNets only (DiTs ignore it)."


def tome_unet_only(settings, model: str) -> list[str]:
    """ToMe on a DiT, where the UNet-only inputs do nothing: the warning that names those set away
    from their defaults (none where all are at their defaults)."""
    changed = [f"{spec.name} {_shown(getattr(settings, spec.name))}" for spec in TOME.inputs
               if spec.name in TOME_UNET_ONLY and getattr(settings, spec.name) != spec.default]
    if not changed:
        return []
    listed = changed[0] if len(changed) == 1 else f"{', '.join(changed[:-1])} and {changed[-1]}"
    return [f"WARNING: {listed} {'does' if len(changed) == 1 else 'do'} nothing on {model}: ToMe merges its whole "
            f"blocks (every token matched within its tile); "
            f"{'this input applies' if len(changed) == 1 else 'these inputs apply'} to UNets only."]


def tome_dit_only(settings, model: str) -> list[str]:
    """ToMe on a UNet, where correct_from_whole does nothing (it corrects whole-block merging on
    DiTs): the warning that says so (none where it is off)."""
    if not getattr(settings, "correct_from_whole", False):
        return []
    return [f"WARNING: correct_from_whole does nothing on {model}: it corrects ToMe's whole-block merging on DiTs; "
            f"on UNets ToMe merges inside self-attention (see mode)."]


def _shown(value) -> str:
    """A setting's value as the node shows it (a switch: on / off)."""
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def _something_to_merge(values: dict) -> str | None:
    if (values.get("merge_attn"), values.get("merge_crossattn"), values.get("merge_mlp")) == (False, False, False):
        return "nothing to merge: turn on at least one of merge_attn, merge_crossattn, merge_mlp."
    return None


def _plan_reuse_needs_shared_plans(values: dict) -> str | None:
    every = values.get("plan_every")
    if is_number(every) and every > 1 and values.get("share_plans") is False:
        return (f"plan_every {every:g} reuses the shared plan across steps, and share_plans is off (a plan per "
                f"block): turn on share_plans, or set plan_every to 1.")
    return None


def _correction_needs_plan_reuse(values: dict) -> str | None:
    every = values.get("plan_every", 1)
    if values.get("correct_from_whole") is True and is_number(every) and every < 2:
        return ("correct_from_whole keeps each merged block's difference from the whole block with the plan it "
                "was made with and adds it in the steps that reuse that plan, and plan_every is 1 (no step reuses a "
                "plan): set plan_every to 2 or more (with share_plans on), or turn correct_from_whole off.")
    return None


def _something_to_downsample(values: dict) -> str | None:
    if values.get("factor") == 1 and values.get("factor_next") == 1:
        return "nothing to downsample: factor and factor_next are both 1. Set factor to 2 or more."
    return None


TOME = Method("ToMe", (
    Input("ratio", FLOAT, 0.5, low=0.0, high=1.0, step=0.01,
          tooltip="Fraction of tokens merged in each patched block. At most 1 - 1/(stride_x*stride_y) (0.75 for "
                  "2x2; on video DiTs 1 - 1/(stride_t*stride_x*stride_y)); higher values are rejected, not silently "
                  "capped. 0 merges nothing."),
    Input("stride_x", INT, 2, low=1, high=8,
          tooltip="Width of the cells that each keep one token as merge target. Larger strides allow higher "
                  "ratios but merge tokens that are further apart."),
    Input("stride_y", INT, 2, low=1, high=8, tooltip="Height of the cells that each keep one token as merge target."),
    Input("max_downsample", CHOICE, "auto", options=LEVEL_CHOICES,
          tooltip="Patch transformer blocks whose feature map is downsampled at most this much from the latent. "
                  "auto: the finest level that has transformer blocks in this model (1 for SD1.x/2.x, 2 for "
                  "SDXL). A value that patches no block is reported." + UNETS_ONLY),
    Input("mode", CHOICE, MODE_FULL, options=(MODE_FULL, MODE_QUERIES, MODE_PROPORTIONAL), advanced=True,
          tooltip="What self-attention computes from merged tokens: queries, keys and values (tomesd, fastest); "
                  "only the queries with full keys and values (ComfyUI's built-in TomePatchModel, closer to "
                  "the unpatched model); or q, k, v with proportional attention (each merged key counts as the "
                  "tokens it stands for: the log of their number added to its logits, as the original ToMe does; "
                  "as fast in arithmetic, much closer to the unpatched model on our trained SD fixture, but the "
                  "attention call takes a bias, which keeps GPUs off their fastest kernel). Proportional: "
                  "ComfyUI and diffusers (Forge refuses it for now)." + UNETS_ONLY),
    Input("merge_attn", BOOL, True, advanced=True,
          tooltip="Merge tokens for self-attention (the main speed-up)." + UNETS_ONLY),
    Input("merge_crossattn", BOOL, False, advanced=True,
          tooltip="Also merge the queries of cross-attention (text). Small gain, costs quality." + UNETS_ONLY),
    Input("merge_mlp", BOOL, False, advanced=True,
          tooltip="Also merge the feed-forward input. Some gain at large sizes, costs quality." + UNETS_ONLY),
    Input("use_rand", BOOL, True, advanced=True,
          tooltip="Pick the merge target in each cell at random (better quality) from a private generator "
                  "seeded by `seed`; off: always the top-left token."),
    Input("seed", SEED, 0, low=0, high=SEED_MAX, host_checked=True, advanced=True,
          tooltip="Seed of the random merge targets. The same seed gives bit-identical results on every run, "
                  "whatever sampler or noise node is used; the global RNG is untouched. Keep 'control after "
                  "generate' on fixed for repeatable images."),
    *window_inputs("Merging"),
    Input("share_plans", BOOL, False, optional=True, advanced=True,
          tooltip="Plan the merge once per level and model call (in the level's first block) and reuse it in "
                  "its other blocks, instead of once per block as tomesd does. Saves most of the planning time, "
                  "which matters at small sizes on fast attention; off plans per block, as tomesd does."),
    Input("matching", CHOICE, MATCH_WHOLE_GRID, options=MATCHING_CHOICES, optional=True, advanced=True,
          tooltip="Where each token looks for its merge target: in the whole grid (tomesd: its cost grows with "
                  "the square of the tokens, like the attention it saves), only in the nearby cells (cost "
                  "grows with the tokens; same quality in our benchmarks, much faster planning at large sizes), "
                  "or tile (fast): only its own stride_x x stride_y cell's target (cheapest planning; merged by "
                  "per-cell sums and restored by one gather, no scatter operations). UNets only (DiTs always "
                  "match within the tile)."),
    reduce_when_input(),
    Input("stride_t", INT, 1, low=1, high=8, optional=True, advanced=True,
          tooltip="Video DiTs (Wan, HunyuanVideo, LTX-Video): the number of latent frames per tile, each tile "
                  "keeping one token as merge target, so tokens also merge across this many frames (never the first "
                  "latent frame: it is in no tile, nor are the frames left over after it where the others are not "
                  "a multiple). 1 = each frame on its own. Image "
                  "models and UNets have no frames: there it does nothing (a value above 1 is reported)."),
    Input("plan_every", INT, 1, low=1, high=50, optional=True, advanced=True,
          tooltip="Reuse the shared merge plan across steps: a plan is made at one step and reused by the next "
                  "plan_every - 1 steps (distinct noise levels) in the model calls of the same size and the same "
                  "conditioning rows (cond and uncond never share), then made anew. Needs share_plans. Saves "
                  "planning time where the tokens change little from step to step; 1 = a new plan every model "
                  "call."),
    measure_change_input(),
    max_change_input(),
    Input("min_similarity", FLOAT, 0.0, low=0.0, high=1.0, step=0.01, optional=True, advanced=True,
          tooltip="Merge a token only where it is at least this alike to its merge target (cosine similarity of "
                  "their features, 1 = identical): ratio is then the most that merges, and fewer merge where the "
                  "picture is not alike, so a textured region stays whole while a flat one merges. 0 = off: "
                  "ratio's count always merges, the most alike first (tomesd). Costs one read from the device per "
                  "plan; the count merged is rounded down to an eighth of ratio's."),
    Input("correct_from_whole", BOOL, False, optional=True, advanced=True,
          tooltip="DiTs: on each step that makes a merge plan (see plan_every), every merged block also runs "
                  "whole, gives its whole output, and keeps the difference from its merged output; the steps "
                  "that reuse the plan add that difference to their merged output. Removes most of the mosaic "
                  "merging leaves on models with peaked attention (our trained Flux fixture at 20 steps with "
                  "plan_every 5: LPIPS 0.56 -> 0.09), for one whole block run per plan and one block output kept "
                  "in memory per merged block. Needs plan_every 2 or more (and share_plans). UNets: does "
                  "nothing (reported)."),
), checks=(_ratio_within_cap, _something_to_merge, _window_order, _plan_reuse_needs_shared_plans,
           _correction_needs_plan_reuse))

TODO = Method("ToDo", (
    Input("factor", FLOAT, 2.0, low=1.0, high=8.0, step=0.1,
          tooltip="Pooling factor per side for keys/values at the first patched level: 2 gives 4x fewer keys. "
                  "Non-integer factors work (the grid is rounded up). 1 = off."),
    Input("factor_next", FLOAT, 1.0, low=1.0, high=8.0, step=0.1, advanced=True,
          tooltip="Pooling factor per side at the next coarser level (twice the downsample of the first). 1 = off."),
    Input("level", CHOICE, "auto", options=LEVEL_CHOICES, advanced=True,
          tooltip="The first patched level, as downsample of its feature map relative to the latent. auto: the "
                  "finest level with transformer blocks in this model (1 for SD1.x/2.x, 2 for SDXL), so the same "
                  "settings mean the same on both."),
    Input("method", CHOICE, "nearest", options=(*DOWNSAMPLE_METHODS, WINDOW), advanced=True,
          tooltip="How keys/values are pooled on the grid: nearest (strided subsampling, fastest), average (mean "
                  "of each cell), bilinear or bicubic (antialiased interpolation). window (DiTs and UNets): "
                  "each tile of queries also sees its neighbourhood exactly and the 16 keys with the most "
                  "attention, the strided keys weighted by the tokens each stands for; much closer to the "
                  "unpatched picture on trained models, but slower: on one CPU thread about 1.5x nearest's "
                  "time on a 64x64 grid, 4x on a 32x32 one (GPU not measured)."),
    *window_inputs("Downsampling"),
    Input("temporal_factor", FLOAT, 1.0, low=1.0, high=8.0, step=0.5, optional=True, advanced=True,
          tooltip="Video DiTs (Wan, HunyuanVideo): also keep the keys/values of one frame in every this many "
                  "(the first frame is always kept). 1 = off. Image models ignore it (a value above 1 is reported)."),
    Input("skip_first_blocks", INT, 1, low=0, high=64, optional=True, advanced=True,
          tooltip="DiTs: leave this many of the model's first blocks unreduced (they lay out the image). UNets "
                  "ignore it."),
    Input("skip_last_blocks", INT, 1, low=0, high=64, optional=True, advanced=True,
          tooltip="DiTs: leave this many of the model's last blocks unreduced (they settle the details). UNets "
                  "ignore it."),
    reduce_when_input(),
    measure_change_input(),
    max_change_input(),
), checks=(_something_to_downsample, _window_order))

DIT_METHODS_WITH_ROPE = ("nearest",)  # keys that carry rotated positions are selected, never averaged
DIT_METHODS = ("nearest", "average")


def tome_reach(settings) -> int | None:
    """How many cells around its own a token looks for its merge target (None: everywhere)."""
    return MATCHING_REACH.get(settings.matching)


def tile_matching(settings) -> bool:
    """Whether each token is matched within its own cell only (``MATCH_TILE``)."""
    return settings.matching == MATCH_TILE


def todo_level_factors(level: int, settings) -> list[tuple[str, int, float]]:
    """(input name, downsample level, factor) of each ToDo factor that pools (> 1), from the
    first patched level."""
    return [(name, lv, f) for name, lv, f in (("factor", level, settings.factor),
                                               ("factor_next", level * 2, settings.factor_next)) if f > 1]


def dit_blocks(sites, settings) -> tuple:
    """The DiT blocks ToDo reduces: all but the first and last ones the settings leave alone."""
    return tuple(sites[settings.skip_first_blocks: max(settings.skip_first_blocks,
                                                        len(sites) - settings.skip_last_blocks)])


def todo_select(settings):
    """The sites a ToDo setting reduces, as ``layout.resolve`` asks for them: the levels its
    factors pool (UNets); the blocks the skip settings leave (DiTs, one level). Every host
    selects with this."""
    def select(layout, level):
        sites = layout.at({lv for _, lv, _ in todo_level_factors(level, settings)})
        return dit_blocks(sites, settings) if layout.kind == DIT else sites
    return select


TOME_DIT_SKIP = 1  # DiTs: ToMe leaves this many first and last blocks whole (they lay out the image, settle details)


def tome_select(layout, level):
    """The sites ToMe merges: every block down to its max_downsample level (UNets); on DiTs every
    block but the first and last ``TOME_DIT_SKIP``, as ToDo's defaults leave them."""
    sites = layout.within(level)
    if layout.kind == DIT:
        return tuple(sites[TOME_DIT_SKIP: max(TOME_DIT_SKIP, len(sites) - TOME_DIT_SKIP)])
    return sites


def dit_method_problem(label: str, family, method: str) -> str | None:
    """Why ToDo's ``method`` cannot reduce this DiT ``family`` (None: it can); every host says this.
    window runs on every DiT family and host (its keys keep their positions, as nearest's)."""
    if method == WINDOW:
        return None
    allowed = DIT_METHODS_WITH_ROPE if family.rope else DIT_METHODS
    if method in allowed:
        return None
    return (f"{label}: method {method!r} does not work on {family.name}: "
            + ("its keys carry rotary positions when they reach attention, and averaging them would mix positions; "
               "use nearest, which keeps each key's own position." if family.rope else
               f"on DiTs ToDo pools with {' or '.join(DIT_METHODS)}."))
