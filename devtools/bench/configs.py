"""The configurations the benchmark compares, as data.

A configuration is a name, the series it belongs to in the plots (its method kind) and the
patch nodes it applies, in order, each with the inputs it changes from that node's declared
defaults (``TOME.defaults()``, ``TODO.defaults()``, the built-in's schema default). Everything
else follows from those settings: the token reduction plotted on the x axis and what the
configuration reduces for the Amdahl bound (which parts of self-attention and the MLP, at
which UNet levels, down to which fraction of their cost).

Host-free: imports only the pack's ``tokenreduce.methods`` (pure Python).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Mapping

from . import REPO

if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # last: ComfyUI's own top-level ``nodes`` module must win over ours

from tokenreduce.methods import (MATCH_TILE, MODE_PROPORTIONAL, MODE_QUERIES, REDUCE_ALWAYS, TODO, TOME,  # noqa: E402
                                 todo_level_factors)

TOME_NODE, TODO_NODE, BUILTIN_NODE = "tome", "todo", "builtin"
# ComfyUI's TomePatchModel declares one input besides the model (tests check this against its schema).
BUILTIN_DEFAULTS = {"ratio": 0.3}
BUILTIN_MAX_LEVEL = 1  # it merges the queries of the downsample-1 blocks only (none on SDXL)
LOCAL = "3x3 cells"  # a `matching` option of our ToMe

# Parts of a transformer block the Amdahl breakdown times: self-attention's projections and
# the attention itself ("core"), and the MLP ("ff").
ATTENTION_PARTS = ("q", "k", "v", "out", "core")
PARTS = ATTENTION_PARTS + ("ff",)


# The benchmark's models have random weights, which say nothing of quality: reduce_when auto's quality
# budget is off there (a configuration sets max_change to measure it: budget_table.py). At full size
# and the defaults it never binds on random weights anyway (docs/quality.md), but it does on the tiny
# test models, whose blocks a reduction changes more.
BENCHMARK_INPUTS = {"max_change": 0.0}


def _declared_defaults(kind: str) -> dict:
    defaults = {TOME_NODE: TOME.defaults, TODO_NODE: TODO.defaults, BUILTIN_NODE: BUILTIN_DEFAULTS.copy}[kind]()
    return {**defaults, **{k: v for k, v in BENCHMARK_INPUTS.items() if k in defaults}}


@dataclass(frozen=True)
class Node:
    """One patch node a configuration applies: its kind and the inputs it sets."""

    kind: str  # TOME_NODE, TODO_NODE or BUILTIN_NODE
    changes: tuple[tuple[str, object], ...] = ()  # (input, value), the rest at the declared defaults

    def __post_init__(self):
        unknown = {name for name, _ in self.changes} - set(_declared_defaults(self.kind))
        if unknown:
            raise ValueError(f"{self.kind} has no input {sorted(unknown)}")
        method = {TOME_NODE: TOME, TODO_NODE: TODO}.get(self.kind)
        problem = method.problem(self.settings) if method else None
        if problem:
            raise ValueError(f"{self.kind}: {problem}")

    @property
    def settings(self) -> dict:
        """Every input the node is given: its declared defaults with this node's changes."""
        return {**_declared_defaults(self.kind), **dict(self.changes)}

    @property
    def reduction(self) -> float:
        """Fraction of self-attention's tokens (queries or keys) it removes at its first level."""
        s = self.settings
        return 1 - 1 / s["factor"] ** 2 if self.kind == TODO_NODE else s["ratio"]

    def scales(self, levels: tuple[int, ...]) -> dict[int, dict[str, float]]:
        """{level: {part: fraction of its cost left}} for the parts it reduces, on a UNet whose
        transformer levels are ``levels`` (finest first). A part reduced in proportion to the
        tokens it keeps: merged queries (ToMe, the built-in) shrink the query and output
        projections and the attention; merged keys and values also their projections, and
        the attention by the square; pooled keys and values (ToDo) their projections and the
        attention by factor^2. Cross-attention merging is not in the breakdown."""
        s, first = self.settings, levels[0]
        if self.kind == TODO_NODE:
            start = first if s["level"] == "auto" else int(s["level"])
            return {level: {"k": 1 / f ** 2, "v": 1 / f ** 2, "core": 1 / f ** 2}
                    for _, level, f in todo_level_factors(start, TODO.settings(s)) if level in levels}
        kept = 1 - s["ratio"]
        if self.kind == BUILTIN_NODE:
            max_level, queries_only, attn, mlp = BUILTIN_MAX_LEVEL, True, True, False
        else:
            max_level = first if s["max_downsample"] == "auto" else int(s["max_downsample"])
            queries_only, attn, mlp = s["mode"] == MODE_QUERIES, s["merge_attn"], s["merge_mlp"]
        parts = {}
        if attn:
            parts = ({"q": kept, "out": kept, "core": kept} if queries_only else
                     {"q": kept, "k": kept, "v": kept, "out": kept, "core": kept * kept})
        if mlp:
            parts["ff"] = kept
        return {level: dict(parts) for level in levels if level <= max_level and parts}


