"""Where ComfyUI versions differ for this pack, in one place.

- The attention override (``transformer_options["optimized_attention_override"]``, every
  version since 0.3.6x): one slot that attention-backend and SageAttention-style nodes use too.
  We keep whatever was there and call it with our keys (our patch's ``previous``), so both act.
  0.33 adds ``ModelPatcher.set_model_optimized_attention`` and may hand attention functions
  ``AttentionTensorContainer`` objects: it unwraps them into tensors before calling an override
  that, like ours, declares no ``container_function``; setting the slot directly works in both.
- Other devices' copies of a model: 0.33's multi-GPU split (``MultiGPU_WorkUnits``) runs each
  extra device's work on a copy loaded afresh from the model's loader; an object patch bound to a
  module of the first copy must be bound again to each copy's own module. 0.33 calls
  ``ON_MATCH_MULTIGPU_CLONES`` callbacks when it makes the copies; 0.3.75 has no such split.
- Wan 2.2 S2V's blocks: 0.3.75 calls them (and a block replacement's original block) without
  transformer_options, so their attention calls carry no call context; there the clone gets an
  object patch of the model's ``forward_orig`` that hands each call's options to its blocks
  (``hand_options_to_blocks``: for ToDo's override and ToMe's block replacements, one patch that
  both share). ComfyUI's "[BlockInfo] Wan" change (PR #10845) passes them: 0.33 does; decided by
  the host's version, once.
- The dtype a model computes in: 0.33 names it (``BaseModel.get_dtype_inference``); 0.3.75
  computes it inline in ``_apply_model`` (the manual-cast dtype, else the weights' dtype).
- The weights a block computes with (the quality budget's per-model change): the patcher's base
  weights and LoRA patches, read alike in both (``weights_fingerprint``; ``current_patcher`` is
  the BaseModel's in both).
- Expert inputs: 0.33's V3 inputs take ``advanced=True`` (sent in object_info as
  ``"advanced": true``; its frontend folds them behind the node's "Show advanced inputs");
  0.3.75's refuse the keyword, so there every input shows as before
  (``supports_advanced_inputs``, decided once by the signatures of the input classes).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import sys
from pathlib import Path

import torch

from ..tokenreduce.fingerprint import fingerprint
from ..tokenreduce.run import OVERRIDE
ATTENTION_MODULE = "comfy.ldm.modules.attention"
COMPILE_KEY = "torch.compile"  # comfy_api.torch_helpers' key of the compiling wrapper


def bind_to_device_copies(patcher, key: str, bind) -> None:
    """Have ``bind(copy)`` applied to every other-device copy of ``patcher``'s model: now, where the
    multi-GPU split was applied before this node (its copies are made again from ``patcher``), and
    whenever the host makes them later. Nothing where the host has no multi-GPU split."""
    from comfy.patcher_extension import CallbacksMP

    event = getattr(CallbacksMP, "ON_MATCH_MULTIGPU_CLONES", None)
    if event is None:
        return
    patcher.add_callback_with_key(event, key, lambda main, copy: bind(copy))
    if patcher.get_additional_models_with_key("multigpu"):
        patcher.match_multigpu_clones()


def compute_dtype(base_model) -> torch.dtype | None:
    """The dtype a model's activations have inside its diffusion model (what the auto rule times in)."""
    inference = getattr(base_model, "get_dtype_inference", None)
    if inference is not None:
        return inference()
    get_dtype = getattr(base_model, "get_dtype", None)
    cast = getattr(base_model, "manual_cast_dtype", None)
    return cast if cast is not None else (get_dtype() if get_dtype is not None else None)


def attention_entry():
    """The attention function ComfyUI's models call (the backend chosen at start-up, behind the
    override slot): the auto rule times DiT attention calls through it. Read per call: it is a
    module global that start-up options set."""
    module = sys.modules.get(ATTENTION_MODULE)
    return getattr(module, "optimized_attention", None)


def decisions_file() -> Path:
    """Where the auto rule keeps its measured decisions: ComfyUI's user directory (per machine, not per user)."""
    import folder_paths

    return Path(folder_paths.get_user_directory()) / "tokenreduce" / "auto_decisions.json"


def weights_fingerprint(base_model, path: str, module: torch.nn.Module) -> str:
    """The fingerprint of the weights ``module`` (at ``path`` under ``base_model``'s diffusion model)
    computes with, for the quality budget's per-model change (``tokenreduce/fingerprint.py``): read
    from the patcher's view, each parameter's base weight (the patcher's backup where it patched the
    weight in place, else the module's own) and the patches on its key (``ModelPatcher.patches``:
    the LoRA's tensors sampled, with their strengths, offsets and functions).

    Why the patcher's view and not the live module's: ComfyUI applies a LoRA either in place (the
    module then holds base + LoRA) or, under lowvram, in each forward (comfy.ops casts the weight
    through ``weight_function``: ``LowVramPatch``; the module holds the base weight), so the live
    module says another thing in each mode, and in the second nothing of the LoRA. Base + patches
    reads the same in both, for what the block really computes with; computing the patched weight
    instead would cost a whole LoRA merge per block. Scheduled weight hooks (``comfy.hooks``) are
    read as the module holds them when the rule decides. Where no patcher is known (a model called
    outside ComfyUI's sampler), the module's own weights."""
    patcher = getattr(base_model, "current_patcher", None)
    patches, backup = getattr(patcher, "patches", None) or {}, getattr(patcher, "backup", None) or {}
    prefix = f"diffusion_model.{path}." if path else "diffusion_model."
    parts = []
    for name, parameter in module.named_parameters():
        key = prefix + name
        kept = backup.get(key)
        parts.append((name, kept.weight if kept is not None else parameter))
        for number, patch in enumerate(patches.get(key, ())):
            parts.append((f"{name} patch {number}", patch))  # (strength, adapter, strength_model, offset, function)
    return fingerprint(parts)


