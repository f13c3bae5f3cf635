"""The ``h100`` constants fitted on a stated subset of published H100 runs, tested on the rest.

The runs are ``cost_models/presets/measurements/h100/h100.csv`` (Llama 3 Table 4, torchtitan's H100
benchmark, NVIDIA's Megatron-Bridge summary), read into jobs by :mod:`cost_models.published_runs`.
Each row is one throughput: tokens per GPU per second (torchtitan, Megatron-Bridge), or, for Llama
3, TFLOP/s per GPU turned into tokens with the formulas' model FLOPs per token
(:func:`cost_models.transformer.model_flops`: 6 x parameters plus the attention core counted as the
full s^2 square, Megatron's 4bs^2h; the paper states no formula), so the error is the same as on
the paper's MFU. A row is predicted by simulating its job (:func:`sim.simulate_job`) and reading
``tokens per step / (iteration time x GPUs)``. The simulator lives above ``cost_models``, so the
fit that runs it lives here, not beside :mod:`cost_models.stage_time_fit`.

What is fitted, on what (each a one-number fit: the constant that makes the mean log error over
its fit set zero, by bisection; the time falls as the constant grows):

* ``FIT_BF16`` = Llama 3 Table 4's 8,192-GPU row, the one row whose layout the paper gives whole
  at 8k: the kernel model's ``gemm_efficiency`` (``h100.yaml``, the asymptote of a GEMM tile's
  share of the peak) with the kernel model, and the linear model's ``efficiency`` (the share of
  the peak a layer reaches) with ``--cost-model linear``; the kernel model cannot price context
  parallelism, so CP rows run on the linear model, which needs its own number.
* fp8: no constant of its own. fp8 GEMMs run at the fp8 peak with the same tile efficiency (and the
  linear model at the same share of the fp8 peak), so every fp8 row is a prediction. An fp8
  efficiency fitted on NVIDIA's fp8 rows would have to exceed the bf16 one (the kernel model comes
  out 5-6% slow on them), which would make an fp8 GEMM more than 2x a bf16 one: no H100 does
  that, so the gap is reported, not fitted away (the bf16 efficiency carries what Llama 3's run
  loses that NVIDIA's recipes do not, e.g. its TP collectives, exposed here).
* ``FIT_POWER_CAP`` = torchtitan Table 1's FSDP row (Llama 3.1 8B, 8 GPUs, bf16, no compile): one
  factor k on both fitted efficiencies for the Grand Teton H100 at its 500 W power limit
  (``grand-teton-h100`` cluster): the cap and whatever else torchtitan's eager stack loses
  against the run the h100 fit came from; one row cannot separate them.

Everything else in the file is held out: predicted where pipetwin expresses the run, listed as
``not expressible: ...`` where it does not (torch.compile, AsyncTP;
:func:`cost_models.published_runs.not_expressible`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from cost_models.bind import load_inputs
from cost_models.device import DeviceSpec
from cost_models.published_runs import PublishedRun, job_of, load_runs, not_expressible
from cost_models.transformer import model_flops

FIT_BF16 = ("Llama 3 T4 llama3-405b 8192 GPUs TP8xPP16xDP64 seq 8k bf16 interleaved",)
FIT_POWER_CAP = ("torchtitan T1 llama3.1-8b 8 GPUs DP8 seq 8k bf16",)
FITTED_BF16 = ("kernels.gemm_efficiency", "efficiency")
TOLERANCE = 1e-4            # bisection: the fitted constant to this relative width


@dataclass(frozen=True)
class Prediction:
    """A simulated row: its step time (s), tokens per GPU per second, the published tokens per GPU
    per second and the signed error, the cost model, and the worst GPU's peak memory (GiB)."""

    iteration_s: float
    tokens_per_gpu_s: float
    published_tokens_per_gpu_s: float
    error: float
    cost_model: str
    peak_memory_gib: float


def published_tokens_per_gpu_s(run: PublishedRun) -> float:
    """The row's measured tokens per GPU per second (Llama 3: its TFLOP/s per GPU over the model
    FLOPs per token, module docstring)."""
    if run.tokens_per_gpu_s is not None:
        return run.tokens_per_gpu_s
    if run.tflops_per_gpu is None:
        raise ValueError(f"{run.name}: neither tokens nor TFLOP/s per GPU published")
    return run.tflops_per_gpu * 1e12 / flops_per_token(run)


