"""ToDo on Forge's own Flux.1 (``backend/nn/flux.py``, ``IntegratedFluxTransformer2DModel``).

Forge's Flux blocks call the module-level ``attention(q, k, v, pe)`` of their module (rope
applied inside, then Forge's ``attention_function``): they get no transformer options and have
no override slot. The way in is per clone and reversible, through Forge's object patches
(``add_object_patch``; applied to the shared model when the clone loads, undone when it unloads,
as Forge does for every object patch) and never the module's global:

- each reduced block's ``forward``: its class's own function, the same code object, rebuilt over
  a copy of its module's globals in which ``attention`` is this pass's (``rebound``), bound to
  the block. Forge's block code runs unchanged; only the name ``attention`` resolves to ours.
- the diffusion model's ``forward``: Forge's own, with the call's transformer options (which
  Forge's Flux drops) noted for this pass's attention for the duration of the call.

This pass's attention applies Forge's ``apply_rope`` to the full q and k (every key keeps its own
position), then hands them to the core's DiT patch (``tokenreduce/todo_dit.py``: the Flux call
plan, the token layout and the keep index of ``tokenreduce/downsample.py``), which keeps the
selected keys and values of the image grid (text tokens intact) and calls Forge's attention
function. Outside a sampling pass of this clone (a stale patched module, a timing of the auto
rule) everything passes through to what Forge computes.

Forge's Flux has no block-replace seam (ComfyUI's ``patches_replace["dit"]``), so the object
patches give each block one (``seamed``): its ``forward`` hands the block, with ComfyUI's Flux
arguments and its own forward as the original block, to the replacement the call's transformer
options name under ComfyUI's key (``("double_block", i)``), and otherwise runs it as it is.

- ToMe (whole blocks merged) puts the core's block wrapper there (``tokenreduce/tome_dit.py``,
  ``ToMeDiTPatch.replacement``: the ComfyUI node's plan, merge and restore, positions following
  the tokens, the text never merged), in the clone's transformer options
  (``set_model_patch_replace``), and seams each block it merges; so its auto rule and quality
  budget are the ComfyUI node's: a block timed and measured through the seam in a rehearsal of
  the call (``tome_dit.captured_blocks``, per block on a late input: ``late_blocks.py``).
- ToDo's quality budget (``max_change``) measures a block's change the same way, its rehearsals
  naming a replacement at the keys of the blocks it reduces; with a budget ToDo seams them too.
  Only the budget's rehearsals and ToMe name replacements, so a block neither reaches runs as it is.

ToMe and ToDo together (in either order of the settings: the same patches) stack as in ComfyUI:
a block both select gets ToMe's forward around ToDo's rebuilt one, and the one diffusion-model
forward notes the call's options for both. ToMe's forward hands the merged block the options with
its merge (``run.MERGED_GRID``) and notes them for this pass's attention while the block runs, so
ToDo keeps keys and values of the merged grid there (``todo_dit.merged_keep_index``).
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import NamedTuple

from tokenreduce.describe import todo_info as core_todo_info
from tokenreduce.families import flux
from tokenreduce.layout import DIT, Layout, dit_layout
from tokenreduce.methods import dit_method_problem, todo_select, tome_select, tome_unet_only
from tokenreduce.pays import auto_rule
from tokenreduce.preflight import dit_factor
from tokenreduce.rebind import rebuilt
from tokenreduce.run import CONTEXT_PREFIX, OVERRIDE
from tokenreduce.target import resolve_target
from tokenreduce.todo_dit import ToDoDiTPatch
from tokenreduce.tome_dit import ToMeDiTPatch, tome_dit_blocks
from tokenreduce.window import SigmaWindow

from .settings import label

MODEL_CLASS = "IntegratedFluxTransformer2DModel"  # Forge's Flux.1 (not its Chroma, nor a subclass)
PATCH = (1, 2, 2)  # Forge's Flux forward patchifies the latent by 2 (its patch_size, not an attribute)
FAMILY = flux.FAMILIES[0]._replace(model_classes=(MODEL_CLASS,), patch=lambda model: PATCH)
FORWARD = "diffusion_model.forward"


def layout_of(diffusion_model) -> Layout | None:
    """The layout of Forge's own Flux.1 (its class exactly), else None."""
    if type(diffusion_model).__name__ != MODEL_CLASS:
        return None
    return dit_layout(diffusion_model, FAMILY)


