"""Reproduce BitPipe (Wu et al., 2024) in simulation.

1. The bubble / activation-memory / weight-memory table at D = N = 4 (unit costs), simulated,
   next to the closed forms the paper tabulates.
2. Scaling of the bubble ratio in D (N = D) and in N (D = 8), with a figure.
3. Throughput of GPipe, DAPPLE, interleaved, Chimera and BitPipe for GPT-96 and BERT-64 on 8, 16
   and 32 GPUs (DGX-A100 nodes, InfiniBand between nodes), with the paper's reported speed-up
   of BitPipe over the best other schedule (1.05x - 1.28x) beside ours.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from cost_models import UnitCostModel
from schedules import ScheduleError, build, lower
from schedules.trace import step_metrics
from sim import simulate

SCHEDULES = ["gpipe", "dapple", "interleaved", "chimera", "bitpipe"]


def closed_form(name: str, D: int, N: int, v: int = 2) -> dict:
    """The paper's closed forms (unit costs F = 1, B = 2): bubble ratio, activation memory range
    [min, max] over devices in Ma, and weight memory per device in Mw."""
    if name in ("gpipe", "dapple"):
        bubble = (D - 1) / (N + D - 1)
    elif name == "interleaved":
        bubble = (D - 1) / (v * N + D - 1)
    elif name == "chimera":
        bubble = (D - 2) / (3 * N / 2 + D - 2)
    else:
        bubble = (D - 2) / (3 * N + D - 2)
    act = {"gpipe": (N, N), "dapple": (min(1, N), min(D, N)),
           "interleaved": (min(N * v, (v - 1) * D + 1) / v, min(N * v, 2 * (D - 1) + (v - 1) * D + 1) / v),
           "chimera": (D / 2 + 1, D), "bitpipe": ((3 * D + 2) / 4, D)}[name]
    weights = 2.0 if name in ("chimera", "bitpipe") else 1.0
    return {"bubble": bubble, "act_min": act[0], "act_max": act[1], "weights": weights}


def simulate_unit(name: str, D: int, N: int):
    low = lower(build(name, D, N))
    return step_metrics(simulate(low, UnitCostModel().bind(low)))


def table_d4(D: int = 4, N: int = 4) -> pd.DataFrame:
    rows = []
    for name in SCHEDULES:
        m = simulate_unit(name, D, N)
        cf = closed_form(name, D, N)
        acts = [p.peak_activation for p in m.per_device]
        rows.append({"schedule": name, "bubble_sim": m.bubble_ratio, "bubble_paper": cf["bubble"],
                     "act_min_sim": min(acts), "act_max_sim": max(acts),
                     "act_min_paper": cf["act_min"], "act_max_paper": cf["act_max"],
                     "weights_sim": max(p.static_memory for p in m.per_device), "weights_paper": cf["weights"]})
    return pd.DataFrame(rows)


def scaling(quick: bool) -> pd.DataFrame:
    rows = []
    Ds = [4, 8] if quick else [4, 8, 16, 32]
    for D in Ds:
        for name in SCHEDULES:
            m = simulate_unit(name, D, D)
            rows.append({"sweep": "D", "D": D, "N": D, "schedule": name, "bubble_sim": m.bubble_ratio,
                         "bubble_paper": closed_form(name, D, D)["bubble"]})
    Ns = [8, 16] if quick else [8, 16, 24, 32, 48, 64]
    for N in Ns:
        for name in SCHEDULES:
            try:
                m = simulate_unit(name, 8, N)
            except ScheduleError:
                continue
            rows.append({"sweep": "N", "D": 8, "N": N, "schedule": name, "bubble_sim": m.bubble_ratio,
                         "bubble_paper": closed_form(name, 8, N)["bubble"] if name not in ("chimera", "bitpipe") or N == 8 else None})
    return pd.DataFrame(rows)


def plot_scaling(df: pd.DataFrame, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, sweep, x in ((axes[0], "D", "D"), (axes[1], "N", "N")):
        sub = df[df.sweep == sweep]
        for name, g in sub.groupby("schedule", sort=False):
            ax.plot(g[x], g.bubble_sim, marker="o", label=name)
        ax.set_xlabel(x if sweep == "D" else "N (D = 8)")
        ax.set_ylabel("bubble ratio (simulated, unit costs)")
        ax.set_title("N = D" if sweep == "D" else "D = 8")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _md(df: pd.DataFrame, floatfmt: str = ".4g") -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in df.itertuples(index=False):
        cells = []
        for v in row:
            if isinstance(v, float):
                cells.append("-" if pd.isna(v) else format(v, floatfmt))
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(out_dir, quick: bool = False) -> str:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t = table_d4()
    t.to_csv(out / "table_d4_n4.csv", index=False)
    sc = scaling(quick)
    sc.to_csv(out / "bubble_scaling.csv", index=False)
    plot_scaling(sc, out / "bubble_scaling.png")
    parts = ["# BitPipe reproduced in simulation", "",
             "## Bubble ratio and memory at D = N = 4 (unit costs: F = 1, B = 2; Ma, Mw per device)", "",
             _md(t), ""]
    mism = t[(t.bubble_sim - t.bubble_paper).abs() > 1e-9]
    parts.append("All simulated bubble ratios equal the closed forms." if mism.empty else
                 "Bubble ratios that differ from the closed form: " + ", ".join(mism.schedule))
    parts += ["", "## Bubble scaling (figure: bubble_scaling.png)", "", _md(sc), "",
              "The closed forms of Chimera and BitPipe hold for one basic unit (N = D); for N > D both "
              "concatenate units and pay a junction bubble per unit, so their simulated ratio at N = K*D "
              "is compared with none. Our BitPipe unit is list-scheduled: it matches the paper's closed "
              "form up to D = 6 and is half a forward-unit longer at D = 8 (30.5 vs 30)."]
    parts += ["", _mapping_section(out)]
    thr = _throughput_section(out, quick)
    if thr:
        parts += ["", thr]
    report = "\n".join(parts)
    (out / "report.md").write_text(report + "\n")
    return report


def _throughput_section(out: Path, quick: bool) -> str:
    """Part 3 needs the transformer cost model and cluster presets (cost_models)."""
    from .bitpipe_throughput import throughput_section
    return throughput_section(out, quick)


def _mapping_section(out: Path) -> str:
    """BitPipe's device mapping and eager gradient sync on a 25 Gb/s Ethernet cluster."""
    from cost_models import TransformerCostModel, load_cluster, load_model
    cl = load_cluster("v100-2x8-25gbe")
    model = load_model("bert-48").replace(micro_batch=4)
    rows = []
    for name in ("chimera", "bitpipe"):
        for mapping in ("sequential", "copies-same-node"):
            for eager in (True, False):
                low = lower(build(name, 16, 16), eager=eager)
                costs = TransformerCostModel(model, cl.device).bind(low)
                tr = simulate(low, costs, cl.place(low, mapping))
                m = step_metrics(tr)
                ar = tr[tr.kind == "ALLREDUCE"]
                rows.append({"schedule": name, "mapping": mapping, "eager_sync": eager,
                             "iteration_time_s": m.iteration_time, "bubble": m.bubble_ratio,
                             "allreduce_time_max_s": float((ar.end - ar.start).max())})
    df = pd.DataFrame(rows)
    df.to_csv(out / "mapping_eager.csv", index=False)
    base = df[(df.schedule == "bitpipe") & (df.mapping == "sequential") & ~df.eager_sync].iteration_time_s.iloc[0]
    best = df[(df.schedule == "bitpipe") & (df.mapping == "copies-same-node") & df.eager_sync].iteration_time_s.iloc[0]
    return "\n".join([
        "## Device mapping and eager gradient sync (BERT-48, D = N = 16 on 2 x 8 V100, 25 Gb/s Ethernet)", "",
        "With the sequential mapping the two copies of stage s sit on devices s and D-1-s, i.e. on different "
        "servers, so each stage's gradient all-reduce crosses Ethernet; BitPipe's mapping keeps both copies on "
        "one server (NVLink). Eager sync starts each all-reduce as soon as the stage's gradients are final.", "",
        _md(df), "",
        f"BitPipe with its mapping and eager sync is {base / best:.2f}x faster than sequential mapping with "
        f"the all-reduces at the end."])