def flops_per_token(run: PublishedRun) -> float:
    """Model FLOPs of one token's forward and backward at the row's sequence length (no
    recomputation; attention as the full square)."""
    from cost_models.model_spec import load_model
    from cost_models.published_runs import MODELS
    spec = load_model(MODELS[run.model]).replace(seq_len=run.seq_len, micro_batch=1)
    return model_flops(spec) / run.seq_len


def predict(run: PublishedRun, device: DeviceSpec | None = None, cost_model: str | None = None) -> Prediction:
    """Simulate the row's job (``device``: in place of its cluster's; ``cost_model``: in place of
    the default, kernels where it prices the block, linear with CP)."""
    from sim import simulate_job
    job = job_of(run)
    if cost_model is not None:
        job = replace(job, cost_model=cost_model)
    inputs = load_inputs(job)
    if device is not None:
        inputs = replace(inputs, cluster=replace(inputs.cluster, device=device))
    sim = simulate_job(job, inputs=inputs)
    t = sim.result.iteration_time
    tokens = run.tokens_per_step / (t * run.gpus)
    pub = published_tokens_per_gpu_s(run)
    peak = max(p.peak_memory for p in sim.result.metrics().per_device) / 2 ** 30
    return Prediction(t, tokens, pub, tokens / pub - 1, sim.bound.report.get("cost_model", ""), peak)


def runs_named(names: Sequence[str]) -> list[PublishedRun]:
    by = {r.name: r for r in load_runs()}
    missing = [n for n in names if n not in by]
    if missing:
        raise ValueError(f"no published run named {missing[0]!r}")
    return [by[n] for n in names]


def fit_one(runs: Sequence[PublishedRun], device_of: Callable[[float], DeviceSpec], lo: float, hi: float,
            cost_model: str | None = None) -> tuple[float, float]:
    """The constant x in [lo, hi] with mean log(predicted / published) = 0 over ``runs`` (the
    device ``device_of(x)`` simulated; faster as x grows), by bisection; returns (x, the rms log
    error at x)."""
    def mean_log(x):
        return sum(math.log(1 + predict(r, device_of(x), cost_model).error) for r in runs) / len(runs)
    f_lo, f_hi = mean_log(lo), mean_log(hi)
    if f_lo > 0 or f_hi < 0:
        raise ValueError(f"the fit's bracket [{lo}, {hi}] does not hold the solution (mean log error "
                         f"{f_lo:+.3f} .. {f_hi:+.3f})")
    while hi - lo > TOLERANCE * hi:
        mid = (lo + hi) / 2
        if mean_log(mid) < 0:
            lo = mid
        else:
            hi = mid
    x = (lo + hi) / 2
    rms = math.sqrt(sum(math.log(1 + predict(r, device_of(x), cost_model).error) ** 2 for r in runs) / len(runs))
    return x, rms


def with_gemm_efficiency(device: DeviceSpec, x: float) -> DeviceSpec:
    return replace(device, kernels=device.kernels.with_values(gemm_efficiency=x))


def with_efficiency(device: DeviceSpec, x: float) -> DeviceSpec:
    return replace(device, efficiency=x)


def fit_bf16(device: DeviceSpec | None = None) -> dict:
    """The h100's ``kernels.gemm_efficiency`` (kernel model) and ``efficiency`` (linear model)
    fitted on :data:`FIT_BF16`; returns {constant: (value, rms log error)}."""
    from cost_models import load_device
    device = device or load_device("h100")
    runs = runs_named(FIT_BF16)
    return {"kernels.gemm_efficiency": fit_one(runs, lambda x: with_gemm_efficiency(device, x), 0.3, 1.0, "kernels"),
            "efficiency": fit_one(runs, lambda x: with_efficiency(device, x), 0.2, 1.0, "linear")}


def capped(device: DeviceSpec, h100: DeviceSpec, k: float) -> DeviceSpec:
    """``device`` with the h100's fitted efficiencies times the power-cap factor ``k``."""
    return replace(device, efficiency=h100.efficiency * k,
                   kernels=device.kernels.with_values(gemm_efficiency=h100.kernels.gemm_efficiency * k))


