"""Reproduce the Zero Bubble paper's GPU runs (Qi et al., ICLR 2024, section 5) in simulation.

Every row of Table 4 (4 models x 3 micro-batch counts x 1F1B, 1F1B-I with one layer per chunk,
ZB-1p, ZB-2p; pure pipeline parallelism, GPUs = stages) and Table 6's ZB-V rows (with their 1F1B),
each costed twice (``source``):

* ``profiled``: Table 9's profiled per-stage F, B, W and message times, written as a
  ``--stage-costs`` file (``DIR/stage-costs/``) and simulated through that path, with the
  activation a layer keeps, 34sbh + 5as^2 b bytes, of which W keeps the 32sbh of its weights'
  inputs (``activation_w``, so that ZB-1p and ZB-2p are scheduled under the memory the paper's
  scheduler counts). Throughput is simulated with blocking sends (a send holds its sender for the
  message time, as the measured runs wait on their P2P calls; ``blocking_sends: true``); the bubble
  compared with Table 5 from the same file with posted sends, as the paper's scheduler assumes.
  Table 6's configurations (other depths and micro-batches) have no profile: their times are Table
  9's for the same model at its first micro-batch count, times the kernel model's ratio of a full
  stage's F + B + W between the two configurations (:func:`table6_scale`); the message is a latency
  plus the bytes over a bandwidth, both fitted on Table 9's twelve ``T_comm`` times
  (:func:`message_fit`: a message twice as large does not take twice as long). Memory: the file
  has no weights, so none is predicted.
* ``kernels``: the model's dimensions alone (Table 3, sequence 1024, GPT-2's vocabulary of 50,257;
  fp16 activations and weights) through the kernel cost model on the ``a100`` preset
  (``dgx-a100-4x8-ib``, ranks in order, one per GPU); the embedding and the loss head count as a
  layer each, so the first and last stages hold one transformer layer fewer, as in the paper. ZB-1p
  and ZB-2p are ordered as the paper's runtime orders them: ``zb-auto`` given the median stage's F,
  B, W for every stage and each stage's own activation, W-kept part and limit (:func:`paper_zb_auto`),
  then simulated with each stage's own costs.

Iteration time and bubble are the paper's: the cost of an iteration is the longest time any
stage takes from its own first op to its own last (the stages' starts are staggered and the next
iteration overlaps them, since the paper validates the optimizer step after the fact instead of
synchronising), ``bubble = 1 - mean busy (F, B, W) / that cost`` (Table 5's
``(cost - m (T_F + T_B + T_W)) / cost``). The optimizer step (kernels: the model's own; profiled:
none) ends the span.

Fitted: one number per model and source, a factor on the simulated iteration time (what a run
adds to its profiled ops: launches, synchronisation, the optimizer for the profiled times),
fitted on Table 4's 1F1B column of that model (its three micro-batch counts, the mean of
measured / simulated); the CSV's ``role`` says ``fitted`` for those cells. What the factor adds is
a time per micro-batch that does not grow with the ops' work: on Table 4's configurations
(f - 1) x (T_F + T_B + T_W) is 2.1 to 3.3 ms for all four models, whose ops take 28 to 79 ms (as a
share: 4.2% and 4.6% for the two models at micro-batch 3 and 6, 7.6% and 8.2% for the two at 1).
Table 6's configurations keep that time while their ops take ``scale`` times as long, so their
factor is ``1 + (f - 1) / scale`` (:func:`transferred_factor`). Everything else is a prediction:
the other three schedules, Table 6's rows (its 1F1B too), the bubbles and the memory.
Throughput is samples per GPU per second, ``N * micro_batch / (iteration time * GPUs)``.

The aims (:func:`aims_line`): bubbles within 0.01 of Table 5; throughput within 5% (profiled) or
10% (kernels) in every cell of Table 4 and Table 6's ZB-V rows (Table 6's 1F1B rows are shown, not
aimed at: the paper gives them as its baseline); the schedules ranked as measured in every row of
Table 4; peak memory within 10%.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from dataclasses import replace as dc_replace
from importlib import resources
from pathlib import Path

import pandas as pd

from cost_models import Job, Layout, bind
from cost_models.bind import bind_lowered, costed_family, load_inputs
from cost_models.files import write_output
from cost_models.model_spec import ModelSpec
from sim import simulate_job
from sim.engine import run as sim_run
from sim.job import job_options

from ..common import write_csv
from ..progress import phase
from ..tables import markdown

MEASUREMENTS = "presets/measurements/zero-bubble/zero-bubble.csv"
CLUSTER = "dgx-a100-4x8-ib"
VOCAB = 50257
SEQ = 1024
COLUMNS = ["table", "model", "gpus", "micro_batch", "microbatches", "schedule", "source", "role",
           "predicted_samples_per_gpu_s",
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
    scale: float = 1.0          # Table 6: the kernel model's stage-time ratio applied to Table 9's times

    def spec(self) -> ModelSpec:
        return ModelSpec(name=f"zb-{self.model}", layers=self.layers, hidden=self.hidden, heads=self.heads,
                         seq_len=SEQ, vocab=VOCAB, micro_batch=self.micro_batch)

    def message_bytes(self) -> float:
        """Bytes of one stage-to-stage message: one micro-batch's fp16 activation, ``b s h`` x 2."""
        return 2.0 * self.micro_batch * SEQ * self.hidden

    def layers_per_stage(self) -> int:
        """Layers of a full (middle) stage, the embedding and the head counted as layers."""
        return (self.layers + 2) // self.gpus

    def activation(self) -> tuple[float, float]:
        """(bytes a full stage keeps per micro-batch from F, of which W keeps): the paper's
        34sbh + 5as^2 b per layer (fp16, no recompute) and the 32sbh of the weights' inputs."""
        s, b, h, a, n = SEQ, self.micro_batch, self.hidden, self.heads, self.layers_per_stage()
        return n * (34 * s * b * h + 5 * a * s * s * b), n * 32 * s * b * h

    def chunks(self, schedule: str) -> int:
        """1F1B-I: one layer per chunk (embedding and head counted as layers); others: 2."""
        return self.layers_per_stage() if schedule == "1F1B-I" else 2


