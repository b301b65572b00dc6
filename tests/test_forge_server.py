"""The extension in a real Stable Diffusion WebUI Forge (named by ``devtools/run_tests.py
--forge PATH``): ``launch.py`` serving UI and API on 127.0.0.1 with this repository symlinked
into the extensions of its own data dir, and a random-weight SD1.5 checkpoint. Loading, the
controls and their API, settings and their refusals, reports in the infotext, the hires pass,
Forge's built-in ToMe, pasting an infotext, the X/Y/Z plot, img2img, and that nothing of a
generation is left behind (the next plain image is the first plain image, bit for bit)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import numpy as np
import pytest

from forge_helpers import (API_NAME, HIRES, generate, png, positional, refused, reload_ui, skip_without_forge,
                           start_forge)
from tokenreduce.methods import MODE_QUERIES
from tokenreduce_forge.settings import ARGS, HIRES_OWN, TITLE
from tokenreduce_forge.texts import INTRO_METHODS

skip_without_forge()

SD15 = "ToDo · SD15 · 5 of 16 blocks at downsample 1"
# ToDo at its defaults against the plain image (random weights, 2 steps): the change is bounded.
FORGE_ERROR_BOUND = 0.1  # measured: 0.014 (Forge dfdcbab, CPU)


@pytest.fixture(scope="module")
def forge(tmp_path_factory):
    server = start_forge(tmp_path_factory.mktemp("forge-sd15"), "SD15")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain(forge):
    """The image without TokenReduce, made first."""
    return generate(forge)


def same(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(a, b)


def rel_error(a, b) -> float:
    """Relative L2 distance of two images' pixels (each centred on its mean)."""
    a, b = (np.asarray(x, dtype=np.float64) for x in (a, b))
    a, b = a - a.mean(), b - b.mean()
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# --- loading, controls, API -----------------------------------------------------------------------

def test_loads_in_both_tabs_with_one_control_per_declared_input(forge):
    scripts = forge.get("/sdapi/v1/scripts")
    assert API_NAME in scripts["txt2img"] and API_NAME in scripts["img2img"]
    infos = [s for s in forge.get("/sdapi/v1/script-info") if s["name"] == API_NAME]
    assert len(infos) == 2 and all(info["is_alwayson"] for info in infos)
    for info in infos:
        assert len(info["args"]) == len(ARGS)
        for arg, shown in zip(ARGS, info["args"]):
            assert shown["value"] == arg.default, arg.name
            if arg.spec is None:
                continue
            assert shown["label"] == arg.name
            if arg.spec.low is not None:
                assert (shown["minimum"], shown["maximum"]) == (arg.spec.low, arg.spec.high), arg.name
            if arg.options:
                assert shown["choices"] == list(arg.options), arg.name
    log = forge.log()
    assert "tokenreduce_webui.py" not in log and "tokenreduce_forge" not in log, forge.log_tail()


def test_the_accordion_in_the_browser(forge):
    """What a user sees in txt2img: the TokenReduce accordion, closed and off; ticked, it opens
    with both methods' inputs under their own names. The screenshot
    (test-artifacts/forge/accordion_txt2img.png) is the picture in docs/forge.md."""
    from playwright.sync_api import sync_playwright

    from browser import chromium_path
    from conftest import REPO

    out = REPO / "test-artifacts" / "forge"
    out.mkdir(parents=True, exist_ok=True)
    accordion_id = "script_txt2img_tokenreduce_enabled"
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        try:
            page = chromium.new_page(viewport={"width": 1400, "height": 1600})
            page.goto(forge.url, timeout=600_000)
            checkbox = page.locator(f"#{accordion_id}-checkbox input[type=checkbox]")
            checkbox.wait_for(state="attached", timeout=600_000)
            assert not checkbox.is_checked()
            accordion = page.locator(f"#{accordion_id}")
            accordion.locator(".label-wrap").first.click()  # opening it turns it on, as Forge's own do
            page.wait_for_timeout(1000)
            assert checkbox.is_checked()
            text = accordion.inner_text()
            for name in ("ToDo", "ToMe", "factor", "factor_next", "method", "ratio", "Hires. fix pass"):
                assert name in text, name
            for line in INTRO_METHODS.values():  # what each method does on which models, one line each
                assert line in text, line
            assert page.locator(f"#{accordion_id} input[type=checkbox]").count() >= 2
            accordion.screenshot(path=str(out / "accordion_txt2img.png"))
        finally:
            chromium.close()


