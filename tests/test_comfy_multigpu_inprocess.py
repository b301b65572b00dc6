"""Our nodes with ComfyUI's own multi-GPU engine (0.33; none in 0.3.75: skipped there, saying so),
in-process, with its real code: ``MultiGPU_WorkUnits`` (deep copies of the model, loaded afresh
from the core loader, one per extra device), the sampler's thread pool running the cond and
uncond work units at the same time on worker threads, each on its device's copy, and
``SelectModelDevice``.

No machine here has two GPUs. The only thing replaced is ComfyUI's list of devices: two CPU
"devices", ``cpu`` and ``cpu:0``, which torch keeps apart as devices but computes on alike. So
the deep copies, the thread pool, the work-unit split and the per-thread model calls all run;
what cannot be shown is arithmetic on two different GPUs (outputs are compared with a tolerance
for the changed batching: cond and uncond run as two batches of one instead of one of two)."""

from __future__ import annotations

import sys

import pytest
import torch

from comfy_helpers import (ALL_FILE_BLOCKS, apply, batching_tolerance, rel_error, sample, sample_dit_file,
                           session_of)
from comfy_server import ensure_checkpoint, ensure_extra_model
from conftest import comfyui_dir

DEVICES = [torch.device("cpu"), torch.device("cpu", 0)]


@pytest.fixture(scope="module")
def multigpu(comfy):
    try:
        import comfy_extras.nodes_multigpu as nodes_multigpu
    except ImportError:
        pytest.skip("this ComfyUI has no multi-GPU engine (MultiGPU_WorkUnits came after 0.3.75)")
    return nodes_multigpu


@pytest.fixture
def two_devices(multigpu, monkeypatch):
    """ComfyUI sees two devices; nothing else is replaced."""
    import comfy.model_management as mm

    monkeypatch.setattr(mm, "get_all_torch_devices", lambda exclude_current=False: list(DEVICES))


def drop_dead_loaded_models():
    """Clones that earlier calls of this process dropped stay listed as loaded (their weights live
    on in the fixtures' models), and the multi-GPU engine's scan of the loaded models (0.33) fails
    on such an entry. The server prunes them between prompts; a test process does it here, right
    before the node (a collection during loading can kill one after any earlier pruning)."""
    import gc

    import comfy.model_management as mm

    gc.collect()
    mm.current_loaded_models[:] = [m for m in mm.current_loaded_models if m.model is not None]


@pytest.fixture(scope="module")
def loaders(comfy, multigpu):
    """ComfyUI's core loaders with the cached test files in their folders (the multi-GPU copies are
    loaded afresh through the loader, so the models must come from one)."""
    import folder_paths

    files = {kind: ensure_extra_model(comfyui_dir(), kind, sys.executable) for kind in ("wan21_t2v", "flux")}
    for folder, path in files.values():
        folder_paths.add_model_folder_path(folder, str(path.parent))
    checkpoint = ensure_checkpoint(comfyui_dir(), sys.executable, "SD15")
    folder_paths.add_model_folder_path("checkpoints", str(checkpoint.parent))
    import comfy.model_management
    import nodes

    loaded = {}

    def load(kind):
        """Each file loaded once per module (the full-size SD1.5 is 3.4 GB in float32 on a CPU, and
        the split makes a second copy)."""
        if kind not in loaded:
            with torch.inference_mode():  # as ComfyUI's executor runs a loader
                loaded[kind] = (nodes.CheckpointLoaderSimple().load_checkpoint(checkpoint.name)[0] if kind == "SD15" else
                                nodes.UNETLoader().load_unet(files[kind][1].name, "default")[0])
        return loaded[kind]

    yield load
    loaded.clear()
    comfy.model_management.unload_all_models()
    comfy.model_management.soft_empty_cache()


def split(multigpu, model):
    drop_dead_loaded_models()
    return multigpu.MultiGPUCFGSplitNode.execute(model, 2).result[0]


