"""ToMe on diffusers DiT transformers: whole-block token merging through the core (``tome_dit``).

The core merges a block's grid tokens before the block and restores the block's change after it
(``plan_block``, ``merged_args``, ``restored``: the same plan, merge and restore the ComfyUI node
runs through the host's block-replace seam). diffusers has no such seam, so ``install`` wraps the
``forward`` of each selected block (an attribute on the block instance, over the class's) and
``uninstall`` deletes it again: nothing is left on the model. Each family describes its blocks
once, in a ``Seam`` (``MERGES``, by diffusers family name: Flux, SD3, Qwen-Image, Wan,
HunyuanVideo, LTX-Video, Chroma, AuraFlow, Lumina 2): which argument holds the grid tokens and
where the grid sits in it, its rotary, per-token modulation and attention-mask arguments, and
where the output holds the tokens; text and reference tokens are never merged. A block of a class its family's seam does
not name is refused at ``apply_patch``, naming the class.

Rotary positions, per-token modulation and mask columns follow the tokens (each merged token
takes its destination's). Where a family's rotary has no batch dimension (Flux's, Chroma's and
HunyuanVideo's ``(cos, sin)`` [L, D], Qwen-Image's complex freqs) a merged call takes each
sample's own rows, and a batch of several samples (each with its own plan) runs the block once
per sample; Wan's [1, L, 1, D], LTX-Video's [B, L, D] and Lumina 2's [B, L, D/2] take a batch
at once.

Tiles are drawn per model call from a private generator seeded from the seed and the timestep (as
the ComfyUI node draws them), so reruns are bit for bit and the global RNG is untouched.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, NamedTuple

import torch

from ..describe import grid_text
from ..dit import BlockArgs
from ..pays import pair
from ..run import CallPatch, note_reduced, note_skipped
from ..seeding import derive_seed
from ..tome_dit import make_tiles, merged_args, merged_count, plan_block, restored, sequence_index, take
from .session import Session

PE = "tokenreduce positions"  # the key under which a block's rotary positions go through merged_args


class Seam(NamedTuple):
    """How ToMe reaches one diffusers family's blocks: the core's ``BlockArgs`` (where the grid
    tokens, rotary positions and per-token modulation sit in a block's arguments, by name) and what
    diffusers' blocks add to it. One per family (``MERGES``); nothing else in this module knows a
    family."""

    args: BlockArgs | dict  # its pe is PE: the positions as ``rope_in`` gives them (or per kind: {kind: BlockArgs})
    kinds: dict  # block class name -> kind, as the report says
    rope: tuple[str, ...] = ()  # the rotary argument's name, per block kind (the one its forward has); (): none
    rope_in: Callable | None = None  # that argument -> positions [1, L, ...] (token dimension 1)
    rope_out: Callable | None = None  # (merged positions [B or 1, L', ...], the argument) -> the block's argument
    per_sample: bool = False  # the rotary has no batch dimension: a batch runs the block once per sample
    # where the block's output holds the tokens (its tuple's index; None: the output), or per kind: {kind: that}
    tokens_out: int | None | dict = 1
    mask: str | None = None  # an attention mask [B, L] or [B, 1, 1, L] over a joint sequence holding the grid
    in_mask: Callable | None = None  # TokenLayout -> (L, where the grid starts in it)


# Flux (diffusers >= 0.35): both block kinds take the image tokens as ``hidden_states`` and the
# text as ``encoder_hidden_states``, rotary (cos, sin) [L, D] over [text, image(, references)];
# they return (encoder_hidden_states, hidden_states). Kontext's reference tokens follow the image.
_FLUX = Seam(BlockArgs("hidden_states", lambda lay: (lay.joint[0] - lay.joint[1], 0), pe=PE, pe_dim=1,
                       in_pe=lambda lay: lay.joint),
             {"FluxTransformerBlock": "double_block", "FluxSingleTransformerBlock": "single_block"},
             ("image_rotary_emb",), lambda rope: torch.stack(tuple(rope[:2]), -2).unsqueeze(0),
             lambda positions, rope: (positions[0, :, 0], positions[0, :, 1]), per_sample=True)
# SD3 / SD3.5 (JointTransformerBlock): the image tokens alone in ``hidden_states`` (the text in
# ``encoder_hidden_states``, joined inside the attention), no rotary; returns
# (encoder_hidden_states or None in the last block, hidden_states).
_SD3 = Seam(BlockArgs("hidden_states", lambda lay: lay.image), {"JointTransformerBlock": "joint_block"})
# Qwen-Image (QwenImageTransformerBlock): the image tokens (then the edit model's references) in
# ``hidden_states``; rotary (image freqs [L, D/2] complex, text freqs), no batch dimension;
# ``modulate_index`` [B, L] (Qwen-Image-Edit-2511's zero_cond_t) picks each token's modulation.
# Returns (encoder_hidden_states, hidden_states).
_QWEN = Seam(BlockArgs("hidden_states", lambda lay: (lay.joint[0] - lay.joint[1], 0), pe=PE, pe_dim=1,
                       in_pe=lambda lay: (lay.joint[0] - lay.joint[1], 0), modulation="modulate_index"),
             {"QwenImageTransformerBlock": "double_block"},
             ("image_rotary_emb",), lambda rope: rope[0].unsqueeze(0), lambda positions, rope: (positions[0], rope[1]),
             per_sample=True)
# Wan 2.1 / 2.2 (WanTransformerBlock): the video tokens in ``hidden_states`` (text by
# cross-attention); rotary (cos, sin) [1, L, 1, D], broadcast over the batch; ``temb`` [B, 6, C],
# or [B, L, 6, C] per token (Wan 2.2 TI2V). Returns hidden_states.
_WAN = Seam(BlockArgs("hidden_states", lambda lay: lay.image, pe=PE, pe_dim=1, in_pe=lambda lay: lay.image,
                      modulation="temb", modulation_ndim=4),
            {"WanTransformerBlock": "block"},
            ("rotary_emb",), lambda rope: torch.stack(tuple(rope), -1), lambda positions, rope: positions.unbind(-1),
            tokens_out=None)
# HunyuanVideo (HunyuanVideoTransformerBlock, HunyuanVideoSingleTransformerBlock): the video tokens
# alone in ``hidden_states`` (the single blocks append the text themselves); rotary (cos, sin)
# [L, D] over the video, no batch dimension (``freqs_cis`` in the double blocks,
# ``image_rotary_emb`` in the single ones); ``attention_mask`` [B, 1, 1, L + text] over
# [video, text]. Both return (hidden_states, encoder_hidden_states). The model also hands them
# ``token_replace_emb`` and ``first_frame_num_tokens`` positionally, which these classes ignore
# (the I2V model's token-replace blocks, which use them, are other classes: not merged).
_HUNYUAN = Seam(BlockArgs("hidden_states", lambda lay: (math.prod(lay.grid), 0), pe=PE, pe_dim=1,
                          in_pe=lambda lay: (math.prod(lay.grid), 0)),
                {"HunyuanVideoTransformerBlock": "double_block", "HunyuanVideoSingleTransformerBlock": "single_block"},
                ("freqs_cis", "image_rotary_emb"), lambda rope: torch.stack(tuple(rope), -1).unsqueeze(0),
                lambda positions, rope: positions[0].unbind(-1), per_sample=True, tokens_out=0,
                mask="attention_mask", in_mask=lambda lay: lay.joint)
# LTX-Video (LTXVideoTransformerBlock): the video tokens in ``hidden_states`` (text by
# cross-attention); rotary (cos, sin) [B, L, D]; ``temb`` [B, 1, 6C], or [B, L, 6C] per token
# (the first frame's conditioning). Returns hidden_states.
_LTX = Seam(BlockArgs("hidden_states", lambda lay: lay.image, pe=PE, pe_dim=1, in_pe=lambda lay: lay.image,
                      modulation="temb", modulation_ndim=3),
            {"LTXVideoTransformerBlock": "block"},
            ("image_rotary_emb",), lambda rope: torch.stack(tuple(rope), -1), lambda positions, rope: positions.unbind(-1),
            tokens_out=None)

# Chroma (ChromaTransformerBlock, ChromaSingleTransformerBlock): Flux's blocks with the modulation
# handed in; the double blocks take the image tokens as ``hidden_states``, the single ones the
# joint [text, image] sequence; rotary as Flux's; ``attention_mask`` [B, text + image] (the
# text's padding). Double blocks return (encoder_hidden_states, hidden_states), single ones the
# sequence.
_CHROMA = Seam({"double_block": _FLUX.args,
                "single_block": BlockArgs("hidden_states", lambda lay: lay.joint, pe=PE, pe_dim=1,
                                          in_pe=lambda lay: lay.joint)},
               {"ChromaTransformerBlock": "double_block", "ChromaSingleTransformerBlock": "single_block"},
               _FLUX.rope, _FLUX.rope_in, _FLUX.rope_out, per_sample=True,
               tokens_out={"double_block": 1, "single_block": None}, mask="attention_mask",
               in_mask=lambda lay: lay.joint)

# AuraFlow (AuraFlowJointTransformerBlock, AuraFlowSingleTransformerBlock): no rotary (learned
# positions added before the blocks); the joint blocks take the image tokens as
# ``hidden_states`` (registers and text as ``encoder_hidden_states``) and return
# (encoder_hidden_states, hidden_states); the single ones take and return the joint
# [registers, text, image] sequence.
_AURAFLOW = Seam({"joint_block": BlockArgs("hidden_states", lambda lay: (lay.joint[0] - lay.joint[1], 0)),
                  "single_block": BlockArgs("hidden_states", lambda lay: lay.joint)},
                 {"AuraFlowJointTransformerBlock": "joint_block", "AuraFlowSingleTransformerBlock": "single_block"},
                 tokens_out={"joint_block": 1, "single_block": None})

# Lumina 2 (Lumina2TransformerBlock, its joint ``layers``): the joint [caption, image] sequence in
# ``hidden_states``; rotary freqs [B, L, D/2] complex over it; ``attention_mask`` None where the
# captions are of one length (the layout's condition). Returns the sequence.
_LUMINA = Seam(BlockArgs("hidden_states", lambda lay: lay.joint, pe=PE, pe_dim=1, in_pe=lambda lay: lay.joint),
               {"Lumina2TransformerBlock": "block"}, ("image_rotary_emb",), lambda rope: rope,
               lambda positions, rope: positions, tokens_out=None, mask="attention_mask", in_mask=lambda lay: lay.joint)

# diffusers family name -> Seam
MERGES = {"Flux": _FLUX, "SD3": _SD3, "Qwen-Image": _QWEN, "Wan": _WAN, "HunyuanVideo": _HUNYUAN, "LTX-Video": _LTX,
          "Chroma": _CHROMA, "AuraFlow": _AURAFLOW, "Lumina 2": _LUMINA}


def _per_kind(value, kind: str):
    """A seam's field for one kind of block (a dict by kind, or one value for every kind)."""
    return value[kind] if isinstance(value, dict) else value


def merges(family) -> bool:
    """Whether ToMe merges whole blocks of this diffusers family."""
    return family is not None and family.name in MERGES


def _sample(value, i: int, batch: int):
    """Sample ``i``'s part of a block argument: a tensor batched on its first dimension (or on a
    multiple of it, Qwen's doubled ``temb``: rows i, i + batch, ...), anything else as it is."""
    if torch.is_tensor(value) and value.ndim >= 1 and value.shape[0] % batch == 0:
        return value[i::batch]
    return value


def _cat(parts):
    return None if parts[0] is None else torch.cat(parts, 0)


class DiffusersToMeDiT(CallPatch):
    """ToMe on the selected blocks of one diffusers DiT (the core's plan, merge and restore)."""

    def __init__(self, settings, family, sites, label: str, session: Session, rule=None):
        super().__init__("tokenreduce.diffusers", label, rule)
        self.settings = settings
        self.family = family
        self.seam = MERGES[family.name]
        self.sites = sites
        self.session = session
        self.strides = (getattr(settings, "stride_t", 1) if family.video else 1, settings.stride_y, settings.stride_x)
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
        kind = self.seam.kinds[type(block).__name__]
        rope = next((name for name in self.seam.rope if name in signature.parameters), None)
        spec, tokens_out = _per_kind(self.seam.args, kind), _per_kind(self.seam.tokens_out, kind)
        # its positional parameters by name, read here: binding at call time (inspect) breaks compiled graphs
        positional = [name for name, p in signature.parameters.items()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

        def forward(*args, **kwargs):
            current, context = self.current, self.session.context
            if current is None or context is None:
                return original(*args, **kwargs)
            # extra positional arguments (HunyuanVideo's, which its blocks ignore) are dropped
            call = {**dict(zip(positional, args)), **kwargs}
            layout, tiles, r = current
            if not self._pays(context, kind, layout, r, original, call, (spec, rope, tokens_out)):
                return original(*args, **kwargs)
            out = self._merged(original, call, layout, tiles, r, (spec, rope, tokens_out))
            if out is None:
                note_skipped(context)  # not the predicted layout: left alone
                return original(*args, **kwargs)
            grid = layout.grid if layout.grid[0] > 1 else layout.grid[1:]
            n = math.prod(layout.grid)
            note_reduced(context, grid, 1, lambda: {"blocks": (n, n - r)})
            return out
        return forward

    def _merged(self, original, call: dict, layout, tiles, r, block: tuple):
        """The block's output with the grid merged through it and its change restored, or None
        where its inputs are not the predicted layout. ``block``: its kind's (BlockArgs, rotary
        argument name or None, tokens_out)."""
        seam = self.seam
        spec, rope_name, tokens_out = block
        x = call.get(spec.tokens)
        where = spec.in_tokens(layout)
        rope = call.get(rope_name) if rope_name else None
        if x is None or x.ndim != 3 or where is None or x.shape[1] != where[0] or (rope_name and rope is None):
            return None
        plan = self.plan if self.settings.share_plans else None
        if plan is None or plan.restore_map.shape[0] != x.shape[0]:
            plan = plan_block(x.narrow(1, where[1], math.prod(layout.grid)), tiles, r)
            if self.settings.share_plans:
                self.plan = plan
        args = {**call, PE: seam.rope_in(rope)} if rope_name else call
        made = merged_args(spec, layout, plan, args)
        if made is None:
            return None
        new, merged_x = made
        mask = new.get(seam.mask) if seam.mask else None
        if torch.is_tensor(mask):  # over [.., grid, ..] of a joint sequence: its columns follow the tokens
            length, start = seam.in_mask(layout)
            if mask.ndim not in (2, 4) or mask.shape[-1] != length or (mask.ndim == 4 and mask.shape[-2] != 1):
                return None
            new[seam.mask] = take(mask, -1, sequence_index(plan, length, start))
        if rope_name:
            positions = new.pop(PE)  # [B, L', ...]: each sample's own
            new.pop(rope_name)
        if not rope_name:
            out = original(**new)
        elif not seam.per_sample or x.shape[0] == 1:
            out = original(**new, **{rope_name: seam.rope_out(positions, rope)})
        else:  # each sample has its own positions, and this rotary has no batch dimension
            b = x.shape[0]
            outs = [original(**{k: _sample(v, i, b) for k, v in new.items()},
                             **{rope_name: seam.rope_out(positions[i:i + 1], rope)}) for i in range(b)]
            out = _cat(outs) if tokens_out is None else tuple(_cat(parts) for parts in zip(*outs))
        if tokens_out is None:
            return restored(spec, layout, plan, x, merged_x, out)
        out = list(out)
        out[tokens_out] = restored(spec, layout, plan, x, merged_x, out[tokens_out])
        return tuple(out)

    def _pays(self, context: dict, kind: str, layout, r: int, original, call: dict, block: tuple) -> bool:
        """reduce_when auto: the first block of each kind timed unmerged and merged (plan, merge,
        block, restore) as the model hands it its inputs; on a CPU merged, untimed."""
        if self.rule is None:
            return True
        x = call.get(block[0].tokens)
        signature = ("diffusers ToMe DiT", self.family.name, kind, tuple(x.shape[1:]) if torch.is_tensor(x) else (),
                     *layout.grid, r, self.settings.ratio, *self.strides, str(getattr(x, "dtype", "")))

        def describe():
            n = math.prod(layout.grid)
            grid = layout.grid if layout.grid[0] > 1 else layout.grid[1:]
            _, tiles, _ = self.current
            site = f"{self.family.name} {kind.replace('_', ' ')}s, {grid_text(grid)} grid ({n} → {n - r} tokens)"
            return site, lambda: pair(lambda: original(**call),
                                      lambda: self._merged(original, call, layout, tiles, r, block))
        return self.pays(self.session.run, x.device, signature, describe)

    def replace_keys(self) -> dict:
        """{block index: (kind, index)} of the blocks it merges (the info text counts them by kind)."""
        def kind(site):
            name = type(self.model.get_submodule(site.path)).__name__
            return self.seam.kinds.get(name, name)
        return {site.key[1]: (kind(site), site.key[1]) for site in self.sites}

    # --- installing ------------------------------------------------------------------------------
    def install(self, hooks, model: torch.nn.Module) -> None:
        self.model = model
        blocks = [model.get_submodule(site.path) for site in self.sites]
        for site, block in zip(self.sites, blocks):  # checked before any is wrapped
            if type(block).__name__ not in self.seam.kinds:
                raise ValueError(f"{self.label}: ToMe cannot patch this {self.family.name} model "
                                 f"({type(model).__name__}): its block {site.path} is a {type(block).__name__}, "
                                 f"whose inputs ToMe does not know how to merge (it merges "
                                 f"{', '.join(self.seam.kinds)}). For this model use ToDo (apply_patch(model, "
                                 f"\"ToDo\")).")
            if "forward" in block.__dict__:
                raise ValueError(f"{self.label}: block {site.path} of this {self.family.name} model has its forward "
                                 f"replaced already (another patch); ToMe cannot wrap it.")
        for block in blocks:
            block.forward = self._forward(block, block.forward)
            self._wrapped.append(block)

    def uninstall(self) -> None:
        for block in reversed(self._wrapped):
            block.__dict__.pop("forward", None)
        self._wrapped.clear()
        self.state.clear()
        self.current = self.plan = None
