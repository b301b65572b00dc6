"""The accordion in txt2img and img2img: one control per argument of ``settings.ARGS``, built
from the methods' declared inputs (kind, default, range, options, tooltip), and the rules that
read them back from a pasted infotext. Imports gradio and the WebUI's components: WebUI only."""

from __future__ import annotations

import gradio as gr

from tokenreduce.inputs import BOOL, CHOICE, FLOAT, INT, SEED

from .settings import (ARGS, FIRST, HIRES, HIRES_MODES, HIRES_OWN, METHOD_TITLES, METHODS, TITLE, Arg, input_arg,
                       method_arg, paste_field_names, paste_rule, webui_inputs)
from .texts import ABOUT, HIRES_INFO, HIRES_PASS, INTRO, INTRO_METHODS, METHOD_INFO


def control(arg: Arg, elem_id: str):
    """The gradio component of one input; its tooltip (the WebUI's ``tooltip``, shown on hover)
    is the input's declared one."""
    spec = arg.spec
    common = dict(label=arg.name, value=arg.default, elem_id=elem_id, tooltip=spec.tooltip)
    if spec.kind == FLOAT:
        return gr.Slider(minimum=spec.low, maximum=spec.high, step=spec.step, **common)
    if spec.kind == INT:
        return gr.Slider(minimum=spec.low, maximum=spec.high, step=1, **common)
    if spec.kind == SEED:
        return gr.Number(minimum=spec.low, maximum=spec.high, precision=0, **common)
    if spec.kind == BOOL:
        return gr.Checkbox(**common)
    if spec.kind == CHOICE:
        return gr.Dropdown(choices=list(spec.options), **common)
    raise ValueError(f"unknown input kind {spec.kind!r}")


def _help(method: str) -> str:
    return "\n".join(f"- **{spec.name}**: {spec.tooltip}" for spec in webui_inputs(METHODS[method]))


def _rows(specs, per_row: int):
    return [specs[i:i + per_row] for i in range(0, len(specs), per_row)]


def _stage(script, stage: str, args: dict, made: dict) -> None:
    """A pass's controls: per method its switch, then its numbers, choices and switches."""
    for method in METHODS:
        switch = method_arg(stage, method)
        with gr.Group():
            made[switch] = gr.Checkbox(label=switch, value=args[switch].default,
                                       elem_id=script.elem_id(switch.replace(" ", "_")),
                                       tooltip=f"{METHOD_TITLES[method]}: {METHOD_INFO[method]}")
            specs = webui_inputs(METHODS[method])
            kinds = ([s for s in specs if s.kind in (FLOAT, INT, SEED)], [s for s in specs if s.kind == CHOICE],
                     [s for s in specs if s.kind == BOOL])
            for group, per_row in zip(kinds, (2, 2, 3)):
                for row in _rows(group, per_row):
                    with gr.Row():
                        for spec in row:
                            name = input_arg(stage, method, spec.name)
                            made[name] = control(args[name], script.elem_id(name.replace(" ", "_")))


def build(script, is_img2img: bool):
    """The controls in ``ARGS`` order, their paste rules and the keys "Send to" carries."""
    from modules.ui_components import InputAccordion

    args, made = {arg.name: arg for arg in ARGS}, {}
    with InputAccordion(False, label=TITLE, elem_id=script.elem_id("enabled")) as enabled:
        made["enabled"] = enabled
        gr.Markdown("\n".join([INTRO, "", *(f"- {INTRO_METHODS[method]}" for method in METHODS)]))
        _stage(script, FIRST, args, made)
        with gr.Accordion(HIRES_PASS, open=False, visible=not is_img2img):
            made["hires"] = gr.Radio(choices=list(HIRES_MODES), value=HIRES_MODES[0], label=HIRES, tooltip=HIRES_INFO,
                                     elem_id=script.elem_id("hires"))
            with gr.Column(visible=False) as own:  # the hires pass's own controls, shown for "own settings"
                _stage(script, HIRES, args, made)
            made["hires"].change(fn=lambda mode: gr.update(visible=mode == HIRES_OWN), inputs=[made["hires"]],
                                 outputs=[own], show_progress=False)
        with gr.Accordion(ABOUT, open=False):
            for method in METHODS:
                gr.Markdown(f"**{method}: {METHOD_TITLES[method]}**\n\n{_help(method)}")
    controls = [made[arg.name] for arg in ARGS]
    return controls, [(made[arg.name], paste_rule(arg)) for arg in ARGS], paste_field_names()
