"""The script's hooks: what TokenReduce does at each point of a Forge generation.

- ``before_process`` (once per generation, before Forge applies ``override_settings``): read
  the settings of every pass (``settings.job_from_args``), turn Forge's built-in ToMe off for
  this generation where it is on (it would merge the queries before TokenReduce sees them) and
  record the settings in the infotext.
- ``before_sampling`` (``process_before_every_sampling``, before each pass; three times with
  hires fix, the second on the first pass's UNet, which Forge then discards): patch a clone of
  the pass's UNet (``patching.install``), or make it refuse the generation.
- ``after_batch`` (``postprocess_batch``, after the passes and before the infotext is written):
  each pass's report into the infotext, what was patched below the image, both to the console.

Forge swallows exceptions raised in hooks; these catch their own and turn any failure into a
refusal at the first model call, so a setting is never silently ignored.
"""

from __future__ import annotations

from pathlib import Path

from tokenreduce.describe import percent_text, run_lines
from tokenreduce.methods import MODE_QUERIES
from tokenreduce.pays import Decisions, decisions_at

from . import patching
from .settings import FIRST, HIRES, PREFIX, STAGE_WORDS, WARNINGS_KEY, Job, change_key, job_from_args, report_key

JOB = "tokenreduce_job"  # attributes TokenReduce sets on the processing object
PASSES = "tokenreduce_passes"
XYZ = "tokenreduce_xyz"  # {(method, input): value} set by the XYZ-plot axes (xyz.py)
BUILTIN_OPTIONS = ("token_merging_ratio", "token_merging_ratio_hr", "token_merging_ratio_img2img")
FAMILIES = {  # Forge's diffusion engines -> the model names ComfyUI reports use
    "StableDiffusion": "SD15", "StableDiffusion2": "SD20", "StableDiffusionXL": "SDXL",
    "StableDiffusionXLRefiner": "SDXLRefiner", "StableDiffusion3": "SD3", "Flux": "Flux", "Chroma": "Chroma",
}


def say(text: str) -> None:
    print(f"[{PREFIX}] {text}", flush=True)


def _opts():
    try:
        from modules import shared
    except ImportError:  # no WebUI (unit tests)
        return None
    return shared.opts


def _state():
    try:
        from modules import shared
    except ImportError:
        return None
    return shared.state


def decisions() -> Decisions:
    """The auto rule's decisions, kept in Forge's data directory (``--data-dir``, per machine)."""
    try:
        from modules import paths_internal

        path = Path(paths_internal.data_path) / "tokenreduce" / "auto_decisions.json"
    except ImportError:  # no WebUI (unit tests): memory only
        path = None
    return decisions_at(path)


def attention_function():
    """Forge's attention function (chosen by its start-up flags): names the backend in what the
    auto rule keeps."""
    try:
        from backend import attention
    except ImportError:
        return None
    return getattr(attention, "attention_function", None)


def hires_runs(p) -> bool:
    """Whether this generation has a hires. fix pass (txt2img only)."""
    return bool(getattr(p, "enable_hr", False)) and not getattr(p, "is_img2img", False) and \
        type(p).__name__ != "StableDiffusionProcessingImg2Img"


def family_of(sd_model) -> str:
    name = type(sd_model).__name__
    return FAMILIES.get(name, name)


def _float(value) -> float:
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        return 0.0


def builtin_ratios(p) -> dict:
    """The built-in ToMe ratios this generation would use (> 0 only), by option name."""
    opts = _opts()
    found = {}
    for name in BUILTIN_OPTIONS:
        value = p.override_settings.get(name) if name in (p.override_settings or {}) else getattr(opts, name, 0)
        if _float(value) > 0:
            found[name] = _float(value)
    for name in ("token_merging_ratio", "token_merging_ratio_hr"):  # fields of p, set by other scripts
        if _float(getattr(p, name, 0)) > 0:
            found[f"p.{name}"] = _float(getattr(p, name))
    return found


def disable_builtin_tome(p) -> str | None:
    """Turn Forge's built-in ToMe off for this generation (its settings are restored after it,
    as every override); what to tell the user, or None where it was off."""
    ratios = builtin_ratios(p)
    if not ratios:
        return None
    p.override_settings = {**(p.override_settings or {}), **{name: 0.0 for name in BUILTIN_OPTIONS}}
    for name in ("token_merging_ratio", "token_merging_ratio_hr"):
        if hasattr(p, name):
            setattr(p, name, 0)
    ratio = max(ratios.values())
    return (f"Forge's built-in Token merging (ratio {ratio:g}) was turned off for this generation: {PREFIX} replaces "
            f"it (the built-in merges the queries before {PREFIX} sees them, which would skip its ToMe in every "
            f"block). {PREFIX}'s ToMe with mode '{MODE_QUERIES}' computes what the built-in does.")


