"""What every diffusers patch does around the model: a call context per model call (from the
model's forward pre-hook, which sees the latent and the timestep, as tomesd's hook does) and
``reduce_when auto`` timed on the module's own call.

Everything is a forward hook or a swapped attention processor, registered on the modules of the
model given and removed with it: the model's classes and its code are never changed.
"""

from __future__ import annotations

import inspect
import sys
from typing import Callable

import torch

from ..fingerprint import fingerprint
from ..measure import copied_containers
from ..pays import CPU, Decision, Work, pair, within_budget
from ..run import call_context
from .session import Session


def argument_reader(forward: Callable) -> Callable[[tuple, dict], Callable[[str], object]]:
    """``read(args, kwargs)(name)``: a forward's argument by name, passed by position or keyword."""
    names = [n for n in inspect.signature(forward).parameters if n != "self"]

    def read(args: tuple, kwargs: dict) -> Callable[[str], object]:
        def get(name: str):
            if name in kwargs:
                return kwargs[name]
            position = names.index(name) if name in names else len(args)
            return args[position] if position < len(args) else None
        get.inputs = (args, kwargs)  # the call's own arguments (block_input runs the call again with them)
        get.names = names  # the forward's argument names, in order (late.late_call replaces some)
        return get
    return read


class _Reached(Exception):
    """Raised by block_input's hook: the block was reached, the call needs to go no further."""


def block_input(model: torch.nn.Module, block: torch.nn.Module, inputs: tuple) -> tuple | None:
    """The (args, kwargs) ``model`` hands ``block`` in a call with ``inputs`` (its (args, kwargs)):
    the call run again by the model's own forward (below the hooks on the model), on copies of its
    lists and dicts, up to the block, which does not run; None where the call never reaches it."""
    found = {}

    def keep(module, args, kwargs):
        found["inputs"] = (args, kwargs)
        raise _Reached

    handle = block.register_forward_pre_hook(keep, with_kwargs=True, prepend=True)
    try:
        again, named = copied_containers(inputs)
        with torch.no_grad():
            model.forward(*again, **named)
    except _Reached:
        return found["inputs"]
    finally:
        handle.remove()
    return None


