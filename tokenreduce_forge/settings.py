"""The extension's arguments and what they mean: one per control of the WebUI's accordion, in
the order the API's ``alwayson_scripts`` takes them, built from the methods' declared inputs
(``tokenreduce.methods``); the settings of each sampling pass read from them (or from the
API's dict form, or an XYZ-plot axis), checked the way the ComfyUI nodes check theirs; and the
infotext keys that record them, with the paste rules that read them back.

Pure Python: imports neither gradio nor the WebUI, so it is tested without a host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from tokenreduce.inputs import BOOL, CHOICE, FLOAT, INT, SEED, Input, Method, is_number
from tokenreduce.methods import TODO, TOME

TITLE = "TokenReduce"  # the script's title; lower-cased ("tokenreduce") its name in alwayson_scripts
PREFIX = TITLE  # of every infotext key the extension writes; the built-in's keys ("Token merging ratio") are never used
# In patch order: ToDo pools the keys first, ToMe then merges the queries (and, in its q, k, v
# mode, finds the keys pooled and leaves them): the order the README recommends for stacking.
METHODS: dict[str, Method] = {"ToDo": TODO, "ToMe": TOME}
METHOD_TITLES = {"ToDo": "Token Downsampling", "ToMe": "Token Merging"}
DEFAULT_ON = {"ToDo": True, "ToMe": False}  # ToDo at its defaults is what the README recommends first
# Inputs that act on DiTs only; the WebUI does not show them, so they keep their defaults (on
# Forge's Flux.1, the one DiT the extension patches: its first and last blocks are left alone).
DIT_ONLY = frozenset({"temporal_factor", "skip_first_blocks", "skip_last_blocks", "stride_t"})
# Not shown either, so they keep their defaults: ToMe's plan_every (reusing plans across steps) and
# correct_from_whole (which needs it), measure_change (the prediction change in the infotext),
# max_change (auto's quality budget) and ToMe's min_similarity (merging only what is alike), not in
# the accordion yet, which keeps the API's positional arguments as they are (a control per method
# and pass would shift them).
NOT_SHOWN = DIT_ONLY | {"plan_every", "correct_from_whole", "measure_change", "max_change", "min_similarity"}
# Of those, what the API's dict form takes (it has no positions to shift): {"ToDo": {"measure_change": true}}.
DICT_ONLY = frozenset({"measure_change", "max_change", "min_similarity", "plan_every", "correct_from_whole"})

FIRST, HIRES = "first", "hires"  # the sampling passes of a generation (hires: the hires. fix pass)
STAGE_WORDS = {FIRST: "first pass", HIRES: "hires pass"}
HIRES_SAME, HIRES_OWN, HIRES_OFF = "same as first pass", "own settings", "off"
HIRES_MODES = (HIRES_SAME, HIRES_OWN, HIRES_OFF)


def webui_inputs(method: Method) -> tuple[Input, ...]:
    """The inputs of a method the WebUI shows."""
    return tuple(spec for spec in method.inputs if spec.name not in NOT_SHOWN)


def settable_inputs(method: Method) -> tuple[Input, ...]:
    """The inputs of a method a job may set: those shown, and those only the API's dict form takes."""
    return tuple(spec for spec in method.inputs if spec.name not in NOT_SHOWN or spec.name in DICT_ONLY)


@dataclass(frozen=True)
class Arg:
    """One control of the accordion, one positional argument of the API."""

    name: str  # unique; the infotext key is PREFIX + " " + name (for inputs and the hires mode)
    kind: str
    default: object
    spec: Input | None = None  # the method's input this control shows
    options: tuple[str, ...] = ()
    stage: str = FIRST
    method: str | None = None

    @property
    def key(self) -> str:
        return f"{PREFIX} {self.name}"


def _stage_prefix(stage: str) -> str:
    return "" if stage == FIRST else f"{HIRES} "


def method_arg(stage: str, method: str) -> str:
    """The name of a method's on/off switch in a pass: "ToDo", "hires ToMe"."""
    return f"{_stage_prefix(stage)}{method}"


def input_arg(stage: str, method: str, name: str) -> str:
    """The name of a method's input in a pass: "ToDo factor", "hires ToMe ratio"."""
    return f"{method_arg(stage, method)} {name}"


