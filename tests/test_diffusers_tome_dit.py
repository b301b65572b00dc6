"""ToMe on diffusers DiT transformers (whole blocks, the core's plan, merge and restore), on a tiny
random-weight FluxTransformer2DModel built from config: only the image tokens merge (the text's
keys stay whole), reruns are bit for bit, the input model and the global RNG are untouched,
remove_patch leaves nothing on the model, ratio 0 is the unpatched model."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("diffusers")

from tokenreduce.diffusers import apply_patch, remove_patch, tiny  # noqa: E402

TEXT = tiny.TEXT_TOKENS
H = W = 8


def _call(model, batch: int = 1) -> torch.Tensor:
    with torch.no_grad():
        return model(**tiny.transformer_inputs("Flux", model, batch=batch, h=H, w=W), return_dict=False)[0]


@pytest.fixture()
def flux():
    return tiny.transformer("Flux")


def _state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_only_image_tokens_merge(flux, monkeypatch):
    module = importlib.import_module("diffusers.models.transformers.transformer_flux")
    original, calls = module.dispatch_attention_fn, []

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        calls.append(key)
        return original(query, key, value, attn_mask, *args, **kwargs)
    monkeypatch.setattr(module, "dispatch_attention_fn", spy)
    _call(flux)
    full = list(calls)
    calls.clear()
    patch = apply_patch(flux, "ToMe", ratio=0.5, reduce_when="always")
    assert "whole blocks merged" in patch.info
    _call(flux)
    n = H * W
    lengths = [k.shape[1] for k in calls]
    # 2 double + 2 single blocks: the first and the last whole, the two between merged (half the grid)
    assert lengths == [TEXT + n, TEXT + n // 2, TEXT + n // 2, TEXT + n]
    assert torch.equal(calls[1][:, :TEXT], full[1][:, :TEXT])  # the text's keys: never merged
    assert torch.equal(calls[0], full[0])


def test_reruns_bit_for_bit_and_remove_leaves_nothing(flux):
    before, rng = _state(flux), torch.get_rng_state()
    unpatched = _call(flux, batch=2)
    apply_patch(flux, "ToMe", ratio=0.5, reduce_when="always", use_rand=True, seed=7)
    first, second = _call(flux, batch=2), _call(flux, batch=2)
    assert torch.equal(first, second)
    assert not torch.equal(first, unpatched)
    assert torch.equal(torch.get_rng_state(), rng)
    remove_patch(flux)
    assert not any("forward" in m.__dict__ for m in flux.modules())
    assert all(torch.equal(v, before[k]) for k, v in flux.state_dict().items())
    assert torch.equal(_call(flux, batch=2), unpatched)


def test_batch_samples_merge_as_alone(flux):
    """Each sample of a batch merges with its own plan, as it would alone."""
    inputs = tiny.transformer_inputs("Flux", flux, batch=2, h=H, w=W)
    apply_patch(flux, "ToMe", ratio=0.5, reduce_when="always", use_rand=False)
    with torch.no_grad():
        both = flux(**inputs, return_dict=False)[0]
        one = flux(**{k: (v[1:] if torch.is_tensor(v) and v.shape[0] == 2 and k not in ("img_ids", "txt_ids")
                          else v) for k, v in inputs.items()}, return_dict=False)[0]
    torch.testing.assert_close(both[1:], one, rtol=1e-5, atol=1e-5)


def test_ratio_zero_is_unpatched(flux):
    unpatched = _call(flux)
    apply_patch(flux, "ToMe", ratio=0.0, reduce_when="always")
    assert torch.equal(_call(flux), unpatched)


def test_auto_on_cpu_merges(flux):
    unpatched = _call(flux)
    apply_patch(flux, "ToMe", ratio=0.5, reduce_when="auto")
    assert not torch.equal(_call(flux), unpatched)


def test_families_without_a_description_point_to_todo():
    model = tiny.transformer("Wan")
    with pytest.raises(ValueError, match="use ToDo"):
        apply_patch(model, "ToMe")


def test_kontext_reference_tokens_stay_whole(flux, monkeypatch):
    """Kontext's reference image: its tokens follow the grid's (ids with first index 1); never merged."""
    module = importlib.import_module("diffusers.models.transformers.transformer_flux")
    original, lengths = module.dispatch_attention_fn, []

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        lengths.append(key.shape[1])
        return original(query, key, value, attn_mask, *args, **kwargs)
    monkeypatch.setattr(module, "dispatch_attention_fn", spy)
    inputs = tiny.transformer_inputs("Flux", flux, h=H, w=W)
    reference = torch.randn(1, 16, inputs["hidden_states"].shape[2], generator=torch.Generator().manual_seed(9))
    ids = torch.zeros(4, 4, 3)
    ids[..., 0], ids[..., 1], ids[..., 2] = 1, torch.arange(4)[:, None], torch.arange(4)[None, :]
    inputs = {**inputs, "hidden_states": torch.cat([inputs["hidden_states"], reference], 1),
              "img_ids": torch.cat([inputs["img_ids"], ids.reshape(-1, 3)])}
    apply_patch(flux, "ToMe", ratio=0.5, reduce_when="always")
    with torch.no_grad():
        out = flux(**inputs, return_dict=False)[0]
    n = H * W
    assert lengths == [TEXT + n + 16, TEXT + n // 2 + 16, TEXT + n // 2 + 16, TEXT + n + 16]
    assert out.shape[1] == n + 16
