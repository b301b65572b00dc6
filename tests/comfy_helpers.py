"""Helpers of the in-process host tests: apply our nodes, sample with comfy.sample, probe."""

from __future__ import annotations

from collections import Counter

import torch

from tokenreduce.methods import TODO, TOME

# What a workflow saved before the optional inputs existed sends: every required input at its default.
TOME_DEFAULTS = {spec.name: spec.default for spec in TOME.inputs if not spec.optional}
TODO_DEFAULTS = {spec.name: spec.default for spec in TODO.inputs if not spec.optional}


def node_class(comfy, node: str):
    return {"tome": comfy.pack.ToMePatchNode, "todo": comfy.todo.ToDoPatchNode}[node]


def apply(comfy, node: str, model, **overrides):
    """Run the node's execute as ComfyUI would; returns its NodeOutput. Without the quality budget
    unless given (``max_change``): on their own inputs these tiny random models' blocks change by
    5-10 %, so the default budget would leave calls alone that a test of the reduction itself
    wants reduced (test_comfy_max_change_inprocess.py tests the budget)."""
    defaults = TOME_DEFAULTS if node == "tome" else TODO_DEFAULTS
    return node_class(comfy, node).execute(model, **{**defaults, "max_change": 0.0, **overrides})


def patched(comfy, node: str, model, **overrides):
    return apply(comfy, node, model, **overrides).result[0]


def sample(comfy, model, family="SD15", *, steps=2, size=(32, 32), batch=1, cfg=5.0, seed=0, denoise=1.0,
           latent=None, positive=None, negative=None, noise=None):
    if noise is None:
        noise = torch.randn(batch, 4, *size, generator=torch.Generator().manual_seed(seed))
    if latent is None:
        latent = torch.zeros_like(noise)
    positive = positive or comfy.models.conditioning(family, True, seed=1)
    negative = negative or comfy.models.conditioning(family, True, seed=2)
    with torch.inference_mode():  # as ComfyUI runs its nodes
        return comfy.sample.sample(model, noise, steps, cfg, "euler", "normal", positive, negative, latent,
                                   denoise=denoise, disable_pbar=True, seed=seed)


# ToDo on the DiT model files (random_dits' Wan 2.1 and Flux.1 files): they have one or two blocks.
ALL_FILE_BLOCKS = {"temporal_factor": 1.0, "skip_first_blocks": 0, "skip_last_blocks": 0}


def sample_dit_file(comfy, model, variant: str, steps: int = 2, seed: int = 0):
    """Sample a model loaded from one of random_dits' Wan 2.1 / Flux.1 files (their text as the real
    encoders give it: T5-XXL 4096 wide, CLIP-L's pooled 768) at 128 px, 9 frames for Wan, CFG 2."""
    import random_dits

    size = dict(height_px=128, width_px=128, **({"frames": 9} if variant.startswith("wan") else {}))
    positive, negative = random_dits.conditioning(variant, text_dim=4096, pooled_dim=768, **size)
    latent = random_dits.latent(variant, **size)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        return comfy.sample.sample(model, noise, steps, 2.0, "euler", "simple", positive, negative, latent, seed=seed,
                                   disable_pbar=True)


def check_todo_on_file_model(comfy, model, variant: str) -> None:
    """ToDo on a model loaded from a file (GGUF, fp8, ...): it acts in every step, reruns repeat bit
    for bit, and the result stays near the same model unpatched."""
    base = sample_dit_file(comfy, model, variant)
    todo = apply(comfy, "todo", model, **ALL_FILE_BLOCKS).result[0]
    first, second = sample_dit_file(comfy, todo, variant), sample_dit_file(comfy, todo, variant)
    assert torch.equal(first, second) and torch.isfinite(first).all()
    report = session_of(todo).last_report
    assert report.levels and report.active_steps == (1, 2) and not report.warnings
    assert 0 < rel_error(first, base) < 0.3


def spy_attn1(model, records):
    """A clone of model with a probe after every other attn1 patch: it records what
    self-attention receives in each block call of sampling (not in the blocks the auto rule
    times, which run every patch too)."""
    probe = model.clone()

    def record(n, context, value, extra):
        if extra.get("tokenreduce:measuring"):
            return n, context, value
        records.append({"block": extra["block"], "grid": tuple(extra["activations_shape"][-2:]),
                        "queries": n.shape[1], "keys": context.shape[1], "values": value.shape[1]})
        return n, context, value

    probe.set_model_attn1_patch(record)
    return probe


