"""ToDo and ToMe on UNets under the quality budget, decided per block (issue #51).

With a budget (``max_change``), which transformer blocks of a UNet a node reduces, and how, is
decided block by block, not per level: the blocks of one level share their shapes, not their
weights, and a level was decided by its first block alone. Speed stays a matter of the level (its
blocks make the same calls: timed once, on the first, as before); the change is read per block:

- **The unit is the level's, per block**: each block's output on the input the model hands it in
  the run's first call, whole and reduced each way of the ladder (ToDo: the node's method, then
  the window; ToMe: the node's ratio, then half of it). One rehearsal of the call (below every
  host wrapper, no TokenReduce context: ``ModelCall.rehearse``) reads every block: a forward
  pre-hook on each, alive only while it runs, runs the block on copies of its input (ComfyUI's
  blocks add to their input in place) and hands the model on unchanged.
- **Each block against the budget alone** (``pays.grade_each``): the unit is the one the levels'
  budget was set by, and summed over a level's blocks it would refuse what leaves the SD
  fixture's picture alone.
- **Kept per block and model**: each block's change is a decision of its own in the file, under
  the level's kind, the block's key and its own weights' fingerprint.

Where the host cannot run a call again, or the rehearsal never reaches a block, the levels are
decided as before (their first block).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .describe import level_text
from .grid import grid_at
from .late_blocks import NotRehearsed, grade, once_per_run, reached, say_graded
from .measure import measuring_options
from .pays import Decision, Work, relative_change
from .run import ModelCall, RunState, call_context

GRADED = "graded"  # call context: site key -> how that block is reduced (the blocks left alone absent)


class BlockChoice(NamedTuple):
    """What the per-block budget decided for a kind of model call."""

    methods: dict  # site key -> the method (ToDo) or ratio (ToMe) it runs; blocks left alone absent
    levels: dict  # level -> the methods its chosen blocks run (levels with none absent)


class UNetBlockBudget:
    """The per-block budget of a UNet patch (``todo_patch.ToDoPatch``, ``tome_patch.ToMePatch``).
    The patch gives ``unet`` (``measure.UNetLevels``), ``rule``, ``context_key``, ``call_key`` and:

    - ``_block_ladder()``: the methods a block may run, the most reducing first;
    - ``_speed_pays(run, call, level, method)``: whether the level's calls pay reduced so (speed
      alone: ``budgeted=False``);
    - ``_level_kind(call, level, method)``: the level's kind of call reduced so;
    - ``_block_context(run, call, level, method)``: a call context reducing the level's blocks so
      (None: the method cannot run there);
    - ``_method_label(method)``: how the report names it."""

    def _graded_blocks(self, run: RunState, call: ModelCall, levels) -> BlockChoice | None:
        """The blocks of ``levels`` reduced in this kind of call, and how, under the quality budget
        (once per run and kind of call); None: decided per level (no budget; the host cannot run
        the call again; the rehearsal never reached a block)."""
        if self.rule is None or self.rule.max_change <= 0 or call.rehearse is None:
            return None
        cache_key = ("unet graded", self.call_key(call))
        if cache_key in run.cache:
            return run.cache[cache_key]
        sites = {site.key: site for site in self.unet.sites if site.level in levels}
        units = [(site.level, key) for key, site in sites.items()]
        graded = grade(units, self._block_ladder(), lambda unit, method: self._speed_pays(run, call, unit[0], method),
                       lambda unit, method: self._block_change(run, call, sites, unit, method),
                       self.rule.max_change, run.reach, each=True) if units else None
        if graded is None:
            run.cache[cache_key] = None
            return None
        latent_hw = tuple(call.x.shape[-2:])
        where = ", ".join(level_text(level, grid_at(latent_hw, level)) for level in sorted(set(levels)))
        say_graded(run, call.x.device, f"{where}, per block", graded, units, block_names(sites.values()),
                   self.rule.max_change, self.rule.decisions.where, label=self._method_label, each=True)
        chosen = {key: method for (_, key), method in graded.choice.items()}
        by_level = {}
        for (level, _), method in graded.choice.items():
            by_level.setdefault(level, set()).add(method)
        choice = run.cache[cache_key] = BlockChoice(chosen, {level: frozenset(m) for level, m in by_level.items()})
        return choice

    def _block_change(self, run: RunState, call: ModelCall, sites: dict, unit: tuple, method) -> Decision:
        """The change of one block alone reduced by ``method``, kept per block and model (the
        block's own weights' fingerprint); measured, where not kept, in one rehearsal that reads
        every block (``_block_changes``)."""
        level, key = unit
        signature = (*self._level_kind(call, level, method), "block", key)
        work = lambda: Work({}, lambda _: 0.0, lambda _: 0.0, change=lambda: self._block_changes(  # noqa: E731
            run, call, sites).get(key, {}).get(method))
        site = f"{level_text(level, grid_at(tuple(call.x.shape[-2:]), level))}, block {'.'.join(map(str, key))}, " \
               f"{self._method_label(method)}"
        return self.rule.decide(call.x.device, signature, work, site,
                                model=lambda: self.unet.site_fingerprint(call, sites[key]),
                                reach=run.reach, budgeted=False, untimed=True)

    def _block_changes(self, run: RunState, call: ModelCall, sites: dict) -> dict:
        """{site key: {method: change}} of every block and method of the ladder, from one
        rehearsal, once per run and kind of call (``late_blocks.once_per_run``)."""
        return once_per_run(run, ("unet block changes", self.call_key(call)),
                            lambda: self._rehearse_blocks(run, call, sites))

    def _rehearse_blocks(self, run: RunState, call: ModelCall, sites: dict) -> dict:
        contexts = {}  # (level, method) -> a call context reducing so (None: cannot run there)
        for site in sites.values():
            for method in self._block_ladder():
                if (site.level, method) not in contexts:
                    contexts[(site.level, method)] = self._block_context(run, call, site.level, method)

        def measure(site, block, args, kwargs) -> dict:
            options = {k: v for k, v in (kwargs.get("transformer_options") or {}).items() if k != self.context_key}

            def side(context: dict):  # on fresh copies: both sides start from the same input
                return block(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args),
                             **{**kwargs, "transformer_options": {**options, self.context_key: context}})

            whole = side(call_context(False))
            return {method: relative_change(whole, side(context))
                    for (level, method), context in contexts.items() if level == site.level and context is not None}

        blocks = {key: (site, self.unet.site_block(call, site)) for key, site in sites.items()}
        return rehearsed_blocks(call, blocks, measure)


def rehearsed_blocks(call: ModelCall, blocks: dict, measure: Callable) -> dict:
    """{key: measure(site, block, args, kwargs)} for each of ``blocks`` ({key: (site, module)}),
    run on the input the model hands the block in a rehearsal of the call (``ModelCall.rehearse``:
    below every wrapper, no TokenReduce context, on copies of the call's containers). A forward
    pre-hook on each block, removed when the rehearsal ends (also when it fails), measures it
    before the block runs on the model's own input (which the block may change in place); calls
    the measurement itself makes pass the hook. Raises ``NotRehearsed`` where a block was never
    reached."""
    if call.rehearse is None:
        raise NotRehearsed("this host cannot run a model call again")
    found, inside = {}, []

    def hook(key, site):
        def before(block, args, kwargs):
            if inside or key in found:  # the measurement's own runs; a block the model calls twice: its first
                return None
            inside.append(key)
            try:
                found[key] = measure(site, block, args, kwargs)
            finally:
                inside.pop()
            return None
        return before

    handles = [block.register_forward_pre_hook(hook(key, site), with_kwargs=True)
               for key, (site, block) in blocks.items()]
    try:
        call.rehearse(measuring_options(call))
    finally:
        for handle in handles:
            handle.remove()
    return reached(blocks, found, lambda key: ".".join(map(str, key)))


def block_names(sites) -> dict:
    """{site key: how the report names the block}: 'input 1' where its transformer has one block
    (SD1.x, SD2.x), 'input 7 blocks 0-9' where several (SDXL); keys as ``describe.block_names``
    reads them (a name and an index, consecutive indices as ranges)."""
    sites = list(sites)
    depth = {}
    for site in sites:
        depth[site.key[:2]] = depth.get(site.key[:2], 0) + 1
    return {site.key: (site.key[0], site.key[1]) if depth[site.key[:2]] == 1
            else (f"{site.key[0]} {site.key[1]} blocks", site.key[2]) for site in sites}
