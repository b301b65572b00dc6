"""The figures: per (family, size, attention) and per compile mode, speed-up and error
against the ratio and speed-up against error, each series (method) with its own colour and
marker; and a speed-vs-error chart with the Pareto front marked."""

from __future__ import annotations

from pathlib import Path

from .families import size_label
from .report import Row, groups

# Every series of configs.CONFIGS has its own colour and its own marker; related series share
# a hue family (ToMe q, k, v: blues; queries only: greens; ToDo: reds and oranges).
STYLES: dict[str, tuple[str, str]] = {
    "unpatched": ("#7f7f7f", "o"),
    "builtin": ("#000000", "X"),
    "tome": ("#1f77b4", "s"),
    "tome-3x3": ("#17becf", "D"),
    "tome-shared": ("#08306b", "d"),
    "tome-queries": ("#2ca02c", "^"),
    "tome-queries-3x3": ("#bcbd22", "v"),
    "tome-queries-shared": ("#00441b", "<"),
    "tome-mlp": ("#9467bd", "P"),
    "todo": ("#d62728", "*"),
    "todo-next": ("#ff7f0e", "h"),
    "combined": ("#8c564b", "p"),
}
# For series not listed above (a new method), in this order, skipping any already taken.
SPARE: tuple[tuple[str, str], ...] = (("#e377c2", ">"), ("#a6761d", "8"), ("#1b9e77", "H"), ("#e7298a", "1"),
                                      ("#666666", "2"), ("#7570b3", "3"), ("#66a61e", "4"), ("#e6ab02", "+"))