def fit_power_cap() -> tuple[float, float]:
    """k of the Grand Teton H100 (500 W) on :data:`FIT_POWER_CAP`, from the h100 preset's fitted
    efficiencies; returns (k, rms log error)."""
    from cost_models import load_cluster, load_device
    h100 = load_device("h100")
    gt = load_cluster("grand-teton-h100").device
    return fit_one(runs_named(FIT_POWER_CAP), lambda k: capped(gt, h100, k), 0.5, 1.0 / h100.kernels.gemm_efficiency)


def role(run: PublishedRun) -> str:
    """``fitted`` (a fit set holds the row), ``not expressible: why``, or ``predicted``."""
    why = not_expressible(run)
    if why:
        return f"not expressible: {why}"
    if run.name in FIT_BF16 + FIT_POWER_CAP:
        return "fitted"
    return "predicted"


def fit_note() -> str:
    """One paragraph for a report: what the h100 constants were fitted on."""
    from cost_models import load_cluster, load_device
    h = load_device("h100")
    gt = load_cluster("grand-teton-h100").device
    k = gt.kernels.gemm_efficiency / h.kernels.gemm_efficiency
    return (f"Fitted (in sample, `role` = fitted): the `h100` preset's kernels.gemm_efficiency = "
            f"{h.kernels.gemm_efficiency:.4g} (kernel model) and efficiency = {h.efficiency:.4g} (linear model, "
            f"the one that prices context parallelism), each on {', '.join(FIT_BF16)} alone; the Grand Teton "
            f"H100 at 500 W, a factor {k:.4g} on both (`grand-teton-h100` cluster: the cap and what torchtitan's eager "
            f"stack loses besides), on {', '.join(FIT_POWER_CAP)} alone. fp8 has no constant of its own (the same "
            f"efficiencies at the fp8 peak). Every other row is held out (`calibration/h100_fit.py`).")


PEAK_BF16 = 989.4e12        # the H100 SXM's dense bf16 peak: the MFU every source reports against
TABLE_COLUMNS = ["source", "table", "row", "gpus", "seq_len", "precision", "role", "cost_model", "iteration_s",
                 "predicted_tokens_per_gpu_s", "published_tokens_per_gpu_s", "error", "error_linear",
                 "predicted_tflops_per_gpu", "published_tflops_per_gpu", "predicted_mfu", "published_mfu",
                 "peak_memory_gib", "published_memory_gib"]


def causal_flops_per_token(run: PublishedRun) -> float:
    """Model FLOPs of one token with the attention core counted causally (half the square):
    :func:`flops_per_token` less 6 l h s (forward and backward of half of 4 b s^2 h)."""
    from cost_models.model_spec import load_model
    from cost_models.published_runs import MODELS
    m = load_model(MODELS[run.model])
    return flops_per_token(run) - 6.0 * m.layers * m.heads * m.head_dim * run.seq_len


def table_row(run: PublishedRun) -> dict:
    """One report row: the run, its role and, unless not expressible, its prediction (the default
    cost model's, and beside it the linear model's error). A run whose
    job pipetwin refuses (a knob a merged feature does not price yet) is ``not expressible`` with
    the refusal's one line."""
    out = {"source": run.source, "table": run.table, "row": run.name, "gpus": run.gpus, "seq_len": run.seq_len,
           "precision": run.precision, "role": role(run), "published_tokens_per_gpu_s": published_tokens_per_gpu_s(run),
           "published_tflops_per_gpu": run.tflops_per_gpu, "published_mfu": run.mfu,
           "published_memory_gib": run.memory_gib}
    if out["role"].startswith("not expressible"):
        return out
    try:
        p = predict(run)
    except ValueError as e:        # SpecError is one too
        out["role"] = f"not expressible: {str(e).splitlines()[0]}"
        return out
    tflops = p.tokens_per_gpu_s * flops_per_token(run) / 1e12
    # the linear cost model's error beside the default's (the one CP rows run on already)
    out["error_linear"] = p.error if p.cost_model == "linear" else predict(run, cost_model="linear").error
    out.update({"cost_model": p.cost_model, "iteration_s": p.iteration_s,
                "predicted_tokens_per_gpu_s": p.tokens_per_gpu_s, "error": p.error, "predicted_tflops_per_gpu": tflops,
                "predicted_mfu": tflops * 1e12 / PEAK_BF16,
                "peak_memory_gib": p.peak_memory_gib})
    return out