def report_key(stage: str, method: str) -> str:
    return f"{PREFIX} {method_arg(stage, method)} report"


def change_key(stage: str, method: str) -> str:
    """The infotext key of measure_change's readout: "TokenReduce ToDo prediction change"."""
    return f"{PREFIX} {method_arg(stage, method)} prediction change"


WARNINGS_KEY = f"{PREFIX} warnings"
NOTE_KEY = f"{PREFIX} note"
HIRES_KEY = f"{PREFIX} hires"


def _build_args() -> tuple[Arg, ...]:
    args = [Arg("enabled", BOOL, False)]
    for stage in (FIRST, HIRES):
        if stage == HIRES:
            args.append(Arg("hires", CHOICE, HIRES_SAME, options=HIRES_MODES, stage=HIRES))
        for method, declared in METHODS.items():
            args.append(Arg(method_arg(stage, method), BOOL, DEFAULT_ON[method], stage=stage, method=method))
            args += [Arg(input_arg(stage, method, spec.name), spec.kind, spec.default, spec, spec.options, stage,
                         method) for spec in webui_inputs(declared)]
    return tuple(args)


ARGS: tuple[Arg, ...] = _build_args()
ARG_INDEX = {arg.name: i for i, arg in enumerate(ARGS)}


def label(stage: str, method: str) -> str:
    """How messages name a method in a pass: "TokenReduce ToMe", "TokenReduce ToMe (hires pass)"."""
    return f"{PREFIX} {method}" + ("" if stage == FIRST else f" ({STAGE_WORDS[stage]})")


# --- values -> settings ----------------------------------------------------------------------

def coerce(kind: str, name: str, value) -> tuple[object, str | None]:
    """A value as the method's checks expect it, or why it cannot be one. The WebUI passes what
    a control or an API client sends, unconverted: sliders give floats for whole numbers, a
    pasted infotext gives 2.0 for a stride, an API client may send "false" for a switch."""
    if value is None:
        return None, None
    if kind == BOOL:
        return (value, None) if isinstance(value, bool) else (value, f"{name} {value!r} is not true or false.")
    if kind in (INT, SEED) and is_number(value) and not isinstance(value, int):
        if float(value).is_integer():
            return int(value), None
        return value, f"{name} {value!r} is not a whole number."
    if kind == FLOAT and is_number(value):
        return float(value), None
    return value, None


class Refusal(ValueError):
    """Settings that cannot run; the message names the input and what to do."""


def value_problem(spec: Input, value) -> str | None:
    """Why one input's value cannot be used on its own (type, range, option), or None: the checks
    of a single control, without the rules across a method's inputs."""
    value, problem = coerce(spec.kind, spec.name, value)
    return problem if problem is not None else spec.problem(value)


def check_each_value(values: dict) -> None:
    """Refuse a mistyped or out-of-range value of any method in any pass, also one switched off
    or in a hires pass that does not run: the accordion cannot send such a value, so an API client
    that does has a bug worth naming. The rules across inputs (start after end, nothing to
    downsample) are left to the methods that run: a user may switch a method off to leave them."""
    for stage in (FIRST, HIRES):
        for method, declared in METHODS.items():
            for spec in settable_inputs(declared):
                name = input_arg(stage, method, spec.name)
                problem = value_problem(spec, values[name]) if name in values else None
                if problem is not None:
                    raise Refusal(f"{label(stage, method)}: {problem}")


def method_settings(method: str, stage: str, values: dict):
    """The frozen settings of one method in one pass from its inputs' values (by input name;
    missing ones take their defaults)."""
    declared = METHODS[method]
    checked = {}
    for spec in settable_inputs(declared):
        if spec.name not in values:
            continue
        value, problem = coerce(spec.kind, spec.name, values[spec.name])
        if problem is not None:
            raise Refusal(f"{label(stage, method)}: {problem}")
        checked[spec.name] = value
    complete = {**{spec.name: spec.default for spec in declared.inputs if spec.name in NOT_SHOWN}, **checked}
    for spec in webui_inputs(declared):
        complete.setdefault(spec.name, spec.default)
    try:
        return declared.settings(complete)
    except ValueError as problem:
        raise Refusal(f"{label(stage, method)}: {problem}") from None


