"""The diffusers adapter is optional: ``import tokenreduce`` and ``import tokenreduce.diffusers``
never import diffusers, and the ComfyUI pack loads and patches a model the same with diffusers
installed and without it (the test host has it; a blocked import stands for its absence)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, comfyui_dir

SCRIPT = textwrap.dedent("""
    import importlib.abc, sys
    if {block!r}:
        class NoDiffusers(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "diffusers" or name.startswith("diffusers."):
                    raise ModuleNotFoundError(f"No module named {{name!r}}")
        sys.meta_path.insert(0, NoDiffusers())
    sys.path[:0] = [{tests!r}, {devtools!r}, {repo!r}]
    import tokenreduce, tokenreduce.diffusers
    from tokenreduce.diffusers import apply_patch
    assert "diffusers" not in sys.modules, "importing the adapter imported diffusers"
    from conftest import load_comfy
    comfy = load_comfy(__import__("pathlib").Path({root!r}))
    import asyncio
    extension = asyncio.run(sys.modules["tokenreduce_pack"].comfy_entrypoint())
    nodes = asyncio.run(extension.get_node_list())
    assert {{n.define_schema().node_id for n in nodes}} == {{"TokenReduceToMe", "TokenReduceToDo", "TokenReduceImageCompare"}}, nodes
    model = comfy.models.make_model("SD15", tiny=True, seed=0)
    patched = comfy.todo.ToDoPatchNode.execute(model, **comfy.todo.ToDoPatchNode.METHOD.defaults()).result[0]
    assert patched is not model
    assert ("diffusers" in sys.modules) == {loaded!r} or {block!r}, sorted(m for m in sys.modules if "diffusers" in m)
    print("ok")
""")


@pytest.mark.parametrize("block", [False, True], ids=["diffusers installed", "without diffusers"])
def test_pack_loads_and_patches_with_and_without_diffusers(block):
    if not block:
        pytest.importorskip("diffusers")
    script = SCRIPT.format(block=block, tests=str(REPO / "tests"), devtools=str(REPO / "devtools"), repo=str(REPO),
                           root=str(comfyui_dir()), loaded=False)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            cwd=str(REPO / "tests"))
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr


def test_apply_patch_says_what_it_takes_without_diffusers():
    import torch

    from tokenreduce.diffusers import apply_patch

    with pytest.raises(ValueError, match="ToDo cannot patch this Linear model.*Flux, SD3, Qwen-Image"):
        apply_patch(torch.nn.Linear(2, 2), "ToDo")
    with pytest.raises(TypeError, match="diffusers pipeline or model"):
        apply_patch(object(), "ToMe")


def test_pip_install_gives_the_tokenreduce_package_alone(tmp_path):
    """``pip install .`` of a clean checkout installs ``tokenreduce`` (core and diffusers adapter),
    needing nothing but torch and filelock (which torch requires itself); the ComfyUI pack and the Forge extension stay in the checkout."""
    pytest.importorskip("setuptools")  # the build backend, used without build isolation (no download)
    from test_registry import tracked_copy

    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              "--no-input", "--target", str(target), str(tracked_copy(tmp_path))],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info")) == ["tokenreduce"]
    metadata = next(target.glob("tokenreduce-*.dist-info")) / "METADATA"
    requires = [line for line in metadata.read_text().splitlines() if line.startswith("Requires-Dist:")]
    assert [r for r in requires if "extra ==" not in r] == ["Requires-Dist: torch>=2.1",
                                                                "Requires-Dist: filelock>=3.0"], requires
    check = ("import sys; sys.path.insert(0, sys.argv[1]); "
             "import tokenreduce, tokenreduce.diffusers; assert tokenreduce.__file__.startswith(sys.argv[1]); "
             "from tokenreduce.diffusers import apply_patch, remove_patch; print('ok')")
    # -I: no PYTHONPATH, no current folder: only what is installed, and the target.
    result = subprocess.run([sys.executable, "-I", "-c", check, str(target)], capture_output=True, text=True,
                            cwd=tmp_path)
    assert result.stdout.strip() == "ok", result.stderr
