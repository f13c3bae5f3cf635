"""Part 4 of the BitPipe reproduction: throughput on a DGX-A100 cluster with InfiniBand.

For each model (GPT-96, BERT-64) and GPU count G in {8, 16, 32}: a D = 8 pipeline, R = G/8
data-parallel replicas (gradient all-reduce across replicas and, for Chimera / BitPipe, across the
two copies; BitPipe's mapping keeps both copies of a stage on one node), N = 8 (one basic unit) and
N = 16 micro-batches of one sample per replica. Throughput = samples per second = R * N * micro_batch /
simulated iteration time.

Every point is a :class:`cost_models.Job` simulated by :func:`sim.simulate_job`, costed by the FLOP
formulas at the device's fixed efficiency (:data:`COST_MODEL`, ``linear``): the setting the report's
"where they differ" describes. A job on a device with kernel constants (the A100 and V100 presets
have them) would otherwise be costed by the kernel model.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from cost_models import Job, Layout
from cost_models.parallel import Parallel
from schedules.trace import step_metrics
from sim import simulate_job

from ..common import write_csv
from ..tables import markdown

SCHEDULES = ["gpipe", "dapple", "interleaved", "chimera", "bitpipe"]
TWO_COPIES = ("chimera", "bitpipe")     # placed with BitPipe's mapping: both copies of a stage on one node
COST_MODEL = "linear"
PAPER_SPEEDUP = "1.05x - 1.28x over the best of the others (BitPipe paper, GPT-96 and BERT-64, 8-32 GPUs)"


def run_config(model_name: str, G: int, schedule: str, *, D: int = 8, N: int = 8, micro_batch: int = 1,
               cluster: str = "dgx-a100-4x8-ib") -> dict:
    """One simulated configuration."""
    R = G // D
    mapping = "copies-same-node" if schedule in TWO_COPIES else "sequential"
    job = Job(layout=Layout(schedule=schedule, devices=D, microbatches=N, replicas=R), model=model_name,
              parallel=Parallel(micro_batch=micro_batch), cluster=cluster, cost_model=COST_MODEL, device_map=mapping)
    bound, res = simulate_job(job, trace=True)
    m = step_metrics(res.trace())       # the bubble from the ops in the trace, as every table here computes it
    cap = bound.report.get("memory_capacity")
    peak = max(p.peak_memory for p in m.per_device)
    return {"model": model_name, "gpus": G, "D": D, "R": R, "N": N, "micro_batch": micro_batch,
            "schedule": schedule, "mapping": mapping, "iteration_time_s": m.iteration_time,
            "throughput_samples_s": R * N * micro_batch / m.iteration_time, "bubble": m.bubble_ratio,
            "peak_memory_GiB": peak / 2**30, "oom": bool(cap and peak > cap)}


def throughput_table(quick: bool) -> pd.DataFrame:
    models = ["gpt-96"] if quick else ["gpt-96", "bert-64"]
    gpus = [8] if quick else [8, 16, 32]
    Ns = [8] if quick else [8, 16]
    rows = [run_config(m, g, s, N=n) for m in models for g in gpus for n in Ns for s in SCHEDULES]
    return pd.DataFrame(rows)


def speedups(df: pd.DataFrame) -> pd.DataFrame:
    out = []
    for (model, g, n), grp in df.groupby(["model", "gpus", "N"], sort=False):
        ok = grp[~grp.oom]
        bit = ok[ok.schedule == "bitpipe"]
        others = ok[ok.schedule != "bitpipe"]
        if bit.empty or others.empty:
            continue
        best = others.loc[others.throughput_samples_s.idxmax()]
        out.append({"model": model, "gpus": g, "N": n, "bitpipe_samples_s": float(bit.throughput_samples_s.iloc[0]),
                    "best_other": best.schedule, "best_other_samples_s": float(best.throughput_samples_s),
                    "speedup": float(bit.throughput_samples_s.iloc[0] / best.throughput_samples_s)})
    return pd.DataFrame(out)


def plot(df: pd.DataFrame, path: Path) -> None:
    from ..plots import plt, save_figure
    models = list(dict.fromkeys(df.model))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        sub = df[(df.model == model) & (df.N == df.N.min())]
        gpus = sorted(sub.gpus.unique())
        width = 0.8 / len(SCHEDULES)
        for i, s in enumerate(SCHEDULES):
            vals = [float(sub[(sub.gpus == g) & (sub.schedule == s)].throughput_samples_s.iloc[0]) for g in gpus]
            ax.bar([j + i * width for j in range(len(gpus))], vals, width, label=s)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(gpus))], [f"{g} GPUs" for g in gpus])
        ax.set_ylabel("samples / s (simulated)")
        ax.set_title(f"{model} on DGX-A100 + InfiniBand, N = {int(sub.N.min())}")
    axes[0][0].legend(fontsize=8)
    save_figure(fig, path)


def throughput_section(out: Path, quick: bool) -> str:
    df = throughput_table(quick)
    write_csv(df, out / "throughput.csv")
    plot(df, out / "throughput.png")
    sp = speedups(df)
    write_csv(sp, out / "speedup.csv")
    lo, hi = (sp.speedup.min(), sp.speedup.max()) if not sp.empty else (float("nan"), float("nan"))
    return "\n".join([
        "## Throughput (figure: throughput.png)", "",
        "D = 8 pipeline stages, R = GPUs / 8 data-parallel replicas, N micro-batches of one sample per "
        "replica (larger micro-batches run GPT-96 out of memory without recomputation), DGX-A100 nodes "
        "(NVLink inside, 8 x HDR InfiniBand between); Chimera and BitPipe use the "
        "mapping that keeps both copies of a stage on one node.", "",
        markdown(df.drop(columns=["D", "micro_batch"])), "",
        "### BitPipe over the best other schedule", "", markdown(sp), "",
        f"Simulated speed-up: {lo:.2f}x - {hi:.2f}x ({_range(sp, 8)} at N = D, {_range(sp, 16)} at N = 2D). "
        f"Paper: {PAPER_SPEEDUP}.",
        "Where they differ: our costs come from FLOP formulas at a fixed efficiency (no kernel-size effects), "
        "and point-to-point and all-reduce times from pipetwin's link model of the cluster preset."])


def _range(sp: pd.DataFrame, N: int) -> str:
    sub = sp[sp.N == N]
    if sub.empty:
        return "-"
    return f"{sub.speedup.min():.2f}x - {sub.speedup.max():.2f}x"

