"""ToMe on diffusers DiT transformers: whole-block token merging through the core (``tome_dit``).

The core merges a block's grid tokens before the block and restores the block's change after it
(``plan_block``, ``merged_args``, ``restored``: the same plan, merge and restore the ComfyUI node
runs through the host's block-replace seam). diffusers has no such seam, so ``install`` wraps the
``forward`` of each selected block (an attribute on the block instance, over the class's) and
``uninstall`` deletes it again: nothing is left on the model. Families describe their blocks in
``MERGES`` (by diffusers family name): which argument holds the grid tokens and where the grid
sits in it; text and reference tokens are never merged.

Rotary positions follow the tokens: diffusers hands a block ``image_rotary_emb`` as ``(cos, sin)``
of shape [L, D] with no batch dimension, so a merged call takes each sample's own rows; a batch of
several samples (each with its own plan) runs the block once per sample.

Tiles are drawn per model call from a private generator seeded from the seed and the timestep (as
the ComfyUI node draws them), so reruns are bit for bit and the global RNG is untouched.
"""

from __future__ import annotations

import inspect
import math

import torch

from ..describe import grid_text
from ..dit import BlockArgs
from ..pays import pair
from ..run import CallPatch, note_reduced, note_skipped
from ..seeding import derive_seed
from ..tome_dit import make_tiles, merged_args, merged_count, plan_block, restored
from .session import Session

ROPE = "image_rotary_emb"
PE = "tokenreduce positions"  # the key under which (cos, sin) go through merged_args, stacked [1, L, 2, D]

# Flux (diffusers >= 0.35): both block kinds take the image tokens as ``hidden_states`` and the
# text as ``encoder_hidden_states``, positions over [text, image(, references)]; they return
# (encoder_hidden_states, hidden_states). Kontext's reference tokens follow the main image.
_FLUX = BlockArgs("hidden_states", lambda lay: (lay.joint[0] - lay.joint[1], 0), pe=PE, pe_dim=1,
                  in_pe=lambda lay: lay.joint)

MERGES = {"Flux": _FLUX}  # diffusers family name -> BlockArgs of its blocks
KINDS = {"FluxTransformerBlock": "double_block", "FluxSingleTransformerBlock": "single_block"}  # as the report says


def merges(family) -> bool:
    """Whether ToMe merges whole blocks of this diffusers family."""
    return family is not None and family.name in MERGES


