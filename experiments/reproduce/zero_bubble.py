"""Reproduce the Zero Bubble paper's GPU runs (Qi et al., ICLR 2024, section 5) in simulation.

Every row of Table 4 (4 models x 3 micro-batch counts x 1F1B, 1F1B-I with one layer per chunk,
ZB-1p, ZB-2p; pure pipeline parallelism, GPUs = stages) and Table 6's ZB-V rows (with their 1F1B),
each costed twice (``source``):

* ``profiled``: Table 9's profiled per-stage F, B, W and message times, written as a
  ``--stage-costs`` file (``DIR/stage-costs/``) and simulated through that path. Table 6's
  configurations (other depths and micro-batches) have no profile: their times are Table 9's for
  the same model at its first micro-batch count, scaled by layers per stage and micro-batch size
  (the message by the micro-batch size). Memory: the file has no weights, so none is predicted.
* ``kernels``: the model's dimensions alone (Table 3, sequence 1024, GPT-2's vocabulary of 50,257;
  fp16 activations and weights) through the kernel cost model on the ``a100`` preset
  (``dgx-a100-4x8-ib``, ranks in order, one per GPU); the embedding and the loss head count as a
  layer each, so the first and last stages hold one transformer layer fewer, as in the paper.

Iteration time and bubble are the paper's: the cost of an iteration is the longest time any
stage takes from its own first op to its own last (the stages' starts are staggered and the next
iteration overlaps them, since the paper validates the optimizer step after the fact instead of
synchronising), ``bubble = 1 - mean busy (F, B, W) / that cost`` (Table 5's
``(cost - m (T_F + T_B + T_W)) / cost``). The optimizer step (kernels: the model's own; profiled:
none) ends the span.

Fitted: one number per model and source, a factor on the simulated iteration time (what a run
adds to its profiled ops: launches, synchronisation, the optimizer for the profiled times),
fitted on Table 4's 1F1B column of that model (its three micro-batch counts, the mean of
measured / simulated). Everything else is a prediction: the other three schedules, Table 6's rows
(its 1F1B too), the bubbles and the memory. Throughput is samples per GPU per second,
``N * micro_batch / (iteration time * GPUs)``.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pandas as pd

from cost_models import Job, Layout
from cost_models.model_spec import ModelSpec
from sim import simulate_job

from ..progress import phase
from ..tables import markdown

MEASUREMENTS = "presets/measurements/zero-bubble/zero-bubble.csv"
CLUSTER = "dgx-a100-4x8-ib"
VOCAB = 50257
SEQ = 1024
COLUMNS = ["table", "model", "gpus", "micro_batch", "microbatches", "schedule", "source", "predicted_samples_per_gpu_s",
           "measured_samples_per_gpu_s", "error", "predicted_bubble", "paper_bubble", "predicted_memory_gb",
           "measured_memory_gb"]
AIMS = {"bubble": 0.01, "profiled": 0.05, "kernels": 0.10, "memory": 0.10}
FIT_SCHEDULE = "1F1B"

# label -> (family, variant, Table 4's throughput column, its memory column, Table 5's bubble column)
SCHEDULES = {"1F1B": ("dapple", None, "1f1b", "mem_1f1b_gb", "bubble_1f1b"),
             "1F1B-I": ("interleaved", None, "1f1b_i", "mem_1f1b_i_gb", "bubble_1f1b_i"),
             "ZB-1p": ("zb-auto", "1p", "zb1p", "mem_zb1p_gb", "bubble_zbh1"),
             "ZB-2p": ("zb-auto", "2p", "zb2p", "mem_zb2p_gb", "bubble_zb2p"),
             "ZB-V": ("zb-v", None, None, None, None)}

# Table 6: model -> (GPUs, micro-batch, the three m, ZB-V and 1F1B samples/GPU/s)
TABLE6 = {"6.2B": (16, 6, (48, 64, 128), (4.15, 4.21, 4.35), (3.38, 3.57, 3.91)),
          "14.6B": (24, 2, (72, 96, 192), (1.85, 1.88, 1.93), (1.52, 1.61, 1.76)),
          "28.3B": (32, 2, (96, 128, 256), (1.01, 1.02, 1.06), (0.82, 0.87, 0.95))}


@dataclass(frozen=True)
class Config:
    """One measured configuration: ``model`` (Table 3's dimensions) on ``gpus`` stages, ``N``
    micro-batches of ``micro_batch``; ``profile``: (f, b, w, message) seconds per stage;
    ``measured``: schedule label -> (samples/GPU/s, peak GB or None, Table 5's bubble or None)."""

    model: str
    layers: int
    heads: int
    hidden: int
    gpus: int
    micro_batch: int
    N: int
    profile: tuple[float, float, float, float]
    measured: dict
    table: int = 4

    def spec(self) -> ModelSpec:
        return ModelSpec(name=f"zb-{self.model}", layers=self.layers, hidden=self.hidden, heads=self.heads,
                         seq_len=SEQ, vocab=VOCAB, micro_batch=self.micro_batch)

    def chunks(self, schedule: str) -> int:
        """1F1B-I: one layer per chunk (embedding and head counted as layers); others: 2."""
        return (self.layers + 2) // self.gpus if schedule == "1F1B-I" else 2


def load_configs() -> list[Config]:
    """Table 4's twelve configurations and Table 6's nine, with what was measured."""
    with resources.files("cost_models").joinpath(MEASUREMENTS).open() as f:
        rows = list(csv.DictReader(f))
    out, first = [], {}
    for r in rows:
        prof = tuple(float(r[f"T_{k}_ms"]) / 1e3 for k in ("F", "B", "W", "comm"))
        measured = {label: (float(r[tp]), float(r[mem]), float(r[bub]))
                    for label, (_, _, tp, mem, bub) in SCHEDULES.items() if tp}
        c = Config(r["model"], int(r["layers"]), int(r["heads"]), int(r["hidden"]), int(r["pipeline_stages"]),
                   int(r["micro_batch"]), int(r["microbatches"]), prof, measured)
        out.append(c)
        first.setdefault(c.model, c)
    for model, (gpus, mb, ms, zbv, base) in TABLE6.items():
        t4 = first[model]
        per_stage = (t4.layers + 2) / gpus / ((t4.layers + 2) / t4.gpus)
        scale = per_stage * mb / t4.micro_batch
        f, b, w, msg = t4.profile
        prof = (f * scale, b * scale, w * scale, msg * mb / t4.micro_batch)
        for N, v, one in zip(ms, zbv, base):
            out.append(Config(model, t4.layers, t4.heads, t4.hidden, gpus, mb, N, prof,
                              {"ZB-V": (v, None, None), "1F1B": (one, None, None)}, table=6))
    return out


def stage_costs_file(c: Config, folder: Path) -> Path:
    """The configuration's profiled times as a ``--stage-costs`` file (one entry for every stage)."""
    f, b, w, msg = c.profile
    path = folder / f"{c.model}-{c.gpus}gpus-b{c.micro_batch}-m{c.N}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# Zero Bubble (Qi et al. 2024) Table {9 if c.table == 4 else '9, scaled'}: {c.model} on "
                    f"{c.gpus} stages, micro-batch {c.micro_batch}\nstages:\n  - {{f: {f:.6g}, b: {b:.6g}, "
                    f"w: {w:.6g}}}\nmessage: {msg:.6g}\n")
    return path


def simulate(c: Config, label: str, source: str, folder: Path) -> dict:
    """One schedule of one configuration from one source: the paper's iteration cost (s), bubble
    and the peak memory (GB, kernels only)."""
    family, variant = SCHEDULES[label][:2]
    layout = Layout(schedule=family, devices=c.gpus, microbatches=c.N, chunks=c.chunks(label), variant=variant)
    if source == "profiled":
        job = Job(layout=layout, stage_costs=str(stage_costs_file(c, folder)))
    else:
        job = Job(layout=layout, model=c.spec(), cluster=CLUSTER)
    _, res = simulate_job(job, trace=True)
    cost, bubble = paper_cost(res.trace())
    peak = max(p.peak_memory for p in res.metrics().per_device) / 1e9 if source == "kernels" else float("nan")
    return {"cost": cost, "bubble": bubble, "memory": peak}


def paper_cost(trace: pd.DataFrame) -> tuple[float, float]:
    """(iteration cost, bubble) as the module docstring defines them: the longest stage span
    (its F, B, W and optimizer ops), and 1 - mean F/B/W busy time over the longest F/B/W span."""
    comp = trace[trace.kind.isin(["F", "B", "W"])]
    ops = trace[trace.kind.isin(["F", "B", "W", "OPTIM"])]
    by = ops.groupby("device")
    cost = float((by.end.max() - by.start.min()).max())
    cb = comp.groupby("device")
    span = float((cb.end.max() - cb.start.min()).max())
    busy = (comp.end - comp.start).groupby(comp.device).sum()
    return cost, 1.0 - float(busy.mean()) / span


def table(configs: list[Config], folder: Path) -> pd.DataFrame:
    """Every (configuration, schedule, source) row of the CSV, the fitted factor applied."""
    raw = []
    for c in configs:
        for source in ("profiled", "kernels"):
            for label, (tp, mem, bub) in c.measured.items():
                s = simulate(c, label, source, folder)
                raw.append({"c": c, "label": label, "source": source, "tp": tp, "mem": mem, "bub": bub, **s})
    factors = fitted_factors(raw)
    rows = []
    for r in raw:
        c = r["c"]
        pred = c.N * c.micro_batch / (r["cost"] * factors[(c.model, r["source"])] * c.gpus)
        rows.append({"table": c.table, "model": c.model, "gpus": c.gpus, "micro_batch": c.micro_batch,
                     "microbatches": c.N, "schedule": r["label"],
                     "source": r["source"], "predicted_samples_per_gpu_s": pred, "measured_samples_per_gpu_s": r["tp"],
                     "error": pred / r["tp"] - 1, "predicted_bubble": r["bubble"],
                     "paper_bubble": float("nan") if r["bub"] is None else r["bub"],
                     "predicted_memory_gb": r["memory"],
                     "measured_memory_gb": float("nan") if r["mem"] is None else r["mem"]})
    return pd.DataFrame(rows, columns=COLUMNS), factors


def fitted_factors(raw: list[dict]) -> dict:
    """(model, source) -> measured / simulated iteration time, the mean over Table 4's 1F1B rows."""
    acc: dict = {}
    for r in raw:
        c = r["c"]
        if c.table == 4 and r["label"] == FIT_SCHEDULE:
            measured_time = c.N * c.micro_batch / (r["tp"] * c.gpus)
            acc.setdefault((c.model, r["source"]), []).append(measured_time / r["cost"])
    return {k: sum(v) / len(v) for k, v in acc.items()}


def rankings(df: pd.DataFrame) -> pd.DataFrame:
    """Per Table 4 row and source: the schedules fastest first, predicted and measured."""
    out = []
    for (model, N, source), g in df[df.table == 4].groupby(["model", "microbatches", "source"], sort=False):
        pred = " > ".join(g.sort_values("predicted_samples_per_gpu_s", ascending=False).schedule)
        meas = " > ".join(g.sort_values("measured_samples_per_gpu_s", ascending=False).schedule)
        out.append({"model": model, "microbatches": N, "source": source, "predicted": pred, "measured": meas,
                    "same": pred == meas})
    return pd.DataFrame(out)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per source and schedule: the largest |throughput error|, bubble gap to Table 5 and memory error."""
    out = []
    for (source, tab, label), g in df.groupby(["source", "table", "schedule"], sort=False):
        mem = (g.predicted_memory_gb / g.measured_memory_gb - 1).abs()
        out.append({"source": source, "table": tab, "schedule": label, "rows": len(g),
                    "max_abs_error": g.error.abs().max(), "median_abs_error": g.error.abs().median(),
                    "max_bubble_gap": (g.predicted_bubble - g.paper_bubble).abs().max(),
                    "max_memory_error": mem.max()})
    return pd.DataFrame(out)


def headline(df: pd.DataFrame) -> pd.DataFrame:
    """Per schedule: the worst |throughput error| from each source and the worst bubble gap to Table 5."""
    out = []
    for label, g in df.groupby("schedule", sort=False):
        p, k = g[g.source == "profiled"], g[g.source == "kernels"]
        out.append({"schedule": label + (" (fitted)" if label == FIT_SCHEDULE else ""), "rows": len(p),
                    "max_error_profiled": f"{p.error.abs().max():.1%}",
                    "max_error_kernels": f"{k.error.abs().max():.1%}",
                    "max_bubble_gap": (p.predicted_bubble - p.paper_bubble).abs().max()})
    return pd.DataFrame(out)


def plot(df: pd.DataFrame, path: Path) -> None:
    """One panel per model: measured samples/GPU/s beside the two predictions, per (m, schedule)."""
    from ..plots import plt, save_figure
    models = list(dict.fromkeys(df.model))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        sub = df[(df.model == model) & (df.source == "profiled")].reset_index(drop=True)
        ker = df[(df.model == model) & (df.source == "kernels")].reset_index(drop=True)
        x = range(len(sub))
        ax.bar(x, sub.measured_samples_per_gpu_s, 0.6, color="0.75", label="measured (Table 4 / 6)")
        ax.plot(x, sub.predicted_samples_per_gpu_s, "o", label="predicted from Table 9's stage times")
        ax.plot(x, ker.predicted_samples_per_gpu_s, "x", label="predicted from the model (kernels, a100)")
        ax.set_xticks(list(x), [f"{s} {g}g b{b} m{n}" for s, g, b, n in
                                zip(sub.schedule, sub.gpus, sub.micro_batch, sub.microbatches)],
                      rotation=90, fontsize=6)
        ax.set_ylabel("samples / GPU / s")
        ax.set_title(f"{model}")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


def run(out_dir, quick: bool = False) -> str:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    configs = load_configs()
    if quick:      # the 8-GPU models' Table 4 rows (their fit sets whole) and 6.2B's smallest Table 6 row
        configs = [c for c in configs if c.table == 4 and c.gpus == 8] + \
            [c for c in configs if c.table == 6 and c.model == "6.2B"][:1]
    phase(f"zero-bubble: {len(configs)} configurations x schedules x 2 sources")
    df, factors = table(configs, out / "stage-costs")
    df.to_csv(out / "zero-bubble.csv", index=False)
    plot(df, out / "zero-bubble.png")
    rk, sm = rankings(df), summary(df)
    fit = pd.DataFrame([{"model": m, "source": s, "factor": v} for (m, s), v in factors.items()])
    report = "\n".join([
        "# Zero Bubble (Qi et al., ICLR 2024) on A100s, simulated", "",
        "Fitted: one factor per model and source on the simulated iteration time, fitted on Table 4's 1F1B "
        "column of that model (mean of measured / simulated over its three micro-batch counts). Predicted: "
        "everything else (1F1B-I, ZB-1p, ZB-2p, Table 6's ZB-V and 1F1B rows, bubbles, memory). Sources: "
        "`profiled` = Table 9's stage times through `--stage-costs` (Table 6's configurations: scaled from "
        "Table 9 by layers per stage and micro-batch); `kernels` = Table 3's dimensions on the a100 kernel "
        "model (its GEMM and memory efficiencies fitted on Table 9's stage times, `cost_models.stage_time_fit`), "
        "first and last stages one layer shorter. Bubble and iteration cost as the paper defines them "
        "(the longest stage span). Memory: kernels only, GB = 1e9 bytes (the paper's unit unstated).", "",
        markdown(headline(df), floatfmt=".3f"), "",
        "## Fitted factors", "", markdown(fit), "",
        f"## Against the aims (bubble within {AIMS['bubble']} of Table 5; throughput within "
        f"{AIMS['profiled']:.0%} profiled, {AIMS['kernels']:.0%} kernels; memory within {AIMS['memory']:.0%})", "",
        markdown(sm), "", aims_line(df), "",
        "## Rankings (Table 4 rows, fastest first)", "", markdown(rk), "",
        "## Every row (figure: zero-bubble.png)", "", markdown(df, floatfmt=".3g")])
    (out / "report.md").write_text(report + "\n")
    return report


def aims_line(df: pd.DataFrame) -> str:
    """How many cells meet each aim."""
    parts = []
    for source in ("profiled", "kernels"):
        g = df[df.source == source]
        ok = int((g.error.abs() <= AIMS[source]).sum())
        parts.append(f"throughput within {AIMS[source]:.0%} ({source}): {ok} of {len(g)} cells")
    b = df[(df.source == "profiled") & df.paper_bubble.notna()]
    ok = int(((b.predicted_bubble - b.paper_bubble).abs() <= AIMS["bubble"]).sum())
    parts.append(f"bubble within {AIMS['bubble']} of Table 5 (profiled): {ok} of {len(b)}")
    m = df[df.measured_memory_gb.notna() & df.predicted_memory_gb.notna()]
    ok = int(((m.predicted_memory_gb / m.measured_memory_gb - 1).abs() <= AIMS["memory"]).sum())
    parts.append(f"memory within {AIMS['memory']:.0%} (kernels): {ok} of {len(m)}")
    return "; ".join(parts) + "."