def test_the_accordion_in_the_users_language(forge):
    """Settings → Localization "zh_CN" and Reload UI, as a user picks a language: Forge's page
    translates the accordion with our localizations/zh_CN.json (Forge collects every extension's
    localizations/*.json): the label of ToDo factor and its tooltip (its ``title``, set by
    hints.js, translated by localization.js). The texts expected are read from that file. Forge
    is put back in English (and its UI reloaded) afterwards. Screenshot:
    test-artifacts/forge/accordion_zh_CN.png."""
    from playwright.sync_api import sync_playwright

    from browser import chromium_path
    from conftest import REPO

    out = REPO / "test-artifacts" / "forge"
    out.mkdir(parents=True, exist_ok=True)
    zh_cn = json.loads((REPO / "localizations" / "zh_CN.json").read_text(encoding="utf-8"))
    name = "ToDo factor"
    (arg,) = [arg for arg in ARGS if arg.name == name]
    label, tooltip = zh_cn[name], zh_cn[arg.spec.tooltip]
    accordion_id = "script_txt2img_tokenreduce_enabled"
    control_id = f"script_txt2img_tokenreduce_{name.replace(' ', '_')}"

    def settled(read, want, seconds: float = 30):
        """``read()`` once it equals ``want`` (the page translates on its mutations, tooltips
        after a debounce), else its last value."""
        deadline = time.time() + seconds
        while (value := read()) != want and time.time() < deadline:
            time.sleep(0.5)
        return value

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        try:
            page = chromium.new_page(viewport={"width": 1400, "height": 1600})
            forge.post("/sdapi/v1/options", {"localization": "zh_CN"})
            try:
                reload_ui(forge, page)
                checkbox = page.locator(f"#{accordion_id}-checkbox input[type=checkbox]")
                checkbox.wait_for(state="attached", timeout=600_000)
                # What Forge put in the page: our file, merged under the name zh_CN.
                assert page.evaluate("(text) => window.localization[text]", name) == label
                assert page.evaluate("(text) => window.localization[text]", arg.spec.tooltip) == tooltip
                accordion = page.locator(f"#{accordion_id}")
                accordion.locator(".label-wrap").first.click()
                page.wait_for_timeout(1000)
                control = page.locator(f"#{control_id}")
                shown = settled(lambda: control.locator("[data-testid=block-info]").first.inner_text().strip(), label)
                assert shown == label, (shown, label)
                title = settled(lambda: control.get_attribute("title"), tooltip)
                assert title == tooltip, f"the tooltip of {name!r} is {title!r}, not {tooltip!r}"
                accordion.screenshot(path=str(out / "accordion_zh_CN.png"))
            finally:
                forge.post("/sdapi/v1/options", {"localization": "None"})
                reload_ui(forge, page)
            page.locator(f"#{accordion_id}-checkbox input[type=checkbox]").wait_for(state="attached", timeout=600_000)
            assert page.evaluate("() => Object.keys(window.localization).length") == 0
        finally:
            chromium.close()


def test_xyz_plot_lists_the_axes(forge):
    (xyz,) = [s for s in forge.get("/sdapi/v1/script-info") if s["name"] == "x/y/z plot" and not s["is_img2img"]]
    assert {"[TokenReduce] ToMe ratio", "[TokenReduce] ToDo factor"} <= set(xyz["args"][0]["choices"])