class DiffusersToMeDiT(CallPatch):
    """ToMe on the selected blocks of one diffusers DiT (the core's plan, merge and restore)."""

    def __init__(self, settings, family, sites, label: str, session: Session, rule=None):
        super().__init__("tokenreduce.diffusers", label, rule)
        self.settings = settings
        self.family = family
        self.spec = MERGES[family.name]
        self.sites = sites
        self.session = session
        self.strides = (1, settings.stride_y, settings.stride_x)
        self.model = None
        self.state: dict = {}  # what the family's layout keeps between calls (Flux: its img_ids' grid)
        self.current = None  # (layout, tiles, r) of the model call running now; None: blocks as they are
        self.plan = None  # the call's shared plan (share_plans)
        self._wrapped: list = []  # the blocks whose forward we set

    # --- before each model call ------------------------------------------------------------
    def prepare(self, context: dict, arguments) -> None:
        self.current = self.plan = None
        if not context["active"]:
            return
        layout = self.family.layout(self.model, arguments, self.state)
        if layout is None:
            self.session.run.warn_once(f"{self.label}: this {self.family.name} model call has inputs whose token "
                                       f"layout ToMe does not know; those calls were left alone.")
            return
        device = arguments("hidden_states").device
        s, run = self.settings, self.session.run
        generator = None
        if s.use_rand:  # keyed by when and what: the same destinations for the same timestep and grid
            seed = derive_seed(s.seed, run.sigma(torch.as_tensor(context["timestep"])), "dit", *layout.grid,
                               *self.strides)
            generator = run.generator(device, seed)
        tiles = make_tiles(layout.grid, self.strides, generator, device)
        r = merged_count(tiles, s.ratio)
        if r > 0:
            self.current = (layout, tiles, r)

    # --- in the block ----------------------------------------------------------------------
    def _forward(self, block, original):
        signature = inspect.signature(original)
        kind = KINDS.get(type(block).__name__, type(block).__name__)

        def forward(*args, **kwargs):
            current, context = self.current, self.session.context
            if current is None or context is None:
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            call = dict(bound.arguments)
            layout, tiles, r = current
            if not self._pays(context, kind, layout, r, original, call):
                return original(*args, **kwargs)
            out = self._merged(original, call, layout, tiles, r)
            if out is None:
                note_skipped(context)  # not the predicted layout: left alone
                return original(*args, **kwargs)
            grid = layout.grid if layout.grid[0] > 1 else layout.grid[1:]
            n = math.prod(layout.grid)
            note_reduced(context, grid, 1, lambda: {"blocks": (n, n - r)})
            return out
        return forward

    def _merged(self, original, call: dict, layout, tiles, r):
        """The block's (encoder_hidden_states, hidden_states) with the grid merged through it and
        its change restored, or None where its inputs are not the predicted layout."""
        spec = self.spec
        x, rope = call.get(spec.tokens), call.get(ROPE)
        where = spec.in_tokens(layout)
        if x is None or x.ndim != 3 or x.shape[1] != where[0] or not isinstance(rope, (tuple, list)) or \
                rope[0].ndim != 2 or rope[0].shape[0] != layout.joint[0]:
            return None
        plan = self.plan if self.settings.share_plans else None
        if plan is None or plan.restore_map.shape[0] != x.shape[0]:
            plan = plan_block(x.narrow(1, where[1], math.prod(layout.grid)), tiles, r)
            if self.settings.share_plans:
                self.plan = plan
        args = {**call, spec.pe: torch.stack(tuple(rope[:2]), -2).unsqueeze(0)}
        made = merged_args(spec, layout, plan, args)
        if made is None:
            return None
        new, merged_x = made
        positions = new.pop(spec.pe)  # [B, L', 2, D]: each sample's own
        new.pop(ROPE)
        if x.shape[0] == 1:
            text, out = original(**new, **{ROPE: (positions[0, :, 0], positions[0, :, 1])})
        else:  # each sample has its own positions, and diffusers' rotary has no batch dimension
            batched = [k for k, v in new.items() if torch.is_tensor(v) and v.ndim >= 1 and v.shape[0] == x.shape[0]]
            outs = [original(**{**new, **{k: new[k][i:i + 1] for k in batched}},
                             **{ROPE: (positions[i, :, 0], positions[i, :, 1])}) for i in range(x.shape[0])]
            text, out = (torch.cat(parts, 0) for parts in zip(*outs))
        return text, restored(spec, layout, plan, x, merged_x, out)

    def _pays(self, context: dict, kind: str, layout, r: int, original, call: dict) -> bool:
        """reduce_when auto: the first block of each kind timed unmerged and merged (plan, merge,
        block, restore) as the model hands it its inputs; on a CPU merged, untimed."""
        if self.rule is None:
            return True
        x = call.get(self.spec.tokens)
        signature = ("diffusers ToMe DiT", self.family.name, kind, tuple(x.shape[1:]) if torch.is_tensor(x) else (),
                     *layout.grid, r, self.settings.ratio, *self.strides, str(getattr(x, "dtype", "")))

        def describe():
            n = math.prod(layout.grid)
            grid = layout.grid if layout.grid[0] > 1 else layout.grid[1:]
            _, tiles, _ = self.current
            site = f"{self.family.name} {kind.replace('_', ' ')}s, {grid_text(grid)} grid ({n} → {n - r} tokens)"
            return site, lambda: pair(lambda: original(**call),
                                      lambda: self._merged(original, call, layout, tiles, r))
        return self.pays(self.session.run, x.device, signature, describe)

    def replace_keys(self) -> dict:
        """{block index: (kind, index)} of the blocks it merges (the info text counts them by kind)."""
        def kind(site):
            name = type(self.model.get_submodule(site.path)).__name__
            return KINDS.get(name, name)
        return {site.key[1]: (kind(site), site.key[1]) for site in self.sites}

    # --- installing ------------------------------------------------------------------------------
    def install(self, hooks, model: torch.nn.Module) -> None:
        self.model = model
        for site in self.sites:
            block = model.get_submodule(site.path)
            if "forward" in block.__dict__:
                raise ValueError(f"{self.label}: block {site.path} of this {self.family.name} model has its forward "
                                 f"replaced already (another patch); ToMe cannot wrap it.")
            block.forward = self._forward(block, block.forward)
            self._wrapped.append(block)

    def uninstall(self) -> None:
        for block in reversed(self._wrapped):
            block.__dict__.pop("forward", None)
        self._wrapped.clear()
        self.state.clear()
        self.current = self.plan = None
