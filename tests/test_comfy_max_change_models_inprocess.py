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

from comfy_helpers import block_changes, patched, per_block, reduced_blocks, sample, session_of, spy_attn1

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
    """The decisions of ToDo on the tiny SD1.5 at 32x32 (downsample 1): its blocks' per-block
    decision (issue #51), the level's speed decision (None on an untimed CPU), and the blocks the
    run reduced."""
    records = []
    # average: nearest over the budget would step down to the window (a second method); what this
    # file tests is the change kept per model, the same for any method
    node = patched(comfy, "todo", model, max_change=budget, **{"method": "average", **settings})
    sample(comfy, spy_attn1(node, records), steps=1)
    decisions = session_of(node).last_report.decisions
    speed = [d for site, d in decisions if not site.endswith("per block")]
    return per_block(node), (speed[0] if speed else None), reduced_blocks(records)


def alone(comfy, monkeypatch, tmp_path, model, name: str) -> dict:
    """{block: the change it makes} for ``model``, measured in a decisions file of its own."""
    store = store_at(comfy, monkeypatch, tmp_path / f"{name}.json")
    decision, _, _ = decided(comfy, model, HUGE)
    assert decision.source == "measured"
    return {block: change for (block, _), change in block_changes(store).items()}


def test_a_second_model_of_one_shape_gets_its_own_change(comfy, pair, monkeypatch, tmp_path):
    """B measured after A in one decisions file: measured for itself (not A's kept changes), and
    left alone where, measured alone, it is left alone; A is still reduced, after a restart too."""
    a, b = pair
    changes_a = alone(comfy, monkeypatch, tmp_path, a, "a")
    changes_b = alone(comfy, monkeypatch, tmp_path, b, "b")
    assert changes_a.keys() == changes_b.keys() and len(changes_a) > 1
    assert min(changes_b.values()) > 1.5 * max(changes_a.values())  # sharper attention: B changes more
    budget = (max(changes_a.values()) + min(changes_b.values())) / 2
    blocks = set(changes_a)
    path = tmp_path / "shared.json"
    store = store_at(comfy, monkeypatch, path)
    first, _, reduces = decided(comfy, a, budget)
    assert (first.source, reduces) == ("measured", blocks)
    assert {block: change for (block, _), change in block_changes(store).items()} == changes_a
    second, _, reduces = decided(comfy, b, budget)
    assert second.source == "measured" and store.measurements == 2 * len(blocks)  # its own, not A's
    assert {block: change for (block, _), change in block_changes(store).items()} == changes_b
    assert second.over_budget and not reduces  # left alone, as alone
    entries = [e for key, e in json.loads(path.read_text())["decisions"].items() if '"block"' in key]
    assert len(entries) == len(blocks)  # a kind per block: one entry, two models' changes each
    assert sorted(c for e in entries for c in e["changes"].values()) == sorted([*changes_a.values(),
                                                                               *changes_b.values()])
    assert not any("change" in e for e in entries)
    restarted = store_at(comfy, monkeypatch, path)  # a second process: each model's kept change, nothing measured
    for model, reduces in ((b, set()), (a, blocks)):
        decision, _, reduced_now = decided(comfy, model, budget)
        assert (decision.source, reduced_now) == ("kept", reduces)
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

    def changes_of(model):
        measured = store.measurements
        decision, _, _ = decided(comfy, model, HUGE)
        return decision, store.measurements - measured, block_changes(store)

    base, counted, base_changes = changes_of(a)
    with_lora, lora_count, lora_changes = changes_of(lora(comfy, a))
    assert (base.source, with_lora.source) == ("measured", "measured") and lora_count == counted > 1
    assert all(lora_changes[block] != change for block, change in base_changes.items())
    stronger, count, _ = changes_of(lora(comfy, a, strength=0.5))  # the strength is the LoRA's too
    assert stronger.source == "measured" and count == counted
    again, count, _ = changes_of(a)
    assert (again.source, again.change, count) == ("kept", base.change, 0)


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
    """Timed (a scripted clock on the CPU): A's timing serves B; B's changes alone are measured."""
    a, b = pair
    store = measuring((10.0, 5.0), (10.0, 20.0))  # a second timing would say "slower": never asked
    first, first_speed, _ = decided(comfy, a, HUGE)
    second, second_speed, reduces = decided(comfy, b, HUGE)
    assert (first.source, second.source, first_speed.source, second_speed.source) == (
        "measured", "measured", "measured", "kept")
    assert (second_speed.full_ms, second_speed.reduced_ms) == (10.0, 5.0)
    assert store.stopwatch.kinds == 1 and reduces and second.change != first.change


def sharpened_block(comfy, path: str, factor: float = SHARPER):
    """The tiny SD1.5 (A's config and seed) with the self-attention of the one block at ``path``
    sharpened: that block alone changes much more when reduced."""
    model = comfy.models.make_model("SD15", tiny=True, seed=0)
    block = model.model.diffusion_model.get_submodule(path)
    with torch.no_grad():
        block.attn1.to_q.weight.mul_(factor)
        block.attn1.to_k.weight.mul_(factor)
    return model


@pytest.mark.parametrize("node", ["todo", "tome"])
def test_each_block_of_a_level_is_decided_on_its_own(comfy, pair, monkeypatch, tmp_path, node):
    """Issue #51, per block on UNets: a level whose first block changes much more than its others
    (its self-attention sharpened) runs every other block and leaves that one alone. Decided per
    level, by its first block, the whole level was left alone. The report names both; the run
    that measured gives the image of the next run and of a restart, which measure nothing."""
    a, _ = pair
    first_path = next(name for name, _ in a.model.diffusion_model.named_modules()
                      if name.endswith("transformer_blocks.0"))
    model = sharpened_block(comfy, first_path)
    settings = {"method": "average"} if node == "todo" else {"use_rand": False}
    store = store_at(comfy, monkeypatch, tmp_path / "blocks.json")
    every = patched(comfy, node, model, max_change=HUGE, **settings)
    sample(comfy, every, steps=1)
    changes = {block: change for (block, _), change in block_changes(store).items()}
    sharp = ("input", 1)  # the level's first block
    assert sharp in changes and len(changes) > 2
    others = max(change for block, change in changes.items() if block != sharp)
    assert changes[sharp] > 1.5 * others
    budget = (changes[sharp] + others) / 2
    records = []
    budgeted = patched(comfy, node, model, max_change=budget, **settings)
    first = sample(comfy, spy_attn1(budgeted, records), steps=2)
    field = "keys" if node == "todo" else "queries"
    assert reduced_blocks(records, field) == set(changes) - {sharp}
    decision = per_block(budgeted)
    assert decision.reduce and decision.change == others
    line = next(line for line in describe_lines(budgeted) if "per block" in line)
    assert "left alone input 1 " in line and "each block alone" in line and "at most" in line, line
    measured = store.measurements
    assert torch.equal(sample(comfy, budgeted, steps=2), first) and store.measurements == measured
    store_at(comfy, monkeypatch, tmp_path / "blocks.json")  # a restart
    again = patched(comfy, node, model, max_change=budget, **settings)
    assert torch.equal(sample(comfy, again, steps=2), first)
    assert per_block(again).source == "kept"


def describe_lines(model) -> list[str]:
    describe = sys.modules[f"{PACK}.tokenreduce.describe"]
    session = session_of(model)
    return describe.run_lines(session.header, session.last_report)
