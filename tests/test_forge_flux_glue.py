"""The Forge-free parts of ToDo and ToMe on Forge's Flux.1 (tokenreduce_forge/flux.py), in CI without Forge:
the block forward rebuilt over its own globals with another ``attention`` (nothing global
changed), what is refused before anything is patched, Forge's attention entry as the auto rule
times it, the call's options noted only for the length of a model call, and ToMe's block forwards
around ToDo's where both run (on a toy whose blocks call their module's attention). The whole path on
Forge's own model is tests/test_forge_flux.py (``--forge``)."""

from __future__ import annotations

import types

import pytest
import torch

from tokenreduce.pays import Decisions
from tokenreduce.run import OVERRIDE
from tokenreduce_forge import flux as forge_flux
from tokenreduce_forge import patching
from tokenreduce_forge import settings as S

SOURCE = '''
def attention(q, k, v, pe):
    return ("forge", q, k, v, pe)


class Block:
    def forward(self, x, *, scale=2):
        return attention(x * scale, x, x, pe=self)
'''


def toy_module():
    """A module as Forge's backend.nn.flux is laid out: blocks calling a module-level attention."""
    module = types.ModuleType("toy_forge_flux")
    exec(compile(SOURCE, "toy_forge_flux.py", "exec"), module.__dict__)  # noqa: S102 - the test's own source
    return module


def test_rebound_runs_the_same_code_with_our_attention_and_changes_nothing_global():
    module = toy_module()
    block = module.Block()
    before = dict(vars(module))
    ours = forge_flux.rebound(block.forward, "attention", lambda q, k, v, pe: ("ours", q, k, v, pe))
    assert ours.__self__ is block and ours.__func__.__code__ is module.Block.forward.__code__
    assert ours.__qualname__ == "Block.forward" and ours.__func__.__kwdefaults__ == {"scale": 2}
    assert ours(3) == ("ours", 6, 3, 3, block) and ours(3, scale=1)[1] == 3
    assert block.forward(3) == ("forge", 6, 3, 3, block)  # the block itself, and every other, unchanged
    assert vars(module) == before and module.attention(1, 2, 3, 4)[0] == "forge"


def test_a_forward_that_is_not_forges_is_named():
    module = toy_module()
    block = module.Block()
    assert forge_flux.forge_block_forward(block.forward) is None
    assert forge_flux.forge_block_forward(lambda x: x).endswith("not Forge's")
    module.attention = lambda q, k, v, pe: None  # another extension swapped the module's global
    assert forge_flux.forge_block_forward(block.forward) == (
        "Forge's Flux attention was replaced by test_forge_flux_glue.test_a_forward_that_is_not_forges_is_named."
        "<locals>.<lambda> (another extension)")


def test_forges_attention_entry_runs_the_override_in_its_options_and_keeps_its_name():
    seen = []

    def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False):
        seen.append((k.shape, mask, skip_reshape))
        return q

    entry = forge_flux.host_entry(attention_pytorch)
    assert entry.__name__ == "attention_pytorch"
    q = torch.zeros(1, 2, 5, 4)
    entry(q, q, q, 2, skip_reshape=True, transformer_options={})

    def halve(func, q, k, v, heads, **kwargs):
        assert "transformer_options" in kwargs
        return func(q, k[:, :, ::2], v[:, :, ::2], heads, **kwargs)

    entry(q, q, q, 2, skip_reshape=True, transformer_options={OVERRIDE: halve})
    assert seen == [(torch.Size([1, 2, 5, 4]), None, True), (torch.Size([1, 2, 3, 4]), None, True)]


def test_the_options_of_a_model_call_are_noted_for_its_length_only():
    attention = forge_flux.PassAttention(None, None, None)
    noted = []

    def forward(x, transformer_options=None):
        noted.append(attention.options)
        if x is None:
            raise RuntimeError("boom")
        return x

    forward_ = attention.forward(forward)
    options = {"sigmas": 1}
    assert forward_(1, transformer_options=options) == 1 and noted == [options] and attention.options is None
    with pytest.raises(RuntimeError):
        forward_(None, transformer_options=options)
    assert attention.options is None