def load_configs() -> list[Config]:
    """Table 4's twelve configurations and Table 6's nine, with what was measured."""
    with resources.files("cost_models").joinpath(MEASUREMENTS).open() as f:
        rows = list(csv.DictReader(f))
    out, first = [], {}
    latency, bandwidth = message_fit(rows)
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
        like = Config(model, t4.layers, t4.heads, t4.hidden, gpus, mb, ms[0], t4.profile, {}, table=6)
        scale = table6_scale(t4, like)
        f, b, w, _ = t4.profile
        prof = (f * scale, b * scale, w * scale, latency + like.message_bytes() / bandwidth)
        for N, v, one in zip(ms, zbv, base):
            out.append(Config(model, t4.layers, t4.heads, t4.hidden, gpus, mb, N, prof,
                              {"ZB-V": (v, None, None), "1F1B": (one, None, None)}, table=6, scale=scale))
    return out


def kernel_stage_time(c: Config) -> float:
    """F + B + W of a full (middle) stage of ``c`` on the kernel cost model (a100 preset), seconds."""
    job = Job(layout=Layout(schedule="zb-h1", devices=c.gpus, microbatches=1), model=c.spec(), cluster=CLUSTER)
    costs = bind(job).costs
    mid = c.gpus // 2
    return costs.f[0][mid] + costs.b[0][mid] + costs.w[0][mid]


