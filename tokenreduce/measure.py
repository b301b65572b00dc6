"""The work the auto rule times (``pays.py``): a unit of the model, run as it would run unreduced
and as it runs reduced, through the real patch.

- UNets: the first transformer block of a level, called as the host calls it (norms, self- and
  cross-attention, feed-forward, every attention patch and override in the model's options), once
  with the patch's call context switched off and once with a context that reduces. Everything
  the reduction changes in a block is inside, the patch's own Python included.
- DiTs: one attention call over the grid, through the host's attention entry with our override
  in place (so whatever override we chain, e.g. SageAttention, runs too), unreduced and reduced.
  The projections before and after are the same both ways, so they are left out.

Inputs are random tensors of the call's shapes, from a private generator, in the model's compute
dtype on its device; the call's own text tokens are used where a block reads them. Other
TokenReduce patches in the model pass their calls through while we measure (each node decides for
its own reduction), and say nothing of it. The quality budget's change is not read from random
inputs where the host can run the call again: the unit then runs on the inputs the model hands it
(``Work.compare``: ``_on_own_input`` for UNet blocks; the DiT patches capture theirs alike).
"""

from __future__ import annotations

from typing import Callable

import torch

from .override_front import beneath_ours
from .pays import Work, pair
from .run import CONTEXT_PREFIX, MEASURING, OVERRIDE, ModelCall, call_context, weights_of


