"""The quality budget's change is kept per model (issue #51, reproduced defect 1), in the real
ComfyUI: two SD1.5 UNets of one config share a kind (the shapes, dtypes, backend and reduction)
but not a change. A decision's speed stays keyed by the kind; its change is kept under a
fingerprint of the weights the measured block computes with (the patcher's base weights and LoRA
patches), so a second model of a shape met before, a LoRA'd clone, a fine-tune is measured for
itself, and the same model after a restart reuses its kept change without measuring.

Tiny random models; B is A with sharper self-attention (its to_q and to_k weights scaled up)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from comfy_helpers import patched, reduced, sample, session_of, spy_attn1

PACK = "tokenreduce_pack"
HUGE = 2.0
SHARPER = 6.0  # B's self-attention queries and keys, scaled


@pytest.fixture(scope="module")
def pair(comfy):
    """A and B: one SD1.5 config, one seed; B's self-attention is sharper."""
    a = comfy.models.make_model("SD15", tiny=True, seed=0)
    b = comfy.models.make_model("SD15", tiny=True, seed=0)
    with torch.no_grad():
        for name, parameter in b.model.diffusion_model.named_parameters():
            if ".attn1.to_q." in name or ".attn1.to_k." in name:
                parameter.mul_(SHARPER)
    return a, b


def store_at(comfy, monkeypatch, path, **options):
    """A decisions store on ``path`` made the nodes' store (a new one: as a new process reads it)."""
    pays = sys.modules[f"{PACK}.tokenreduce.pays"]
    store = pays.Decisions(path, **options)
    monkeypatch.setattr(sys.modules[f"{PACK}.nodes.common"], "decisions", lambda: store)
    return store


def decided(comfy, model, budget: float, **settings):
    """The decision of the one kind ToDo meets on the tiny SD1.5 at 32x32 (downsample 1), and
    whether the run reduced."""
    records = []
    # average: nearest over the budget would step down to the window (a second decision); what this
    # file tests is the change kept per model, the same for any method
    node = patched(comfy, "todo", model, max_change=budget, **{"method": "average", **settings})
    sample(comfy, spy_attn1(node, records), steps=1)
    (_, decision), = session_of(node).last_report.decisions
    return decision, bool(reduced(records, "keys"))


def alone(comfy, monkeypatch, tmp_path, model, name: str) -> float:
    """The change ``model``'s block makes when measured in a decisions file of its own."""
    store_at(comfy, monkeypatch, tmp_path / f"{name}.json")
    decision, _ = decided(comfy, model, HUGE)
    assert decision.source == "measured"
    return decision.change


def test_a_second_model_of_one_shape_gets_its_own_change(comfy, pair, monkeypatch, tmp_path):
    """B measured after A in one decisions file: measured for itself (not A's kept change), and left
    alone where, measured alone, it is left alone; A is still reduced, after a restart too."""
    a, b = pair
    change_a, change_b = alone(comfy, monkeypatch, tmp_path, a, "a"), alone(comfy, monkeypatch, tmp_path, b, "b")
    assert change_b > 1.5 * change_a  # sharper attention: reducing its keys changes B more
    budget = (change_a + change_b) / 2
    path = tmp_path / "shared.json"
    store = store_at(comfy, monkeypatch, path)
    first, reduces = decided(comfy, a, budget)
    assert (first.source, first.change, reduces) == ("measured", change_a, True)
    second, reduces = decided(comfy, b, budget)
    assert (second.source, second.change) == ("measured", change_b)  # its own, not A's
    assert second.over_budget and not reduces  # left alone, as alone
    assert store.measurements == 2
    (entry,) = json.loads(path.read_text())["decisions"].values()  # one kind: one entry, two models' changes
    assert sorted(entry["changes"].values()) == [change_a, change_b] and "change" not in entry
    restarted = store_at(comfy, monkeypatch, path)  # a second process: each model's kept change, nothing measured
    for model, change, reduces in ((b, change_b, False), (a, change_a, True)):
        decision, reduced_now = decided(comfy, model, budget)
        assert (decision.source, decision.change, reduced_now) == ("kept", change, reduces)
    assert restarted.measurements == 0


