"""Megatron-LM SC'21 Table 1 (Narayanan et al.), predicted from its configurations: held out.

Each row is a GPT model (vocabulary 51,200, sequence 2048, eager attention, dropout, 16-bit
weights and activations, weight gradients accumulated as :func:`grad_accumulation` says) on DGX
A100 80 GB nodes, 8 x 200 Gb/s HDR InfiniBand per node (``dgx-a100-ib`` sized ``NAME:NODES``),
tensor parallel T inside a node, pipeline parallel D, data parallel R, full activation
recomputation, 1F1B (``dapple``) or the interleaved schedule with the row's chunks, the gradient
all-reduce after the pipeline's flush (``eager=False``, as Megatron-LM's training step runs it).
Each is a :class:`cost_models.Job` simulated by :func:`sim.simulate_job`
with the ``a100`` preset's kernel model; TFLOP/s per GPU is the paper's Eq. (3),
F = 96 B s l h^2 (1 + s/6h + V/16lh), over the predicted iteration time and the GPUs. Nothing is
fitted on these rows (``cost_models/presets/measurements/megatron/README.md`` names the source):
the preset's two fitted constants come from Zero Bubble Table 9 alone
(:mod:`cost_models.stage_time_fit`), and the report says so above its table.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import pandas as pd

from cost_models import Job, Layout
from cost_models.parallel import Parallel
from cost_models.model_spec import ModelSpec
from cost_models.stage_time_fit import fit_note, table9_errors
from cost_models.transformer import megatron_flops
from sim import simulate_job

from cost_models.files import write_output

from ..common import write_csv
from ..progress import phase
from ..tables import markdown

SEQ, VOCAB = 2048, 51200
CLUSTER = "dgx-a100-ib"         # 8 A100 80 GB per node on NVSwitch, one 200 Gb/s HDR NIC per GPU
GPUS_PER_NODE = 8
QUICK_ROWS = (0, 1, 2, 3, 5)    # every T, both schedules, up to 1,024 GPUs: well under a second each
COLUMNS = ["params_b", "gpus", "tp", "pp", "dp", "microbatches", "chunks", "schedule", "grad_accumulation",
           "iteration_s", "simulated_replicas", "sim_wall_s", "predicted_tflops_per_gpu", "measured_tflops_per_gpu",
           "error"]


def table(name: str) -> pd.DataFrame:
    """One of the published tables shipped with the package (``measurements/megatron/NAME``)."""
    path = resources.files("cost_models") / "presets" / "measurements" / "megatron" / name
    return pd.read_csv(Path(str(path)))


def gpt(name: str, layers: int, hidden: int, heads: int, micro_batch: int) -> ModelSpec:
    """The measured models: GPT blocks, vocabulary 51,200, sequence 2048, eager attention."""
    return ModelSpec(name=name, kind="gpt", layers=layers, hidden=hidden, heads=heads, seq_len=SEQ, vocab=VOCAB,
                     micro_batch=micro_batch, attention="eager")


def megatron_job(spec: ModelSpec, *, tp: int, pp: int, dp: int, microbatches: int, chunks: int,
                 recompute: str, sequence_parallel: bool = False, grad_accumulation: str = "fused") -> Job:
    """One measured run as a job: 1F1B, or interleaved with ``chunks`` > 1, on T x D x R GPUs."""
    schedule = "interleaved" if chunks > 1 else "dapple"
    layout = Layout(schedule=schedule, devices=pp, microbatches=microbatches, replicas=dp,
                    chunks=chunks if chunks > 1 else 2)
    nodes = -(-(tp * pp * dp) // GPUS_PER_NODE)
    return Job(layout=layout, model=spec, cluster=f"{CLUSTER}:{nodes}", eager=False,
               parallel=Parallel(tp=tp, recompute=recompute, sequence_parallel=sequence_parallel),
               grad_accumulation=grad_accumulation)


def model_flops(global_batch: int, layers: int, hidden: int) -> float:
    """The paper's Eq. (3): FLOPs of one iteration with full recomputation."""
    return megatron_flops(global_batch, SEQ, layers, hidden, VOCAB)


def fit_table() -> pd.DataFrame:
    """The ``a100`` constants' fit set beside the preset's times (:func:`cost_models.stage_time_fit.table9_errors`),
    errors as signed percentages."""
    df = pd.DataFrame(table9_errors())
    for c in [c for c in df.columns if c.startswith("error")]:
        df[c] = df[c].map(percent)
    return df


def error(predicted: float, measured: float) -> float:
    """Relative error of a prediction, signed (positive: predicted above measured)."""
    return predicted / measured - 1


def percent(e: float) -> str:
    return f"{e:+.1%}"


