"""DeepSeek-V3's pre-training throughput (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024),
predicted from its stated layout: an in-sample sanity check, not a held-out prediction.

The report trains DeepSeek-V3 (671 B parameters, 37 B active; the ``deepseek-v3`` preset, MTP
module left out) on 2,048 H800 GPUs (``h800-ib:256``: 8 GPUs on NVLink per node, 8 x 400 Gb/s
InfiniBand), at 180 K H800 GPU hours per trillion tokens (Table 1 and section 1): 10^12 / (180e3
x 3600) = 1,543 tokens per GPU per second. Its layout (section 3.2): 16-way pipeline parallelism
with DualPipe, 64-way expert parallelism over 8 nodes, ZeRO-1 data parallelism, no tensor
parallelism, sequence 4,096, FP8 GEMMs (section 3.3), node-limited routing to at most 4 nodes per
token with DeepEP-style all-to-all (IB once per node, then NVLink) and dispatch in FP8, the
forward and backward of two micro-batches overlapped with 20 of 132 SMs for communication. The
batch grows to 15,360 sequences; the report gives no micro-batch size: we take 1 sequence, so a
replica runs 15,360 / 128 = 120 micro-batches per step.

pipetwin runs DualPipe-V (the V cut of DualPipe, the same bubble as DualPipe on 2D ranks: see
:mod:`schedules.dualpipe_v`) at D = 16, since DualPipe's two copies of the weights are not
modelled. Nothing is fitted here: the h800 preset is the H100's datasheet with the NVLink and NICs
the report states; the efficiency (0.4 of peak) is the h100 preset's, which no H100 run has fitted
yet. Rows: the stated layout, and the same with one knob taken back each (no overlap, a flat
all-to-all, bf16 GEMMs) and with recomputation, so the table says what each is worth here.

The memory verdict is shown beside each row: pipetwin keeps the routed activations of the k = 8
expert copies of a token in 16 bits (1.3 GB per MoE block and micro-batch), where DeepSeek
stores them in FP8 and recomputes the SwiGLU and the norms; the stated layout therefore does not
fit here without recomputation.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from cost_models import Job
from cost_models.files import write_output
from cost_models.memory import memory_verdict
from sim import simulate_job

from ..progress import phase
from ..tables import markdown
from .megatron import error, percent, save

PUBLISHED_TOKENS_PER_GPU_S = 1e12 / (180e3 * 3600)      # 180 K H800 GPU hours per trillion tokens
GLOBAL_BATCH, SEQ, GPUS = 15360, 4096, 2048
STATED = dict(schedule="dualpipe-v", devices=16, replicas=128, microbatches=GLOBAL_BATCH // 128, model="deepseek-v3",
              cluster="h800-ib:256", ep=64, zero=1, precision="fp8", fp8_dispatch=True, a2a_hierarchical=True,
              route_nodes=4, overlap_fb=True)
VARIANTS = {                 # name: what changes from the stated layout
    "as stated": {},
    "no F&B overlap": {"overlap_fb": False},
    "flat all-to-all (NCCL)": {"a2a_hierarchical": False, "route_nodes": 0, "fp8_dispatch": False},
    "bf16 GEMMs": {"precision": None},
    "selective recompute": {"recompute": "selective"},
    "full recompute": {"recompute": "full"},
}
QUICK = ("as stated", "no F&B overlap")
COLUMNS = ["setting", "iteration_s", "tokens_per_gpu_s", "published", "error", "a2a_s", "a2a_hidden_s",
           "peak_memory_gib", "fits"]


def predict(changes: dict) -> dict:
    sim = simulate_job(Job.of(**{**STATED, **changes}))
    res, low = sim.result, sim.bound.lowered
    m = res.metrics()
    worst = max(m.per_device, key=lambda p: p.peak_memory)
    v = memory_verdict(worst.static_memory, worst.peak_activation, sim.bound.report["memory_capacity"],
                       transient=sim.bound.report["memory_transient"])
    tokens = GLOBAL_BATCH * SEQ / GPUS / res.iteration_time
    a2a = res.a2a_time or [0.0]
    hidden = res.a2a_hidden or [0.0]
    assert low.num_ranks == STATED["devices"] * STATED["replicas"]
    return {"iteration_s": res.iteration_time, "tokens_per_gpu_s": tokens, "published": PUBLISHED_TOKENS_PER_GPU_S,
            "error": error(tokens, PUBLISHED_TOKENS_PER_GPU_S), "a2a_s": sum(a2a) / len(a2a),
            "a2a_hidden_s": sum(hidden) / len(hidden), "peak_memory_gib": worst.peak_memory / 2 ** 30,
            "fits": v.fits}


def predictions(quick: bool) -> pd.DataFrame:
    rows = []
    for name, changes in VARIANTS.items():
        if quick and name not in QUICK:
            continue
        phase(f"deepseek-v3: {name}")
        rows.append({"setting": name, **predict(changes)})
    return pd.DataFrame(rows, columns=COLUMNS)


def plot(df: pd.DataFrame, path: Path) -> None:
    from ..plots import plt, save_figure
    fig, ax = plt.subplots(figsize=(7, 3.4))
    y = range(len(df))
    ax.barh(list(y), df.tokens_per_gpu_s, color=["C0" if f else "C3" for f in df.fits])
    ax.axvline(PUBLISHED_TOKENS_PER_GPU_S, color="k", ls=":", lw=1, label="published (180 K GPU h / T tokens)")
    ax.set_yticks(list(y), df.setting)
    ax.invert_yaxis()
    ax.set_xlabel("tokens per GPU per second (red: does not fit in memory here)")
    ax.legend(fontsize=8, loc="lower right")
    save_figure(fig, path)


def run(out_dir, quick: bool = False) -> str:
    df = predictions(quick)
    out = save(out_dir, "deepseek_v3", df, plot)
    shown = df.assign(error=df.error.map(percent), fits=df.fits.map({True: "yes", False: "no"}))
    report = ("# DeepSeek-V3 on 2,048 H800s (in sample: the layout and cluster the report states; nothing "
              "fitted)\n\n" + markdown(shown, floatfmt=".4g") +
              f"\n\npublished: {PUBLISHED_TOKENS_PER_GPU_S:.0f} tokens per GPU per second (180 K H800 GPU hours per "
              f"trillion tokens). DualPipe-V stands for DualPipe; the h800 preset's efficiency (0.4 of peak) is "
              f"fitted on no run (the h100 fit, 0.5945 on Llama 3 Table 4, is not carried over); "
              f"routed activations are kept in 16 bits (DeepSeek: FP8 and "
              f"recomputation), so the stated layout does not fit here without recomputation.\n")
    write_output(out / "report.md", report, "report")       # whole or not at all, as its CSV and figure
    return report