def before_process(p, args) -> None:
    # An XYZ cell's processing object is a shallow copy of the grid's: give it its own dict, so
    # that one cell's keys do not reach the next.
    p.extra_generation_params = {k: v for k, v in p.extra_generation_params.items() if not str(k).startswith(PREFIX)}
    setattr(p, PASSES, {})
    try:
        job = job_from_args(args, hires_runs=hires_runs(p), overrides=getattr(p, XYZ, None))
        if job.enabled:
            note = disable_builtin_tome(p)
            if note is not None:
                job = Job(job.enabled, job.passes, job.hires_mode, job.problem, job.notes + (note,))
            p.extra_generation_params.update(job.infotext(hires_runs(p)))
    except Exception as failure:  # noqa: BLE001 - refused at the first model call instead
        job = Job(True, problem=f"{PREFIX} failed to read its settings: {failure!r}")
    setattr(p, JOB, job)  # a problem is said once, where it is raised (patching.PassRun.wrapper)


def before_sampling(p, args, kwargs) -> None:
    job = getattr(p, JOB, None)
    if job is None:  # before_process did not run for this processing object
        job = job_from_args(args, hires_runs=hires_runs(p), overrides=getattr(p, XYZ, None))
        setattr(p, JOB, job)
    stage = HIRES if getattr(p, "is_hr_pass", False) else FIRST
    if stage == FIRST or not hasattr(p, PASSES):
        setattr(p, PASSES, {})  # a new batch: its passes start here
    forge_objects = p.sd_model.forge_objects
    unet = forge_objects.unet
    if not job.enabled and not patching.has_ours(unet):
        return
    try:
        latent = kwargs.get("x")
        patched, run = patching.install(unet, family_of(p.sd_model), stage, job.stage(stage) if job.enabled else {},
                                        tuple(latent.shape) if latent is not None else (), refusal=job.problem,
                                        decisions=decisions(), attention=attention_function())
        if patched is not unet and patching.strip_builtin_tome(patched):
            run.warnings.append(f"Forge's built-in Token merging was applied to the {STAGE_WORDS[stage]} although "
                                f"{PREFIX} turned it off for this generation; {PREFIX} took it out.")
        if run.methods:
            run.use_schedule(schedule_of(p), patched)
    except Exception as failure:  # noqa: BLE001
        patched, run = patching.refusing(unet, stage, f"{PREFIX} failed to patch the model: {failure!r}")
    forge_objects.unet = patched
    getattr(p, PASSES)[stage] = run


def schedule_of(p) -> list[float] | None:
    """The sigmas of the pass about to sample, as Forge's k-diffusion samplers compute them (for
    the report's steps); None where it cannot tell (then the report counts the noise levels the
    model was called at)."""
    sampler = getattr(p, "sampler", None)
    if sampler is None or not hasattr(sampler, "get_sigmas"):
        return None
    saved = dict(p.extra_generation_params)  # get_sigmas notes some settings there; sampling does it again
    try:
        from modules import sd_samplers_common

        if getattr(p, "is_hr_pass", False):
            steps, t_enc = sd_samplers_common.setup_img2img_steps(p, p.hr_second_pass_steps or p.steps)
            return [float(s) for s in sampler.get_sigmas(p, steps)[steps - t_enc - 1:]]
        if type(p).__name__ == "StableDiffusionProcessingImg2Img":
            steps, t_enc = sd_samplers_common.setup_img2img_steps(p)
            return [float(s) for s in sampler.get_sigmas(p, steps)[steps - t_enc - 1:]]
        return [float(s) for s in sampler.get_sigmas(p, p.steps)]
    except Exception:  # noqa: BLE001 - only the report's step numbers depend on it
        return None
    finally:
        p.extra_generation_params.clear()
        p.extra_generation_params.update(saved)


def _change_text(change) -> str:
    """measure_change's readout for the infotext: '1.8 % at step 1'."""
    return percent_text(change.change) + (f" at step {change.step}" if change.step is not None else "")


def _interrupted() -> bool:
    state = _state()
    return bool(state is not None and (state.interrupted or state.skipped))


def after_batch(p, args) -> None:
    job = getattr(p, JOB, None)
    runs = getattr(p, PASSES, None) or {}
    if job is None or not job.enabled:
        return
    completed = not _interrupted()
    warnings, comments = [], []
    for stage in (FIRST, HIRES):
        run = runs.get(stage)
        if run is None or run.finished:
            continue
        warnings += run.warnings
        for method, report in run.finish(completed):
            p.extra_generation_params[report_key(stage, method.method)] = " | ".join(
                run_lines(method.header, report, timing=False))
            if report.prediction_change is not None:  # measure_change: one model call's change, one step
                p.extra_generation_params[change_key(stage, method.method)] = _change_text(report.prediction_change)
            comments.append(f"{PREFIX}, {STAGE_WORDS[stage]}: {method.info}")
            comments.append(" · ".join(run_lines(method.header, report)))
            warnings += [w for w in report.warnings if w not in warnings]
    if warnings:
        p.extra_generation_params[WARNINGS_KEY] = " | ".join(dict.fromkeys(warnings))
    for text in [*job.notes, *comments, *dict.fromkeys(warnings)]:
        p.comment(text)
        say(text)
    setattr(p, PASSES, {})  # nothing of this batch's runs outlives it
