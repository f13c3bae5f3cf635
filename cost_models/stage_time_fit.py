"""The ``a100`` kernel constants fitted on Zero Bubble's profiled stage times (Table 9), and nothing else.

Qi et al. (ICLR 2024) profiled, on A100 SXM 80 GB in fp16, the forward (T_F), input-gradient
(T_B) and weight-gradient (T_W) time of one pipeline stage of four GPT models (Table 9; the
``zero-bubble.csv`` shipped in ``cost_models/presets/measurements/zero-bubble``; three micro-batch
counts per model, whose times agree to 2%: their mean is the point). A middle stage holds
(L + 2) / D transformer layers (the first and last hold one fewer, for the embedding and the loss),
so a point is ``n`` Megatron-LM layers (the ``gpt`` block of :mod:`cost_models.kernels`: eager
attention, its dropouts, W = the weight-gradient GEMMs alone) at the model's micro-batch and
sequence 1024::

    T_F = n F(layer),   T_B = n B(layer),   T_W = n W(layer)

Twelve numbers (4 models x 3 phases). What they identify: ``gemm_efficiency`` (T_W is the
weight-gradient GEMMs alone) and ``memory_efficiency`` (the element-wise share of T_F and T_B
falls from the 1.5B model, h = 2304 and 6 sequences, to the 28.3B one). What they do not: the
tile intensity (every GEMM here runs on the largest tiles), the kernel latency and the host times
(the stages are GPU-bound; a fit that frees them lowers the error by < 0.002): those stay the
V100 fit's (``v100.yaml``), the SM count the datasheet's. :func:`fit_table9` fits the two by
least squares on the log of the twelve times (Nelder-Mead, :func:`cost_models.layer_measurements`);
``a100.yaml`` carries the result. Every other published A100 measurement (Megatron-LM SC'21,
Korthikanti et al. 2022, Zero Bubble's own throughputs) is held out from it.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from importlib import resources

from .device import DeviceSpec, load_device
from .kernels import DeviceRates, GpuConstants, block_kernels, block_shape
from .layer_measurements import _nelder_mead
from .model_spec import ModelSpec

TABLE9 = "presets/measurements/zero-bubble/zero-bubble.csv"
SEQ = 1024
PRECISION = "fp16"
FITTED_TABLE9 = ("gemm_efficiency", "memory_efficiency")
PHASES = ("F", "B", "W")


@dataclass(frozen=True)
class StagePoint:
    """One model of Table 9: a middle stage of ``layers`` blocks of ``spec`` and its measured
    (T_F, T_B, T_W) in seconds (the mean over the model's micro-batch counts)."""

    model: str
    spec: ModelSpec
    layers: int
    measured: tuple[float, float, float]


def table9_points() -> list[StagePoint]:
    """The four models of Table 9, in the file's order."""
    with resources.files("cost_models").joinpath(TABLE9).open() as f:
        rows = list(csv.DictReader(f))
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["model"], []).append(r)
    out = []
    for model, rs in by.items():
        r = rs[0]
        L, D = int(r["layers"]), int(r["pipeline_stages"])
        spec = ModelSpec(name=f"zb-{model}", kind="gpt", layers=L, hidden=int(r["hidden"]), heads=int(r["heads"]),
                         seq_len=SEQ, vocab=50257, micro_batch=int(r["micro_batch"]))
        meas = tuple(sum(float(x[f"T_{p}_ms"]) for x in rs) / len(rs) / 1e3 for p in PHASES)
        out.append(StagePoint(model, spec, (L + 2) // D, meas))   # type: ignore[arg-type]
    return out


def predict_stage(p: StagePoint, device: DeviceSpec, constants: GpuConstants | None = None
                  ) -> tuple[float, float, float]:
    """(T_F, T_B, T_W) seconds of the point's middle stage in the kernel model."""
    rates = DeviceRates.of(device, PRECISION, constants)
    f, b, w = rates.phases(block_kernels(block_shape(p.spec)))
    return p.layers * f, p.layers * b, p.layers * w


def _loss(points, device, c) -> float:
    e = [math.log(x / m) ** 2 for p in points for x, m in zip(predict_stage(p, device, c), p.measured)]
    return sum(e) / len(e)


def fit_table9(device: DeviceSpec | None = None, names: tuple[str, ...] = FITTED_TABLE9,
               start: GpuConstants | None = None) -> tuple[GpuConstants, float]:
    """Constants minimising the mean squared log error over Table 9's twelve times, fitting
    ``names`` only (efficiencies capped at 1), from ``start`` (default: the device preset's);
    returns (constants, rms log error)."""
    device = device or load_device("a100")
    c0 = start or device.kernels
    points = table9_points()

    def build(x):
        return c0.with_values(**{n: min(1.0, math.exp(v)) if n.endswith("efficiency") else math.exp(v)
                                 for n, v in zip(names, x)})

    x, v = _nelder_mead(lambda x: _loss(points, device, build(x)), [math.log(getattr(c0, n)) for n in names],
                        step=0.3, iters=600, tol=1e-10)
    return build(x), math.sqrt(v)


def table9_errors(device: DeviceSpec | None = None, constants: GpuConstants | None = None) -> list[dict]:
    """One row per model: measured and modelled T_F, T_B, T_W (ms), their relative errors and the
    error of the sum (what a 1F1B step costs per micro-batch)."""
    device = device or load_device("a100")
    rows = []
    for p in table9_points():
        pred = predict_stage(p, device, constants)
        row = {"model": p.model, "layers_per_stage": p.layers, "micro_batch": p.spec.micro_batch}
        for ph, x, m in zip(PHASES, pred, p.measured):
            row.update({f"T_{ph}_ms": m * 1e3, f"model_{ph}_ms": x * 1e3, f"error_{ph}": x / m - 1})
        row["error_sum"] = sum(pred) / sum(p.measured) - 1
        rows.append(row)
    return rows


def fit_note(device: DeviceSpec | None = None) -> str:
    """One paragraph for a report: what the ``a100`` kernel constants were fitted on, and how close
    the preset comes to its fit set."""
    device = device or load_device("a100")
    c = device.kernels
    rows = table9_errors(device)
    worst = max(abs(r[f"error_{p}"]) for r in rows for p in PHASES)
    worst_sum = max(abs(r["error_sum"]) for r in rows)
    fitted = ", ".join(f"{n} = {getattr(c, n):.3g}" for n in FITTED_TABLE9)
    return (f"Fitted (in sample): the `a100` kernel constants {fitted}, on Zero Bubble Table 9's "
            f"profiled stage times only (4 models x T_F, T_B, T_W; the preset "
            f"reproduces them within {worst:.1%} per phase, {worst_sum:.1%} for F + B + W). Every row "
            f"below is held out.")