class IntegratedFluxTransformer2DModel(torch.nn.Module):  # named as Forge's Flux.1 (backend/nn/flux.py)
    def __init__(self):
        super().__init__()
        self.num_heads, self.hidden_size = 2, 8
        self.double_blocks = torch.nn.ModuleList(torch.nn.Identity() for _ in range(2))
        self.single_blocks = torch.nn.ModuleList(torch.nn.Identity() for _ in range(3))


def test_forges_flux_is_known_by_its_class_and_its_layout_is_the_flux_plan():
    layout = forge_flux.layout_of(IntegratedFluxTransformer2DModel())
    assert layout.family.name == "Flux.1" and layout.family.patch(None) == (1, 2, 2)
    assert [site.path for site in layout.sites] == [
        "diffusion_model.double_blocks.0", "diffusion_model.double_blocks.1", "diffusion_model.single_blocks.0",
        "diffusion_model.single_blocks.1", "diffusion_model.single_blocks.2"]
    assert {slot.kind for slot in layout.plan} == {"joint"}

    class Derived(IntegratedFluxTransformer2DModel):
        pass

    assert forge_flux.layout_of(Derived()) is None  # a subclass may add streams: left to the refusals


@pytest.mark.parametrize("methods,expected", [
    ({"ToDo": {"method": "bicubic"}}, "TokenReduce ToDo: method 'bicubic' does not work on Flux.1"),
])
def test_what_cannot_run_on_forges_flux_is_refused_before_anything_is_patched(methods, expected):
    settings = {m: S.method_settings(m, S.FIRST, v) for m, v in methods.items()}
    layout = forge_flux.layout_of(IntegratedFluxTransformer2DModel())
    refusal, chosen = forge_flux.choose(None, None, layout, "Flux", S.FIRST, settings, (1, 16, 64, 64), None, None)
    assert refusal.startswith(expected) and chosen == []


def test_the_refusal_of_other_dits_says_what_forge_supports():
    assert "works on UNet models (SD1.x, SD2.x, SDXL) and ToMe or ToDo on Forge's Flux.1; both on other DiT models" in \
        patching.not_a_unet("Chroma")


# --- ToMe on Forge's Flux: the core's block wrapper called from each block's forward -------------

class ToyDouble(torch.nn.Module):  # Forge's DoubleStreamBlock.forward(img, txt, vec, pe) -> (img, txt)
    def __init__(self, seen):
        super().__init__()
        self.seen, self.img, self.txt = seen, torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, img, txt, vec, pe):
        self.seen.append((img.shape[1], pe.shape[2], txt))
        rotary = pe[:, 0, txt.shape[1]:, :1, 0, 0]  # the image tokens' own positions
        return img + torch.tanh(self.img(img)) * vec[:, None, None] + rotary, txt + self.txt(txt)


class ToySingle(torch.nn.Module):  # Forge's SingleStreamBlock.forward(x, vec, pe) -> x, x = [text, image]
    def __init__(self, seen):
        super().__init__()
        self.seen, self.lin = seen, torch.nn.Linear(8, 8)

    def forward(self, x, vec, pe):
        self.seen.append((x.shape[1], pe.shape[2], None))
        return x + torch.tanh(self.lin(x)) + pe[:, 0, :, :1, 0, 0]


