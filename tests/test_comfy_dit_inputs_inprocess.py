"""ToDo on DiTs given inputs that change what the model does, or that its model ignores, in the
real ComfyUI, in-process, on tiny random-weight models (devtools/random_dits.py and
devtools/dit_fixtures/):

- a conditioning input that the host's ``model_base`` passes on but the diffusion model ignores
  (Chroma's and Chroma Radiance's ``ref_latents``, from ReferenceLatent) adds no token, so the
  layout must not count one: ToDo reduces as without it;
- Kandinsky 5 beyond 40 latent frames: where the model sends its self-attention to NABLA sparse
  attention (a ComfyUI that has it), that attention never reaches the host's, so ToDo leaves the
  model call alone and says why; where it has none (0.33.0), those calls are reduced as any other.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

import random_dits
from comfy_helpers import apply, rel_error, session_of

IMAGE = dict(height_px=128, width_px=96)  # a 16x12 latent: an 8x6 token grid at patch 2
ALL_BLOCKS = dict(temporal_factor=1.0, skip_first_blocks=0, skip_last_blocks=0)


def _sample(comfy, model, variant, positive, negative, size, steps=2, cfg=2.0):
    latent = random_dits.latent(variant, **size)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        return comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", positive, negative, latent, seed=0,
                                   disable_pbar=True)


def _key_lengths(model, records):
    """A clone whose attention override (before ToDo's, which chains to it) records each call's
    key length."""
    probed = model.clone()

    def probe(func, *args, **kwargs):
        records.append(args[1].shape[2 if kwargs.get("skip_reshape") else 1])
        return func(*args, **kwargs)

    probed.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = probe
    return probed


def _with_reference(conditioning, reference):
    """The conditioning as ReferenceLatent leaves it: ``reference_latents`` in every entry."""
    return [[context, {**extras, "reference_latents": [reference]}] for context, extras in conditioning]


# --- inputs the model ignores ---------------------------------------------------------------------

# variant -> the token grid of IMAGE, the reference latent ReferenceLatent stores (a 64x48 px image)
IGNORED_REFERENCE = {
    "chroma": ((8, 6), [1, 16, 6, 8]),  # comfy.ldm.chroma.model.Chroma: forward(..., **kwargs) drops ref_latents
    "chroma_radiance": ((8, 6), [1, 3, 48, 64]),  # pixel space: its "latent" is the image
}


@pytest.mark.parametrize("variant", list(IGNORED_REFERENCE))
def test_a_reference_latent_the_model_ignores_leaves_the_layout_as_without_it(comfy, variant):
    """Chroma's model_base is Flux's, which passes ReferenceLatent's latents on as ``ref_latents``;
    Chroma's diffusion model ignores them (no token is added). ToDo once counted them in the key
    length it expects, so no call matched and nothing was reduced (relative change 0.0, with a
    warning blaming another patch). The premise is checked first: the unpatched model gives the
    same result with and without the reference."""
    grid, reference_shape = IGNORED_REFERENCE[variant]
    if not random_dits.available(variant):
        pytest.skip(f"this ComfyUI has no {random_dits.FAMILY_SPECS[variant].config}")
    base = random_dits.make_dit(variant)
    positive, negative = random_dits.conditioning(variant, **IMAGE)
    reference = torch.randn(reference_shape, generator=torch.Generator().manual_seed(5))
    with_ref = _with_reference(positive, reference), _with_reference(negative, reference)

    plain = _sample(comfy, base, variant, positive, negative, IMAGE)
    assert torch.equal(_sample(comfy, base, variant, *with_ref, IMAGE), plain)  # the model ignores it

    unpatched_keys, keys = [], []
    _sample(comfy, _key_lengths(base, unpatched_keys), variant, *with_ref, IMAGE)
    output = apply(comfy, "todo", _key_lengths(base, keys), **ALL_BLOCKS)
    model = output.result[0]
    out = _sample(comfy, model, variant, *with_ref, IMAGE)

    assert 1e-5 < rel_error(out, plain) < 0.1
    tokens, kept = math.prod(grid), math.prod(-(-n // 2) for n in grid)
    assert keys == [n - tokens + kept for n in unpatched_keys]  # every call is a grid call here
    report = session_of(model).last_report
    assert report.warnings == () and report.skipped_calls == 0
    assert [(level.grid, level.tokens) for level in report.levels] == [(grid, {"q": (tokens, tokens),
                                                                               "k/v": (tokens, kept)})]
    # The same result as without the reference, bit for bit: the reference changes nothing.
    assert torch.equal(out, _sample(comfy, model, variant, positive, negative, IMAGE))


# --- Kandinsky 5 beyond 40 latent frames --------------------------------------------------------

LONG = dict(frames=161, height_px=48, width_px=32)  # 41 latent frames of a 6x4 latent: 3x2 tokens each
LONG_GRID = (41, 3, 2)


def _long_run(comfy, model):
    positive, negative = random_dits.conditioning("kandinsky5", **LONG)
    return _sample(comfy, model, "kandinsky5", positive, negative, LONG, steps=1, cfg=1.0)


def _kandinsky(comfy):
    if not random_dits.available("kandinsky5"):
        pytest.skip("this ComfyUI has no Kandinsky5 (0.33 has it: run with --comfyui)")
    return random_dits.make_dit("kandinsky5")


def test_kandinsky5_beyond_40_frames_without_nabla_is_reduced(comfy):
    """ComfyUI 0.33.0's Kandinsky 5 has no sparse attention: 41 latent frames go through the host's
    attention like 3, so ToDo reduces them."""
    base = _kandinsky(comfy)
    assert "sparse_params" not in _self_attention_parameters(base)  # this tree has no NABLA
    plain = _long_run(comfy, base)
    model = apply(comfy, "todo", base, **ALL_BLOCKS).result[0]
    out = _long_run(comfy, model)
    assert 1e-5 < rel_error(out, plain) < 0.2
    report = session_of(model).last_report
    assert report.warnings == () and [level.grid for level in report.levels] == [LONG_GRID]


def _self_attention_parameters(patcher):
    import inspect

    attention = patcher.model.diffusion_model.visual_transformer_blocks[0].self_attention
    return inspect.signature(type(attention).forward).parameters


def with_nabla(base, monkeypatch):
    """``base`` (a Kandinsky 5) with a self-attention that takes NABLA's ``sparse_params``, as in the
    ComfyUI trees that send the self-attention of more than 40 latent frames to NABLA (flex
    attention over fractal-ordered tokens, never the host's attention). Stand-in: the module's own
    self-attention class with that parameter added (it still computes full attention here, which
    is what lets the tests see that ToDo and ToMe leave it alone)."""
    module = sys.modules[type(base.model.diffusion_model).__module__]

    class SelfAttention(module.SelfAttention):
        def forward(self, x, freqs, sparse_params=None, transformer_options={}):
            return super().forward(x, freqs, transformer_options=transformer_options)

    for block in base.model.diffusion_model.visual_transformer_blocks:
        monkeypatch.setattr(block.self_attention, "__class__", SelfAttention)
    return base


@pytest.fixture
def nabla_kandinsky(comfy, monkeypatch):
    """A tiny Kandinsky 5 whose self-attention takes NABLA's ``sparse_params`` (``with_nabla``)."""
    return with_nabla(_kandinsky(comfy), monkeypatch)


def test_kandinsky5_with_nabla_beyond_40_frames_is_left_alone_and_said(comfy, nabla_kandinsky):
    plain = _long_run(comfy, nabla_kandinsky)
    model = apply(comfy, "todo", nabla_kandinsky, **ALL_BLOCKS).result[0]
    assert torch.equal(_long_run(comfy, model), plain)
    report = session_of(model).last_report
    assert report.levels == () and report.skipped_calls == 0
    (warning,) = [w for w in report.warnings if "NABLA" in w]
    assert "more than 40 latent frames (41 here)" in warning and "never reaches the host's attention" in warning
    assert not any("patch applied" in w or "reference streams" in w for w in report.warnings)  # no one else blamed


def test_kandinsky5_with_nabla_up_to_40_frames_is_reduced(comfy, nabla_kandinsky):
    size = dict(frames=9, height_px=48, width_px=32)  # 3 latent frames: full attention through the host's
    positive, negative = random_dits.conditioning("kandinsky5", **size)
    model = apply(comfy, "todo", nabla_kandinsky, **ALL_BLOCKS).result[0]
    plain = _sample(comfy, nabla_kandinsky, "kandinsky5", positive, negative, size, steps=1, cfg=1.0)
    out = _sample(comfy, model, "kandinsky5", positive, negative, size, steps=1, cfg=1.0)
    assert 1e-5 < rel_error(out, plain) < 0.2
    report = session_of(model).last_report
    assert report.warnings == () and [level.grid for level in report.levels] == [(3, 3, 2)]