def reduced(records, field="queries"):
    """The grids of the block calls in which `field` had fewer tokens than the grid."""
    return {r["grid"] for r in records if r[field] < r["grid"][0] * r["grid"][1]}


def reduced_blocks(records, field="keys"):
    """The UNet blocks (``extra["block"]``) whose calls had fewer ``field`` tokens than their grid."""
    return {r["block"] for r in records if r[field] < r["grid"][0] * r["grid"][1]}


def block_changes(store) -> dict:
    """{(block, method): change} the UNet per-block budget measured (issue #51), from a store's log:
    its sites read '..., block input.1.0, nearest' (ToMe: '..., ratio 0.5'); block as the records
    name it (("input", 1)) where its transformer has one block."""
    found = {}
    for site, decision in store.log:
        if ", block " in site:
            block, method = site.split(", block ")[1].split(", ", 1)
            parts = block.split(".")
            name = (parts[0], int(parts[1])) if len(parts) == 3 else block  # diffusers: the block's path
            found[(name, method)] = decision.change
    return found


def per_block(model):
    """The per-block decision of a node (issue #51): the one site that ends so."""
    (decision,) = [d for site, d in session_of(model).last_report.decisions if site.endswith("per block")]
    return decision


def rel_error(a, b):
    return float((a - b).norm() / b.norm())


def split_cond_uncond(model):
    """A clone of ``model`` that sends cond and uncond to the UNet in separate calls, as
    ComfyUI does when memory is short."""
    from comfy.samplers import calc_cond_batch

    split = model.clone()
    split.set_model_sampler_calc_cond_batch_function(
        lambda args: [calc_cond_batch(args["model"], [c], args["input"], args["sigma"], args["model_options"])[0]
                      for c in args["conds"]])
    return split


def batching_tolerance(unpatched_one_way, unpatched_other_way) -> float:
    """How far two batchings of the same work may differ: 1e-3, or four times what the
    unpatched model itself differs by between them. On a CPU that is BLAS rounding far below
    1e-3; on a GPU the host's kernels (TF32 matmuls, algorithms chosen by batch size) already
    differ by about that much, with no token reduction involved."""
    return max(1e-3, 4 * rel_error(unpatched_one_way, unpatched_other_way))


def session_of(model):
    import sys

    (session,) = sys.modules["tokenreduce_pack.nodes.session"].sessions_of(model)
    return session


class ScriptedClock:
    """A fake clock for the auto rule: the n-th kind measured takes the n-th (full ms, reduced
    ms) of the script (the last one repeats); the work itself runs, as it would."""

    def __init__(self, *script):
        self.script = script
        self.kinds = 0
        self.runs = Counter()
        self.compiling = []  # whether dynamo was tracing at each timed run (it must never be)

    def __call__(self, device):  # the stopwatch for the next kind measured
        full, reduced_ms = self.script[min(self.kinds, len(self.script) - 1)]
        self.kinds += 1

        def stopwatch(name, work):
            self.compiling.append(torch.compiler.is_compiling())
            work()
            self.runs[name] += 1
            return {"full": full, "reduced": reduced_ms}.get(name, 0.0) / 1000.0

        return stopwatch


def spy_stepping_aside(monkeypatch, run_module, spied: dict) -> tuple[dict, list]:
    """Spies for a run that should step aside. Each of ``spied`` ({name: (owner, attribute)})
    notes in ``counts[name]`` the model call it ran in (``counts["calls"]``, which the caller
    advances); every call context the run folds has its "active" flag noted in ``active``."""
    counts = {"calls": 0, **{name: [] for name in spied}}

    def noting(name, original):
        def spy(*args, **kwargs):
            counts[name].append(counts["calls"])
            return original(*args, **kwargs)
        return spy

    for name, (owner, attribute) in spied.items():
        monkeypatch.setattr(owner, attribute, noting(name, getattr(owner, attribute)))
    close_call, active = run_module.RunState.close_call, []
    monkeypatch.setattr(run_module.RunState, "close_call", lambda run, context, sigmas: (
        active.append(context["active"]), close_call(run, context, sigmas)))
    return counts, active


