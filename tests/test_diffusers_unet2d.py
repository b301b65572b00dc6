"""diffusers' UNet2DModel (DDPM, consistency models): its self-attentions are plain ``Attention``
modules in AttnDownBlock2D / AttnUpBlock2D / UNetMidBlock2D, called on the feature map. ToDo pools
their keys and values (as the processor norms them), ToMe merges their projections' input and
unmerges the output before the residual; a tiny model built from a config, random weights, no
download. Also the report of a model whose timesteps go negative (consistency models). They reduce
"always": the plain attentions of this tiny model change by 12-14 %, over the default max_change
(tests/test_diffusers_max_change.py tests the budget)."""

from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from tokenreduce import steps_of  # noqa: E402
from tokenreduce.diffusers import apply_patch  # noqa: E402

ATTENTIONS = ("down_blocks.1.attentions.0", "mid_block.attentions.0", "up_blocks.0.attentions.0")


def tiny_unet2d(attention=True):
    torch.manual_seed(0)
    blocks = ("DownBlock2D", "AttnDownBlock2D" if attention else "DownBlock2D")
    up = ("AttnUpBlock2D" if attention else "UpBlock2D", "UpBlock2D")
    return diffusers.UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                                 block_out_channels=(16, 32), down_block_types=blocks, up_block_types=up,
                                 norm_num_groups=8, attention_head_dim=8, add_attention=attention).eval()


def sample(seed=1, batch=2):
    return torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def projection_inputs(model):
    """{attention path: [(q tokens, k tokens)]} per call, read at to_q and to_k."""
    seen, handles = {}, []
    for path in ATTENTIONS:
        attention = model.get_submodule(path)
        for name in ("to_q", "to_k"):
            handles.append(getattr(attention, name).register_forward_pre_hook(
                lambda m, a, path=path, name=name: seen.setdefault((path, name), []).append(a[0].shape[1])))
    return seen, handles


def run(model, x, t=500):
    with torch.no_grad():
        return model(x, t).sample


def rel_error(a, b):
    return float((a - b).norm() / b.norm())


def test_todo_pools_the_keys_of_the_plain_attentions_as_the_processor_norms_them():
    model, x = tiny_unet2d(), sample()
    plain = run(model, x)
    patch = apply_patch(model, "ToDo", reduce_when="always")
    assert "UNet2DModel" in patch.info and "SD UNet2DModel" not in patch.info
    seen, handles = projection_inputs(model)
    out = run(model, x)
    for handle in handles:
        handle.remove()
    # the 8x8 level (downsample 2): queries whole, keys pooled 2x2
    assert seen[(ATTENTIONS[0], "to_q")] == [64] and seen[(ATTENTIONS[0], "to_k")] == [16]
    assert 0 < rel_error(out, plain) < 0.2
    patch.remove()
    # The keys are the processor's own normed tokens, pooled: nearest 2x2 keeps every other row and
    # column, so the attention given those normed tokens as its keys computes what it did patched.
    patch = apply_patch(model, "ToDo", method="nearest", reduce_when="always")
    attention, calls = model.get_submodule(ATTENTIONS[0]), []
    spy = attention.register_forward_hook(lambda m, a, out: calls.append((a[0], out)))
    run(model, x)
    spy.remove()
    (feature, patched), = calls
    patch.remove()
    normed = attention.group_norm(feature.flatten(2)).transpose(1, 2)
    kept = normed.reshape(2, 8, 8, 32)[:, ::2, ::2].reshape(2, 16, 32)
    with torch.no_grad():
        assert torch.allclose(patched, attention(feature, encoder_hidden_states=kept), atol=1e-5)
        assert not torch.allclose(patched, attention(feature), atol=1e-5)
    patch = apply_patch(model, "ToDo", reduce_when="always")
    run(model, x)
    report = patch.report()
    assert report.levels and report.levels[0].grid == (8, 8)
    patch.remove()
    assert torch.equal(run(model, x), plain)  # removed: the model as it was


def test_tome_merges_the_projections_of_the_plain_attentions_and_restores_the_map():
    model, x = tiny_unet2d(), sample()
    plain = run(model, x)
    patch = apply_patch(model, "ToMe", ratio=0.5, max_downsample="2", reduce_when="always")
    seen, handles = projection_inputs(model)
    out = run(model, x)
    for handle in handles:
        handle.remove()
    assert out.shape == plain.shape and torch.isfinite(out).all()
    assert seen[(ATTENTIONS[0], "to_q")] == [32] and seen[(ATTENTIONS[0], "to_k")] == [32]
    assert 0 < rel_error(out, plain) < 0.5
    assert torch.equal(run(model, x), out)  # reproducible
    report = patch.report()
    assert report.levels and report.levels[0].grid == (8, 8)
    patch.remove()
    # queries only: the keys and values from every token
    patch = apply_patch(model, "ToMe", ratio=0.5, max_downsample="2", mode="queries only (ComfyUI built-in)",
                        reduce_when="always")
    seen, handles = projection_inputs(model)
    run(model, x)
    for handle in handles:
        handle.remove()
    assert seen[(ATTENTIONS[0], "to_q")] == [32] and seen[(ATTENTIONS[0], "to_k")] == [64]
    patch.remove()
    assert torch.equal(run(model, x), plain)
    # proportional attention: the sizes cannot go into a processor that projects and attends in one call
    with pytest.raises(ValueError, match="plain attentions"):
        apply_patch(model, "ToMe", ratio=0.5, max_downsample="2", mode="q, k, v + proportional attention")
    assert torch.equal(run(model, x), plain)  # refused before any hook


def test_a_unet2dmodel_without_attention_is_refused_by_its_own_name():
    model = tiny_unet2d(attention=False)
    for method in ("ToDo", "ToMe"):
        with pytest.raises(ValueError) as refused:
            apply_patch(model, method)
        message = str(refused.value)
        assert "UNet2DModel" in message and "SD UNet2DModel" not in message, message
        assert "AttnDownBlock2D" in message, message


def test_steps_of_counts_negative_timesteps_in_their_own_step():
    schedule = [1095.5, 400.0, -300.0, -1553.6, -1554.6]  # 250 * ln(sigma), one below the last
    assert steps_of(schedule, [1095.5, 400.0, -300.0, -1553.6]) == (1, 2, 3, 4)
    assert steps_of(schedule, [-1553.6 * (1 + 1e-7)]) == (4,)  # a float32 round trip
    assert steps_of([14.6, 9.0, 0.0], [9.0 * (1 + 1e-7)]) == (2,)


def test_a_consistency_model_run_reports_every_reduced_step():
    """Timesteps 250 * ln(sigma) (CMStochasticIterativeScheduler's), negative at the end: a 4-call
    run with every call reduced reads steps 1-4 of 4."""
    scheduler = diffusers.CMStochasticIterativeScheduler()
    scheduler.set_timesteps(4)
    timesteps = scheduler.timesteps
    assert timesteps[-1] < 0
    model, x = tiny_unet2d(), sample(batch=1)
    patch = apply_patch(model, "ToDo", reduce_when="always")
    for t in timesteps:
        run(model, x, t)
    report = patch.report()
    assert report.steps == 4 and report.active_steps == (1, 2, 3, 4), (list(timesteps), report.active_steps)
    patch.remove()