class Hooks:
    """The hook handles of one applied patch, removed together."""

    def __init__(self):
        self.handles: list = []

    def pre(self, module: torch.nn.Module, hook: Callable) -> None:
        self.handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def post(self, module: torch.nn.Module, hook: Callable) -> None:
        self.handles.append(module.register_forward_hook(hook, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def track_calls(hooks: Hooks, model: torch.nn.Module, session: Session, prepare: Callable,
                hooked: torch.nn.Module | None = None) -> None:
    """Open a call context before each call of ``model`` (hooked on ``hooked``: it, or its
    torch.compile wrapper), let ``prepare(context, read)`` decide what the call reduces (outside
    the blocks, which a regional torch.compile compiles), close it after."""
    read = argument_reader(model.forward)

    given = {}  # the inputs of the call running now, as they were before it ran

    def before(module, args, kwargs):
        arguments = read(args, kwargs)
        timestep = arguments("timestep")
        context = session.open_call(0 if timestep is None else timestep, arguments)
        prepare(context, arguments)
        # measure_change's rerun comes after the call, which may have consumed the lists it was
        # handed (the UNet pops down_intrablock_additional_residuals, a T2I-Adapter's): it gets
        # copies of them as they were now (``copied_containers``), never the live ones
        given["inputs"] = copied_containers((args, kwargs))

    def after(module, args, kwargs, output):
        inputs = given.pop("inputs", (args, kwargs))

        def rerun():
            again, named = copied_containers(inputs)
            return model.forward(*again, **named)
        session.close_call(output, rerun)

    hooked = model if hooked is None else hooked  # (a compiled wrapper has no truth value: it has no len())
    hooks.pre(hooked, before)
    # measure_change reruns the call by the model's own forward: below these hooks and uncompiled
    hooks.post(hooked, after)


def unet_sample(arguments) -> torch.Tensor:
    """The latent a UNet call is given (``sample``, or ``hidden_states`` as some callers name it)."""
    sample = arguments("sample")
    return sample if sample is not None else arguments("hidden_states")


class UNetCalls:
    """What the UNet patches (ToMe, ToDo) do around a model call: the latent's grid and the node's
    checks before it; and, under ``reduce_when auto``, stepping aside where the run's first such
    call left every kind of block call alone: the core's ``CallPatch.steps_aside``, asked by the
    session before the next calls (no timestep read, no kind built, a cached lookup), filled by
    ``CallPatch.left_alone`` when that first call ends (its kinds are decided in the blocks, where
    the auto rule times the block's own call)."""

    session: Session

    def prepare(self, context: dict, arguments) -> None:
        sample = unet_sample(arguments)
        self.session.latent_hw = tuple(sample.shape[-2:])
        self.session.check_latent(sample.shape)

    def call_key(self, call) -> tuple:
        """What of a UNet call (its arguments) decides the kinds of its block calls in a run: its
        latent's shape (the batch too, as the kinds have it), dtype and device; the settings,
        weights and attention backend are the run's."""
        sample = unet_sample(call)
        return sample.device, tuple(sample.shape), sample.dtype

    @staticmethod
    def decided(context: dict, kind: tuple, reduce: bool) -> bool:
        """The auto rule's decision for a kind of block call in this model call, noted for close_call."""
        context.setdefault("kinds", {})[kind] = reduce
        return reduce

    def close_call(self, context: dict) -> None:
        kinds = context.get("kinds")
        if kinds:  # the rule decided in this call: a later call like it steps aside where it left all alone
            self.left_alone(context, self.session.run, self.session.call, kinds, kinds.get)


class Switch:
    """Whether a patch acts, forced for the auto rule's timing (the module's call run once as
    it would run unreduced, once reduced) and otherwise as decided. A timed call runs in a call
    context of its own (``run.call_context``, as the ComfyUI path times), so nothing it notes
    reaches the run's report."""

    def __init__(self, session: Session):
        self.session = session
        self.forced: bool | None = None

    def work(self, call: Callable[[], object], context: Callable[[], dict] = lambda: call_context(True),
             unit: Callable[[], object] | None = None) -> Work:
        """The two sides of one module call for the auto rule (``context()``: the timing context).
        ``unit``: the block whose output the quality budget compares, run on the input the model
        handed it in this call (``on_copies``), unreduced and reduced (``pays.Work.compare``).
        None: no change is read (one attention call on random tensors, no residual: it changes
        as much on random weights as on trained ones); the budget is then not applied (said)."""
        def side(reduce: bool, run: Callable[[], object]) -> Callable[[], object]:
            def forced():
                self.forced = reduce
                saved, self.session.context = self.session.context, context()
                try:
                    with torch.no_grad():
                        return run()
                finally:
                    self.forced = None
                    self.session.context = saved
            return forced
        compare = (lambda: (side(False, unit), side(True, unit))) if unit is not None else (lambda: None)
        return pair(side(False, call), side(True, call))._replace(compare=compare)


def on_copies(module: torch.nn.Module, args: tuple, kwargs: dict) -> Callable[[], object]:
    """``module``'s call on what the model handed it, each run on fresh copies: its tensors cloned
    (both sides compared start from the same input, whatever a block adds to it in place) and its
    lists and dicts copied (what it may consume stays for the real call)."""
    def run():
        again, named = copied_containers((args, kwargs))
        fresh = lambda value: value.clone() if torch.is_tensor(value) else value  # noqa: E731
        return module(*map(fresh, again), **{name: fresh(value) for name, value in named.items()})
    return run


def attention_backend(processor) -> str:
    """The attention a diffusers processor runs, as a kind of call names it: its class and the
    dispatcher's backend (the one ``set_attention_backend`` gave it, else diffusers' active one)."""
    base = getattr(type(processor), "_tokenreduce_base", type(processor))
    backend = getattr(processor, "_attention_backend", None)
    if backend is None:
        dispatch = sys.modules.get("diffusers.models.attention_dispatch")
        registry = getattr(dispatch, "_AttentionBackendRegistry", None)
        try:
            backend = registry.get_active_backend()[0] if registry is not None else None
        except Exception:  # noqa: BLE001 - another diffusers version: the class alone names it
            backend = None
    return f"{base.__name__}:{getattr(backend, 'value', backend) or ''}"


def weights_fingerprint(module: torch.nn.Module) -> str:
    """The fingerprint of the weights the unit ``module`` computes with, for the quality budget's
    per-model change (``tokenreduce/fingerprint.py``). diffusers holds a LoRA in the module: fused
    into the weights (read as they are), or as PEFT layers whose ``lora_A``/``lora_B`` are the
    module's own parameters; what PEFT keeps beside them (each adapter's scaling, which adapters
    are active, whether they are disabled: ``set_adapters``' weights) is added per layer."""
    parts = list(module.named_parameters())
    for name, layer in module.named_modules():
        scaling = getattr(layer, "scaling", None)
        if isinstance(scaling, dict) and scaling:
            try:
                state = (list(getattr(layer, "active_adapters", None) or ()), bool(getattr(layer, "disable_adapters", False)))
            except Exception:  # noqa: BLE001 - a PEFT version without them: the scaling must do
                state = ()
            parts.append((f"{name} adapters", scaling, state))
    return fingerprint(parts)


def block_decision(patch, device, kind: tuple, describe: Callable, block: torch.nn.Module, name: str, where: str,
                   label: str, time_cpu: bool = False) -> Decision | None:
    """The auto rule's decision for one UNet block's call of a level's ``kind`` (issue #51): the
    level's speed (timed once per kind, on the first block that meets it) and, with a quality
    budget, this block's own change (on the input the model hands it now: ``describe``'s work's
    ``compare``), kept per block and model and held against the budget alone, as ComfyUI's UNet
    blocks are (``unet_blocks.py``), and said so: '``where``, block ``name``, ``label``' (the level,
    the block's path, the method or ratio). None: no rule."""
    run = patch.session.run
    model = lambda: weights_fingerprint(block)  # noqa: E731
    if patch.rule is None or patch.rule.max_change <= 0:
        return patch.decision(run, device, kind, describe, model, time_cpu=time_cpu)
    speed = patch.decision(run, device, kind, describe, model, time_cpu=time_cpu, budgeted=False)
    key = ("auto block", device, kind, name)
    decision = run.cache.get(key)
    if decision is None:
        _, work = describe()
        site = f"{where}, block {name}, {label}"
        change = patch.rule.decide(device, (*kind, "block", name), work, site, model=model, reach=run.reach,
                                   budgeted=False, untimed=True)
        decision = run.cache[key] = within_budget(change._replace(
            reduce=change.reduce and speed.reduce, full_ms=speed.full_ms, reduced_ms=speed.reduced_ms),
            patch.rule.max_change, run.reach)
        if decision.source != CPU:
            run.decided(site, device, decision, patch.rule.decisions.where)
    return decision

