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


def shown_replica(trace, all_replicas: bool = False) -> tuple[list, str]:
    """The ranks a timeline draws and what the title says of them: with R > 1 data-parallel
    replicas, one replica (its D ranks: rank = replica x D + device), the one whose last compute op
    ends last (replica 0 when they end together, as identical replicas do), since replicas run the
    same program and R identical rows add nothing; ``all_replicas``: every rank."""
    ranks = sorted(trace["device"].unique())
    D, R = int(trace.attrs.get("devices") or 0), int(trace.attrs.get("replicas") or 1)
    if all_replicas or R <= 1 or D < 1 or len(ranks) != D * R:
        return ranks, ""
    comp = trace[trace["kind"].isin(["F", "B", "W"])]
    ends = comp.groupby(comp["device"] // D)["end"].max()
    k = int(ends.index[ends.to_numpy().argmax()])       # the first of the latest
    return [r for r in ranks if r // D == k], f"replica {k} of {R} drawn (--all-replicas: all)"


def draw_timeline(ax, trace, *, step=None, title=None, label_ops=True, all_replicas=False):
    """One row per device: F light, B solid, W dotted; colour = micro-batch; the up copy of a
    bidirectional schedule has a hatched edge. Title carries the bubble ratio (of every rank). With
    data-parallel replicas, one replica's rows unless ``all_replicas`` (:func:`shown_replica`)."""
    steps = sorted(trace["step"].unique())
    step = steps[-1] if step is None else step
    drawn, which = shown_replica(trace, all_replicas)
    t = trace[(trace["step"] == step) & trace["kind"].isin(["F", "B", "W"]) & trace["device"].isin(drawn)]
    t0 = trace[trace["step"] == step]["start"].min()
    N = int(trace.attrs.get("microbatches", max(1, int(t["microbatch"].max()) + 1)))
    cmap = plt.get_cmap("tab20" if N > 10 else "tab10")
    devices = sorted(set(trace[trace["step"] == step]["device"].unique()) & set(drawn))
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
    if which:       # at the left, clear of the centred title and of the key at the right
        ax.set_title(which, loc="left", fontsize=7)
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


def plot_timeline(trace, path, *, title=None, all_replicas=False):
    """One timeline (``all_replicas``: every data-parallel replica's rows, else one replica's)."""
    devices = len(shown_replica(trace, all_replicas)[0])
    fig, ax = plt.subplots(figsize=(12, 0.45 * devices + 1.4))
    draw_timeline(ax, trace, title=title, all_replicas=all_replicas)
    add_legend(ax)
    save_figure(fig, path)


def plot_stacked(traces: dict, path, *, sharex=True, all_replicas=False):
    """Timelines of several schedules stacked, same time axis (one replica each unless ``all_replicas``)."""
    n = len(traces)
    heights = [0.4 * len(shown_replica(t, all_replicas)[0]) + 0.9 for t in traces.values()]
    fig, axes = plt.subplots(n, 1, figsize=(12, sum(heights) + 0.5), sharex=sharex,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (name, t) in zip(axes[:, 0], traces.items()):
        draw_timeline(ax, t, title=name, label_ops=t.attrs.get("microbatches", 0) <= 16, all_replicas=all_replicas)
    add_legend(axes[0, 0])
    save_figure(fig, path)


def plot_overlay(comps, path) -> None:
    """Measured (filled, the op styles of :func:`draw_timeline`, micro-batch numbers on the ops
    wide enough to hold them) under simulated (black outlines) timelines, one panel per schedule,
    all on one x axis from 0 to the last op's end of any panel. ``comps``:
    :class:`calibration.compare.Comparison` per schedule (its measured and simulated traces hold
    the one step compared), titled with both iteration times and the error."""
    save_figure(overlay_figure(comps), path, layout=False)


def overlay_figure(comps):
    """The figure of :func:`plot_overlay`, laid out (returned open; :func:`plot_overlay` saves it)."""
    from matplotlib.lines import Line2D
    panels = [(f"{c.schedule}: measured {c.measured_iteration_time * 1e3:.1f} ms vs simulated "
               f"{c.simulated_iteration_time * 1e3:.1f} ms, error {c.error:+.1%}", c.measured_trace,
               c.simulated_trace) for c in comps]
    ops = [[(tr[tr["kind"].isin(["F", "B", "W"])], tr["start"].min()) for tr in (m, s)] for _, m, s in panels]
    # one x axis for every panel, to the last op's end (communication included) of all of them, in ms
    # since each step's first op
    right = max(float((tr["end"] - tr["start"].min()).max()) for _, m, s in panels for tr in (m, s) if len(tr)) * 1e3
    heights = [0.9 + 0.45 * m["device"].nunique() for _, m, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, sum(heights) + 1.2), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    cmap = plt.get_cmap("tab10")
    labels = []
    for ax, (title, measured, simulated), pair in zip(axes[:, 0], panels, ops):
        devices = sorted(set(measured["device"]) | set(simulated["device"]))
        for (t, t0), filled in zip(pair, (True, False)):
            for row in t.itertuples(index=False):
                y, width, left = devices.index(row.device), (row.end - row.start) * 1e3, (row.start - t0) * 1e3
                if filled:
                    style = dict(KIND_STYLE[row.kind])
                    hatch = style.pop("hatch", None)
                    if getattr(row, "copy", 0) == 1:
                        hatch = (hatch or "") + "//"
                    ax.barh(y, width, left=left, height=0.8, color=cmap(row.microbatch % 10), hatch=hatch,
                            edgecolor="grey", linewidth=0.3, **style)
                    if width > 0:
                        labels.append((ax, left, width, y, str(row.microbatch)))
                else:
                    ax.barh(y, width, left=left, height=0.8, fill=False, edgecolor="black", linewidth=0.7)
        ax.set_title(title, fontsize=9)
        ax.set_yticks(range(len(devices)), [f"rank {r}" for r in devices], fontsize=7)
        ax.set_ylim(len(devices) - 0.5, -0.5)
        ax.set_xlim(0.0, right * 1.01)
    axes[-1, 0].set_xlabel("milliseconds since the step's first op", fontsize=8)
    outline = Line2D([], [], color="black", linewidth=1.0, label="simulated (outline)")
    # the key above every panel, in a band of its own (anchored to an axes it can meet that axes' title)
    handles = op_handles([Patch(facecolor="tab:blue", alpha=0.9, label="measured (filled)"), outline])
    band = 0.5 / fig.get_figheight()
    fig.legend(handles=handles, loc="upper right", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=len(handles),
               frameon=False, title="colour = micro-batch, number on the op = micro-batch", title_fontsize=7)
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 1.0 - band))
    _label_ops(fig, labels)
    return fig


def _label_ops(fig, labels) -> None:
    """Micro-batch numbers on the measured ops, each only where it fits inside its op (so no two
    overlap: a rank's ops do not), with the layout fixed."""
    renderer = fig.canvas.get_renderer()
    for ax, left, width, y, text in labels:
        t = ax.text(left + width / 2, y, text, ha="center", va="center", fontsize=5, clip_on=True)
        x0, x1 = (ax.transData.transform((x, y))[0] for x in (left, left + width))
        if t.get_window_extent(renderer).width + 2.0 > x1 - x0:
            t.remove()


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


def save_figure(fig, path, *, layout: bool = True) -> None:
    """Finish a figure the one way every figure here is finished: tight layout (nothing clipped or
    overlapping; ``layout=False``: the figure was laid out already), written at :data:`DPI` (its
    folder made, atomically), closed (pyplot keeps open figures alive)."""
    if layout:
        fig.tight_layout()
    try:
        with output_file(path, "figure", "wb") as fh:
            fig.savefig(fh, dpi=DPI, format=Path(path).suffix[1:] or None)
    finally:
        plt.close(fig)


def plot_layouts(points, limit: float, chosen, path, *, title: str | None = None) -> None:
    """The whole-layout planner's simulated candidates (``points``: dicts with ``schedule``,
    ``iteration_time`` in seconds, ``memory_need`` in bytes: the worst GPU's peak with the
    transients, what the verdict compares with the usable memory): step time against memory per GPU,
    one colour and marker per schedule family, the usable memory ``limit`` as a vertical line and
    the ``chosen`` record ringed."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    fams = sorted({p["schedule"] for p in points})
    for i, fam in enumerate(fams):
        mine = [p for p in points if p["schedule"] == fam]
        ax.scatter([p["memory_need"] / 2**30 for p in mine], [p["iteration_time"] for p in mine], s=18,
                   marker=SERIES_MARKERS[i % len(SERIES_MARKERS)], color=plt.cm.tab10(i % 10), alpha=0.8,
                   label=fam)
    ax.axvline(limit / 2**30, color="black", linestyle="--", linewidth=1, label="usable memory per GPU")
    ax.scatter([chosen["memory_need"] / 2**30], [chosen["iteration_time"]], s=160, facecolors="none",
               edgecolors="red", linewidths=2, label="chosen", zorder=5)
    ax.set_xlabel("memory per GPU (GiB; peak + transients)")
    ax.set_ylabel("simulated step time (s)")
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_figure(fig, path)
