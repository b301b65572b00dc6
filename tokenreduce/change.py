"""``measure_change``: how much the reduction changed the model's prediction, on the user's own
model and inputs, at one step of the run.

At the run's first model call that reduced something (``run.call_reduced``), once that call has
returned its (reduced) output, the host runs the same call once more with every TokenReduce
node passing through (``ModelCall.rehearse``: below the host's wrappers; options as the auto rule
measures with them, ``measure.measuring_options``), and the run keeps
``||reduced - full|| / ||full||`` as a tensor on the device: nothing is read from it until the
run's report is made. The sampler gets the reduced output, untouched, and the random number
generators are as they were (``pays.untouched_rng``): the image is bit for bit the one of a run
without the readout.

What it is: the relative L2 change of one model call's output (the host's prediction: ComfyUI's
and Forge's denoised estimate, diffusers' model output) at one step, the change of all the
TokenReduce nodes on the model together. What it is not: the change of the final image, which
sums every step's change through the sampler (docs/quality.md anchors one against the other on
the trained fixtures).
"""

from __future__ import annotations

import torch

from .measure import measuring_options
from .pays import untouched_rng
from .run import ModelCall, RunState, call_context

# Exceptions a host raises to stop sampling (ComfyUI's interrupt): never taken for a failed readout.
INTERRUPTS = ("InterruptProcessingException",)


def relative_change(reduced: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``||reduced - full|| / ||full||`` as a 0-d float32 tensor where the outputs are (no host read)."""
    full = full.detach().float()
    difference = reduced.detach().float().to(full.device) - full
    return difference.norm() / full.norm().clamp_min(torch.finfo(torch.float32).tiny)


def first_output(output) -> torch.Tensor:
    """The prediction tensor of a model's output: itself, diffusers' ``.sample`` or the first item
    of its tuple."""
    if torch.is_tensor(output):
        return output
    sample = getattr(output, "sample", None)
    if torch.is_tensor(sample):
        return sample
    return output[0]


def measure_change(run: RunState, context: dict, call: ModelCall, reduced, context_key: str, label: str) -> None:
    """After a model call that returned ``reduced``: if the run measures the change and this is its
    first call that reduced, run the call again unreduced (``call.rehearse``, with the options the
    auto rule measures with: no TokenReduce node reduces there) and keep the relative change."""
    if not run.claims_change(context):
        return
    if call.rehearse is None:
        run.warn_once(f"{label}: measure_change: this host cannot run a model call again; no prediction change "
                      f"is reported.")
        return
    options = measuring_options(call, **{context_key: call_context(False)})
    keep_change(run, label, reduced, lambda: call.rehearse(options), call.x.device, call.sigmas)


def keep_change(run: RunState, label: str, reduced, unreduced, device: torch.device, sigmas: torch.Tensor) -> None:
    """Run ``unreduced()`` (the claimed call again, every reduction passing through) with the random
    number generators left as they were, and keep its relative change from ``reduced`` in the run.
    A readout that cannot be made is said in the report; the run goes on."""
    try:
        with torch.no_grad(), untouched_rng(device):
            full = first_output(unreduced())
            run.keep_change(relative_change(first_output(reduced), full), sigmas)
    except Exception as problem:  # noqa: BLE001 - the readout is extra: the run's own result must not fail
        if type(problem).__name__ in INTERRUPTS:
            raise
        run.warn_once(f"{label}: could not measure the prediction change ({type(problem).__name__}: {problem}); "
                      f"the image is not affected.")