def rebound(method, name: str, value):
    """``method`` (bound) with its function rebuilt over a copy of its globals in which ``name``
    is ``value``, bound to the same object: the same code, nothing global changed."""
    return types.MethodType(rebuilt(method.__func__, **{name: value}), method.__self__)


def forge_block_forward(method) -> str | None:
    """Why ToDo cannot reach this block's attention through its ``forward``, or None."""
    func = getattr(method, "__func__", None)
    if not isinstance(func, types.FunctionType) or "attention" not in func.__code__.co_names:
        return f"its forward is {getattr(method, '__qualname__', type(method).__name__)}, not Forge's"
    own = func.__globals__.get("attention")
    if getattr(own, "__module__", None) != func.__globals__.get("__name__") or \
            getattr(own, "__qualname__", None) != "attention":
        name = f"{getattr(own, '__module__', '')}.{getattr(own, '__qualname__', type(own).__name__)}"
        return f"Forge's Flux attention was replaced by {name.lstrip('.')} (another extension)"
    return None


class ForgeFluxToDo(ToDoDiTPatch):
    """The core's DiT patch, called by this pass's attention: Forge has no override slot to be in
    front of, so nothing runs after ours but Forge's attention function."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.attention: PassAttention | None = None  # set with the object patches (``_reach``)
        self.object_patches: dict = {}  # key -> object, added to the clone by ``register``
        self.rebuilt: dict = {}  # key -> the block's forward rebuilt with this pass's attention (seamed or not)

    def _in_front(self, run, options):
        return self.override, None


def _backend(attention_function):
    """Forge's attention function as the core's override calls it (it passes the options)."""

    def call(q, k, v, heads, mask=None, skip_reshape=False, transformer_options=None):
        if mask is None:
            return attention_function(q, k, v, heads, skip_reshape=skip_reshape)
        return attention_function(q, k, v, heads, mask=mask, skip_reshape=skip_reshape)

    return call


def host_entry(attention_function):
    """Forge's attention function as the auto rule times a DiT call: through the override in the
    options it is given, as ComfyUI's attention entry does. Named as Forge's function, which names
    the backend in what the rule keeps."""
    backend = _backend(attention_function)

    @functools.wraps(attention_function)
    def entry(q, k, v, heads, mask=None, skip_reshape=False, transformer_options=None):
        override = (transformer_options or {}).get(OVERRIDE)
        if override is None:
            return backend(q, k, v, heads, mask, skip_reshape)
        return override(backend, q, k, v, heads, mask=mask, skip_reshape=skip_reshape,
                        transformer_options=transformer_options)

    return entry


class PassAttention:
    """This pass's ``attention(q, k, v, pe)`` for Forge's Flux blocks, and the options of the model
    call running (noted by the diffusion model's patched forward, None outside a call)."""

    def __init__(self, patch: ForgeFluxToDo, apply_rope, attention_function):
        self.patch = patch
        self.apply_rope = apply_rope  # Forge's own, from the blocks' module
        self.attention_function = attention_function
        self.backend = _backend(attention_function)
        self.options: dict | None = None

    def for_slot(self, slot: int):
        """The attention of the block whose calls are ``slot`` in the Flux call plan."""
        return functools.partial(self.attend, slot)

    def attend(self, slot: int, q, k, v, pe):
        q, k = self.apply_rope(q, k, pe)  # full q and k: each kept key keeps its own position
        options = self.options if self.options is not None else {}
        context = self.patch.call_context(options)
        if context is not None and context["active"]:
            context["calls"] = slot
        return self.patch.override(self.backend, q, k, v, q.shape[1], skip_reshape=True, transformer_options=options)

    @contextlib.contextmanager
    def noting(self, options: dict | None):
        """``options`` noted for the calls inside (a merged block's: the call's with ToMe's merge)."""
        outer, self.options = self.options, options
        try:
            yield
        finally:
            self.options = outer

    def forward(self, original):
        """The diffusion model's forward: ``original``, with its call's options noted."""

        def forward(*args, **kwargs):
            self.options = kwargs.get("transformer_options")
            try:
                return original(*args, **kwargs)
            finally:
                self.options = None

        return forward


def _replacement_in_options(key: tuple):
    """The block-replace function of ``seamed``: the replacement the call's options name at ``key``
    (the budget's rehearsal: ``late_blocks.late_block_changes``, ``measure.captured_blocks``), else
    the block as it is."""
    def run_block(args: dict, extra: dict):
        replace = ((args.get("transformer_options") or {}).get("patches_replace") or {}).get("dit", {}).get(key)
        return replace(args, extra) if replace is not None else extra["original_block"](args)
    return run_block


def seamed(kind: str, index: int, current, options: PassAttention):
    """A block's ``forward`` with ComfyUI's block-replace seam: ``current`` (ToDo's rebuilt forward),
    run by whatever the call's options replace ``(kind, index)`` with (ToDo's quality budget, in its
    rehearsals), else as it is."""
    return block_forward(_replacement_in_options((kind, index)), options, kind, current)


class Chosen(NamedTuple):
    """A method this pass runs on Forge's Flux (as ``patching.MethodRun`` takes it)."""

    method: str
    settings: object
    target: object
    patch: ForgeFluxToDo
    window: SigmaWindow
    warnings: list


def choose(clone, run, layout: Layout, family: str, stage: str, methods: dict, latent_shape: tuple, decisions,
           percent_to_sigma) -> tuple[str | None, list[Chosen]]:
    """The methods this pass runs on Forge's Flux (``clone``: its UnetPatcher), with the same
    checks as the ComfyUI node: (refusal or None, chosen, in the order of ``methods``). Warnings
    of settings that do nothing go to ``run.warnings``. ToDo is chosen first: where both run,
    ToMe's block forwards wrap ToDo's (``_reach_tome``)."""
    chosen = {}
    if "ToDo" in methods:
        refusal, chosen["ToDo"] = choose_todo(clone, run, layout, family, stage, methods["ToDo"], latent_shape,
                                              decisions, percent_to_sigma)
        if refusal is not None:
            return refusal, []
    if "ToMe" in methods:
        inner = chosen["ToDo"][0].patch if chosen.get("ToDo") else None
        refusal, chosen["ToMe"] = choose_tome(clone, run, layout, family, stage, methods["ToMe"], decisions,
                                              percent_to_sigma, inner)
        if refusal is not None:
            return refusal, []
    return None, [c for method in methods for c in chosen.get(method, [])]


def choose_todo(clone, run, layout: Layout, family: str, stage: str, settings, latent_shape: tuple, decisions,
                percent_to_sigma) -> tuple[str | None, list[Chosen]]:
    """ToDo on Forge's Flux: the core's DiT patch, called by this pass's attention in each
    selected block's rebuilt ``forward``."""
    who = label(stage, "ToDo")
    problem = dit_method_problem(who, FAMILY, settings.method)
    if problem:
        return problem, []
    target = resolve_target(layout, family, "ToDo", "level", settings.level, todo_select(settings), kinds=(DIT,))
    if target.sites is None:
        run.warnings.append(f"{who}: {target.message}")
        return None, []
    diffusion_model = clone.get_model_object("diffusion_model")
    patch = ForgeFluxToDo(layout, frozenset(site.key[1] for site in target.sites), settings.factor, 1.0,
                          settings.method, diffusion_model, f"{CONTEXT_PREFIX}forge.{stage}.ToDo", who,
                          auto_rule(settings.reduce_when, decisions, per_process=True, max_change=settings.max_change))
    problem = _reach(clone, layout, target, patch)
    if problem is not None:
        return f"{who} cannot reach the attention of Forge's Flux: {problem}. Turn one of them off.", []
    try:
        warnings = [f"{who}: {w}" for w in core_todo_info(settings, target)[1]]
        warnings += dit_factor(who, PATCH, settings.factor)(latent_shape)
    except ValueError as refused:
        return str(refused), []
    run.attention = host_entry(patch.attention.attention_function)  # the auto rule times through it
    window = SigmaWindow(percent_to_sigma(settings.start_percent), percent_to_sigma(settings.end_percent))
    return None, [Chosen("ToDo", settings, target, patch, window, warnings)]


def _forward_of(clone, key: str, module, name: str = "forward"):
    """The ``forward`` ours wraps: another extension's object patch on this clone, else the
    class's own (never the shared module's attribute: an earlier pass's clone may still have its
    patches on it until Forge unloads that clone)."""
    if key in clone.object_patches:
        return clone.object_patches[key]
    return getattr(type(module), name).__get__(module)


def _reach(clone, layout: Layout, target, patch: ForgeFluxToDo) -> str | None:
    """Put the object patches of ``patch`` on it (``register`` adds them), or say why there can be none."""
    slots = {slot.block: index for index, slot in enumerate(layout.plan)}  # Flux: one joint call per block
    found = {}
    for site in target.sites:
        key = f"{site.path}.forward"
        current = _forward_of(clone, key, clone.get_model_object(site.path))
        problem = forge_block_forward(current)
        if problem is not None:
            return f"in block {site.path.split('.', 1)[1]}, {problem}"
        found[(key, slots[site.key[1]])] = current
    module = next(iter(found.values())).__func__.__globals__
    attention = PassAttention(patch, module["apply_rope"], module["attention_function"])
    patch.attention = attention
    patch.rebuilt = {key: rebound(current, "attention", attention.for_slot(slot))
                     for (key, slot), current in found.items()}
    patch.object_patches = dict(patch.rebuilt)
    if patch.rule is not None and patch.rule.max_change > 0:  # the budget's rehearsals reach the blocks here
        keys = FAMILY.merge.keys(clone.get_model_object("diffusion_model"))  # block -> ("double_block", i)
        blocks = {f"{site.path}.forward": site.key[1] for site in target.sites}
        patch.object_patches = {key: seamed(*keys[blocks[key]], forward, attention)
                                for key, forward in patch.rebuilt.items()}
    patch.object_patches[FORWARD] = attention.forward(_forward_of(clone, FORWARD,
                                                                  clone.get_model_object("diffusion_model")))
    return None


def register(clone, run) -> tuple[list, list, list]:
    """Add the object patches and block replacements (ToMe's) of the pass's Flux methods to
    ``clone``: (functions, object keys, replacements), as ``patching.Installed`` records them."""
    keys, replaced = [], []
    for method in run.methods:
        for key, value in method.patch.object_patches.items():
            clone.add_object_patch(key, value)
            keys.append(key)
        for (kind, index), function in getattr(method.patch, "replaces", {}).items():
            clone.set_model_patch_replace(function, "dit", kind, index)
            replaced.append(("dit", (kind, index), function))
    return [], keys, replaced


# --- ToMe: whole blocks merged through the core's block wrapper (tokenreduce/tome_dit.py) ---------

def choose_tome(clone, run, layout: Layout, family: str, stage: str, settings, decisions, percent_to_sigma,
                todo: ForgeFluxToDo | None = None):
    """ToMe on Forge's Flux: the core's ``ToMeDiTPatch`` (the ComfyUI node's), its block-replace
    functions in the clone's transformer options, called through the seam each selected block's
    ``forward`` gets (an object patch on the clone: ``seamed``); ``todo``: ToDo's patch of the same
    pass, whose rebuilt block forwards ToMe's call inside. Its auto rule and quality budget are the
    ComfyUI node's (the block timed and measured through that seam)."""
    who = label(stage, "ToMe")
    target = resolve_target(layout, family, "ToMe", "max_downsample", settings.max_downsample, tome_select,
                            kinds=(DIT,))
    if target.sites is None:
        run.warnings.append(f"{who}: {target.message}")
        return None, []
    diffusion_model = clone.get_model_object("diffusion_model")
    patch = ToMeDiTPatch(settings, layout, tome_dit_blocks(target.sites), diffusion_model,
                         f"{CONTEXT_PREFIX}forge.{stage}.ToMe", who,
                         auto_rule(settings.reduce_when, decisions, per_process=True, max_change=settings.max_change))
    problem = _reach_tome(clone, target, patch, todo)
    if problem is not None:
        return f"{who} cannot reach the blocks of Forge's Flux: {problem}. Turn one of them off.", []
    warnings = [f"{who}: {warning}" for warning in tome_unet_only(settings, layout.family.name)]
    window = SigmaWindow(percent_to_sigma(settings.start_percent), percent_to_sigma(settings.end_percent))
    return None, [Chosen("ToMe", settings, target, patch, window, warnings)]


def block_forward(run_block, options: PassAttention, kind: str, current):
    """A Forge Flux block's ``forward`` (``current``: the one it had) through ``run_block(args,
    extra)``, a ComfyUI block replacement: the arguments as ComfyUI's Flux hands them (the call's
    options noted by the diffusion model's patched forward), the block's own forward as the
    original block (run with the options it is handed noted for this pass's attention)."""
    if kind == "double_block":
        def forward(img, txt, vec, pe, **kwargs):
            def original(a):
                with options.noting(a["transformer_options"]):  # the merge, for ToDo's attention inside
                    img_, txt_ = current(img=a["img"], txt=a["txt"], vec=a["vec"], pe=a["pe"], **kwargs)
                return {"img": img_, "txt": txt_}
            args = {"img": img, "txt": txt, "vec": vec, "pe": pe, "transformer_options": options.options}
            out = run_block(args, {"original_block": original})
            return out["img"], out["txt"]
        forward.__wrapped__ = current  # the forward it runs
        return forward

    def forward(x, vec, pe, **kwargs):  # single block: x = [text, image]
        def original(a):
            with options.noting(a["transformer_options"]):
                return {"img": current(a["img"], vec=a["vec"], pe=a["pe"], **kwargs)}
        args = {"img": x, "vec": vec, "pe": pe, "transformer_options": options.options}
        return run_block(args, {"original_block": original})["img"]
    forward.__wrapped__ = current
    return forward


def _reach_tome(clone, target, patch: ToMeDiTPatch, todo: ForgeFluxToDo | None = None) -> str | None:
    """The object patches and block replacements of ToMe on Forge's Flux (``register`` adds them),
    or why there can be none: each selected block's ``forward`` seamed (``seamed``) and ToMe's
    replacement at its key, chained to one already there. With ``todo`` (ToDo's patch of the pass):
    a block both select runs ToDo's rebuilt forward inside the seam, whose object patch takes that
    key's place, and ToDo's attention and model forward serve both (one object patch per key)."""
    inner = todo.object_patches if todo is not None else {}
    rebuilt = todo.rebuilt if todo is not None else {}
    options = todo.attention if todo is not None else PassAttention(None, None, None)  # the call's options
    keys = patch.replace_keys()
    there = clone.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    patch.object_patches, patch.replaces = {}, {}
    for site in target.sites:
        key = f"{site.path}.forward"
        if key in clone.object_patches:
            return f"block {site.path.split('.', 1)[1]} has another extension's forward"
        inner.pop(key, None)
        current = rebuilt.get(key) or _forward_of(clone, key, clone.get_model_object(site.path))
        kind, index = keys[site.key[1]]
        patch.object_patches[key] = seamed(kind, index, current, options)
        patch.replaces[(kind, index)] = patch.replacement(kind, site.key[1], there.get((kind, index)))
    if todo is None:
        patch.object_patches[FORWARD] = options.forward(_forward_of(clone, FORWARD,
                                                                    clone.get_model_object("diffusion_model")))
    return None
