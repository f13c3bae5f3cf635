"""Paper-style figures from traces (simulated or measured) and bubble tables.

Rules every figure here keeps: legends sit outside the axes (they never cover an op); op kinds
differ by more than colour (F light, B solid, W dotted hatch), so the figures read in black and
white; lines that coincide stay visible (each series its own marker, size and dash); panels that
are compared share one x axis starting at 0."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from cost_models.files import output_file  # noqa: E402
from schedules.trace import step_metrics  # noqa: E402

DPI = 110      # the resolution of pipetwin's figures (save_figure)

KIND_STYLE = {"F": dict(alpha=0.45), "B": dict(alpha=1.0), "W": dict(alpha=0.75, hatch="..")}


def draw_timeline(ax, trace, *, step=None, title=None, label_ops=True):
    """One row per device: F light, B solid, W dotted; colour = micro-batch; the up copy of a
    bidirectional schedule has a hatched edge. Title carries the bubble ratio."""
    steps = sorted(trace["step"].unique())
    step = steps[-1] if step is None else step
    t = trace[(trace["step"] == step) & trace["kind"].isin(["F", "B", "W"])]
    t0 = trace[trace["step"] == step]["start"].min()
    N = int(trace.attrs.get("microbatches", max(1, int(t["microbatch"].max()) + 1)))
    cmap = plt.get_cmap("tab20" if N > 10 else "tab10")
    devices = sorted(trace[trace["step"] == step]["device"].unique())
    for row in t.itertuples(index=False):
        y = devices.index(row.device)
        style = dict(KIND_STYLE[row.kind])
        colour = cmap(row.microbatch % cmap.N)
        hatch = style.pop("hatch", None)
        if row.copy == 1:
            hatch = (hatch or "") + "//"
        ax.barh(y, row.end - row.start, left=row.start - t0, height=0.8, color=colour,
                edgecolor="black", linewidth=0.4, hatch=hatch, **style)
        if label_ops and (row.end - row.start) > 0:
            ax.text(row.start - t0 + (row.end - row.start) / 2, y, str(row.microbatch), ha="center",
                    va="center", fontsize=6)
    m = step_metrics(trace, step)
    unit = trace.attrs.get("time_unit", "s")
    name = title or f"{trace.attrs.get('schedule', '')}"
    ax.set_title(f"{name}: iteration {m.iteration_time:.4g} {unit}, bubble {m.bubble_ratio:.3f}", fontsize=9)
    ax.set_yticks(range(len(devices)), [f"dev {d}" for d in devices], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({'units of F' if unit == 'F' else unit})", fontsize=8)
    return m


def op_handles(extra=()) -> list:
    """Legend handles of the op styles (F / B / W / up copy), plus ``extra`` handles."""
    return [Patch(facecolor="grey", alpha=0.45, edgecolor="black", label="forward (F)"),
            Patch(facecolor="grey", edgecolor="black", label="backward (B)"),
            Patch(facecolor="grey", alpha=0.75, hatch="..", edgecolor="black", label="weight-grad (W)"),
            Patch(facecolor="white", hatch="//", edgecolor="black", label="up copy"), *extra]


def add_legend(ax, extra=()) -> None:
    """The op-style key, above the axes so that it never covers an op (colour = micro-batch)."""
    handles = op_handles(extra)
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.12), borderaxespad=0.0, fontsize=7,
              ncol=len(handles), frameon=False, title="colour = micro-batch, number on the op = micro-batch",
              title_fontsize=7)


def plot_timeline(trace, path, *, title=None):
    devices = trace["device"].nunique()
    fig, ax = plt.subplots(figsize=(12, 0.45 * devices + 1.4))
    draw_timeline(ax, trace, title=title)
    add_legend(ax)
    save_figure(fig, path)


def plot_stacked(traces: dict, path, *, sharex=True):
    """Timelines of several schedules stacked, same time axis."""
    n = len(traces)
    heights = [0.4 * t["device"].nunique() + 0.9 for t in traces.values()]
    fig, axes = plt.subplots(n, 1, figsize=(12, sum(heights) + 0.5), sharex=sharex,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (name, t) in zip(axes[:, 0], traces.items()):
        draw_timeline(ax, t, title=name, label_ops=t.attrs.get("microbatches", 0) <= 16)
    add_legend(axes[0, 0])
    save_figure(fig, path)


def plot_overlay(comps, path) -> None:
    """Measured (filled, the op styles of :func:`draw_timeline`, micro-batch numbers on the ops)
    under simulated (black outlines) timelines, one panel per schedule, all on one x axis from 0.
    ``comps``: :class:`calibration.compare.Comparison` per schedule (its measured and simulated
    traces hold the one step compared), titled with both iteration times and the error."""
    from matplotlib.lines import Line2D
    panels = [(f"{c.schedule}: measured {c.measured_iteration_time * 1e3:.1f} ms vs simulated "
               f"{c.simulated_iteration_time * 1e3:.1f} ms, error {c.error:+.1%}", c.measured_trace,
               c.simulated_trace) for c in comps]
    n = len(panels)
    heights = [0.9 + 0.45 * m["device"].nunique() for _, m, _ in panels]
    fig, axes = plt.subplots(n, 1, figsize=(12, sum(heights) + 1.0), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    cmap = plt.get_cmap("tab10")
    for ax, (title, measured, simulated) in zip(axes[:, 0], panels):
        devices = sorted(set(measured["device"]) | set(simulated["device"]))
        for tr, filled in ((measured, True), (simulated, False)):
            t = tr[tr["kind"].isin(["F", "B", "W"])]
            t0 = tr["start"].min()
            for row in t.itertuples(index=False):
                y, width, left = devices.index(row.device), row.end - row.start, row.start - t0
                if filled:
                    style = dict(KIND_STYLE[row.kind])
                    hatch = style.pop("hatch", None)
                    if getattr(row, "copy", 0) == 1:
                        hatch = (hatch or "") + "//"
                    ax.barh(y, width, left=left, height=0.8, color=cmap(row.microbatch % 10), hatch=hatch,
                            edgecolor="grey", linewidth=0.3, **style)
                    if width > 0:
                        ax.text(left + width / 2, y, str(row.microbatch), ha="center", va="center", fontsize=5)
                else:
                    ax.barh(y, width, left=left, height=0.8, fill=False, edgecolor="black", linewidth=0.7)
        ax.set_title(title, fontsize=9)
        ax.set_yticks(range(len(devices)), [f"rank {r}" for r in devices], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(left=0)
    axes[-1, 0].set_xlabel("seconds since the step's first op", fontsize=8)
    outline = Line2D([], [], color="black", linewidth=1.0, label="simulated (outline)")
    add_legend(axes[0, 0], extra=[Patch(facecolor="tab:blue", alpha=0.9, label="measured (filled)"), outline])
    save_figure(fig, path)


# one style per series: coinciding lines (gpipe = dapple in bubble plots) stay visible
SERIES_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "h", "<", ">")
SERIES_DASHES = ("-", "--", "-.", ":")


def series_style(i: int) -> dict:
    """Plot keywords of series ``i``: its own marker and dash; even series large and hollow, odd ones
    small and filled, so a series drawn over its neighbour's equal values shows inside it."""
    hollow = i % 2 == 0
    return dict(marker=SERIES_MARKERS[i % len(SERIES_MARKERS)], linestyle=SERIES_DASHES[i % len(SERIES_DASHES)],
                markersize=10 if hollow else 5, markerfacecolor="none" if hollow else None,
                markeredgewidth=1.4 if hollow else 1.0, linewidth=1.2)


def save_figure(fig, path) -> None:
    """Finish a figure the one way every figure here is finished: tight layout (nothing clipped or
    overlapping), written at :data:`DPI` (its folder made), closed (pyplot keeps open figures alive)."""
    fig.tight_layout()
    try:
        with output_file(path, "figure", "wb") as fh:
            fig.savefig(fh, dpi=DPI, format=Path(path).suffix[1:] or None)
    finally:
        plt.close(fig)