# The first ComfyUI version known to call Wan S2V's blocks (and the original block it hands a block
# replacement) with transformer_options (ComfyUI PR #10845, "[BlockInfo] Wan", merged after
# 0.3.75, which calls them without). Versions before it, and one that does not say its version, get
# the object patch: where such a version passes the options already it is redundant, never wrong.
S2V_BLOCKS_GET_OPTIONS = (0, 33, 0)
FORWARD_ORIG = "diffusion_model.forward_orig"


def hand_options_to_blocks(patcher, diffusion_model) -> bool:
    """Where a Wan S2V model's ``forward_orig`` calls its blocks without transformer_options (0.3.75:
    its block wrapper passes none), give the clone an object patch of ``forward_orig`` (undone with
    the clone) that hands each model call's options to every block through the host's own hook: a
    block replacement per block, chained to one found in the call's options. One patch serves ToDo
    and ToMe both (it reads each call's options): the second node keeps the first's. Whether the
    clone has it."""
    if type(diffusion_model).__name__ != "WanModel_S2V" or s2v_blocks_get_options(host_version()):
        return False
    current = patcher.get_model_object(FORWARD_ORIG)
    if not _hands_options(current):
        patcher.add_object_patch(FORWARD_ORIG, functools.partial(_forward_handing_options, current,
                                                                 diffusion_model.blocks))
    return True


@functools.cache
def s2v_blocks_get_options(version: str) -> bool:
    """Whether ComfyUI ``version`` ("0.3.75") calls Wan S2V's blocks with transformer_options."""
    numbers = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return numbers is not None and tuple(int(n or 0) for n in numbers.groups()) >= S2V_BLOCKS_GET_OPTIONS


def _hands_options(forward) -> bool:
    """Whether ``forward`` (a clone's forward_orig) is already our object patch (another node's)."""
    return isinstance(forward, functools.partial) and forward.func is _forward_handing_options


def _forward_handing_options(original, blocks, *args, transformer_options=None, **kwargs):
    options = {} if transformer_options is None else transformer_options
    replace = options.get("patches_replace", {})
    found = replace.get("dit", {})
    ours = {("double_block", i): functools.partial(_block_with_options, block, options, found.get(("double_block", i)))
            for i, block in enumerate(blocks)}
    return original(*args, transformer_options={**options, "patches_replace": {**replace, "dit": {**found, **ours}}},
                    **kwargs)


def _block_with_options(block, options, inner, args, extra):
    """A block replacement that runs the block with the call's options (inside ``inner``, a
    replacement found there, as its original block: with the options ``inner`` hands it, ToMe's
    merged grid among them)."""
    def original_block(block_args):
        return {"img": block(block_args["img"], context=block_args["txt"], e=block_args["vec"],
                             freqs=block_args["pe"],
                             transformer_options=block_args.get("transformer_options", options))}

    if inner is None:
        return original_block(args)
    return inner({**args, "transformer_options": options}, {**extra, "original_block": original_block})


# The V3 input classes our nodes build (nodes/schema.py): each must take ``advanced``.
WIDGET_INPUTS = ("Float", "Int", "Boolean", "Combo")


@functools.cache
def supports_advanced_inputs() -> bool:
    """Whether this ComfyUI's V3 widget inputs take ``advanced`` (0.33 does, 0.3.75 does not):
    read from their signatures, not the version, so a build between the two is told right."""
    from comfy_api.latest import io

    return all("advanced" in inspect.signature(getattr(io, name).Input.__init__).parameters
               for name in WIDGET_INPUTS)


def host_version() -> str:
    """ComfyUI's version ("0.3.75"), "unknown" for one too old to name it."""
    version = getattr(sys.modules.get("comfyui_version"), "__version__", None)
    if version is None:
        try:
            import comfyui_version

            version = comfyui_version.__version__
        except ImportError:  # a ComfyUI too old to name its version
            version = "unknown"
    return version


def host_environment() -> tuple:
    """What of ComfyUI decides how fast a call runs, for the auto rule's keys: its version."""
    return (f"ComfyUI {host_version()}",)


