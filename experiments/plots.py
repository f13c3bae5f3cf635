"""Paper-style timeline figures from traces (simulated or measured)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from schedules.trace import step_metrics  # noqa: E402

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


def add_legend(ax) -> None:
    """The op-style key (F / B / W / up copy), above the axes so that it never covers an op."""
    handles = [Patch(facecolor="grey", alpha=0.45, edgecolor="black", label="forward"),
               Patch(facecolor="grey", edgecolor="black", label="backward"),
               Patch(facecolor="grey", alpha=0.75, hatch="..", edgecolor="black", label="weight-grad (W)"),
               Patch(facecolor="white", hatch="//", edgecolor="black", label="up copy")]
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.02), borderaxespad=0.0, fontsize=7,
              ncol=4, frameon=False)


def plot_timeline(trace, path, *, title=None):
    devices = trace["device"].nunique()
    fig, ax = plt.subplots(figsize=(12, 0.45 * devices + 1.4))
    draw_timeline(ax, trace, title=title)
    add_legend(ax)
    fig.tight_layout()
    _save(fig, path)


def plot_stacked(traces: dict, path, *, sharex=True):
    """Timelines of several schedules stacked, same time axis."""
    n = len(traces)
    heights = [0.4 * t["device"].nunique() + 0.9 for t in traces.values()]
    fig, axes = plt.subplots(n, 1, figsize=(12, sum(heights) + 0.5), sharex=sharex,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (name, t) in zip(axes[:, 0], traces.items()):
        draw_timeline(ax, t, title=name, label_ops=t.attrs.get("microbatches", 0) <= 16)
    add_legend(axes[0, 0])
    fig.tight_layout()
    _save(fig, path)


def _save(fig, path):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