def message_fit(rows: list[dict]) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of ``T_comm = latency + bytes / bandwidth``, least squares over Table
    9's rows (bytes: one fp16 activation, ``b s h`` x 2): 0.24 ms and 72 GB/s, rms error 7% over the
    rows (max 17%), where the best time proportional to the bytes has 23% (max 33%)."""
    xs = [2.0 * int(r["micro_batch"]) * SEQ * int(r["hidden"]) for r in rows]
    ys = [float(r["T_comm_ms"]) / 1e3 for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, 1.0 / slope


def transferred_factor(factor: float, c: Config) -> float:
    """The fitted factor of ``c``'s model applied to ``c``: itself on Table 4's configurations; on Table
    6's, whose ops take ``c.scale`` times as long, the same added time per micro-batch (module
    docstring): ``1 + (factor - 1) / c.scale``."""
    return factor if c.table == 4 else 1.0 + (factor - 1.0) / c.scale


def table6_scale(profiled: Config, target: Config) -> float:
    """How much longer a full stage of ``target`` runs than one of the ``profiled`` configuration (other
    layers per stage and micro-batch), by the kernel model: a ratio, so the profile's absolute times
    stay the measured ones."""
    return kernel_stage_time(target) / kernel_stage_time(profiled)


def stage_costs_file(c: Config, folder: Path, blocking: bool = True) -> Path:
    """The configuration's profiled times as a ``--stage-costs`` file (one entry for every stage),
    with blocking sends (throughput) or posted ones (``-posted``, the bubble)."""
    f, b, w, msg = c.profile
    act, act_w = c.activation()
    path = folder / f"{c.model}-{c.gpus}gpus-b{c.micro_batch}-m{c.N}{'' if blocking else '-posted'}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    src = "Table 9" if c.table == 4 else (f"Table 9 x {c.scale:.4g} (the kernel model's stage-time ratio), "
                                          f"message latency + bytes / bandwidth fitted on Table 9")
    write_output(path, f"# Zero Bubble (Qi et al. 2024) {src}: {c.model} on {c.gpus} stages, micro-batch "
                 f"{c.micro_batch}; activation 34sbh + 5as^2b per layer, W keeps 32sbh\nstages:\n"
                 f"  - {{f: {f:.6g}, b: {b:.6g}, w: {w:.6g}}}\nmessage: {msg:.6g}\nactivation: {act:.6g}\n"
                 f"activation_w: {act_w:.6g}\nblocking_sends: {'true' if blocking else 'false'}\n",
                 "stage-costs file")
    return path


def simulate(c: Config, label: str, source: str, folder: Path) -> dict:
    """One schedule of one configuration from one source: the paper's iteration cost (s), bubble
    (profiled: from posted sends, as Table 5) and the peak memory (GB, kernels only)."""
    family, variant = SCHEDULES[label][:2]
    layout = Layout(schedule=family, devices=c.gpus, microbatches=c.N, chunks=c.chunks(label), variant=variant)
    if source == "profiled":
        job = Job(layout=layout, stage_costs=str(stage_costs_file(c, folder)))
        res = simulate_job(job, trace=True).result
    else:
        job = Job(layout=layout, model=c.spec(), cluster=CLUSTER)
        res = paper_zb_auto(job) if family == "zb-auto" else simulate_job(job, trace=True).result
    cost, bubble = paper_cost(res.trace())
    if source == "profiled":
        posted = Job(layout=layout, stage_costs=str(stage_costs_file(c, folder, blocking=False)))
        bubble = paper_cost(simulate_job(posted, trace=True).result.trace())[1]
    peak = max(p.peak_memory for p in res.metrics().per_device) / 1e9 if source == "kernels" else float("nan")
    return {"cost": cost, "bubble": bubble, "memory": peak}


def paper_zb_auto(job: Job):
    """Simulate a zb-auto ``job`` whose order is built, as the paper's runtime builds it, from the median
    stage's F, B and W for every stage and each stage's own memory (its activation, the part W keeps
    and its limit: the runtime estimates each rank's memory from that rank's own profile, and the last
    stage's W keeps the loss head's logits); the simulation then runs each stage's own costs. Returns
    the traced :class:`sim.SimResult`."""
    inputs = load_inputs(job)
    c = costed_family(job, inputs)["costs"]

    def median(t):
        return (sorted(t)[len(t) // 2],) * len(t)
    uniform = dc_replace(c, f=median(c.f), b=median(c.b), w=median(c.w))
    bound = bind_lowered(job, inputs, job.build(family={"costs": uniform}, **inputs.limits()))
    return sim_run(bound.lowered, bound.costs, bound.network, job_options(job, bound), trace=True)


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
        pred = c.N * c.micro_batch / (r["cost"] * transferred_factor(factors[(c.model, r["source"])], c) * c.gpus)
        rows.append({"table": c.table, "model": c.model, "gpus": c.gpus, "micro_batch": c.micro_batch,
                     "microbatches": c.N, "schedule": r["label"],
                     "source": r["source"], "role": role(c, r["label"]), "predicted_samples_per_gpu_s": pred,
                     "measured_samples_per_gpu_s": r["tp"],
                     "error": pred / r["tp"] - 1, "predicted_bubble": r["bubble"],
                     "paper_bubble": float("nan") if r["bub"] is None else r["bub"],
                     "predicted_memory_gb": r["memory"],
                     "measured_memory_gb": float("nan") if r["mem"] is None else r["mem"]})
    return pd.DataFrame(rows, columns=COLUMNS), factors


def role(c: Config, label: str) -> str:
    """``fitted`` for the cells the factor was fitted on (Table 4's 1F1B column), else ``predicted``."""
    return "fitted" if c.table == 4 and label == FIT_SCHEDULE else "predicted"


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
    """Per schedule and table: the worst |throughput error| from each source and the worst bubble gap to
    Table 5 (Table 4's 1F1B is the fitted column; Table 6's 1F1B rows, the paper's baseline there, are
    predicted but outside the aims)."""
    out = []
    for (tab, label), g in df.groupby(["table", "schedule"], sort=False):
        p, k = g[g.source == "profiled"], g[g.source == "kernels"]
        if tab == 4:
            name = label + (" (fitted)" if label == FIT_SCHEDULE else "")
        else:
            name = f"{label}, Table 6" + ("" if label == "ZB-V" else " (not aimed)")
        out.append({"schedule": name, "rows": len(p),
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
    write_csv(df, out / "zero-bubble.csv")
    plot(df, out / "zero-bubble.png")
    rk, sm = rankings(df), summary(df)
    fit = pd.DataFrame([{"model": m, "source": s, "factor": v} for (m, s), v in factors.items()])
    scales = {c.model: c.scale for c in configs if c.table == 6}
    report = "\n".join([
        "# Zero Bubble (Qi et al., ICLR 2024) on A100s, simulated", "",
        "Fitted: one factor per model and source on the simulated iteration time, fitted on Table 4's 1F1B "
        "column of that model (mean of measured / simulated over its three micro-batch counts; `role` = fitted "
        "in the CSV); on Table 6's configurations it adds the same time per micro-batch, 1 + (factor - 1) / "
        "stage-time ratio. Predicted: everything else (1F1B-I, ZB-1p, ZB-2p, Table 6's ZB-V and 1F1B rows, bubbles, "
        "memory). Sources: `profiled` = Table 9's stage times through `--stage-costs`, activation 34sbh + "
        "5as^2b per layer of which W keeps 32sbh, throughput with blocking sends and the bubble with posted "
        "ones as the paper's scheduler assumes (Table 6's configurations: Table 9's times times the kernel "
        "model's stage-time ratio, " + ", ".join(f"{m} {x:.3f}" for m, x in scales.items()) + ", the message "
        "a latency plus bytes over a bandwidth fitted on Table 9's message times); `kernels` = "
        "Table 3's dimensions on the a100 kernel model (its GEMM and memory efficiencies fitted on Table 9's "
        "stage times, `cost_models.stage_time_fit`), first and last stages one layer shorter. Bubble and "
        "iteration cost as the paper defines them (the longest stage span). Memory: kernels only, GB = 1e9 "
        "bytes (the paper's unit unstated).", "",
        markdown(headline(df), floatfmt=".3f"), "",
        "## Fitted factors", "", markdown(fit), "",
        f"## Against the aims (bubble within {AIMS['bubble']} of Table 5; throughput within "
        f"{AIMS['profiled']:.0%} profiled, {AIMS['kernels']:.0%} kernels; memory within {AIMS['memory']:.0%})", "",
        markdown(sm), "", aims_line(df), "",
        "## Rankings (Table 4 rows, fastest first)", "", markdown(rk), "",
        "## Every row (figure: zero-bubble.png)", "", markdown(df, floatfmt=".3g")])
    write_output(out / "report.md", report + "\n", "report")
    return report


def aimed(df: pd.DataFrame) -> pd.DataFrame:
    """The cells the throughput aims cover: every Table 4 cell and Table 6's ZB-V rows."""
    return df[(df.table == 4) | (df.schedule == "ZB-V")]


def aims_line(df: pd.DataFrame) -> str:
    """How many cells meet each aim."""
    parts = []
    for source in ("profiled", "kernels"):
        g = aimed(df[df.source == source])
        ok = int((g.error.abs() <= AIMS[source]).sum())
        parts.append(f"throughput within {AIMS[source]:.0%} ({source}; Table 4, Table 6's ZB-V): {ok} of "
                     f"{len(g)} cells")
    b = df[(df.source == "profiled") & df.paper_bubble.notna()]
    ok = int(((b.predicted_bubble - b.paper_bubble).abs() <= AIMS["bubble"]).sum())
    parts.append(f"bubble within {AIMS['bubble']} of Table 5 (profiled): {ok} of {len(b)}")
    m = df[df.measured_memory_gb.notna() & df.predicted_memory_gb.notna()]
    ok = int(((m.predicted_memory_gb / m.measured_memory_gb - 1).abs() <= AIMS["memory"]).sum())
    parts.append(f"memory within {AIMS['memory']:.0%} (kernels): {ok} of {len(m)}")
    rk = rankings(df)
    for source in ("profiled", "kernels"):
        g = rk[rk.source == source]
        parts.append(f"ranked as measured ({source}): {int(g.same.sum())} of {len(g)} rows")
    return "; ".join(parts) + "."
