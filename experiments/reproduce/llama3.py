"""Llama 3's training throughput on H100s (Grattafiori et al., "The Llama 3 Herd of Models", 2024,
Table 4), and NVIDIA's Megatron-Bridge Llama 3 recipes in FP8, simulated.

Table 4: Llama 3 405B on 8,192 and 16,384 H100 SXM 80 GB, TP 8 x PP 16 x DP 64 / 128 at sequence
8,192 (16M tokens a batch: 32 and 16 sequences per DP group), and TP 8 x CP 16 x PP 16 x DP 8 at
131,072 tokens; interleaved with one layer per chunk, FSDP that shards gradients and optimizer
state and keeps the weights gathered, ranks in the order [TP, CP, PP, DP] on the ``h100-pods``
cluster (:mod:`cost_models.published_runs` says how each row becomes a job). The paper publishes
TFLOP/s per GPU and BF16 MFU; the predicted MFU counts the same model FLOPs (the formulas' 6 x
parameters plus the attention core as the full square; the paper states no formula), so ``error``
is the relative error of the MFU, of the TFLOP/s and of the tokens per GPU per second alike.

Megatron-Bridge (release 25.11): Llama 3 8B on 8 GPUs (Megatron-FSDP), 70B on 64 (TP 4 x PP 8 x
VP 5 x DP 2), 405B on 1,024 (TP 8 x CP 2 x PP 8 x VP 8 x DP 8), FP8 with current scaling on DGX
H100; tokens per GPU per second as published.

Fitted (``role`` fitted): the 8,192-GPU row only (:mod:`calibration.h100_fit`: the h100's
``kernels.gemm_efficiency`` and ``efficiency``); everything else is held out. The 131k row runs on
the linear cost model (the kernel model prices whole-sequence attention kernels, not CP), the
others on the kernel model.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from cost_models.files import write_output
from cost_models.published_runs import load_runs

from ..progress import phase
from ..tables import markdown
from .megatron import percent, save

SOURCES = ("llama3-paper", "megatron-bridge-25.11")
# quick: the fitted row and Megatron-Bridge's 70B row (64 GPUs)
QUICK = ("Llama 3 T4 llama3-405b 8192 GPUs TP8xPP16xDP64 seq 8k bf16 interleaved",
         "Megatron-Bridge llama3-70b 64 GPUs TP4xPP8xDP2 seq 8k fp8-current-scaling interleaved")
AIM = 0.10
SHOWN = ["row", "role", "cost_model", "iteration_s", "predicted_tokens_per_gpu_s", "published_tokens_per_gpu_s",
         "error", "error_linear", "predicted_mfu", "published_mfu", "peak_memory_gib"]


def predictions(sources=SOURCES, quick: tuple[str, ...] | None = None, name: str = "llama3") -> pd.DataFrame:
    """One row per published run of ``sources`` (``quick``: only the runs named, and every run
    that is not expressible, which costs no simulation)."""
    from calibration.h100_fit import TABLE_COLUMNS, table_row, role
    rows = []
    for source in sources:
        for run in load_runs(source):
            if quick is not None and run.name not in quick and not role(run).startswith("not expressible"):
                continue
            phase(f"{name}: {run.name}")
            rows.append(table_row(run))
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)


def aims_line(df: pd.DataFrame) -> str:
    """How many predicted rows are within the aim, and the worst."""
    p = df[df.role == "predicted"]
    if p.empty:
        return "no predicted row"
    ok = int((p.error.abs() <= AIM).sum())
    worst = p.loc[p.error.abs().idxmax()]
    return (f"predicted rows within {AIM:.0%} of the published throughput: {ok} of {len(p)} (worst "
            f"{percent(worst.error)}: {worst.row}); fitted rows: {int((df.role == 'fitted').sum())}; not "
            f"expressible: {int(df.role.str.startswith('not expressible').sum())}")


def plot(df: pd.DataFrame, path: Path) -> None:
    """Per simulated row, the error of the predicted throughput against the published one (orange:
    fitted; the band: the 10% aim)."""
    from ..plots import plt, save_figure
    sim = df[df.predicted_tokens_per_gpu_s.notna()].reset_index(drop=True)
    fig, ax = plt.subplots(figsize=(9, 0.8 + 0.4 * max(1, len(sim))))
    y = list(range(len(sim)))
    ax.axvspan(-AIM * 100, AIM * 100, color="0.9", label=f"within {AIM:.0%}")
    ax.barh(y, sim.error * 100, 0.6, color=["C1" if r == "fitted" else "C0" for r in sim.role])
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(y, [r[:64] for r in sim.row], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("predicted / published tokens per GPU per second - 1 (%; orange: fitted)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    save_figure(fig, path)


def shown(df: pd.DataFrame) -> pd.DataFrame:
    out = df[SHOWN].copy()
    for c in ("error", "error_linear"):
        out[c] = [percent(e) if pd.notna(e) else "" for e in df[c]]
    for c in ("predicted_mfu", "published_mfu"):
        out[c] = [f"{v:.1%}" if pd.notna(v) else "" for v in df[c]]
    return out


def conventions(df: pd.DataFrame) -> pd.DataFrame:
    """Per simulated Llama 3 row: the published tokens per GPU per second and the error under the two
    ways of counting the attention core's FLOPs (the paper states neither): the full square (the
    formulas', ``error``) and causal (half of it, what a causal flash kernel computes)."""
    from calibration.h100_fit import causal_flops_per_token, flops_per_token
    out = []
    runs = {r.name: r for r in load_runs("llama3-paper")}
    for _, row in df[df.row.isin(list(runs)) & df.predicted_tokens_per_gpu_s.notna()].iterrows():
        r = runs[row.row]
        full, half = flops_per_token(r), causal_flops_per_token(r)
        causal = r.tflops_per_gpu * 1e12 / half
        out.append({"row": row.row, "attention_share": f"{2 * (full - half) / full:.0%}",
                    "full_square_tokens_per_gpu_s": row.published_tokens_per_gpu_s,
                    "error_full_square": percent(row.error), "causal_tokens_per_gpu_s": causal,
                    "error_causal": percent(row.predicted_tokens_per_gpu_s / causal - 1)})
    return pd.DataFrame(out)


def run(out_dir, quick: bool = False) -> str:
    from calibration.h100_fit import fit_note
    df = predictions(quick=QUICK if quick else None)
    out = save(out_dir, "llama3", df, plot)
    report = "\n".join([
        "# Llama 3 on H100s: Table 4 of the Llama 3 paper and Megatron-Bridge's FP8 recipes, simulated", "",
        fit_note(), "",
        "Llama 3 rows: published TFLOP/s per GPU turned into tokens with the formulas' model FLOPs per token "
        "(6 x parameters + the attention core as the full square; the paper gives no formula), so `error` is the "
        "MFU's. MFU against the H100's dense bf16 peak (989.4 TFLOP/s) for every row, fp8 ones too.", "",
        markdown(shown(df), floatfmt=".4g"), "", aims_line(df), "",
        "## Llama 3: how the attention is counted", "",
        "The paper gives TFLOP/s, not tokens, and no formula. `error` counts the attention core as the full "
        "square (the formulas' convention, which the linear model prices; the kernel model prices a causal flash "
        "kernel, about half of it); counted causally the published tokens are more, and the errors these "
        "(`attention_share`: the core's share of the full-square FLOPs):", "",
        markdown(conventions(df), floatfmt=".4g"), "",
        "`error_linear`: the linear cost model's error on the same job (the default is the kernel model where it "
        "prices the block, the linear model with context parallelism).", ""])
    write_output(out / "report.md", report, "report")
    return report