def styles_for(methods) -> dict[str, tuple[str, str]]:
    """(colour, marker) per series: the fixed ones of STYLES, then spares, never reusing a
    colour or a marker within the figure."""
    out = {m: STYLES[m] for m in methods if m in STYLES}
    spare = iter(s for s in SPARE if s[0] not in {c for c, _ in out.values()} and s[1] not in {k for _, k in out.values()})
    for method in methods:
        if method not in out:
            out[method] = next(spare)
    return out


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the (error, speed-up) points that no other point beats on both (lower or
    equal error and higher or equal speed-up, better in one), by rising error."""
    front = [i for i, (e, s) in enumerate(points)
             if not any(e2 <= e and s2 >= s and (e2 < e or s2 > s) for e2, s2 in points)]
    return sorted(front, key=lambda i: (points[i][0], points[i][1]))


def _label(key: tuple) -> tuple[str, str]:
    family, size, attention, compiled = key
    title = f"{family} {size_label(size)} px, batch 2, {attention} attention"
    title += f", compiled ({compiled})" if compiled else ""
    return title, f"{family.lower().replace(' ', '_')}_{size}_{attention}" + ("_compiled" if compiled else "")


def _curves(plt, group: list[Row], styles: dict, title: str):
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    for method, (colour, marker) in styles.items():
        if method == "unpatched":
            continue
        pts = sorted((r.reduction, r.speedup, r.rel_error) for r in group if r.method == method)
        kw = dict(color=colour, marker=marker, markersize=8, label=method, linewidth=1.5)
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], **kw)
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], **kw)
        axes[2].plot([p[2] for p in pts], [p[1] for p in pts], linestyle="none", **kw)
    baseline = "compiled unpatched" if group[0].compiled else "unpatched"
    for ax in (axes[0], axes[2]):
        ax.axhline(1.0, color=STYLES["unpatched"][0], linewidth=0.8, linestyle=":")
    axes[0].set(xlabel="tokens removed at the first level (ratio, or 1 - 1/factor^2)",
                ylabel=f"speed-up vs {baseline}", title="speed-up vs ratio")
    axes[1].set(xlabel="tokens removed at the first level", ylabel="relative error", title="error vs ratio")
    axes[2].set(xlabel=f"relative error vs {baseline}", ylabel="speed-up", title="speed-up vs error")
    for ax in axes:
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=9, title="series")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    return fig


def _ticks(low: float, high: float) -> list[float]:
    """1, 2, 5 times powers of ten from ``low`` to ``high`` (a readable log axis)."""
    import math

    ticks = []
    for exponent in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1):
        ticks += [m * 10.0 ** exponent for m in (1, 2, 5) if low / 2 <= m * 10.0 ** exponent <= high * 2]
    return ticks


def spread(positions: list[float], gap: float) -> list[float]:
    """Label positions (axes fraction, sorted) moved apart to at least ``gap``, as little as
    possible and staying within [0, 1]: pushed up where crowded, then back down from the top."""
    out = list(positions)
    for i in range(1, len(out)):
        out[i] = max(out[i], out[i - 1] + gap)
    if out and out[-1] > 1.0:
        out[-1] = 1.0
        for i in range(len(out) - 2, -1, -1):
            out[i] = min(out[i], out[i + 1] - gap)
    return out


def _pareto(plt, group: list[Row], styles: dict, title: str):
    fig, ax = plt.subplots(figsize=(11, 6.5))
    points = [(r.rel_error, r.speedup) for r in group]
    front = pareto_front(points)
    for method, (colour, marker) in styles.items():
        rows = [r for r in group if r.method == method]
        ax.scatter([r.rel_error for r in rows], [r.speedup for r in rows], color=colour, marker=marker, s=70,
                   label=method, zorder=3)
    xs, ys = [points[i][0] for i in front], [points[i][1] for i in front]
    ax.step(xs, ys, where="post", color="#444444", linewidth=1.2, linestyle="--", zorder=2, label="Pareto front")
    ax.scatter(xs, ys, s=260, facecolors="none", edgecolors="#444444", linewidths=1.5, zorder=4)
    positive = [e for e, _ in points if e > 0]
    if positive:  # small errors spread out, zero (unpatched) still on the axis
        ax.set_xscale("symlog", linthresh=min(positive) / 2, linscale=0.3)
        ax.set_xticks([0.0] + _ticks(min(positive), max(positive)))
        ax.xaxis.set_major_formatter(plt.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.set(xlabel="relative error vs " + ("compiled unpatched" if group[0].compiled else "unpatched")
                  + " (symlog scale)", ylabel="speed-up", title=f"{title}: speed vs error")
    ax.grid(alpha=0.3)
    ax.autoscale_view()
    # Names of the front's configs beside them, moved apart where they would overlap: to the
    # left, where no point can be (nothing has less error and more speed than a point of the
    # front), except close to the axis, where they go to the right, above the front's line.
    to_axes = ax.transData + ax.transAxes.inverted()
    anchors = []
    for i in front:
        x, y = to_axes.transform(points[i])
        anchors.append((x, y, y if x > 0.3 else y + 0.035, group[i].config))
    anchors.sort(key=lambda a: a[2])
    for (x, y, _, name), label_y in zip(anchors, spread([a[2] for a in anchors], 0.05)):
        left = x > 0.3
        ax.annotate(name, (x, y), xycoords="axes fraction", xytext=(x - 0.035 if left else x + 0.035, label_y),
                    textcoords="axes fraction", fontsize=8, va="center", ha="right" if left else "left", zorder=5,
                    arrowprops=dict(arrowstyle="-", color="#888888", linewidth=0.6, shrinkA=0, shrinkB=7))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="series (circled: Pareto front)",
              title_fontsize=8)
    fig.tight_layout()
    return fig


def plot(rows: list[Row], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, group in groups(rows).items():
        title, stem = _label(key)
        styles = styles_for(dict.fromkeys(r.method for r in group))
        for fig, path in ((_curves(plt, group, styles, title), out / f"{stem}.png"),
                          (_pareto(plt, group, styles, title), out / f"{stem}_pareto.png")):
            fig.savefig(path, dpi=90)
            plt.close(fig)
            written.append(path)
    return written