def sample(shape: tuple, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Random values for timing (never the global RNG); drawn on the device where it can."""
    try:
        generator = torch.Generator(device=device).manual_seed(0)
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)
    except (RuntimeError, TypeError):  # a device without its own generator
        return torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=dtype).to(device)


def compute_dtype(call: ModelCall) -> torch.dtype:
    return call.dtype if call.dtype is not None else call.x.dtype


def measuring_options(call: ModelCall, **extra) -> dict:
    """The call's options without any TokenReduce call context, marked as a measurement. Its
    dicts and lists are copies (as deep as the host copies options for each run): another pack
    that keeps per-call state there (a counter, a cache) must find it after the timed runs as it
    was before, or the run that measured would differ from later runs."""
    options = {k: copied_containers(v) for k, v in call.options.items()
               if not (isinstance(k, str) and k.startswith(CONTEXT_PREFIX))}
    options[MEASURING] = True
    options.update(extra)
    return options


def copied_containers(value):
    """``value`` with its dicts, lists and tuples copied (as deep as they nest), the tensors and
    other objects in them shared. What a rehearsal of a model call (``ModelCall.rehearse``,
    measure_change's rerun) is handed: a model may consume the containers it is given (ComfyUI's
    and Forge's UNets pop their control residuals, ``apply_control``; diffusers' UNet pops
    ``down_intrablock_additional_residuals``), and the user's call must find them as they were, a
    rerun after it as they were before it."""
    if isinstance(value, dict):
        return {k: copied_containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copied_containers(v) for v in value]
    if type(value) is tuple:  # a plain tuple (a NamedTuple is the model's own value: left as it is)
        return tuple(copied_containers(v) for v in value)
    return value


def backend_of(call: ModelCall, override=None) -> str:
    """The attention backend as the kind of a call names it: the host's function, and the override
    (another pack's) that runs it."""
    names = [getattr(call.attention, "__name__", "") if call.attention is not None else ""]
    if override is not None:
        names.append(getattr(override, "__qualname__", type(override).__name__))
    if call.compiled:  # a compiled model's kernels differ: its decisions are its own
        names.append("compiled")
    return "+".join(names)


RANDOM_TOKENS = "random tokens"  # in a timed call context: the block runs on random tokens


def unet_block_work(block: torch.nn.Module, site, grid: tuple[int, int], call: ModelCall, context_key: str,
                    reducing: Callable[[], dict]) -> Callable[[], Work]:
    """The work of the UNet transformer block ``block`` (at ``site``) at ``grid``: unreduced, and
    reduced with the call context ``reducing()`` makes."""

    def build() -> Work:
        h, w = grid
        batch, dim = call.x.shape[0], int(block.norm1.normalized_shape[0])  # the block's width
        device, dtype = call.x.device, compute_dtype(call)
        x = sample((batch, h * w, dim), device, dtype)
        text = call.context.to(device, dtype) if call.context is not None else None
        options = measuring_options(call, activations_shape=[batch, dim, h, w], original_shape=list(call.x.shape),
                                    block=tuple(site.key[:2]), block_index=site.key[2])
        full = {**options, context_key: call_context(False)}
        # random tokens: nothing a reduction reads off the tokens (ToMe's min_similarity count) is
        # read from them; the reduction is timed at the most it does
        reduced = {**options, context_key: {**reducing(), RANDOM_TOKENS: True}}
        work = pair(lambda: block(x, context=text, transformer_options=full),
                    lambda: block(x, context=text, transformer_options=reduced))
        if call.rehearse is None:  # the change is read from the timed runs: random tokens, the call's text
            return work
        return work._replace(compare=lambda: _on_own_input(block, call, context_key, reducing))

    return build


class _Captured(Exception):
    """Ends a rehearsed UNet call once the measured block has shown its input."""


def _on_own_input(block: torch.nn.Module, call: ModelCall, context_key: str,
                  reducing: Callable[[], dict]) -> tuple[Callable, Callable]:
    """The quality budget's two runs of the UNet block ``block`` (``pays.Work.compare``): on the
    input the model hands it in this call, unreduced and reduced. A block's change depends on its
    activations, not only on its weights: on random tokens the SD fixture's ToMe read 0.017, on
    the block's own input 0.031, and random tokens through a random-weight UNet read about as much
    as through a trained one, while trained models' samples can change a hundredfold more. The input is captured in a rehearsal of
    the call (``ModelCall.rehearse``: below every wrapper, no TokenReduce context, so every patch
    of ours passes through) that stops at the block; a forward pre-hook on the block lives only
    while that rehearsal runs (removed in ``finally``, even when it fails)."""
    seen = {}

    def keep(_module, args, kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        raise _Captured

    hook = block.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        call.rehearse(measuring_options(call))
    except _Captured:
        pass
    finally:
        hook.remove()
    if not seen:
        raise RuntimeError("the UNet call, run again to measure its change, never reached the measured block "
                           "(something in the model skipped or replaced it)")
    args, kwargs = seen["args"], seen["kwargs"]
    options = {k: v for k, v in (kwargs.get("transformer_options") or {}).items() if k != context_key}

    def side(context: dict) -> Callable:  # on fresh copies: both sides start from the same input
        return lambda: block(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args),
                             **{**kwargs, "transformer_options": {**options, context_key: context}})

    return side(call_context(False)), side(reducing())


def dit_attention_work(attention: Callable, geometry, length: int, call: ModelCall, override: Callable,
                       context_key: str, reducing: dict, slot: int,
                       compare: Callable[[], tuple | None] | None = None) -> Callable[[], Work]:
    """The work of one DiT attention call over ``length`` tokens: through the host's attention
    entry with ``override`` (ours) in the options, with our context off, and with ``reducing``
    (a context whose call counter is set to ``slot`` before each run). ``compare``: the quality
    budget's two runs (``pays.Work.compare``); none: the change is not known."""

    def build() -> Work:
        heads, head_dim, heads_first = geometry
        batch, device, dtype = call.x.shape[0], call.x.device, compute_dtype(call)
        shape = (batch, heads, length, head_dim) if heads_first else (batch, length, heads * head_dim)
        q, k, v = (sample(shape, device, dtype) for _ in range(3))
        options = measuring_options(call, **{OVERRIDE: override})
        full = {**options, context_key: call_context(False)}
        reduced = {**options, context_key: reducing}

        def run_reduced():
            reducing["calls"] = slot
            return attention(q, k, v, heads, skip_reshape=heads_first, transformer_options=reduced)

        # The change reducing makes is not read from these: on random q, k, v (and without the
        # block's residual) it says nothing of the model; ``compare`` gives the unit it is read from.
        return pair(lambda: attention(q, k, v, heads, skip_reshape=heads_first, transformer_options=full),
                    run_reduced)._replace(compare=compare or (lambda: None))

    return build


def tensor_copies(args: dict) -> dict:
    """A DiT block's arguments with their tensors copied (those in tuples and lists too): a block
    may add to its input in place (Flux's double blocks do: ``img +=``), so a second run on the
    same input (the quality budget's other side, ToMe's correct_from_whole) is given copies."""
    def copy(value):
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, (tuple, list)):
            return type(value)(copy(v) for v in value)
        return value
    return {name: copy(value) for name, value in args.items()}


def on_copies(block: Callable, args: dict, extra: dict) -> Callable:
    """A DiT block-replace run on fresh copies of its captured tensors (``tensor_copies``), for the
    quality budget's comparison: both sides compared must start from the same input."""
    def run():
        return block(tensor_copies(args), extra)
    return run


def dit_block_fingerprint(call: ModelCall, model: torch.nn.Module, paths: Callable[[torch.nn.Module], list],
                          block: int) -> str:
    """The weights the DiT block ``block`` (its module path ``paths(model)[block]``) runs with in
    ``call`` (``run.weights_of``), in the model copy the call runs; the whole diffusion model's
    where the family cannot say the block's path."""
    model = call.model if call.model is not None else model
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the module it compiled
    try:
        path = paths(model)[block]
        module = model.get_submodule(path)
    except (AttributeError, IndexError, KeyError, TypeError):
        path, module = "", model
    return weights_of(call, path, module)


class UNetLevels:
    """A patched UNet as the auto rule sees it: the first block of each level (all blocks of a
    level have the same shapes), the kind of a call at a level, the work that times it. The
    block is looked up in the diffusion model the call runs: under ComfyUI's multi-GPU split a
    call may run another device's copy of the model."""

    def __init__(self, diffusion_model: torch.nn.Module, sites, family: str):
        self.model = diffusion_model  # the model at patch time: where a call names none
        self.family = family
        self.sites = tuple(sites)  # every patched block (the quality budget decides them one by one)
        self.first = {}  # level -> its first site
        for site in self.sites:
            self.first.setdefault(site.level, site)

    def block(self, call: ModelCall, level: int) -> torch.nn.Module:
        return self.site_block(call, self.first[level])

    def site_block(self, call: ModelCall, site) -> torch.nn.Module:
        """The transformer block of ``site`` in the diffusion model the call runs."""
        model = call.model if call.model is not None else self.model
        model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the module it compiled
        return model.get_submodule(site.path.removeprefix("diffusion_model."))

    def fingerprint(self, call: ModelCall, level: int) -> str:
        """The weights the level's measured block (its first) runs with in ``call``: the quality
        budget's change is kept per model (``run.weights_of``)."""
        return self.site_fingerprint(call, self.first[level])

    def site_fingerprint(self, call: ModelCall, site) -> str:
        """The weights the block of ``site`` runs with in ``call`` (``run.weights_of``)."""
        return weights_of(call, site.path.removeprefix("diffusion_model."), self.site_block(call, site))

    def block_dim(self, call: ModelCall, level: int) -> int:
        return int(self.block(call, level).norm1.normalized_shape[0])

    def kind(self, call: ModelCall, level: int, grid: tuple[int, int], reduction: tuple) -> tuple:
        """What decides the speed of a block call at this level (the batch does not: a kind is
        decided once, whatever batches the sampler forms later)."""
        weights = next(self.block(call, level).parameters(), None)
        text = tuple(call.context.shape[1:]) if call.context is not None else ()
        others = beneath_ours(call.options.get(OVERRIDE))  # other packs' override: ToDo's window makes no kind
        return ("unet", self.family, level, *grid, *text, str(compute_dtype(call)),
                str(weights.dtype) if weights is not None else "", backend_of(call, others), *reduction)

    def call_key(self, call: ModelCall) -> tuple:
        """What of a call decides every level's ``kind`` (the model copy fixes the weights' dtype),
        for the per-run lookup of what the auto rule left alone: no block is looked up."""
        text = tuple(call.context.shape[1:]) if call.context is not None else ()
        return (call.x.device, tuple(call.x.shape[-2:]), text, compute_dtype(call), call.model,
                backend_of(call, beneath_ours(call.options.get(OVERRIDE))))

    def work(self, call: ModelCall, level: int, grid: tuple[int, int], context_key: str,
             reducing: Callable[[], dict]) -> Callable[[], Work]:
        return unet_block_work(self.block(call, level), self.first[level], grid, call, context_key, reducing)