@dataclass(frozen=True)
class Job:
    """What TokenReduce does in one generation: the settings of each method in each pass."""

    enabled: bool
    passes: dict = field(default_factory=dict)  # FIRST / HIRES -> {method: settings}, the methods that run
    hires_mode: str = HIRES_SAME
    problem: str | None = None  # the generation is refused with this message
    notes: tuple[str, ...] = ()  # said in the infotext and the UI

    def stage(self, stage: str) -> dict:
        return self.passes.get(stage, {})

    def infotext(self, hires_runs: bool) -> dict:
        """The infotext entries that record these settings (pasting them restores the controls; the
        dict-only inputs set away from their defaults are recorded too, with no control to restore)."""
        if not self.enabled or self.problem is not None:
            return {}
        out = {}
        stages = (FIRST, HIRES) if hires_runs and self.hires_mode == HIRES_OWN else (FIRST,)
        if hires_runs:
            out[HIRES_KEY] = self.hires_mode
        for stage in stages:
            for method, settings in self.stage(stage).items():
                for spec in webui_inputs(METHODS[method]):
                    out[f"{PREFIX} {input_arg(stage, method, spec.name)}"] = getattr(settings, spec.name)
                # the API's dict-only inputs where set away from their defaults: recorded, so the
                # image says how it was made (no control to paste them back into: they stay as set)
                for spec in settable_inputs(METHODS[method]):
                    value = getattr(settings, spec.name)
                    if spec.name in DICT_ONLY and value != spec.default:
                        out[f"{PREFIX} {input_arg(stage, method, spec.name)}"] = value
        if self.notes:
            out[NOTE_KEY] = " | ".join(self.notes)
        return out


OFF = Job(False)
DICT_KEYS = {"todo": "ToDo", "tome": "ToMe", "hires": "hires"}


def _values_from_positional(args: Sequence) -> dict:
    return {arg.name: (args[i] if i < len(args) else arg.default) for i, arg in enumerate(ARGS)}


def _method_values_from_dict(stage: str, method: str, given, values: dict) -> None:
    values[method_arg(stage, method)] = given is True or isinstance(given, dict)
    if given is None or isinstance(given, bool):
        return
    if not isinstance(given, dict):
        raise Refusal(f"{label(stage, method)}: {given!r} is not true, false or a dict of its inputs.")
    names = [spec.name for spec in settable_inputs(METHODS[method])]
    unknown = [name for name in given if name not in names]
    if unknown:
        raise Refusal(f"{label(stage, method)}: unknown input {unknown[0]!r}; its inputs are {', '.join(names)}.")
    for name, value in given.items():
        values[input_arg(stage, method, name)] = value


def _values_from_dict(given: dict) -> dict:
    """The API's dict form, ``{"ToDo": {...} | true, "ToMe": {...} | true, "hires": mode | {...}}``
    (keys in any case; a method not named is off), as the positional values."""
    values = {arg.name: arg.default for arg in ARGS}
    values["enabled"] = True
    named = {}
    for key, value in given.items():
        canonical = DICT_KEYS.get(str(key).lower())
        if canonical is None:
            raise Refusal(f"{PREFIX}: unknown key {key!r} in the settings dict; use {', '.join(METHODS)} and hires.")
        named[canonical] = value
    for method in METHODS:
        _method_values_from_dict(FIRST, method, named.get(method), values)
    hires = named.get("hires", HIRES_SAME)
    if isinstance(hires, dict):
        values["hires"] = HIRES_OWN
        unknown = [k for k in hires if DICT_KEYS.get(str(k).lower()) not in METHODS]
        if unknown:
            raise Refusal(f"{PREFIX} (hires pass): unknown key {unknown[0]!r}; use {' and '.join(METHODS)}.")
        hires_named = {DICT_KEYS[str(k).lower()]: v for k, v in hires.items()}
        for method in METHODS:
            _method_values_from_dict(HIRES, method, hires_named.get(method), values)
    else:
        values["hires"] = hires
    return values


