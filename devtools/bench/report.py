"""The results: one row per configuration and measured setting, the markdown tables and the
JSON (``results.json``: ``machine``, ``settings``, ``rows`` with every field of ``Row``, and
``skipped``: configurations a family's model refused)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .families import size_label


@dataclass(kw_only=True)
class Row:
    family: str
    size: int | str  # px: 1024 (square) or "832x480" (width x height)
    attention: str  # the attention backend
    config: str  # its name; compiled rows: "compiled " + the eager config's name
    method: str  # its series in the plots
    reduction: float  # tokens removed at the first level (ratio, or 1 - 1/factor^2)
    seconds: float  # per model evaluation, median of the timed passes
    speedup: float  # against unpatched in the same run (compiled rows: against compiled unpatched)
    rel_error: float  # relative L2 error of the noise prediction, against the same unpatched
    peak_mib: float | None  # CUDA: the allocator's peak; CPU: peak resident set above the pass's start
    plan_seconds: float | None = None  # ToMe: merge planning per evaluation
    share: float | None = None  # Amdahl (UNets, eager rows): share of the forward in the parts reduced
    bound: float | None = None  # ... the speed-up if those parts cost nothing
    bound_at: float | None = None  # ... the speed-up if they cost in proportion to the tokens kept
    repeats: list = field(default_factory=list)  # seconds of every timed pass
    breakdown: dict | None = None  # unpatched rows of UNets: share of the forward per part and level
    image_mse: float | None = None  # with --checkpoint: decoded image of a full sampling run vs unpatched
    image_psnr: float | None = None
    # Added with the bench package (older results.json files lack them):
    attention_mib: float | None = None  # largest attention working set (q + k + v + scores held), eager rows
    compiled: str | None = None  # the torch.compile backend; None: eager
    vs_eager: float | None = None  # compiled rows: eager seconds of the same config / compiled seconds
    vs_eager_error: float | None = None  # compiled rows: relative difference from the eager output
    first_seconds: float | None = None  # seconds of the whole first warm-up pass (compiled: compiling included)
    compiles_in_timed_passes: int | None = None  # compiled rows: graphs compiled after warm-up (0 expected)
    # Added with the measured auto rule (issue #20): what reduce_when auto timed and decided for this
    # configuration, in its first (warm-up) pass, and what timing cost; None where it measured nothing.
    auto: list | None = None  # [{"site", "reduce", "full_ms", "reduced_ms"}]
    auto_seconds: float | None = None


def groups(rows: list[Row]) -> dict[tuple, list[Row]]:
    """Rows by (family, size, attention, compile backend or None), in the order measured."""
    out: dict[tuple, list[Row]] = {}
    for row in rows:
        out.setdefault((row.family, row.size, row.attention, row.compiled), []).append(row)
    return out


def write_json(path: Path, machine: str, settings: str, rows: list[Row], skipped: list[dict]) -> None:
    path.write_text(json.dumps({"machine": machine, "settings": settings, "rows": [asdict(r) for r in rows],
                                "skipped": skipped}, indent=1))


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds is not None else "-"


def _mib(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 10 else f"{value:.2f}"


def _eager_table(group: list[Row]) -> list[str]:
    base = group[0]
    images = base.image_mse is not None
    if base.breakdown is not None:
        goes = ("Where it goes (hooks): " + ", ".join(f"{name} {share:.0%}" for name, share in base.breakdown.items())
                + ".")
    else:
        goes = "No layout of this model: no Amdahl breakdown or bounds."
    lines = ["", f"Unpatched: {base.seconds * 1000:.0f} ms per model forward. {goes}", "",
             "| config | s/forward | speed-up | rel. error | plan time | peak MiB | attention MiB | reduced share "
             "| bound if free | bound at its reduction | of that bound |" + (" image MSE | PSNR dB |" if images else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if images else "")]
    for r in group:
        amdahl = (f"{r.share:.0%} | {r.bound:.2f}x | {r.bound_at:.2f}x | {r.speedup / r.bound_at:.0%}"
                  if r.method != "unpatched" and r.share is not None else "- | - | - | -")
        lines.append(f"| {r.config} | {r.seconds:.3f} | {r.speedup:.2f}x | {r.rel_error:.4f} | {_ms(r.plan_seconds)} | "
                     f"{_mib(r.peak_mib)} | {_mib(r.attention_mib)} | {amdahl} |"
                     + (f" {r.image_mse:.2e} | {r.image_psnr:.1f} |" if images else ""))
    return lines


def _auto_table(group: list[Row]) -> list[str]:
    """What reduce_when auto decided per configuration, and its cost against one model forward."""
    measured = [r for r in group if r.auto]
    if not measured:
        return []
    base = group[0].seconds
    lines = ["", "reduce_when auto (timed in the first warm-up pass; the timed passes use the kept decisions): "
                 "per level or kind of DiT call, unreduced → reduced ms and the decision; what timing cost, in "
                 "seconds and in unpatched model forwards.", "",
             "| config | decisions | timing cost | in forwards |", "|---|---|---|---|"]
    for r in measured:
        decisions = "; ".join(f"{a['site']}: {_measured(a)}, {'reduced' if a['reduce'] else 'left alone'}"
                              for a in r.auto)
        lines.append(f"| {r.config} | {decisions} | {r.auto_seconds:.3f} s | {r.auto_seconds / base:.2f} |")
    return lines


def _measured(a: dict) -> str:
    """What auto measured of one kind: its times, and the change max_change reads where measured
    (untimed on a CPU: the change alone; the budget is applied when read, not in this log)."""
    times = f"{a['full_ms']:.2f} → {a['reduced_ms']:.2f} ms" if a.get("full_ms") is not None else "untimed"
    return times + (f", change {100 * a['change']:.3g} %" if a.get("change") is not None else "")


def _compiled_table(group: list[Row]) -> list[str]:
    backend = group[0].compiled
    lines = ["", f"Compiled (`torch.compile`, backend {backend}, through ComfyUI's `set_torch_compile_wrapper`): "
                 f"speed-up and error against compiled unpatched in the same run; vs eager: the same config's eager "
                 f"time over its compiled time, and how far the compiled output is from the eager one; first pass: "
                 f"the first warm-up pass, compiling included.", "",
             "| config | s/forward | speed-up | rel. error | vs eager: speed | vs eager: error | first pass | peak MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in group:
        vs_eager = f"{r.vs_eager:.2f}x" if r.vs_eager is not None else "-"
        vs_error = f"{r.vs_eager_error:.1e}" if r.vs_eager_error is not None else "-"
        first = f"{r.first_seconds:.1f} s" if r.first_seconds is not None else "-"
        lines.append(f"| {r.config} | {r.seconds:.3f} | {r.speedup:.2f}x | {r.rel_error:.4f} | {vs_eager} | {vs_error} | "
                     f"{first} | {_mib(r.peak_mib)} |")
    recompiled = [r.config for r in group if r.compiles_in_timed_passes]
    if recompiled:
        lines += ["", f"WARNING: dynamo compiled graphs during the timed passes of {', '.join(recompiled)}: their "
                      f"times include compiling."]
    return lines


def to_markdown(rows: list[Row], machine: str, settings: str = "", skipped: list[dict] = ()) -> str:
    lines = [f"Machine: {machine}", ""] + ([settings, ""] if settings else [])
    for (family, size, attention, compiled), group in groups(rows).items():
        if compiled is None:
            lines.append(f"### {family}, {size_label(size)} px, batch 2 (CFG), {attention} attention")
            refused = [s for s in skipped if s["family"] == family]
            if refused:
                lines += ["", "Not applicable: " + "; ".join(f"{s['config']} ({s['reason']})" for s in refused)]
            lines += _eager_table(group) + _auto_table(group)
        else:
            lines += [f"#### {family}, {size_label(size)} px, {attention} attention, compiled"] + _compiled_table(group)
        lines.append("")
    return "\n".join(lines)