def run(comfy, model, kind):
    if kind == "SD15":
        return sample(comfy, model, "SD15", positive=comfy.models.conditioning("SD15", False, seed=1),
                      negative=comfy.models.conditioning("SD15", False, seed=2))
    return sample_dit_file(comfy, model, {"flux": "flux_dev"}.get(kind, kind))


CASES = [("wan21_t2v", "todo", ALL_FILE_BLOCKS), ("flux", "todo", ALL_FILE_BLOCKS), ("SD15", "todo", {}),
         ("SD15", "tome", {"merge_mlp": True, "merge_crossattn": True})]


@pytest.mark.parametrize("ours_first", [True, False], ids=["ours-then-split", "split-then-ours"])
@pytest.mark.parametrize("kind,node,settings", CASES, ids=[f"{k}-{n}" for k, n, _ in CASES])
def test_work_units_on_two_devices_are_reduced_as_on_one(comfy, multigpu, two_devices, loaders, kind, node, settings,
                                                         ours_first):
    base = loaders(kind)
    single = apply(comfy, node, base, **settings).result[0]
    if ours_first:
        model = split(multigpu, apply(comfy, node, base, **settings).result[0])
    else:
        model = apply(comfy, node, split(multigpu, base), **settings).result[0]
    copies = model.get_additional_models_with_key("multigpu")
    assert [copy.load_device for copy in copies] == [DEVICES[1]]
    reference, plain_split = run(comfy, single, kind), run(comfy, split(multigpu, base), kind)
    tolerance = batching_tolerance(plain_split, run(comfy, base, kind))
    first, second = run(comfy, model, kind), run(comfy, model, kind)
    assert torch.equal(first, second)  # the threads share nothing that changes a result
    assert rel_error(first, reference) < tolerance
    report = session_of(model).last_report
    assert report.levels and report.active_steps == (1, 2) and not report.warnings
    if settings.get("merge_mlp"):  # each copy's MLP patch runs that copy's own feed-forward module
        for copy in copies:
            for key, forward in copy.object_patches.items():
                if key.endswith(".ff.forward"):
                    assert forward.feed_forward is copy.get_model_object(key[:-len(".forward")])


@pytest.mark.parametrize("ours_first", [True, False], ids=["ours-then-split", "split-then-ours"])
def test_tome_on_nextdit_binds_its_layer_patches_to_each_copy(comfy, multigpu, two_devices, ours_first):
    """ToMe reaches Lumina 2's layers through object patches on their forwards (NextDiT has no
    block-replace lookup): each device copy's patches run that copy's own layers, and the split
    run merges as one device does. The copies are loaded afresh through the factory a core loader
    would register (here: the tiny model's own builder, the same seed)."""
    import functools

    import random_dits
    from test_comfy_dit_inprocess import run as run_dit

    build = functools.partial(random_dits.make_dit, "lumina2", n_layers=2, n_refiner_layers=2)
    base = build()
    base.cached_patcher_init = (build, ())
    single = apply(comfy, "tome", base).result[0]
    if ours_first:
        model = split(multigpu, apply(comfy, "tome", base).result[0])
    else:
        model = apply(comfy, "tome", split(multigpu, base)).result[0]
    copies = model.get_additional_models_with_key("multigpu")
    assert [copy.load_device for copy in copies] == [DEVICES[1]]
    reference = run_dit(comfy, single, "lumina2")
    plain_split = run_dit(comfy, split(multigpu, base), "lumina2")
    tolerance = batching_tolerance(plain_split, run_dit(comfy, base, "lumina2"))
    first, second = run_dit(comfy, model, "lumina2"), run_dit(comfy, model, "lumina2")
    assert torch.equal(first, second)
    assert rel_error(first, reference) < tolerance
    report = session_of(model).last_report
    assert report.levels and not report.warnings
    for copy in [model, *copies]:
        layers = {key: f for key, f in copy.object_patches.items() if hasattr(f, "tokenreduce_key")}
        assert len(layers) == 2  # noise_refiner.1 and layers.0
        for key, forward in layers.items():
            assert forward.layer is copy.get_model_object(key[:-len(".forward")])


