"""The Forge-free parts of ToDo on Forge's Flux.1 (tokenreduce_forge/flux.py), in CI without Forge:
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
    ({"ToMe": {}}, "TokenReduce ToMe cannot patch Forge's Flux: ToMe works on UNet models"),
    ({"ToDo": {"method": "bicubic"}}, "TokenReduce ToDo: method 'bicubic' does not work on Flux.1"),
])
def test_what_cannot_run_on_forges_flux_is_refused_before_anything_is_patched(methods, expected):
    settings = {m: S.method_settings(m, S.FIRST, v) for m, v in methods.items()}
    layout = forge_flux.layout_of(IntegratedFluxTransformer2DModel())
    refusal, chosen = forge_flux.choose(None, None, layout, "Flux", S.FIRST, settings, (1, 16, 64, 64), None, None)
    assert refusal.startswith(expected) and chosen == []


def test_the_refusal_of_other_dits_says_what_forge_supports():
    assert "works on UNet models (SD1.x, SD2.x, SDXL) and ToDo on Forge's Flux.1; ToDo on other DiT models" in \
        patching.not_a_unet("Chroma")