@dataclass(frozen=True)
class Config:
    name: str
    method: str  # its series in the plots: unpatched, builtin, tome, tome-3x3, todo, ...
    nodes: tuple[Node, ...] = ()  # applied in this order, the first closest to the model loader

    @property
    def reduction(self) -> float:
        """Tokens removed at the first level: the largest of its nodes' (x axis of the plots)."""
        return max((node.reduction for node in self.nodes), default=0.0)

    def scales(self, levels: tuple[int, ...]) -> dict[int, dict[str, float]]:
        """What it reduces for the Amdahl bound: {level: {part: fraction of its cost left}},
        the fractions of stacked nodes multiplied."""
        out: dict[int, dict[str, float]] = {}
        for node in self.nodes:
            for level, parts in node.scales(levels).items():
                for part, scale in parts.items():
                    out.setdefault(level, {})[part] = out.get(level, {}).get(part, 1.0) * scale
        return out

    def apply(self, model, appliers: Mapping[str, Callable]):
        """The model with this configuration's nodes applied; ``appliers[kind](model, settings)``
        runs a node as ComfyUI would and returns its MODEL output. Raises ValueError where a
        node refuses the model."""
        for node in self.nodes:
            model = appliers[node.kind](model, node.settings)
        return model


def tome(**changes) -> Node:
    return Node(TOME_NODE, tuple(changes.items()))


def todo(**changes) -> Node:
    return Node(TODO_NODE, tuple(changes.items()))


def builtin(**changes) -> Node:
    return Node(BUILTIN_NODE, tuple(changes.items()))


QUERIES = {"mode": MODE_QUERIES}
ALWAYS = {"reduce_when": REDUCE_ALWAYS}  # no auto rule: the setting runs on every call