def grad_accumulation(pp: int) -> str:
    """How a Table 1 run accumulated its weight gradients over micro-batches: the launch scripts
    (``examples/sc21``, August 2021) run Megatron-LM from before its gradient-accumulation fusion
    (February 2022) without ``--use-contiguous-buffers-in-ddp`` or
    ``--accumulate-allreduce-grads-in-fp32``, so with either DDP (``local`` where pp > 1, ``torch``
    where pp = 1) autograd adds each micro-batch's 16-bit weight gradients into ``.grad``
    (``autograd``; charged to every micro-batch, the first too: at most 1/m of the step's
    accumulation, nothing beside its compute for the pp = 1 rows of one micro-batch)."""
    return "autograd"


def predict_row(r) -> dict:
    import time
    spec = gpt(f"gpt-{r.params_b:g}b", int(r.layers), int(r.hidden), int(r.heads), int(r.micro_batch))
    job = megatron_job(spec, tp=int(r.tp), pp=int(r.pp), dp=int(r.dp), microbatches=int(r.microbatches),
                       chunks=int(r.virtual_stages), recompute=str(r.recompute),
                       grad_accumulation=grad_accumulation(int(r.pp)))
    t0 = time.perf_counter()
    _, res = simulate_job(job)
    wall = time.perf_counter() - t0
    it = res.iteration_time
    tflops = model_flops(int(r.global_batch), int(r.layers), int(r.hidden)) / it / int(r.gpus) / 1e12
    return {"params_b": float(r.params_b), "gpus": int(r.gpus), "tp": int(r.tp), "pp": int(r.pp), "dp": int(r.dp),
            "microbatches": int(r.microbatches), "chunks": int(r.virtual_stages), "schedule": job.layout.schedule,
            "grad_accumulation": job.grad_accumulation,
            "iteration_s": it, "simulated_replicas": res.simulated_replicas, "sim_wall_s": wall,
            "predicted_tflops_per_gpu": tflops, "measured_tflops_per_gpu": float(r.tflops_per_gpu),
            "error": error(tflops, float(r.tflops_per_gpu))}


def predictions(quick: bool) -> pd.DataFrame:
    rows = table("megatron-sc21-table1.csv")
    if quick:
        rows = rows.iloc[list(QUICK_ROWS)]
    out = []
    for _, r in rows.iterrows():
        phase(f"megatron: {r.params_b:g}B on {int(r.gpus)} GPUs")
        out.append(predict_row(r))
    return pd.DataFrame(out, columns=COLUMNS)


def plot(df: pd.DataFrame, path: Path) -> None:
    from ..plots import plt, save_figure
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(df.gpus, df.measured_tflops_per_gpu, "o-", label="measured (SC'21 Table 1)")
    ax.plot(df.gpus, df.predicted_tflops_per_gpu, "s--", label="predicted (held out)")
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("TFLOP/s per GPU")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def summary(df: pd.DataFrame, col: str = "error") -> str:
    e = df[col].abs()
    within = int((e <= 0.10).sum())
    return f"absolute error: median {e.median():.1%}, max {e.max():.1%}; {within} of {len(df)} within 10%"


def save(out_dir, name: str, df: pd.DataFrame, draw) -> Path:
    """Write DIR/NAME.csv and the figure ``draw(df, path)`` to DIR/NAME.png, each whole or not at all
    (:func:`cost_models.files.output_file`: a temporary file renamed when complete); return DIR."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(df, out / f"{name}.csv")
    draw(df, out / f"{name}.png")
    return out


def run(out_dir, quick: bool = False) -> str:
    df = predictions(quick)
    out = save(out_dir, "megatron", df, plot)
    shown = df[["params_b", "gpus", "tp", "pp", "dp", "chunks", "grad_accumulation", "iteration_s",
                "predicted_tflops_per_gpu", "measured_tflops_per_gpu", "error"]].rename(columns={
                    "predicted_tflops_per_gpu": "TFLOP/s predicted", "measured_tflops_per_gpu": "measured"})
    shown["error"] = shown.error.map(percent)
    shown.insert(0, "row", "held out")
    report = "\n".join([
        "# Megatron-LM SC'21 Table 1, predicted (held out: nothing fitted on it)", "",
        "TFLOP/s per GPU by the paper's Eq. (3) over the simulated iteration time; DGX A100 80 GB nodes "
        f"({CLUSTER}:NODES), full recomputation, the `a100` preset's kernel model (figure: megatron.png).", "",
        fit_note(), "",
        markdown(shown, floatfmt=".4g"), "",
        summary(df) + ".",
        f"Slowest row to simulate: {df.sim_wall_s.max():.1f} s (simulated replicas: "
        f"{', '.join(str(int(x)) for x in df.simulated_replicas)}).", "",
        "## The fit set (in sample): Zero Bubble Table 9, one middle stage, ms", "",
        markdown(fit_table(), floatfmt=".3g")])
    write_output(out / "report.md", report + "\n", "report")
    return report
