"""Megatron-LM SC'21 Table 1 (Narayanan et al.), predicted from its configurations: held out.

Each row is a GPT model (vocabulary 51,200, sequence 2048, eager attention, dropout, 16-bit
weights and activations: ``--precision fp16`` as the runs' ``--fp16``, at the A100's 312 TFLOP/s
like bf16) on DGX A100 80 GB nodes, 8 x 200 Gb/s HDR InfiniBand per node (``dgx-a100-ib`` sized
``NAME:NODES``), tensor parallel T inside a node, pipeline parallel D,
data parallel R, full activation recomputation, 1F1B (``dapple``) or the interleaved schedule with
the row's chunks, the gradient all-reduce after the pipeline's flush (``--no-eager``, as
Megatron-LM's training step runs it), with the ``a100`` preset's kernel model. Every row is the
job ``pipetwin simulate`` builds from options a user can give (:func:`simulate_argv`, parsed by
the command's own parser and :func:`experiments.jobs.job_from_args`; the model a YAML file written
beside the report), e.g. the 76.1B row::

    pipetwin simulate -s interleaved -D 4 -N 28 --chunks 3 --dp 32 --tp 8 -m gpt-76.1b.yaml \\
        -c dgx-a100-ib:128 --cost-model kernels --precision fp16 --recompute full --no-eager \\
        --grad-accumulation autograd --p2p-scatter-gather

TFLOP/s per GPU is the paper's Eq. (3), F = 96 B s l h^2 (1 + s/6h + V/16lh), over the predicted
iteration time and the GPUs. Nothing is fitted on these rows
(``cost_models/presets/measurements/megatron/README.md`` names the source): the preset's two fitted
constants come from Zero Bubble Table 9 alone (:mod:`cost_models.stage_time_fit`), and the report
says so above its table.

What Megatron-LM of August 2021 (the code ``examples/sc21`` runs: ``--fp16``, ``--DDP-impl local``
from 39B up, ``torch`` below, no ``--use-contiguous-buffers-in-ddp``) did that pipetwin's defaults
do not, and how each is modelled (issue 44 item 4; mechanisms, no constant tuned on this table):

1. **Gradient accumulation through autograd** (``--grad-accumulation autograd``): before the
   gradient-accumulation fusion (2022) each micro-batch's 16-bit weight gradients were written and
   then added into the parameter's 16-bit ``.grad`` (3 x 2 bytes per parameter and micro-batch at
   memory bandwidth, :data:`cost_models.kernels.GRAD_ACCUMULATION`). The largest effect: with the
   default ``fused`` the interleaved rows come out 7-13 % fast (76.1B +12.6 %, 310B +11.0 %,
   529.6B +12.2 %) and the 1T row +6.7 %; with ``autograd`` at most +9.9 %. It was the
   reproduction's setting already; the command line could not set it, and now can.
2. **Scatter-gather of the pipeline messages** (``--p2p-scatter-gather``): with T = 8 each GPU
   sends 1/8 of the boundary tensor over its own NIC (pipetwin's model already), and the receiver
   then all-gathers the 8 pieces over NVLink on its compute stream before the chunk runs
   (``mpu.gather_split_1d_tensor`` after ``torch.cuda.synchronize()``): one all-gather of bsh d per
   received message, v times more messages with v chunks. Priced as each RECV's time
   (:meth:`cost_models.transformer.TransformerCostModel.p2p_gather_time`): 0.1 to 0.8 points off
   the pipelined rows' errors (76.1B +9.9 % -> +9.6 %, 529.6B +6.4 % -> +5.6 %).
3. **Blocking, combined P2P** (``batch_isend_irecv`` + ``wait`` + ``torch.cuda.synchronize()``; in
   the interleaved steady state a chunk's forward output is sent only after the next backward, in
   one call with the gradient): the coupling is not modelled, on evidence. An event model of the
   2021 program with rendezvous sends (:mod:`experiments.reproduce.megatron_p2p`: every send
   completes only when its receiver posts the receive;
   ``forward_backward_pipelining_with_interleaving`` re-implemented op for op at unit costs, B = 3F
   with recomputation) gives the same makespan as receive-only blocking and exactly
   the ideal bubble (D-1)/v (F + B) for the interleaved rows' (D, v, N) = (4, 3, 28), (8, 2, 48),
   (16, 2, 144), (35, 3, 280): the warm-up's extra 2(D-1-d) forwards absorb the deferred sends, so
   neither the warm-up nor the coupling adds a bubble. What remains is the sender's hold for its
   own transfer (a 1/8 message of 64-105 MB at 25 GB/s, about 2vN times per step): charged as a
   SEND's time it takes 0.3-1.2 points off the interleaved rows, but it depends on where the peer
   sits, which the cost model does not know (the simulator's SEND is an isend), so it is not
   priced.

With 1 and 2 every row is within 10 % (max +9.6 %, the 76.1B row). What is left on the
interleaved rows (+4.5-9.6 %) is not explained by the pipeline's mechanics above. Candidates: the
tensor-parallel all-reduces, priced at NVLink's line rate (300 GB/s, a ring of 2(T-1)/T S / B)
while NCCL's ring on an 8-GPU NVSwitch reaches a lower bus bandwidth; and the un-bucketed,
un-overlapped gradient all-reduce of ``LocalDDP`` (one flattened buffer per model chunk after the
flush: a copy in and out at memory bandwidth besides the ring). Neither has a measured constant in
this project, so neither is priced. As a sensitivity only (a cluster file with ``collective:
{bandwidth: 200 GB/s}``, not a fit), the T = 8 rows move 2-3 points slower, their 1F1B ones to
within 1.1 % but the 76.1B row only to +7.4 %: its gap is not the all-reduce's bandwidth.
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
           "p2p_scatter_gather", "iteration_s", "simulated_replicas", "sim_wall_s", "predicted_tflops_per_gpu",
           "measured_tflops_per_gpu", "error"]


def table(name: str) -> pd.DataFrame:
    """One of the published tables shipped with the package (``measurements/megatron/NAME``)."""
    path = resources.files("cost_models") / "presets" / "measurements" / "megatron" / name
    return pd.read_csv(Path(str(path)))


def gpt(name: str, layers: int, hidden: int, heads: int, micro_batch: int) -> ModelSpec:
    """The measured models: GPT blocks, vocabulary 51,200, sequence 2048, eager attention."""
    return ModelSpec(name=name, kind="gpt", layers=layers, hidden=hidden, heads=heads, seq_len=SEQ, vocab=VOCAB,
                     micro_batch=micro_batch, attention="eager")


def megatron_job(spec: ModelSpec, *, tp: int, pp: int, dp: int, microbatches: int, chunks: int,
                 recompute: str, sequence_parallel: bool = False, grad_accumulation: str = "fused",
                 p2p_scatter_gather: bool = False, precision: str | None = None) -> Job:
    """One measured run as a job: 1F1B, or interleaved with ``chunks`` > 1, on T x D x R GPUs."""
    schedule = "interleaved" if chunks > 1 else "dapple"
    layout = Layout(schedule=schedule, devices=pp, microbatches=microbatches, replicas=dp,
                    chunks=chunks if chunks > 1 else 2)
    nodes = -(-(tp * pp * dp) // GPUS_PER_NODE)
    return Job(layout=layout, model=spec, cluster=f"{CLUSTER}:{nodes}", eager=False, cost_model="kernels",
               parallel=Parallel(tp=tp, recompute=recompute, sequence_parallel=sequence_parallel,
                                 p2p_scatter_gather=p2p_scatter_gather, precision=precision),
               grad_accumulation=grad_accumulation)


def row_spec(r) -> ModelSpec:
    """A Table 1 row's model."""
    return gpt(f"gpt-{r.params_b:g}b", int(r.layers), int(r.hidden), int(r.heads), int(r.micro_batch))