CONFIGS: tuple[Config, ...] = (
    Config("unpatched", "unpatched"),
    Config("built-in ToMe 0.3 (its default)", "builtin", (builtin(),)),
    Config("built-in ToMe 0.5", "builtin", (builtin(ratio=0.5),)),
    Config("ToMe 0.3", "tome", (tome(ratio=0.3),)),
    Config("ToMe 0.5", "tome", (tome(ratio=0.5),)),
    Config("ToMe 0.7", "tome", (tome(ratio=0.7),)),
    Config("ToMe 0.5 3x3", "tome-3x3", (tome(ratio=0.5, matching=LOCAL),)),
    Config("ToMe 0.5 shared plans", "tome-shared", (tome(ratio=0.5, share_plans=True),)),
    Config("ToMe 0.3 queries only", "tome-queries", (tome(ratio=0.3, **QUERIES),)),
    Config("ToMe 0.5 queries only", "tome-queries", (tome(ratio=0.5, **QUERIES),)),
    Config("ToMe 0.3 queries only 3x3", "tome-queries-3x3", (tome(ratio=0.3, matching=LOCAL, **QUERIES),)),
    Config("ToMe 0.5 queries only 3x3", "tome-queries-3x3", (tome(ratio=0.5, matching=LOCAL, **QUERIES),)),
    Config("ToMe 0.5 queries only shared plans", "tome-queries-shared",
           (tome(ratio=0.5, share_plans=True, **QUERIES),)),
    # issue #50: proportional attention (each merged key weighed by its tokens; a biased attention call)
    Config("ToMe 0.5 proportional", "tome", (tome(ratio=0.5, mode=MODE_PROPORTIONAL),)),
    Config("ToMe 0.75 proportional", "tome", (tome(ratio=0.75, mode=MODE_PROPORTIONAL),)),
    Config("ToMe 0.5 + MLP", "tome-mlp", (tome(ratio=0.5, merge_mlp=True),)),
    Config("ToMe 0.5 queries + MLP to downsample 4 3x3", "tome-mlp",
           (tome(ratio=0.5, merge_mlp=True, max_downsample="4", matching=LOCAL, **QUERIES),)),
    Config("ToDo 1.5", "todo", (todo(factor=1.5),)),
    Config("ToDo 2", "todo", (todo(factor=2.0),)),
    Config("ToDo 3", "todo", (todo(factor=3.0),)),
    Config("ToDo 4", "todo", (todo(factor=4.0),)),
    Config("ToDo 2 + next 2", "todo-next", (todo(factor=2.0, factor_next=2.0),)),
    Config("ToDo 3 + next 2", "todo-next", (todo(factor=3.0, factor_next=2.0),)),
    Config("ToDo 4 + next 2", "todo-next", (todo(factor=4.0, factor_next=2.0),)),
    Config("ToDo 2 + time 2", "todo-time", (todo(factor=2.0, temporal_factor=2.0),)),  # video DiTs
    Config("ToDo 2 average", "todo-average", (todo(factor=2.0, method="average"),)),  # not on RoPE DiTs
    Config("ToMe 0.5 queries + ToDo 2", "combined", (tome(ratio=0.5, **QUERIES), todo(factor=2.0))),
    # Issue #38 (the --gpu-table-tome preset): both nodes at their defaults stacked, and ToMe's
    # candidates for SDXL and SD1.5 at 1024 px (tile matching, the MLP and cross-attention too, deeper levels).
    Config("ToMe 0.5 + ToDo 2", "combined", (tome(ratio=0.5), todo(factor=2.0))),
    Config("ToMe 0.5 tile", "tome-tile", (tome(ratio=0.5, matching=MATCH_TILE),)),
    Config("ToMe 0.5 tile + MLP + cross", "tome-tile", (tome(ratio=0.5, matching=MATCH_TILE, merge_mlp=True,
                                                             merge_crossattn=True),)),
    Config("ToMe 0.5 to downsample 4", "tome", (tome(ratio=0.5, max_downsample="4"),)),
    Config("ToMe 0.5 queries + ToDo 4", "combined", (tome(ratio=0.5, **QUERIES), todo(factor=4.0))),
    # Issue #38: a plan reused across steps (one plan per 4 steps, shared by the blocks): Flux.1, and
    # SDXL with tile matching
    Config("ToMe 0.5 shared plans every 4", "tome-shared", (tome(ratio=0.5, share_plans=True, plan_every=4),)),
    Config("ToMe 0.5 tile shared plans every 4", "tome-shared",
           (tome(ratio=0.5, matching=MATCH_TILE, share_plans=True, plan_every=4),)),
    # Issue #50 (the --gpu-table-peaks preset): the new settings beside the old at the same token
    # count, each run (reduce_when always), so the speed is the setting's and not auto's decision.
    Config("ToDo 2 always", "todo", (todo(factor=2.0, **ALWAYS),)),
    Config("ToDo 2 window always", "todo-window", (todo(factor=2.0, method="window", **ALWAYS),)),
    Config("ToMe 0.5 always", "tome", (tome(ratio=0.5, **ALWAYS),)),
    Config("ToMe 0.5 proportional always", "tome", (tome(ratio=0.5, mode=MODE_PROPORTIONAL, **ALWAYS),)),
    Config("ToMe 0.5 min_similarity 0.01 always", "tome", (tome(ratio=0.5, min_similarity=0.01, **ALWAYS),)),
    Config("ToMe 0.5 shared plans every 2 always", "tome-shared",
           (tome(ratio=0.5, share_plans=True, plan_every=2, **ALWAYS),)),
    Config("ToMe 0.5 shared plans every 2 corrected always", "tome-corrected",
           (tome(ratio=0.5, share_plans=True, plan_every=2, correct_from_whole=True, **ALWAYS),)),
)
BY_NAME: dict[str, Config] = {config.name: config for config in CONFIGS}
UNPATCHED = BY_NAME["unpatched"]


def select(names: list[str] | None) -> list[Config]:
    """The named configurations in the catalogue's order, unpatched always first; all of
    them without names. Raises SystemExit naming unknown ones."""
    unknown = sorted(set(names or []) - set(BY_NAME))
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {sorted(BY_NAME)}")
    return [c for c in CONFIGS if not names or c is UNPATCHED or c.name in names]
