"""The Forge-free parts of ToDo and ToMe on Forge's Flux.1 (tokenreduce_forge/flux.py), in CI without Forge:
the block forward rebuilt over its own globals with another ``attention`` (nothing global
changed), what is refused before anything is patched, Forge's attention entry as the auto rule
times it, and the call's options noted only for the length of a model call. The whole path on
Forge's own model is tests/test_forge_flux.py (``--forge``)."""

from __future__ import annotations

import types

import pytest
import torch

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
    ({"ToMe": {}, "ToDo": {}}, "TokenReduce ToMe and TokenReduce ToDo together cannot patch Forge's Flux yet"),
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
    """What ToMe asks of Forge's UnetPatcher: its model objects and object patches."""

    def __init__(self, model):
        self.model, self.object_patches = model, {}

    def get_model_object(self, name):
        return self.model if name == "diffusion_model" else self.model.get_submodule(name.split(".", 1)[1])


def _forge_tome_run(model, values: dict, x, context, seeds=(0.7,)):
    """ToMe chosen for Forge's Flux and called as Forge's sampling calls it: the object patches
    put on the model for the call (as Forge loads the clone) and taken off after."""
    clone = ToyClone(model)
    settings = S.method_settings("ToMe", S.FIRST, values)
    layout = forge_flux.layout_of(model)
    run = types.SimpleNamespace(warnings=[])
    refusal, chosen = forge_flux.choose(clone, run, layout, "Flux", S.FIRST, {"ToMe": settings}, x.shape, None,
                                        lambda p: 1.0 - p)
    assert refusal is None and len(chosen) == 1
    method = patching.MethodRun(chosen[0].method, S.FIRST, *chosen[0][1:])
    outs = []
    for sigma in seeds:
        sigmas = torch.tensor([sigma])
        options = {"sigmas": sigmas}
        context_ = method.run.open_call(sigmas, options)
        method.patch.prepare_call(context_, method.run, patching.ModelCall(x, context, {}, options, sigmas))
        options[method.patch.context_key] = context_
        for key, value in method.patch.object_patches.items():
            setattr(clone.get_model_object(key.rsplit(".", 1)[0]), "forward", value)
        try:
            outs.append(model(x, torch.full((x.shape[0],), sigma), context, transformer_options=options))
        finally:
            for key in method.patch.object_patches:
                del clone.get_model_object(key.rsplit(".", 1)[0]).__dict__["forward"]
            method.run.close_call(context_, sigmas)
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


def test_tome_auto_on_forges_flux_says_it_is_untimed():
    torch.manual_seed(0)
    model = ToyForgeFlux()
    with torch.no_grad():
        _, method, _ = _forge_tome_run(model, {"reduce_when": "auto"}, torch.randn(1, 4, 12, 10), torch.randn(1, 6, 8))
    assert "reduce_when auto is not timed for ToMe on Forge's Flux" in method.info
    assert any("reduce_when auto is not timed" in w for w in method.run.warnings)