def model_file(r, folder) -> Path:
    """The row's model as a YAML file a user passes to ``-m`` (written to ``folder``)."""
    spec = row_spec(r)
    path = Path(folder) / f"{spec.name}.yaml"
    fields = dict(name=spec.name, kind="gpt", layers=spec.layers, hidden=spec.hidden, heads=spec.heads,
                  seq_len=SEQ, vocab=VOCAB, micro_batch=spec.micro_batch, attention="eager", dtype_bytes=2)
    write_output(path, "".join(f"{k}: {v}\n" for k, v in fields.items()), "model file")
    return path


def simulate_argv(r, model_path) -> list[str]:
    """``pipetwin simulate``'s options for a Table 1 row (the module docstring's mechanisms 1 and 2:
    Megatron-LM's 2021 gradient accumulation and, with T > 1 and a pipeline, its scatter-gather)."""
    tp, pp, dp, v = int(r.tp), int(r.pp), int(r.dp), int(r.virtual_stages)
    nodes = -(-(tp * pp * dp) // GPUS_PER_NODE)
    argv = ["simulate", "-s", "interleaved" if v > 1 else "dapple", "-D", str(pp), "-N", str(int(r.microbatches))]
    argv += ["--chunks", str(v)] if v > 1 else []
    argv += ["--dp", str(dp), "--tp", str(tp), "-m", str(model_path), "-c", f"{CLUSTER}:{nodes}",
             "--cost-model", "kernels", "--precision", "fp16", "--recompute", str(r.recompute), "--no-eager",
             "--grad-accumulation", grad_accumulation(pp)]
    return argv + (["--p2p-scatter-gather"] if tp > 1 and pp > 1 else [])


def simulate_job_of(argv: list[str]) -> Job:
    """The job ``pipetwin simulate`` builds from ``argv`` (its parser, then what its main does)."""
    from ..cli import build_parser
    from ..jobs import check_plan_args, job_from_args
    args = build_parser().parse_args(argv)
    return job_from_args(args, plan=check_plan_args(args))


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


def predict_row(r, folder) -> dict:
    """Simulate a row as ``pipetwin simulate`` runs it (:func:`simulate_argv`; its model file in ``folder``)."""
    import time
    job = simulate_job_of(simulate_argv(r, model_file(r, folder)))
    t0 = time.perf_counter()
    _, res = simulate_job(job)
    wall = time.perf_counter() - t0
    it = res.iteration_time
    tflops = model_flops(int(r.global_batch), int(r.layers), int(r.hidden)) / it / int(r.gpus) / 1e12
    return {"params_b": float(r.params_b), "gpus": int(r.gpus), "tp": int(r.tp), "pp": int(r.pp), "dp": int(r.dp),
            "microbatches": int(r.microbatches), "chunks": int(r.virtual_stages), "schedule": job.layout.schedule,
            "grad_accumulation": job.grad_accumulation, "p2p_scatter_gather": job.parallel.p2p_scatter_gather,
            "iteration_s": it, "simulated_replicas": res.simulated_replicas, "sim_wall_s": wall,
            "predicted_tflops_per_gpu": tflops, "measured_tflops_per_gpu": float(r.tflops_per_gpu),
            "error": error(tflops, float(r.tflops_per_gpu))}


def predictions(quick: bool, folder) -> pd.DataFrame:
    """Every row (``quick``: :data:`QUICK_ROWS`) simulated; the model files written to ``folder``."""
    rows = table("megatron-sc21-table1.csv")
    if quick:
        rows = rows.iloc[list(QUICK_ROWS)]
    Path(folder).mkdir(parents=True, exist_ok=True)
    out = []
    for _, r in rows.iterrows():
        phase(f"megatron: {r.params_b:g}B on {int(r.gpus)} GPUs")
        out.append(predict_row(r, folder))
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
    df = predictions(quick, Path(out_dir) / "models")
    out = save(out_dir, "megatron", df, plot)
    shown = df[["params_b", "gpus", "tp", "pp", "dp", "chunks", "grad_accumulation", "iteration_s",
                "predicted_tflops_per_gpu", "measured_tflops_per_gpu", "error"]].rename(columns={
                    "predicted_tflops_per_gpu": "TFLOP/s predicted", "measured_tflops_per_gpu": "measured"})
    shown["error"] = shown.error.map(percent)
    shown.insert(0, "row", "held out")
    report = "\n".join([
        "# Megatron-LM SC'21 Table 1, predicted (held out: nothing fitted on it)", "",
        "TFLOP/s per GPU by the paper's Eq. (3) over the simulated iteration time; DGX A100 80 GB nodes "
        f"({CLUSTER}:NODES), full recomputation, the `a100` preset's kernel model (figure: megatron.png). "
        "Each row is `pipetwin simulate` with the options below (model files in models/), e.g.", "",
        "    pipetwin " + " ".join(simulate_argv(table("megatron-sc21-table1.csv").iloc[5], "models/gpt-76.1b.yaml")),
        "",
        fit_note(), "",
        markdown(shown, floatfmt=".4g"), "",
        summary(df) + ".",
        f"Slowest row to simulate: {df.sim_wall_s.max():.1f} s (simulated replicas: "
        f"{', '.join(str(int(x)) for x in df.simulated_replicas)}).", "",
        "## The fit set (in sample): Zero Bubble Table 9, one middle stage, ms", "",
        markdown(fit_table(), floatfmt=".3g")])
    write_output(out / "report.md", report + "\n", "report")
    return report