class ToyForgeFlux(torch.nn.Module):
    """Laid out and called as Forge's IntegratedFluxTransformer2DModel (patch 2, text first)."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.hidden_size, self.seen = 2, 8, []
        self.img_in = torch.nn.Linear(16, 8)
        self.double_blocks = torch.nn.ModuleList(ToyDouble(self.seen) for _ in range(2))
        self.single_blocks = torch.nn.ModuleList(ToySingle(self.seen) for _ in range(3))

    def forward(self, x, timestep, context, transformer_options=None):
        b, _, h, w = x.shape
        img = self.img_in(x.reshape(b, 4, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, 16))
        txt, vec = context, timestep.view(b)
        positions = torch.cat([torch.zeros(txt.shape[1]), torch.arange(1.0, img.shape[1] + 1)])
        pe = positions.view(1, 1, -1, 1, 1, 1).expand(b, 1, -1, 4, 2, 2)
        for block in self.double_blocks:
            img, txt = block(img=img, txt=txt, vec=vec, pe=pe)
        img = torch.cat((txt, img), 1)
        for block in self.single_blocks:
            img = block(img, vec=vec, pe=pe)
        return img[:, txt.shape[1]:]


ToyForgeFlux.__name__ = forge_flux.MODEL_CLASS


class ToyClone:
    """What ToMe asks of Forge's UnetPatcher: its model objects, object patches and model options."""

    def __init__(self, model):
        self.model, self.object_patches, self.model_options = model, {}, {"transformer_options": {}}

    def get_model_object(self, name):
        return self.model if name == "diffusion_model" else self.model.get_submodule(name.split(".", 1)[1])


def _forge_run(model, methods: dict, x, context, seeds=(0.7,)):
    """``methods`` ({method: values}) chosen for Forge's Flux and called as Forge's sampling calls
    them: the object patches put on the model for the call (as Forge loads the clone) and taken off
    after. (outputs, the MethodRuns, the pass's run)."""
    clone = ToyClone(model)
    settings = {name: S.method_settings(name, S.FIRST, values) for name, values in methods.items()}
    layout = forge_flux.layout_of(model)
    run = types.SimpleNamespace(warnings=[])
    refusal, chosen = forge_flux.choose(clone, run, layout, "Flux", S.FIRST, settings, x.shape, Decisions(None),
                                        lambda p: 1.0 - p)
    assert refusal is None and len(chosen) == len(methods), (refusal, run.warnings)
    runs = [patching.MethodRun(c.method, S.FIRST, *c[1:]) for c in chosen]
    patches = {key: value for method in runs for key, value in method.patch.object_patches.items()}
    replaces = {key: value for method in runs for key, value in getattr(method.patch, "replaces", {}).items()}
    outs = []
    for sigma in seeds:
        sigmas = torch.tensor([sigma])
        options = {"sigmas": sigmas, "patches_replace": {"dit": dict(replaces)}}  # as register sets them
        contexts = [method.run.open_call(sigmas, options) for method in runs]
        for method, context_ in zip(runs, contexts):
            method.patch.prepare_call(context_, method.run, patching.ModelCall(x, context, {}, options, sigmas))
            options[method.patch.context_key] = context_
        for key, value in patches.items():
            setattr(clone.get_model_object(key.rsplit(".", 1)[0]), "forward", value)
        try:
            outs.append(model(x, torch.full((x.shape[0],), sigma), context, transformer_options=options))
        finally:
            for key in patches:
                del clone.get_model_object(key.rsplit(".", 1)[0]).__dict__["forward"]
            for method, context_ in zip(runs, contexts):
                method.run.close_call(context_, sigmas)
    return outs, runs, run


def _forge_tome_run(model, values: dict, x, context, seeds=(0.7,)):
    """ToMe alone: (outputs, its MethodRun, the pass's run)."""
    outs, (method,), run = _forge_run(model, {"ToMe": values}, x, context, seeds)
    return outs, method, run