def steps_down_to_half_the_ratio(one_pass, change=lambda decision: decision.change) -> None:
    """ToMe's milder step on a host's UNets (issue #51): ``one_pass(name, **tome_inputs)`` runs ToMe
    once on a one-level UNet with decisions of its own and returns (output, report). Ratio 0.5 and
    0.25 are each measured alone; a budget between the two (as ``change`` reads a decision) leaves
    0.5 alone and merges at 0.25: ratio 0.25's output, both decisions reported."""
    changes, outputs = {}, {}
    for ratio in (0.5, 0.25):  # each alone, within a budget nothing exceeds
        outputs[ratio], report = one_pass(str(ratio), ratio=ratio, max_change=2.0)
        ((_, decision),) = report.decisions
        assert decision.reduce
        changes[ratio] = change(decision)
    assert changes[0.25] < changes[0.5]
    output, report = one_pass("ladder", ratio=0.5, max_change=(changes[0.25] + changes[0.5]) / 2)
    (_, full), (site, half) = report.decisions
    assert full.over_budget and not full.reduce
    assert half.reduce and site.endswith("ratio 0.25 instead") and change(half) == changes[0.25]
    assert torch.equal(output, outputs[0.25])


def steps_down_block_by_block(one_pass, full, milder, inputs_of, label=str, reach: float = 1.0) -> None:
    """The budget's milder step on a host's UNets, block by block (issue #51): ``one_pass(name,
    **inputs)`` runs the node once with decisions of its own and returns (output, report, store);
    ``inputs_of(method)`` sets the node to ``full`` (nearest, ratio 0.5) or ``milder`` (the window,
    ratio 0.25), as ``label`` names them in the store's log. Each is measured alone, block by
    block; at a budget as large as the largest milder change every block runs, those whose node's
    setting is over it at the milder step (the milder pass's image where that is every block).
    ``reach``: the share of sampling the passes cover (the budget weighs the changes by its cube
    root). A host that says each block's decision (diffusers) has no ``per block`` line."""
    weight = reach ** (1 / 3)

    def decided(report) -> list:
        summary = [d for site, d in report.decisions if site.endswith("per block")]
        return summary or [d for site, d in report.decisions if ", block " in site]

    changes, outputs = {}, {}
    for method in (full, milder):  # each alone, within a budget nothing exceeds
        outputs[method], report, store = one_pass(str(method), **inputs_of(method), max_change=2.0)
        assert decided(report) and all(decision.reduce for decision in decided(report))
        changes.update({(block, method): change for (block, name), change in block_changes(store).items()
                        if name == label(method)})
    blocks = {block for block, _ in changes}
    assert len(changes) == 2 * len(blocks) > 2
    budget = weight * max(changes[(block, milder)] for block in blocks)
    stepping = {block for block in blocks if weight * changes[(block, full)] > budget}
    assert stepping and all(changes[(block, milder)] < changes[(block, full)] for block in stepping)
    output, report, store = one_pass("ladder", **inputs_of(full), max_change=budget)
    summary = [d for site, d in report.decisions if site.endswith("per block")]
    assert all(d.reduce and d.change <= budget for d in summary)
    solo = {(block, label(method)): change for (block, method), change in changes.items()}
    measured = block_changes(store)  # every block and step (a rehearsal) or the ones a block asked for (diffusers)
    assert measured and all(solo[key] == change for key, change in measured.items())
    if stepping == blocks:
        assert torch.equal(output, outputs[milder])
    else:  # some blocks at the node's setting, the others at the milder step: neither pass's image
        assert not torch.equal(output, outputs[milder]) and not torch.equal(output, outputs[full])


def steps_down_to_the_window(one_pass, change=lambda decision: decision.change) -> None:
    """The budget's milder step on a host's UNets: ``one_pass(name, **todo_inputs)`` runs ToDo once
    with decisions of its own (a device where reducing pays) and returns (output, report). Nearest
    and the window are each measured alone, then a budget between the two (as ``change`` reads a
    decision) leaves nearest alone and runs the window: its output, both decisions reported."""
    changes, outputs = {}, {}
    for method in ("nearest", "window"):  # each alone, within a budget nothing exceeds
        outputs[method], report = one_pass(method, method=method, max_change=2.0)
        ((_, decision),) = report.decisions
        assert decision.reduce
        changes[method] = change(decision)
    assert changes["window"] < changes["nearest"]
    output, report = one_pass("ladder", max_change=(changes["window"] + changes["nearest"]) / 2)
    (_, nearest), (site, window) = report.decisions
    assert nearest.over_budget and not nearest.reduce
    assert window.reduce and site.endswith("method window instead")
    assert torch.equal(output, outputs["window"])