def test_install_py_under_forges_installer_is_quiet_and_cheap(forge):
    """Forge runs every extension's install.py at each launch, through launch.run_extension_installer
    (its working directory, its root on PYTHONPATH)."""
    code = ("import sys; sys.argv = ['launch.py', '--data-dir', sys.argv[1]]\n"
            "import launch\nlaunch.run_extension_installer(sys.argv[2])\n")
    for _ in range(2):
        start = time.perf_counter()
        done = subprocess.run([forge.python, "-c", code, str(forge.data), str(forge.extension)], cwd=forge.tree,
                              capture_output=True, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        seconds = time.perf_counter() - start
        assert done.returncode == 0 and "Error" not in done.stdout + done.stderr, done.stdout + done.stderr
        assert "TokenReduce" not in done.stdout and seconds < 60


# --- what it does, what it says --------------------------------------------------------------------

def test_todo_at_its_defaults_changes_the_image_and_reports_what_it_did(forge, plain):
    result = generate(forge, [True])
    assert not same(result.pixels, plain.pixels)
    error = rel_error(result.pixels, plain.pixels)
    print(f"ToDo defaults against plain, SD1.5 256 px 2 steps: relative pixel error {error:.4f}")
    assert 0 < error < FORGE_ERROR_BOUND
    ours = result.ours()
    assert ours["TokenReduce ToDo factor"] == 2.0 and ours["TokenReduce ToDo method"] == "nearest"
    assert ours["TokenReduce ToDo report"] == f"{SD15} | ds 1 · 32×32 · q 1024→1024 · k/v 1024→256 | steps 1-2 of 2"
    assert "TokenReduce ToMe ratio" not in ours and "TokenReduce warnings" not in ours
    assert "TokenReduce ToDo report: " in result.infotext and "Token merging ratio" not in result.infotext


def test_todo_method_window_runs_in_forges_blocks_and_reruns_bit_for_bit(forge, plain):
    """method window on Forge's SD1.5: its blocks hand ToDo's attn1 replace patch q, k and v, and
    the self-attention runs windowed (not nearest's image, not the plain one); reruns bit for bit;
    the next plain image is the plain one (the replace patches went with the pass's clone)."""
    args = [{"ToDo": {"method": "window", "reduce_when": "always"}}]
    first = generate(forge, args)
    assert not same(first.pixels, plain.pixels) and not same(first.pixels, generate(forge, [True]).pixels)
    report = first.ours()["TokenReduce ToDo report"]
    assert report.startswith(f"{SD15} | ds 1 · 32×32 · q 1024→1024 · k/v 1024→") and "k/v 1024→256" not in report
    assert first.ours()["TokenReduce ToDo method"] == "window"
    assert same(generate(forge, args).pixels, first.pixels)
    assert same(generate(forge).pixels, plain.pixels)


def test_reruns_are_bit_identical_and_leave_nothing_behind(forge, plain):
    # max_change 0: these merges change the random model's blocks by about 11 %, over the default
    # budget, which would leave them alone (the next test); here they must run, MLP object patches included.
    args = [{"ToMe": {"merge_mlp": True, "merge_crossattn": True, "max_change": 0.0}, "ToDo": True}]
    first = generate(forge, args)
    assert not same(first.pixels, plain.pixels)
    assert first.ours()["TokenReduce ToMe report"] == (
        "ToMe · SD15 · 5 of 16 blocks at downsample 1 | ds 1 · 32×32 · q 1024→512 · k/v 256→256 · cross q 1024→512 · "
        "mlp 1024→512 | steps 1-2 of 2")
    assert same(generate(forge, args).pixels, first.pixels)
    # The MLP object patches stay on Forge's shared model after a run: the next plain image
    # must still be the plain image.
    assert same(generate(forge).pixels, plain.pixels)


def test_the_quality_budget_leaves_alone_what_changes_too_much_and_says_so(forge, plain):
    """reduce_when auto's max_change at its default (5 %) on a real Forge: measured on the CPU too,
    on the model call's own input; a merge that changes a block by more is left alone, said in the
    report, and measured again at half the ratio (the milder step, issue #51): where that is over
    the budget too, the warnings say so and the image is the plain one; else the level merges at
    half, said."""
    result = generate(forge, [{"ToMe": {"merge_mlp": True, "merge_crossattn": True}}])
    report = result.ours()["TokenReduce ToMe report"]
    assert report.startswith("ToMe · SD15 · 5 of 16 blocks at downsample 1 | auto · downsample 1 (32×32) · left "
                             "alone: changes its output "), report
    assert "> 5 %" in report and "auto · downsample 1 (32×32), ratio 0.25 instead · " in report, report
    if "ratio 0.25 instead · left alone" in report:
        assert same(result.pixels, plain.pixels) and "Raise max_change" in result.ours()["TokenReduce warnings"]
    else:
        assert "ratio 0.25 instead · reduced" in report and not same(result.pixels, plain.pixels), report


def test_the_api_dict_form_and_the_positional_arguments_agree(forge):
    by_dict = generate(forge, [{"ToMe": {"ratio": 0.3, "mode": MODE_QUERIES, "seed": 5}}])
    by_position = generate(forge, positional(enabled=True, ToDo=False, ToMe=True, ToMe__ratio=0.3,
                                             ToMe__mode=MODE_QUERIES, ToMe__seed=5))
    assert same(by_dict.pixels, by_position.pixels) and by_dict.ours() == by_position.ours()


@pytest.mark.parametrize("args,fields,message", [
    ([{"ToMe": {"ratio": 0.9}}], {}, "TokenReduce ToMe: ratio 0.9 cannot be reached with strides 2x2"),
    ([{"ToMe": {"stride_x": 2.5}}], {}, "TokenReduce ToMe: stride_x 2.5 is not a whole number."),
    ([{"ToMe": {"merge_attn": "false"}}], {}, "TokenReduce ToMe: merge_attn 'false' is not true or false."),
    ([{"ToDo": {"start_percent": 0.9, "end_percent": 0.1}}], {}, "TokenReduce ToDo: start_percent 0.9 is after"),
    ([{"ToDo": {"factor": 1, "factor_next": 1}}], {}, "TokenReduce ToDo: nothing to downsample"),
    ([{"ToDo": {"level": "3"}}], {}, "TokenReduce ToDo: level '3' is not one of"),
    ([{"todo": True, "tomme": True}], {}, "TokenReduce: unknown key 'tomme'"),
    ([True, False], {}, "TokenReduce is on, but neither ToDo nor ToMe is selected"),
    ([True, "yes"], {}, "TokenReduce: ToDo 'yes' is not true or false."),
    (positional(enabled=True, ToDo=False, ToMe=True, ToDo__factor="yes"), {},  # a method switched off: checked too
     "TokenReduce ToDo: factor 'yes' is not a number."),
    ([{"ToDo": {"level": "4", "factor": 8}}], {"width": 128, "height": 128},
     "TokenReduce ToDo: factor 8 does not fit the 4x4 token grid at downsample 4"),
    ([{"ToMe": {"stride_x": 8, "stride_y": 8, "ratio": 0.9}}], {"width": 56, "height": 56},
     "TokenReduce ToMe: stride_x 8 / stride_y 8 do not fit the token grids"),
    ([{"ToDo": True, "hires": {"ToMe": {"ratio": 0.8}}}], HIRES,
     "TokenReduce ToMe (hires pass): ratio 0.8 cannot be reached"),
])
def test_bad_settings_are_refused_before_any_step_and_leave_nothing_behind(forge, plain, args, fields, message):
    assert refused(forge, args, **fields).startswith(message)
    if fields.get("enable_hr"):
        assert same(generate(forge).pixels, plain.pixels)


def test_a_refusal_is_one_line_in_the_servers_console(forge, plain):  # plain: a first image made (as the refusals)
    """What the console shows of a refusal: one line, as the UI shows it, and no traceback (the web
    server's, about 100 lines, only with --loglevel DEBUG)."""
    start = len(forge.log())
    message = refused(forge, [{"ToMe": {"ratio": 0.9}}])
    forge.get("/sdapi/v1/sd-models")  # the server logs an error after its answer: let it
    time.sleep(1)
    new = forge.log()[start:]
    said = [line for line in new.splitlines() if "ratio 0.9" in line]  # after a progress bar's "\r" line, maybe
    assert len(said) == 1 and said[0].endswith(f"[{TITLE}] Refused: {message}"), new
    assert "Traceback" not in new and "Exception in ASGI application" not in new, new


def test_settings_that_do_nothing_are_said(forge, plain):
    # SD1.5's middle block is at 8, none at 16. max_change 0: pooling the 4x4 grid changes the random
    # model's block by about 20 %, and the budget would leave it alone (said in the warnings too).
    result = generate(forge, [{"ToDo": {"level": "8", "factor_next": 2, "max_change": 0.0}}])
    assert result.ours()["TokenReduce warnings"] == (
        "TokenReduce ToDo: WARNING: factor_next 2 does nothing: this SD15 model has no transformer blocks at "
        "downsample 16.")
    report = result.ours()["TokenReduce ToDo report"]
    assert report.startswith("ToDo · SD15 · 1 of 16 blocks at downsample 8 | ds 8 · 4×4")
    result = generate(forge, [{"ToMe": {"start_percent": 0.4, "end_percent": 0.5}}])  # between the two steps' sigmas
    assert same(result.pixels, plain.pixels)
    assert result.ours()["TokenReduce warnings"].startswith("TokenReduce ToMe was active in none of the 2 steps")


def test_forges_builtin_token_merging_is_turned_off_and_said(forge):
    ours_alone = generate(forge, [{"ToMe": {}}])
    with_builtin = generate(forge, [{"ToMe": {}}], override_settings={"token_merging_ratio": 0.5,
                                                                      "token_merging_ratio_hr": 0.5})
    assert same(with_builtin.pixels, ours_alone.pixels)
    assert with_builtin.ours()["TokenReduce note"].startswith(
        "Forge's built-in Token merging (ratio 0.5) was turned off for this generation")
    assert "Token merging ratio" not in with_builtin.infotext
    options = forge.get("/sdapi/v1/options")
    assert options["token_merging_ratio"] == 0 and options["token_merging_ratio_hr"] == 0
    builtin_alone = generate(forge, override_settings={"token_merging_ratio": 0.5})
    assert "Token merging ratio: 0.5" in builtin_alone.infotext and not same(builtin_alone.pixels, ours_alone.pixels)


# --- hires fix ---------------------------------------------------------------------------------------

def test_hires_pass_with_its_own_settings(forge):
    args = [{"ToMe": {"mode": MODE_QUERIES}, "hires": {"ToDo": {"factor": 3}}}]
    result = generate(forge, args, hires=True)
    ours = result.ours()
    assert ours["TokenReduce hires"] == HIRES_OWN and ours["TokenReduce hires ToDo factor"] == 3.0
    assert ours["TokenReduce ToMe report"] == (
        "ToMe · SD15 · 5 of 16 blocks at downsample 1 | ds 1 · 32×32 · q 1024→512 · k/v 1024→1024 | steps 1-2 of 2")
    # Forge calls the hook three times with hires fix; the hires pass is patched once, with its settings.
    assert ours["TokenReduce hires ToDo report"] == (
        f"{SD15} | ds 1 · 48×48 · q 2304→2304 · k/v 2304→256 | steps 1-2 of 2")
    assert "TokenReduce hires ToMe report" not in ours and "TokenReduce ToDo report" not in ours
    assert same(generate(forge, args, hires=True).pixels, result.pixels)


def test_hires_pass_same_as_first_or_off(forge):
    plain = generate(forge, hires=True)
    same_settings = generate(forge, [{"ToDo": True}], hires=True)
    assert same_settings.ours()["TokenReduce hires ToDo report"].startswith(f"{SD15} | ds 1 · 48×48")
    off = generate(forge, [{"ToDo": True, "hires": "off"}], hires=True)
    assert "TokenReduce hires ToDo report" not in off.ours() and "TokenReduce ToDo report" in off.ours()
    assert len({p.tobytes() for p in (plain.pixels, same_settings.pixels, off.pixels)}) == 3


# --- infotext round trip, X/Y/Z plot, img2img ----------------------------------------------------------

def _paste(forge, infotext: str) -> dict:
    """What the txt2img tab's "read generation parameters" button sets each of our controls to
    (Forge's own paste function, through Gradio's API); absent: the control keeps its value."""
    config = forge.get("/config")
    by_id = {c["id"]: c["props"].get("elem_id") for c in config["components"]}
    (dependency,) = [d for d in config["dependencies"] if d.get("api_name") == "paste_func"]
    outputs = forge.post("/run/paste_func", {"data": [infotext]})["data"]
    pasted = {}
    for component, update in zip(dependency["outputs"], outputs):
        elem_id = by_id.get(component) or ""
        if elem_id.startswith("script_txt2img_tokenreduce_") and isinstance(update, dict) and "value" in update:
            pasted[elem_id.removeprefix("script_txt2img_tokenreduce_").removesuffix("-checkbox")] = update["value"]
    return pasted


def test_pasting_an_images_parameters_restores_the_controls_and_the_image(forge):
    sent = positional(enabled=True, ToDo__factor=3.0, ToDo__factor_next=2.0, ToDo__method="average", ToMe=True,
                      ToMe__ratio=0.4, ToMe__mode=MODE_QUERIES, ToMe__matching="3x3 cells", ToMe__seed=12,
                      ToMe__start_percent=0.1, hires=HIRES_OWN, hires_ToDo=False, hires_ToMe=True,
                      hires_ToMe__stride_x=3, hires_ToMe__share_plans=True)
    first = generate(forge, sent, hires=True)
    pasted = _paste(forge, first.infotext)
    restored = []
    for arg, value in zip(ARGS, sent):
        key = arg.name.replace(" ", "_")
        if arg.stage == "hires" and arg.method == "ToDo" and arg.spec is not None:  # not in the infotext: kept
            assert key not in pasted, key
            restored.append(value)
            continue
        assert pasted[key] == value, (key, pasted.get(key), value)
        restored.append(pasted[key])
    assert same(generate(forge, restored, hires=True).pixels, first.pixels)
    # An image without TokenReduce turns it off.
    assert _paste(forge, "a cat\nSteps: 2, Seed: 1, Size: 256x256") == {"enabled": False}


def test_xyz_plot_axes(forge, plain):
    (xyz,) = [s for s in forge.get("/sdapi/v1/script-info") if s["name"] == "x/y/z plot" and not s["is_img2img"]]
    choices = xyz["args"][0]["choices"]

    def grid(axis: str, values: str):
        return generate(forge, None, script_name="x/y/z plot",
                        script_args=[choices.index(axis), values, [], 0, "", [], 0, "", [], True, True, False, False,
                                     False, False, False, 0, False])

    result = grid("[TokenReduce] ToMe ratio", "0, 0.5")
    cells, texts = result.images[1:], result.info["infotexts"][1:]
    assert len(cells) == 2 and "q 1024→1024" in texts[0] and "q 1024→512" in texts[1]
    assert same(cells[0], plain.pixels)  # ratio 0 merges nothing: exactly the plain image
    assert same(cells[1], generate(forge, [{"ToMe": {"ratio": 0.5}}]).pixels)
    result = grid("[TokenReduce] ToDo factor", "1, 3")
    assert "ToDo is off in this cell" in result.info["infotexts"][1] and same(result.images[1], plain.pixels)
    assert same(result.images[2], generate(forge, [{"ToDo": {"factor": 3}}]).pixels)


def test_img2img(forge, plain):
    fields = dict(init_images=[png(plain.pixels)], denoising_strength=0.5, steps=4, endpoint="img2img")
    unpatched = generate(forge, None, **fields)
    result = generate(forge, [{"ToDo": {"start_percent": 0.5}}], **fields)
    assert not same(result.pixels, unpatched.pixels)
    assert result.ours()["TokenReduce ToDo report"] == (
        f"{SD15} | ds 1 · 32×32 · q 1024→1024 · k/v 1024→256 | steps 2-3 of 3")
    assert TITLE + " hires" not in result.ours()


def test_batch_size_and_count(forge):
    result = generate(forge, [{"ToMe": {"mode": MODE_QUERIES}}], width=128, height=128, batch_size=2, n_iter=2)
    assert len(result.images) == 4 and len(result.info["infotexts"]) == 4
    for text in result.info["infotexts"]:  # each batch of the count is patched and reported
        assert "TokenReduce ToMe report: ToMe · SD15 · 5 of 16 blocks at downsample 1 | ds 1 · 16×16 · q 256→128" \
            in text