def test_an_interrupted_multi_gpu_run_leaves_nothing_behind(comfy, multigpu, two_devices, loaders):
    import comfy.model_management as mm

    model = split(multigpu, apply(comfy, "todo", loaders("wan21_t2v"), **ALL_FILE_BLOCKS).result[0])
    expected = run(comfy, model, "wan21_t2v")
    stop = model.clone()
    stop.set_model_sampler_post_cfg_function(lambda args: (mm.interrupt_current_processing(True), args["denoised"])[1])
    with pytest.raises(mm.InterruptProcessingException):
        run(comfy, stop, "wan21_t2v")
    mm.interrupt_current_processing(False)
    session = session_of(model)
    assert session.run is None and session.last_report.completed is False
    assert torch.equal(run(comfy, model, "wan21_t2v"), expected)


@pytest.mark.parametrize("ours_first", [True, False])
def test_select_model_device_before_or_after(comfy, multigpu, loaders, ours_first):
    """Select Model Device (here the only real one, "cpu"), wired before or after ToDo."""
    base = loaders("wan21_t2v")

    def todo(model):
        return apply(comfy, "todo", model, **ALL_FILE_BLOCKS).result[0]

    def choose(model):
        return multigpu.SelectModelDeviceNode.execute(model, "cpu").result[0]

    model = choose(todo(base)) if ours_first else todo(choose(base))
    out = run(comfy, model, "wan21_t2v")
    assert torch.equal(out, run(comfy, todo(base), "wan21_t2v"))
    assert session_of(model).last_report.levels


# --- the same concurrency without the multi-GPU engine (every ComfyUI version) ----------------------

def concurrent_cond_uncond(model, rounds: int = 1):
    """A clone whose sampler runs the cond and uncond model calls of each step at the same time,
    in two threads (as the multi-GPU split's workers do), ``rounds`` times over."""
    import threading

    from comfy.samplers import calc_cond_batch

    def calc(args):
        outputs = [None] * len(args["conds"])

        def one(i, cond):
            outputs[i] = calc_cond_batch(args["model"], [cond], args["input"], args["sigma"], args["model_options"])[0]

        for _ in range(rounds):
            threads = [threading.Thread(target=one, args=(i, c)) for i, c in enumerate(args["conds"])]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        return outputs

    clone = model.clone()
    clone.set_model_sampler_calc_cond_batch_function(calc)
    return clone


@pytest.mark.parametrize("node,settings", [("todo", {"factor_next": 2.0}),
                                           ("tome", {"merge_mlp": True, "merge_crossattn": True, "max_downsample": "2"})])
def test_concurrent_model_calls_compute_what_sequential_ones_do(comfy, models, node, settings):
    from comfy_helpers import patched, split_cond_uncond

    model = patched(comfy, node, models["SD15"], **settings)
    sequential = sample(comfy, split_cond_uncond(model))
    for _ in range(2):  # each run: 2 steps, each step's two calls 3 times over, in two threads
        assert torch.equal(sample(comfy, concurrent_cond_uncond(model, rounds=3)), sequential)
    report = session_of(model).last_report
    assert report.active_steps == (1, 2) and not report.warnings and report.levels


def test_concurrent_dit_calls_compute_what_sequential_ones_do(comfy):
    import random_dits
    from comfy_helpers import split_cond_uncond
    from test_comfy_dit_inprocess import run as run_dit

    model = apply(comfy, "todo", random_dits.make_dit("wan21_t2v"), **ALL_FILE_BLOCKS).result[0]
    sequential = run_dit(comfy, split_cond_uncond(model), "wan21_t2v")
    for _ in range(2):
        assert torch.equal(run_dit(comfy, concurrent_cond_uncond(model, rounds=3), "wan21_t2v"), sequential)
    assert session_of(model).last_report.levels