def lora(comfy, patcher, strength: float = 1.0, rank: int = 2, seed: int = 4):
    """A clone of ``patcher`` with a random LoRA (ComfyUI's own ``LoRAAdapter`` patches, as
    LoraLoader adds them) on every self-attention's to_q and to_k."""
    from comfy.weight_adapter.lora import LoRAAdapter

    generator = torch.Generator().manual_seed(seed)
    patches = {}
    for key, weight in patcher.model.state_dict().items():
        if key.startswith("diffusion_model.") and (".attn1.to_q.weight" in key or ".attn1.to_k.weight" in key):
            up = torch.randn(weight.shape[0], rank, generator=generator)
            down = torch.randn(rank, weight.shape[1], generator=generator)
            patches[key] = LoRAAdapter(set(), (up, down, None, None, None, None))
    clone = patcher.clone()
    assert len(clone.add_patches(patches, strength)) == len(patches) > 0
    return clone


def test_a_lora_d_clone_gets_its_own_fingerprint_and_change(comfy, pair, monkeypatch, tmp_path):
    a, _ = pair
    store = store_at(comfy, monkeypatch, tmp_path / "d.json")
    base, _ = decided(comfy, a, HUGE)
    with_lora, _ = decided(comfy, lora(comfy, a), HUGE)
    assert (base.source, with_lora.source) == ("measured", "measured") and with_lora.change != base.change
    stronger, _ = decided(comfy, lora(comfy, a, strength=0.5), HUGE)  # the strength is the LoRA's too
    assert stronger.source == "measured" and store.measurements == 3
    again, _ = decided(comfy, a, HUGE)
    assert (again.source, again.change) == ("kept", base.change)


def test_the_fingerprint_reads_the_lora_alike_patched_in_place_or_on_the_fly(comfy, pair):
    """ComfyUI applies a LoRA in place (a full load: the module holds base + LoRA, the base kept in
    the patcher's backup) or in each forward (lowvram: the module holds the base): the fingerprint
    reads the patcher's view, the same both ways, and another than the base model's."""
    import comfy.model_management as comfy_models

    host = sys.modules[f"{PACK}.nodes.host"]
    a, _ = pair
    clone = lora(comfy, a)
    path = next(name for name, _ in a.model.diffusion_model.named_modules() if name.endswith("transformer_blocks.0"))
    block = a.model.diffusion_model.get_submodule(path)
    base_model = clone.model
    comfy_models.load_models_gpu([a])  # A loaded (whatever an earlier test left loaded): no LoRA in its weights
    previous = base_model.current_patcher
    try:
        base_model.current_patcher = a
        plain = host.weights_fingerprint(base_model, path, block)
        base_model.current_patcher = clone
        on_the_fly = host.weights_fingerprint(base_model, path, block)  # not patched yet: the base weights
        before = block.attn1.to_q.weight.detach().clone()
        comfy_models.load_models_gpu([clone])  # as sampling the clone loads it: the LoRA patched in
        try:
            assert not torch.equal(block.attn1.to_q.weight, before)  # patched in place
            in_place = host.weights_fingerprint(base_model, path, block)
        finally:
            comfy_models.load_models_gpu([a])  # A again: the clone's patches undone
        assert torch.equal(block.attn1.to_q.weight, before)
    finally:
        base_model.current_patcher = previous
    assert on_the_fly == in_place != plain


def test_speed_stays_keyed_by_shape(comfy, pair, measuring):
    """Timed (a scripted clock on the CPU): A's timing serves B; B's change alone is measured."""
    a, b = pair
    store = measuring((10.0, 5.0), (10.0, 20.0))  # a second timing would say "slower": never asked
    first, _ = decided(comfy, a, HUGE)
    second, reduces = decided(comfy, b, HUGE)
    assert (first.source, second.source) == ("measured", "measured")
    assert (second.full_ms, second.reduced_ms) == (first.full_ms, first.reduced_ms) == (10.0, 5.0)
    assert store.stopwatch.kinds == 1 and reduces and second.change != first.change