@contextlib.contextmanager
def uncompiled(base_model):
    """``base_model`` with its eager modules in place of the compiled ones while a rehearsal runs
    (``ModelCall.rehearse``: a model call run again, uncompiled). ComfyUI's compile wrapper
    (``comfy_api.torch_helpers``, ``COMPILE_KEY``) swaps the compiled modules in for the duration
    of each call; where it runs around ours (TorchCompileModel applied before our node) they are in
    place when ours rehearses. A rehearsal run compiled is traced as a model call of its own (other
    options, a capture that stops the call in a block): graphs and graph breaks the user's compiled
    model never had. Swapped back as the wrapper swaps them, on this model copy only."""
    compiled_modules, inside = [], ()
    for name, module in base_model.named_modules():
        if name and not name.startswith(inside) and isinstance(getattr(module, "_orig_mod", None), torch.nn.Module):
            compiled_modules.append((name, module))
            inside = (*inside, f"{name}.")  # torch.compile's wrapper holds the eager module: not looked into
    parents = [(base_model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], module)
               for name, module in compiled_modules]
    for parent, attribute, module in parents:
        setattr(parent, attribute, module._orig_mod)
    try:
        yield base_model
    finally:
        for parent, attribute, module in parents:
            setattr(parent, attribute, module)


def compiled(options: dict) -> bool:
    """Whether this model call runs compiled: ComfyUI's TorchCompileModel adds an APPLY_MODEL
    wrapper under this key (kept in the call's options)."""
    from comfy.patcher_extension import WrappersMP

    return COMPILE_KEY in options.get("wrappers", {}).get(WrappersMP.APPLY_MODEL, {})


def install_attention_override(patcher, patch) -> None:
    """Make ``patch.override`` the clone's attention override, chained to the one it replaces."""
    options = patcher.model_options.setdefault("transformer_options", {})
    patch.previous = options.get(OVERRIDE)
    options[OVERRIDE] = patch.override


def install_block_replacements(patcher, patch) -> None:
    """Put ``patch``'s block replacements into the clone's ``patches_replace["dit"]`` (undone with
    the clone), each chained to the replacement that was there before (called as its inner block).
    A family whose model calls its blocks with no lookup there (``DiTMerge.layer_args``: NextDiT,
    OmniGen2, Krea 2) is reached by layer object patches: each merged block's ``forward`` looks its key up itself
    (``reach_layers``), on the clone and on every other-device copy of it."""
    found = patcher.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    for block, (kind, number) in patch.replace_keys().items():
        patcher.set_model_patch_replace(patch.replacement(kind, block, found.get((kind, number))), "dit", kind, number)
    if patch.merge.layer_args is not None:
        reach = functools.partial(reach_layers, patch=patch)
        reach(patcher)
        bind_to_device_copies(patcher, f"{patch.context_key} layers", reach)


def reach_layers(patcher, patch) -> None:
    """An object patch (undone with ``patcher``) on the ``forward`` of each block ``patch`` merges,
    for a model that calls its blocks directly: the block's leading arguments (given by position or
    by the block's own parameter names, HiDream's) are handed, under the family's ``layer_args``
    names and with the call's transformer_options, to the replacement
    found at the block's key in those options (ours, or a timing rehearsal's around it), with the
    block's own forward as the original block. The module run is ``patcher``'s own (a device copy's
    on a copy); an object patch on that forward from another node is chained, as the original."""
    paths = patch.family.blocks(patch.model)
    for block, key in patch.replace_keys().items():
        path = f"diffusion_model.{paths[block]}"
        previous = patcher.object_patches.get(f"{path}.forward")
        if getattr(previous, "tokenreduce_key", None) is not None:
            previous = None  # ours, bound to the module of the copy this one was made from
        returns = (patch.merge.layer_returns or {}).get(key[0])
        patcher.add_object_patch(f"{path}.forward", _layer_forward(patcher.get_model_object(path), previous, key,
                                                                   patch.merge.layer_args, returns))


def _layer_forward(module, previous, key, names, returns=None):
    original = previous if previous is not None else functools.partial(type(module).forward, module)
    # the block's own names of the parameters ``names`` stand for, for a model that passes them by keyword
    params = tuple(inspect.signature(type(module).forward).parameters)[1:1 + len(names)]

    def forward(*args, transformer_options=None, **kwargs):
        options = {} if transformer_options is None else transformer_options
        replace = options.get("patches_replace", {}).get("dit", {}).get(key)
        if replace is None or len(args) > len(names):
            return original(*args, transformer_options=options, **kwargs)
        count = len(args)
        by_keyword = {param: name for param, name in zip(params[count:], names[count:]) if param in kwargs}
        rest = {k: v for k, v in kwargs.items() if k not in by_keyword}
        given = {**dict(zip(names, args)), **{name: kwargs[param] for param, name in by_keyword.items()}}

        def original_block(block_args):
            out = original(*(block_args[name] for name in names[:count]),
                           **{param: block_args[name] for param, name in by_keyword.items()},
                           transformer_options=block_args["transformer_options"], **rest)
            return dict(zip(returns, out)) if returns else {names[0]: out}

        out = replace({**given, "transformer_options": options}, {"original_block": original_block})
        return tuple(out[name] for name in returns) if returns else out[names[0]]

    forward.tokenreduce_key = key
    forward.layer = module  # the module it was bound to (each device copy's own)
    return forward
