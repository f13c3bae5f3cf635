"""torchtitan's H100 benchmark (``benchmarks/llama3_h100_202412_torchtitan.md``, December 2024),
simulated: Llama 3.1 8B, 70B and 405B on 8 to 512 H100 of Grand Teton hosts (96 GB HBM2e at
2.4 TB/s, a 500 W power limit, NVLink, 400 Gb/s RDMA per GPU: the ``grand-teton-h100`` cluster).

Tables 1 and 3: 8B with FSDP on 8 and 128 GPUs, local batch 2 at 8k, selective (per-op)
activation checkpointing; eager, with torch.compile, with torch.compile + Float8. Table 2: 8B with
FSDP x CP to 262k tokens; Table 4: 70B with FSDP 32 x TP 8; Tables 5-6: 405B with FSDP 8 x TP 8 x
PP 8 (1F1B against interleaved 1F1B, then CP to 262k) — all of Tables 2, 4, 5, 6 with
torch.compile (and Float8, AsyncTP from Table 4 on). torch.compile and AsyncTP change kernels and
overlaps pipetwin does not model: those rows are listed ``not expressible``, never fitted. Of the
eager rows, Table 1's FSDP row fits the 500 W cap (one factor on the h100's fitted efficiencies,
:mod:`calibration.h100_fit`) and Table 3's is predicted. The benchmark page says Table 4 runs
torch.compile + Float8 with full checkpointing at global batch 512 (a transcription had left
these out; the page wins: ``cost_models/presets/measurements/h100/README.md``).
"""
from __future__ import annotations

from cost_models.files import write_output

from ..tables import markdown
from .llama3 import aims_line, plot, predictions, shown
from .megatron import save

SOURCES = ("torchtitan-bench",)
QUICK = ("torchtitan T1 llama3.1-8b 8 GPUs DP8 seq 8k bf16", "torchtitan T3 llama3.1-8b 128 GPUs DP128 seq 8k bf16")


def run(out_dir, quick: bool = False) -> str:
    from calibration.h100_fit import fit_note
    df = predictions(SOURCES, quick=QUICK if quick else None, name="torchtitan")
    out = save(out_dir, "torchtitan", df, plot)
    report = "\n".join([
        "# torchtitan's H100 benchmark (December 2024), simulated", "", fit_note(), "",
        "Throughput: tokens per GPU per second as published (read at iteration 90). torchtitan's selective "
        "activation checkpointing (per op: every second matmul recomputed) is priced as pipetwin's `selective` "
        "(the attention core re-run in the backward; at 8B and 8k, 8% of a layer's FLOPs added against per-op "
        "SAC's 9%). Memory: the worst GPU's peak here, the maximum over ranks there.", "",
        markdown(shown(df), floatfmt=".4g"), "", aims_line(df), "",
        "`error_linear`: the linear cost model's error on the same job (the default is the kernel model).", ""])
    write_output(out / "report.md", report, "report")
    return report