def test_tome_on_forges_flux_merges_only_the_image_and_reruns_bit_for_bit():
    torch.manual_seed(0)
    model = ToyForgeFlux()
    x, context = torch.randn(2, 4, 12, 10), torch.randn(2, 6, 8)  # a 6x5 token grid, 6 text tokens
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        unpatched = model(x, torch.full((2,), 0.7), context)
        full_seen = list(model.seen)
        model.seen.clear()
        rng = torch.get_rng_state()
        (first,), method, run = _forge_tome_run(model, {"ratio": 0.5, "reduce_when": "always"}, x, context)
        merged_seen = list(model.seen)
        (second,), _, _ = _forge_tome_run(model, {"ratio": 0.5, "reduce_when": "always"}, x, context)
        (zero,), _, _ = _forge_tome_run(model, {"ratio": 0.0, "reduce_when": "always"}, x, context)
    assert torch.equal(torch.get_rng_state(), rng)
    assert "ToMe on Flux: whole blocks merged (1 double blocks, 2 single blocks" in method.info
    n, text = 30, 6
    # blocks 1..3 of 5 merged (half the grid), the first and last whole; positions follow the tokens
    assert [s[:2] for s in merged_seen] == [(n, text + n), (n // 2, text + n // 2), (text + n // 2, text + n // 2),
                                             (text + n // 2, text + n // 2), (text + n, text + n)]
    assert torch.equal(merged_seen[1][2], full_seen[1][2])  # the text: never merged
    assert torch.equal(first, second) and not torch.equal(first, unpatched) and torch.equal(zero, unpatched)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_tome_on_forges_flux_reuses_plans_and_corrects_from_the_whole_blocks():
    """plan_every and correct_from_whole (the API's dict form) on Forge's Flux, through the core's
    block wrapper as in ComfyUI: the step that plans gives the whole blocks' output (the unpatched
    one), the steps reusing its plan add the kept differences (closer to unpatched than the same
    plans without them), one plan per step kept (fewer merged calls plan), reruns bit for bit."""
    import tokenreduce.tome_dit as core

    torch.manual_seed(0)
    model = ToyForgeFlux()
    x, context = torch.randn(1, 4, 12, 10), torch.randn(1, 6, 8)
    seeds = (0.9, 0.8, 0.7)
    with torch.no_grad():
        unpatched = [model(x, torch.full((1,), s), context) for s in seeds]
        settings = {"ratio": 0.5, "reduce_when": "always", "share_plans": True, "plan_every": 3}
        plans, plan_block = [], core.plan_block
        core.plan_block = lambda *a, **k: plans.append(1) or plan_block(*a, **k)
        try:
            plain, _, _ = _forge_tome_run(model, settings, x, context, seeds)
            assert len(plans) == 1  # step 0 plans, steps 1 and 2 reuse
            corrected, _, _ = _forge_tome_run(model, {**settings, "correct_from_whole": True}, x, context, seeds)
            again, _, _ = _forge_tome_run(model, {**settings, "correct_from_whole": True}, x, context, seeds)
        finally:
            core.plan_block = plan_block
    assert torch.equal(corrected[0], unpatched[0]) and not torch.equal(plain[0], unpatched[0])
    assert all(torch.equal(a, b) for a, b in zip(corrected, again))
    for step in (1, 2):
        assert (corrected[step] - unpatched[step]).norm() < 0.5 * (plain[step] - unpatched[step]).norm()


def test_tome_on_forges_flux_puts_its_block_replacements_in_the_options_behind_a_seam():
    """ToMe on Forge's Flux as in ComfyUI: its replacement at each merged block's key, which the
    block's seamed forward calls (the auto rule's rehearsals put theirs there instead); a block's
    forward with no replacement in the options runs the block as it is."""
    torch.manual_seed(0)
    model = ToyForgeFlux()
    x, context = torch.randn(1, 4, 12, 10), torch.randn(1, 6, 8)
    with torch.no_grad():
        _, method, _ = _forge_tome_run(model, {"reduce_when": "always"}, x, context)
        assert set(method.patch.replaces) == {("double_block", 1), ("single_block", 0), ("single_block", 1)}
        assert "reduce_when auto is not timed" not in method.info and not method.run.warnings
        forward = method.patch.object_patches["diffusion_model.double_blocks.1.forward"]
        img, txt, vec = torch.randn(1, 30, 8), torch.randn(1, 6, 8), torch.ones(1)
        pe = torch.zeros(1, 1, 36, 4, 2, 2)
        block = model.double_blocks[1]
        assert all(torch.equal(a, b) for a, b in zip(forward(img, txt, vec, pe), block(img, txt, vec, pe)))


def test_tome_on_forges_flux_names_the_unet_only_settings_it_ignores():
    """As the ComfyUI node: set away from their defaults, the settings only UNets use are named in
    one warning; at their defaults, none."""
    model, x, context = ToyForgeFlux(), torch.randn(1, 4, 12, 10), torch.randn(1, 6, 8)
    with torch.no_grad():
        _, plain, _ = _forge_tome_run(model, {"reduce_when": "always"}, x, context)
        _, method, _ = _forge_tome_run(model, {"reduce_when": "always", "mode": "queries only (ComfyUI built-in)"},
                                       x, context)
    assert not plain.run.warnings
    assert method.run.warnings == ["TokenReduce ToMe: WARNING: mode queries only (ComfyUI built-in) does nothing on "
                                   "Flux.1: ToMe merges its whole blocks (every token matched within its tile); this "
                                   "input applies to UNets only."]


# --- ToMe and ToDo together: ToMe's block forwards around ToDo's, one model forward --------------

BLOCKS_SOURCE = '''
import torch


def apply_rope(q, k, pe):
    return q + pe[:, :, :, :1, 0, 0], k - pe[:, :, :, :1, 0, 0]


def attention_function(q, k, v, heads, mask=None, skip_reshape=False):
    seen.append((q.shape[2], k.shape[2]))
    out = torch.softmax(q @ k.transpose(-1, -2) + (0 if mask is None else mask), -1) @ v
    return out.transpose(1, 2).flatten(2)


def attention(q, k, v, pe):
    q, k = apply_rope(q, k, pe)
    return attention_function(q, k, v, q.shape[1], skip_reshape=True)


def heads(x):
    return x.unflatten(-1, (2, -1)).transpose(1, 2)


class DoubleStreamBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.img, self.txt = torch.nn.Linear(8, 24), torch.nn.Linear(8, 24)

    def forward(self, img, txt, vec, pe):
        qkv = torch.cat([self.txt(txt), self.img(img)], 1).chunk(3, -1)
        out = attention(*map(heads, qkv), pe=pe)
        return img + out[:, txt.shape[1]:] * vec[:, None, None], txt + out[:, :txt.shape[1]]


class SingleStreamBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 24)

    def forward(self, x, vec, pe):
        return x + attention(*map(heads, self.lin(x).chunk(3, -1)), pe=pe)
'''


class ToyAttentionFlux(ToyForgeFlux):
    """The toy Flux whose blocks call their module's ``attention(q, k, v, pe)``, as Forge's do."""

    def __init__(self):
        super().__init__()
        module = types.ModuleType("toy_forge_flux_blocks")
        module.seen = self.seen
        exec(compile(BLOCKS_SOURCE, "toy_forge_flux_blocks.py", "exec"), module.__dict__)  # noqa: S102 - the test's own
        self.double_blocks = torch.nn.ModuleList(module.DoubleStreamBlock() for _ in range(2))
        self.single_blocks = torch.nn.ModuleList(module.SingleStreamBlock() for _ in range(3))


ToyAttentionFlux.__name__ = forge_flux.MODEL_CLASS


def test_tome_and_todo_stack_on_forges_flux_in_either_order():
    """Both on: each block both select runs ToMe's forward around ToDo's (one object patch per key),
    and in the merged blocks ToDo keeps, of the merged grid, as many keys as of the whole grid; the
    same in either order of the settings; reruns bit for bit; each alone as before."""
    torch.manual_seed(0)
    model = ToyAttentionFlux()
    x, context = torch.randn(1, 4, 12, 10), torch.randn(1, 6, 8)  # a 6x5 token grid, 6 text tokens
    tome, todo = {"ToMe": {"ratio": 0.5, "reduce_when": "always"}}, {"ToDo": {"reduce_when": "always"}}
    with torch.no_grad():
        unpatched = model(x, torch.full((1,), 0.7), context)
        (only_todo,), _, _ = _forge_run(model, todo, x, context)
        (only_tome,), _, _ = _forge_run(model, tome, x, context)
        model.seen.clear()
        (both,), methods, run = _forge_run(model, {**todo, **tome}, x, context)
        seen = list(model.seen)
        (reverse,), reversed_methods, _ = _forge_run(model, {**tome, **todo}, x, context)
        (again,), _, _ = _forge_run(model, {**todo, **tome}, x, context)
        assert torch.equal(_forge_run(model, todo, x, context)[0][0], only_todo)  # each alone as before
        assert torch.equal(_forge_run(model, tome, x, context)[0][0], only_tome)
    assert [m.method for m in methods] == ["ToDo", "ToMe"] and [m.method for m in reversed_methods] == ["ToMe", "ToDo"]
    keys = [set(m.patch.object_patches) for m in methods]
    assert not keys[0] & keys[1] and forge_flux.FORWARD in keys[0]
    n, text = 30, 6
    # blocks 1..3 merged to half the grid (queries); their keys: ToDo's 3x3 kept of the merged grid
    assert seen == [(text + n, text + n)] + [(text + n // 2, text + 9)] * 3 + [(text + n, text + n)]
    assert torch.equal(both, reverse) and torch.equal(both, again) and torch.isfinite(both).all()
    assert not torch.equal(both, only_todo) and not torch.equal(both, only_tome) and not torch.equal(both, unpatched)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert "k/v in merged blocks" in methods[0].run.report("ToDo", 0.0, 1.0, 0.0, True, None).levels[0].tokens


def test_todo_window_on_forges_flux_runs_each_grid_call_whole_through_the_core(monkeypatch):
    """method window on Forge's Flux: the core's override (todo_dit.py) runs each reduced block's
    call whole through peak_window.window_call (every query; rope applied before), the text
    queries through Forge's attention function with the far field's log counts as the mask;
    reruns bit for bit; not nearest."""
    from tokenreduce import todo_dit
    from tokenreduce.peak_window import window_plan

    torch.manual_seed(0)
    model = ToyAttentionFlux()
    # A 12x12 grid (the windows, 4x4 tiles and 2 tokens around, do not cover it); batch 2.
    x, context = torch.randn(2, 4, 24, 24), torch.randn(2, 6, 8)
    windowed, real = [], todo_dit.window_call
    monkeypatch.setattr(todo_dit, "window_call", lambda q, *args, **kwargs: windowed.append(q.shape) or
                        real(q, *args, **kwargs))
    with torch.no_grad():
        (nearest,), _, _ = _forge_run(model, {"ToDo": {"reduce_when": "always"}}, x, context)
        model.seen.clear()
        (first, again), (method,), _ = _forge_run(model, {"ToDo": {"method": "window", "reduce_when": "always"}}, x,
                                                  context, seeds=(0.7, 0.7))
    n, text = 144, 6
    assert windowed == [(2, 2, text + n, 4)] * 6  # blocks 1..3, twice: the whole call
    # Forge's attention: the blocks left whole, and the text queries of the windowed ones over
    # the text, the 6x6 far field and the 16 heavy keys.
    assert model.seen == ([(text + n, text + n)] + [(text, text + 36 + 16)] * 3 + [(text + n, text + n)]) * 2
    assert torch.equal(first, again) and torch.isfinite(first).all() and not torch.equal(first, nearest)
    seen = window_plan(text + n, text, (1, 12, 12), (1, 6, 6), (1.0, 2.0, 2.0), "cpu").seen
    tokens = method.run.report("ToDo", 0.0, 1.0, 0.0, True, None).levels[0].tokens
    assert tokens == {"q": (n, n), "k/v": (n, round(seen * n))}
