"""Reproduce BitPipe (Wu et al., 2024) in simulation.

1. The bubble / activation-memory / weight-memory table at D = N = 4 (unit costs), simulated,
   next to the closed forms the paper tabulates.
2. Scaling of the bubble ratio in D (N = D) and in N (D = 8), with a figure, next to the closed
   form of each order (the papers give Chimera's and BitPipe's for N = D; for N = K*D the released
   orders' own, see schedules/bitpipe.py and schedules/chimera.py).
3. BitPipe's device mapping (both copies of a stage on one server) and eager gradient sync, each
   on and off, for BERT-48 at D = N = 16 on two V100 servers joined by 25 Gb/s Ethernet.
4. Throughput of GPipe, DAPPLE, interleaved, Chimera and BitPipe for GPT-96 and BERT-64 on 8, 16
   and 32 GPUs (DGX-A100 nodes, InfiniBand between nodes), with the paper's reported speed-up
   of BitPipe over the best other schedule (1.05x - 1.28x) beside ours
   (:mod:`experiments.reproduce.bitpipe_throughput`).

Every point is a :class:`cost_models.Job` simulated by :func:`sim.simulate_job`: unit costs for 1
and 2, the FLOP formulas at the device's fixed efficiency for 3 and 4
(:data:`~experiments.reproduce.bitpipe_throughput.COST_MODEL`).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from cost_models import Job, Layout
from cost_models.parallel import Parallel
from cost_models.files import write_output
from schedules import ScheduleError
from schedules.trace import step_metrics
from sim import simulate_job

from ..common import write_csv
from ..progress import phase
from ..tables import markdown
from .bitpipe_throughput import COST_MODEL, throughput_section

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


def order_closed_form(name: str, D: int, N: int) -> float:
    """Bubble ratio (unit costs) of the order pipetwin builds: the paper's closed form, and for
    Chimera and BitPipe at N = K*D the released orders' (each junction costs half a unit's fill and
    drain), which is the paper's at N = D."""
    K = N / D
    if name == "chimera":
        return (K + 1) * (D - 2) / (3 * N + (K + 1) * (D - 2))
    if name == "bitpipe":
        return (K + 1) * (D - 2) / (6 * N + (K + 1) * (D - 2))
    return closed_form(name, D, N)["bubble"]


def simulate_unit(name: str, D: int, N: int):
    """Metrics of ``name`` on D devices with N micro-batches under unit costs (F = 1, B = 2, no
    communication): the setting of the closed forms."""
    job = Job(layout=Layout(schedule=name, devices=D, microbatches=N), unit_costs=True)
    return simulate_job(job).result.metrics()


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
                         "bubble_paper": closed_form(name, D, D)["bubble"],
                         "bubble_closed_form": order_closed_form(name, D, D)})
    Ns = [8, 16] if quick else [8, 16, 24, 32, 48, 64]
    for N in Ns:
        for name in SCHEDULES:
            try:
                m = simulate_unit(name, 8, N)
            except ScheduleError:
                continue
            paper = closed_form(name, 8, N)["bubble"] if name not in ("chimera", "bitpipe") or N == 8 else None
            rows.append({"sweep": "N", "D": 8, "N": N, "schedule": name, "bubble_sim": m.bubble_ratio,
                         "bubble_paper": paper,
                         "bubble_closed_form": order_closed_form(name, 8, N)})
    return pd.DataFrame(rows)


def plot_scaling(df: pd.DataFrame, path: Path) -> None:
    from ..plots import plt, save_figure
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
    save_figure(fig, path)


