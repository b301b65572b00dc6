"""ToMe on DiTs, corrected from the whole block (ToMe's ``correct_from_whole``, issue #50).

Why: a merged block's change is the same for every token of a merged group, so on a model whose
attention rests on each query's neighbours the restored changes add up, block after block, to a
mosaic of the tiles (the Flux fixture: LPIPS 0.56 against unpatched at 20 steps). The difference
between the whole block's output and the merged one's changes slowly from step to step where the
merge plan stays the same (DiTFastAttn's residual caching, arXiv 2406.08552). So on the step
that makes a plan (``plan_every``) every merged block runs whole and merged on the same input,
gives the whole output, and keeps ``whole - merged``; the steps that reuse that plan add it to
their merged output. The Flux fixture at 20 steps with a plan every 5: LPIPS 0.085 (docs/quality.md).

The difference is kept with the plan it belongs to (in the plans ``RunState.keep_plans`` keeps
for the calls like this one: same latent, batch and cond/uncond rows), so it never outlives the
run and never meets a call it was not made for. Host-free: the hosts' block replacements call
``corrected_block`` with the block and the merged run they already have.
"""

from __future__ import annotations

from typing import Callable

import torch

from .measure import tensor_copies

DIFFERENCE = "whole minus merged"  # a block's difference, in the plans, under (DIFFERENCE, its key)


def difference(whole, merged):
    """``whole - merged`` over every tensor of a block's output (a tensor, or a dict, tuple or list
    of them); anything else None. None where the two outputs differ in shape (nothing kept)."""
    if torch.is_tensor(whole):
        return whole - merged if torch.is_tensor(merged) and merged.shape == whole.shape else None
    if isinstance(whole, dict) and isinstance(merged, dict) and whole.keys() == merged.keys():
        return {key: difference(whole[key], merged[key]) for key in whole}
    if isinstance(whole, (tuple, list)) and isinstance(merged, (tuple, list)) and len(whole) == len(merged):
        return type(whole)(difference(w, m) for w, m in zip(whole, merged))
    return None


def corrected(merged, kept):
    """A merged block's output with the difference ``kept`` added (tensor by tensor; where a
    tensor's shape is not the one kept, it is left as it is)."""
    if kept is None:
        return merged
    if torch.is_tensor(merged):
        return merged + kept if torch.is_tensor(kept) and kept.shape == merged.shape else merged
    if isinstance(merged, dict) and isinstance(kept, dict):
        return {key: corrected(value, kept.get(key)) for key, value in merged.items()}
    if isinstance(merged, (tuple, list)) and isinstance(kept, (tuple, list)) and len(kept) == len(merged):
        return type(merged)(corrected(m, k) for m, k in zip(merged, kept))
    return merged


def corrected_block(plans: dict, key, planning: bool, args: dict, whole: Callable, merged: Callable):
    """One merged block call with the correction: on the step that plans (``planning``), the
    block ``merged`` (its arguments -> output, or None where it cannot merge them) on copies of
    ``args``, then ``whole`` on ``args``: the whole output returned and the difference kept in
    ``plans`` under ``key``; on the steps that reuse the plan, the merged output plus the kept
    difference. Returns None where the block cannot merge (the caller runs it whole). The merged
    run is given copies: blocks that add to their inputs in place (ComfyUI's Flux) would else hand
    the whole run what the merged one left."""
    slot = (DIFFERENCE, key)
    if planning:
        out = merged(tensor_copies(args))
        if out is None:
            return None
        full = whole(args)
        plans[slot] = difference(full, out)
        return full
    out = merged(args)
    return None if out is None else corrected(out, plans.get(slot))