def _apply_overrides(values: dict, overrides: dict) -> list[str]:
    """XYZ-plot axes: ``{(method, input name): value}`` for the first pass. An axis turns its
    method on; with the extension off in the controls, only the axes' methods run. ToDo factor
    1 with factor_next 1 is the cell without ToDo."""
    notes = []
    if values.get("enabled") is not True:
        values["enabled"] = True
        for arg in ARGS:
            if arg.method is not None and arg.spec is None:
                values[arg.name] = False
        values["hires"] = HIRES_SAME
    for (method, name), value in overrides.items():
        values[method_arg(FIRST, method)] = True
        values[input_arg(FIRST, method, name)] = value
    factors = (values.get(input_arg(FIRST, "ToDo", "factor")), values.get(input_arg(FIRST, "ToDo", "factor_next")))
    if ("ToDo", "factor") in overrides and factors == (1, 1):
        values[method_arg(FIRST, "ToDo")] = False
        notes.append("ToDo is off in this cell: the XYZ axis sets its factor to 1 (and factor_next is 1).")
    return notes


def _stage_settings(values: dict, stage: str) -> dict:
    out = {}
    for method in METHODS:
        switch = values.get(method_arg(stage, method))
        _, problem = coerce(BOOL, method_arg(stage, method), switch)
        if problem is not None:
            raise Refusal(f"{PREFIX}: {problem}")
        if switch:
            names = {spec.name: input_arg(stage, method, spec.name) for spec in settable_inputs(METHODS[method])}
            out[method] = method_settings(method, stage,
                                          {name: values[arg] for name, arg in names.items() if arg in values})
    return out


def job_from_args(args: Sequence, *, hires_runs: bool, overrides: dict | None = None) -> Job:
    """The job the script's arguments describe (positional, as the controls give them, or the
    API's dict form as the first argument); ``hires_runs``: the generation has a hires. fix
    pass. Never raises: settings that cannot run come back as the job's ``problem``."""
    try:
        values = _values_from_dict(args[0]) if args and isinstance(args[0], dict) else _values_from_positional(args)
        notes = _apply_overrides(values, overrides) if overrides else []
        _, problem = coerce(BOOL, "enabled", values["enabled"])
        if problem is not None:
            raise Refusal(f"{PREFIX}: {problem}")
        if not values["enabled"]:
            return OFF
        check_each_value(values)
        first = _stage_settings(values, FIRST)
        mode = values["hires"]
        if mode not in HIRES_MODES:
            raise Refusal(f"{PREFIX}: hires {mode!r} is not one of {', '.join(map(repr, HIRES_MODES))}.")
        hires = {}
        if hires_runs:
            hires = first if mode == HIRES_SAME else {} if mode == HIRES_OFF else _stage_settings(values, HIRES)
        if not first and not hires and not notes:
            where = "the first pass" + (" or the hires pass" if hires_runs else "")
            raise Refusal(f"{PREFIX} is on, but neither ToDo nor ToMe is selected for {where}: nothing would be "
                          f"patched. Select a method, or turn {PREFIX} off.")
        return Job(True, {FIRST: first, HIRES: hires}, mode, notes=tuple(notes))
    except Refusal as refusal:
        return Job(True, problem=str(refusal))


# --- infotext -> controls ------------------------------------------------------------------------

def _mentions_us(params: dict) -> bool:
    return any(str(key).startswith(PREFIX + " ") for key in params)


def _marker(stage: str, method: str) -> str:
    """The infotext key whose presence says the method ran in that pass: its first input."""
    return f"{PREFIX} {input_arg(stage, method, webui_inputs(METHODS[method])[0].name)}"


def paste_rule(arg: Arg) -> str | Callable[[dict], object]:
    """How the WebUI reads this control back from a pasted infotext (``params``: the parsed
    infotext): an infotext key (absent: the control keeps its value), or a function (None: the
    control keeps its value). The switches are functions, so that pasting an image made without
    TokenReduce, or without one of its methods, turns them off."""
    if arg.name == "enabled":
        return _mentions_us
    if arg.name == "hires":
        return lambda params: params.get(HIRES_KEY, HIRES_SAME) if _mentions_us(params) else None
    if arg.spec is None:  # a method's switch
        marker = _marker(arg.stage, arg.method)
        if arg.stage == FIRST:
            return lambda params: (marker in params) if _mentions_us(params) else None
        return lambda params: (marker in params) if params.get(HIRES_KEY) == HIRES_OWN else None
    return arg.key


def paste_field_names() -> list[str]:
    """The infotext keys the "Send to img2img/inpaint" buttons carry over: the first pass's inputs."""
    return [arg.key for arg in ARGS if arg.spec is not None and arg.stage == FIRST]