def run(out_dir, quick: bool = False) -> str:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    phase("bitpipe: bubble and memory at D = N = 4")
    t = table_d4()
    write_csv(t, out / "table_d4_n4.csv")
    phase("bitpipe: bubble scaling over D and N")
    sc = scaling(quick)
    write_csv(sc, out / "bubble_scaling.csv")
    plot_scaling(sc, out / "bubble_scaling.png")
    parts = ["# BitPipe reproduced in simulation", "",
             "## Bubble ratio and memory at D = N = 4 (unit costs: F = 1, B = 2; Ma, Mw per device)", "",
             markdown(t), ""]
    mism = t[(t.bubble_sim - t.bubble_paper).abs() > 1e-9]
    parts.append("All simulated bubble ratios equal the closed forms." if mism.empty else
                 "Bubble ratios that differ from the closed form: " + ", ".join(mism.schedule))
    off = sc[(sc.bubble_sim - sc.bubble_closed_form).abs() > 1e-9]
    parts += ["", "## Bubble scaling (figure: bubble_scaling.png)", "", markdown(sc), "",
              "The papers state Chimera's and BitPipe's closed forms for one basic unit (N = D, column "
              "bubble_paper). Both follow the per-device orders their authors released (BitPipe: wuhouming/BitPipe; "
              "Chimera: Shigangli/Chimera), which for N = K*D concatenate "
              "K units and fill part of each junction with the next unit's first forwards: each junction costs "
              "half a unit's fill and drain, so the ratio falls with K, to (K+1)(D-2)/(6N+(K+1)(D-2)) for "
              "BitPipe and (K+1)(D-2)/(3N+(K+1)(D-2)) for Chimera (column bubble_closed_form, the paper's "
              "at N = D). " + ("Every simulated ratio equals its closed form." if off.empty else
                               "Simulated ratios that differ from the closed form: " +
                               ", ".join(f"{r.schedule} D={r.D} N={r.N}" for r in off.itertuples()))]
    phase("bitpipe: device mapping and eager sync")
    parts += ["", _mapping_section(out)]
    phase("bitpipe: throughput (Table 4 models)")
    parts += ["", throughput_section(out, quick)]
    report = "\n".join(parts)
    write_output(out / "report.md", report + "\n", "report")
    return report


def _mapping_section(out: Path) -> str:
    """Part 3: BitPipe's device mapping and eager gradient sync on a 25 Gb/s Ethernet cluster."""
    rows = []
    for name in ("chimera", "bitpipe"):
        for mapping in ("sequential", "copies-same-node"):
            for eager in (True, False):
                # FLOP formulas at the device's fixed efficiency, as in the throughput part (a V100 has
                # kernel constants, which a job would otherwise be costed with)
                job = Job(layout=Layout(schedule=name, devices=16, microbatches=16), model="bert-48",
                          parallel=Parallel(micro_batch=4), cluster="v100-2x8-25gbe", cost_model=COST_MODEL,
                          device_map=mapping, eager=eager)
                tr = simulate_job(job, trace=True).result.trace()
                m = step_metrics(tr)
                ar = tr[tr.kind == "ALLREDUCE"]
                rows.append({"schedule": name, "mapping": mapping, "eager_sync": eager,
                             "iteration_time_s": m.iteration_time, "bubble": m.bubble_ratio,
                             "allreduce_time_max_s": float((ar.end - ar.start).max())})
    df = pd.DataFrame(rows)
    write_csv(df, out / "mapping_eager.csv")
    base = df[(df.schedule == "bitpipe") & (df.mapping == "sequential") & ~df.eager_sync].iteration_time_s.iloc[0]
    best = df[(df.schedule == "bitpipe") & (df.mapping == "copies-same-node") & df.eager_sync].iteration_time_s.iloc[0]
    return "\n".join([
        "## Device mapping and eager gradient sync (BERT-48, D = N = 16 on 2 x 8 V100, 25 Gb/s Ethernet)", "",
        "With the sequential mapping the two copies of stage s sit on devices s and D-1-s, i.e. on different "
        "servers, so each stage's gradient all-reduce crosses Ethernet; BitPipe's mapping keeps both copies on "
        "one server (NVLink). Eager sync starts each all-reduce as soon as the stage's gradients are final.", "",
        markdown(df), "",
        f"BitPipe with its mapping and eager sync is {base / best:.2f}x faster than sequential mapping with "
        f"the all-reduces at the end."])
