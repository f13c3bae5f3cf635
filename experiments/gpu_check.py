"""The one short script for a machine with a GPU: the kernel model and the executor checked on it.

Run: ``python -m experiments.gpu_check`` (defaults: ``--device cuda --model gpt3-1.3b --gpu h200
--dtype bf16 --micro-batches 1,2,4,8,16``; ``make gpu-check``). It prints each part as it goes and
writes ``--out`` (default ``out/gpu-check``):

1. **Layers** (``layers.csv``): one transformer block of the model measured on the device the way
   ``pipetwin calibrate`` measures a layer (:func:`calibration.measure.measure_layers`: F, the
   split backward's B_input and W, the full B; times wait for the GPU's queue), at each
   micro-batch, beside the kernel model's prediction for the ``--gpu`` preset
   (:func:`cost_models.kernels.transformer_layer_times`: F, B = the input gradient, W), with the
   relative errors (model / measured - 1).
2. **Fit** (``fitted-constants.yaml``, ``measurements/``): the preset's kernel constants fitted on
   the measured F and full B (:func:`cost_models.layer_measurements.fit_constants`, the fit
   ``pipetwin reproduce cost-curves`` does on Chimera's V100 files), the errors after the fit, and
   the measurements as a measurement set (``layers.yaml`` + ``block.csv``) that
   :func:`cost_models.layer_measurements.load_measurements` reads.
3. **Runs** (``runs.csv``): the single-process reference and a pipetwin run (DAPPLE's 1F1B) of the
   same model and data on D = ``--devices`` ranks, one GPU each (NCCL wants a GPU per rank; the
   default is 1 .. the GPUs at hand), in ``--dtype``: losses side by side (bf16 runs should stay
   within 1e-2 of the reference) and the median step time after the first step.
4. **Zero Bubble layer** (``zb-layer.csv``): one block of a Zero Bubble model (``--zb-model``,
   Table 3's dimensions: sequence 1024, GPT-2's vocabulary, at Table 4's micro-batch), measured as
   in part 1 beside the kernel model of ``--gpu``; ``none`` skips it.
5. **Llama runs** (``llama-runs.csv``): ``--llama`` (a preset or a Hugging Face config.json; default
   ``llama3-8b`` cut to ``--llama-layers`` blocks at ``--llama-seq-len``) trained by the executor's
   tensor-parallel stage at T = ``--llama-tp`` (default: 1 and every power of two up to the GPUs
   at hand that divides the heads; the largest T again with sequence parallelism), one pipeline
   rank, against the single-process reference of the same model and data: losses side by side
   and the median step time. T = 1 runs the Llama block (RMSNorm, rotary, grouped-query
   attention, SwiGLU) through the executor in ``--dtype``; T > 1 adds the f/g collectives.
6. **MoE layer** (``moe-layer.csv``): the first MoE block of ``--moe`` (default ``mixtral-8x7b``,
   one block at ``--moe-seq-len``) at EP 1, every expert on the device, measured as in part 1 at
   each micro-batch beside the kernel model's MoE block (:func:`cost_models.kernels.moe_block_times`)
   at the rows its router sent each expert on that micro-batch; ``none`` skips it.

``report.md`` holds the tables. Without a GPU, ``--device cpu`` runs the same code (the
tests do, on the tiny model); the GPU preset's prediction is then not a statement about the CPU.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from cost_models.files import output_file, write_output

from .checks import int_in, output_dir
from .sweep import parse_ints

KINDS = ("f", "b_input", "w", "b")


def measure_block(spec, mbs, device, dtype: str, repeats: int, progress=print) -> list[dict]:
    """Per micro-batch: the executor's block measured on ``device`` (seconds)."""
    import torch

    from calibration.measure import measure_layers
    from executor.precision import Precision
    rows = []
    for mb in mbs:
        t0 = time.perf_counter()
        m = measure_layers(replace(spec, micro_batch=mb), torch.get_num_threads(), repeats,
                           precision=Precision(dtype), device=device, kinds=("block",))["block"]
        rows.append({"micro_batch": mb, **{k: float(m[k]) for k in KINDS}})
        progress(f"layers: micro-batch {mb}: F {m['f'] * 1e3:.3f} ms, B_input {m['b_input'] * 1e3:.3f} ms, "
                 f"W {m['w'] * 1e3:.3f} ms, B {m['b'] * 1e3:.3f} ms ({time.perf_counter() - t0:.1f} s)")
    return rows


def measure_moe_block(spec, mbs, device, dtype: str, repeats: int, progress=print) -> list[dict]:
    """Per micro-batch: the executor's first MoE block (EP 1: every expert on this device)
    measured on ``device`` as :func:`measure_block` measures a dense one (seconds), with the pairs
    its router sent to each expert on the measured micro-batch (``counts``: what the kernel model
    prices, :func:`model_moe_block`)."""
    import torch

    from calibration.measure import measure_layers, moe_block
    from executor.precision import Precision
    rows = []
    for mb in mbs:
        t0 = time.perf_counter()
        sp = replace(spec, micro_batch=mb)
        got = measure_layers(sp, torch.get_num_threads(), repeats, precision=Precision(dtype), device=device,
                             kinds=("block",))
        m = got.get("moe_block", got["block"])
        counts = moe_block(sp, device)[1]
        rows.append({"micro_batch": mb, **{k: float(m[k]) for k in KINDS}, "counts": counts})
        progress(f"moe: micro-batch {mb}: F {m['f'] * 1e3:.3f} ms, B_input {m['b_input'] * 1e3:.3f} ms, "
                 f"W {m['w'] * 1e3:.3f} ms, B {m['b'] * 1e3:.3f} ms, rows per expert {min(counts)}-{max(counts)} "
                 f"({time.perf_counter() - t0:.1f} s)")
    return rows


def model_moe_block(spec, mb: int, gpu, dtype: str, counts, constants=None) -> dict:
    """The kernel model's (F, B_input, W, full B) seconds of one MoE block at micro-batch ``mb`` with
    ``counts`` routed pairs per expert (:func:`cost_models.kernels.moe_block_times`)."""
    from cost_models.kernels import moe_block_times
    f, b, w = moe_block_times(replace(spec, micro_batch=mb), gpu, dtype, counts, constants)
    return {"f": f, "b_input": b, "w": w, "b": b + w}


def moe_table(spec, measured: list[dict], gpu, dtype: str, constants=None) -> list[dict]:
    """:func:`layer_table`'s rows for the MoE block (the kernel model at each row's routed counts)."""
    return _table(measured, lambda row: model_moe_block(spec, row["micro_batch"], gpu, dtype, row["counts"],
                                                        constants))


def model_block(spec, mb: int, gpu, dtype: str, constants=None) -> dict:
    """The kernel model's (F, B_input, W, full B) seconds of one block at micro-batch ``mb``."""
    from cost_models.kernels import transformer_layer_times
    f, b, w = transformer_layer_times(replace(spec, micro_batch=mb, layers=1), gpu, dtype, dropout=False,
                                      constants=constants)[1]
    return {"f": f, "b_input": b, "w": w, "b": b + w}


def layer_table(spec, measured: list[dict], gpu, dtype: str, constants=None) -> list[dict]:
    return _table(measured, lambda row: model_block(spec, row["micro_batch"], gpu, dtype, constants))


def _table(measured: list[dict], predict) -> list[dict]:
    """Per measured row: measured and predicted (``predict(row)``) ms of each of :data:`KINDS` and the
    relative error model / measured - 1."""
    out = []
    for row in measured:
        pred = predict(row)
        r = {"micro_batch": row["micro_batch"]}
        for k in KINDS:
            r[f"{k}_measured_ms"] = row[k] * 1e3
            r[f"{k}_model_ms"] = pred[k] * 1e3
            r[f"{k}_error"] = pred[k] / row[k] - 1 if row[k] > 0 else float("nan")
        out.append(r)
    return out


def measurement_set(spec, measured: list[dict], gpu, dtype: str):
    """The measured block as a :class:`cost_models.layer_measurements.MeasurementSet` (F and full B
    per micro-batch, one pass each, the input needing a gradient as in a pipeline stage)."""
    from cost_models.kernels import Protocol, block_shape
    from cost_models.layer_measurements import LayerMeasurement, MeasurementSet
    shape = replace(block_shape(spec, dropout=False), dtype_bytes=4 if dtype == "fp32" else 2)
    layer = LayerMeasurement("block", shape, tuple(r["micro_batch"] for r in measured),
                             tuple(r["f"] for r in measured), tuple(r["b"] for r in measured))
    return MeasurementSet(f"{gpu.name}-measured", gpu, dtype, Protocol(passes=1, input_grad=True), (layer,),
                          ("block",), ())


def write_measurement_set(ms, folder: Path) -> None:
    """``layers.yaml`` + ``block.csv`` in the format
    :func:`cost_models.layer_measurements.load_measurements` reads (milliseconds)."""
    folder.mkdir(parents=True, exist_ok=True)
    layer = ms.layers[0]
    sh = layer.shape
    write_output(
        folder / "layers.yaml",
        "# one block measured by experiments/gpu_check.py (calibration.measure.measure_layers): F and the\n"
        "# full backward, one pass each, input with a gradient\n"
        f"device: {ms.device.name}\nprecision: {ms.precision}\n"
        f"protocol: {{passes: {ms.protocol.passes}, input_grad: {str(ms.protocol.input_grad).lower()}}}\n"
        f"layers:\n  block: {{file: block.csv, arch: {sh.arch}, hidden: {sh.hidden}, heads: {sh.heads}, "
        f"ffn: {sh.ffn}, seq: {sh.seq}, dropout: {str(sh.dropout).lower()}}}\nfit: [block]\n", "measurements")
    with output_file(folder / "block.csv", "measurements", newline="") as f:
        w = csv.writer(f)
        w.writerow(["bs", "time_f", "time_b"])
        for b, tf, tb in zip(layer.batches, layer.time_f, layer.time_b):
            w.writerow([b, f"{tf * 1e3:.6f}", f"{tb * 1e3:.6f}"])


def run_pair(model: str, devices: int, dtype: str, device: str, steps: int, microbatches: int) -> dict:
    """The reference and a DAPPLE run on ``devices`` ranks: losses and median step times."""
    from executor.config import RunConfig
    from executor.launch import run
    from executor.reference import run_reference
    cfg = RunConfig.of(schedule="dapple", devices=devices, microbatches=microbatches, model=model, steps=steps,
                    dtype=dtype, device=device)
    ref = run_reference(cfg)
    res = run(cfg)
    diff = max(abs(a - b) for a, b in zip(ref.losses, res.losses))
    return {"devices": devices, "schedule": "dapple", "microbatches": microbatches, "dtype": dtype,
            "loss_reference": ref.losses[-1], "loss_run": res.losses[-1], "max_loss_difference": diff,
            "step_ms_reference": _step_ms(ref.iteration_times), "step_ms_run": _step_ms(res.iteration_times)}


def zb_spec(model: str):
    """The Zero Bubble paper's ``model`` (1.5B, 6.2B, 14.6B or 28.3B) at Table 4's micro-batch."""
    from experiments.reproduce.zero_bubble import load_configs
    configs = {c.model: c for c in reversed(load_configs()) if c.table == 4}
    if model not in configs:
        raise ValueError(f"--zb-model {model!r}: the Zero Bubble models are {', '.join(sorted(configs, key=float_b))}"
                         " (or none)")
    return configs[model].spec()


def float_b(name: str) -> float:
    return float(name.rstrip("B"))


def llama_tps(spec, n_gpus: int, device: str) -> tuple[int, ...]:
    """T = 1 and the powers of two up to the ranks at hand (GPUs; 2 on the CPU) that divide the
    heads, KV heads and FFN."""
    most = n_gpus if device == "cuda" else 2
    return tuple(t for t in (1 << k for k in range(most.bit_length())) if t <= most and _splits(spec, t))


def _splits(spec, t: int) -> bool:
    try:
        spec.check_tensor_parallel(t)
    except ValueError:
        return False
    return True


def llama_runs(spec, tps, dtype: str, device: str, steps: int, progress=print) -> list[dict]:
    """Per T (and the largest T > 1 again with sequence parallelism): the executor's run of ``spec``
    on one pipeline rank of T processes beside the single-process reference."""
    from executor.config import RunConfig
    from executor.launch import run
    from executor.reference import run_reference
    cases = [(t, False) for t in tps] + ([(max(tps), True)] if max(tps) > 1 else [])
    rows = []
    for t, sp in cases:
        t0 = time.perf_counter()
        cfg = RunConfig.of(schedule="dapple", devices=1, microbatches=2, model=spec, steps=steps, dtype=dtype,
                        device=device, tp=t, sequence_parallel=sp)
        ref, res = run_reference(cfg), run(cfg)
        row = {"tp": t, "sequence_parallel": sp, "dtype": dtype, "loss_reference": ref.losses[-1],
               "loss_run": res.losses[-1],
               "max_loss_difference": max(abs(a - b) for a, b in zip(ref.losses, res.losses)),
               "step_ms_reference": _step_ms(ref.iteration_times), "step_ms_run": _step_ms(res.iteration_times)}
        rows.append(row)
        progress(f"llama: T={t}{' SP' if sp else ''}: loss {row['loss_run']:.4f} vs reference "
                 f"{row['loss_reference']:.4f} (max difference {row['max_loss_difference']:.2e}), step "
                 f"{row['step_ms_run']:.1f} ms vs {row['step_ms_reference']:.1f} ms ({time.perf_counter() - t0:.1f} s)")
    return rows


def _step_ms(times) -> float:
    """The median step time after the first (warm-up) step, milliseconds."""
    later = times[1:] or times
    return statistics.median(later) * 1e3


def _write_csv(rows: list[dict], path: Path) -> None:
    with output_file(path, "table", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", default="gpt3-1.3b", help="GPT model preset or YAML (default gpt3-1.3b)")
    p.add_argument("--gpu", default="h200", help="device preset whose kernel model is checked (default h200)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--micro-batches", default="1,2,4,8,16", help="comma-separated (default 1,2,4,8,16)")
    p.add_argument("--repeats", type=int_in(3, 1000), default=10,
                   help="timed backward runs per measurement (default 10)")
    p.add_argument("--devices", default=None,
                   help="ranks of the runs, comma-separated (default: 1 .. the GPUs at hand; on the CPU 1,2)")
    p.add_argument("--run-layers", type=int_in(1, 100000), default=None,
                   help="blocks of the model in the runs (default: the model's; fewer for a shorter check)")
    p.add_argument("--steps", type=int_in(2, 1000), default=4, help="steps per run (default 4)")
    p.add_argument("--zb-model", default="1.5B",
                   help="Zero Bubble model whose block is measured: 1.5B, 6.2B, 14.6B, 28.3B or none (default 1.5B)")
    p.add_argument("--llama", default="llama3-8b",
                   help="Llama preset or Hugging Face config.json of the Llama runs, or none (default llama3-8b)")
    p.add_argument("--llama-tp", default=None,
                   help="T of the Llama runs, comma-separated (default: 1 and the powers of two up to the GPUs)")
    p.add_argument("--llama-layers", type=int_in(1, 100000), default=2,
                   help="blocks of the Llama model in its runs (default 2)")
    p.add_argument("--llama-seq-len", type=int_in(1, 1 << 20), default=None,
                   help="sequence of the Llama runs (default: 2048, or the model's if shorter)")
    p.add_argument("--moe", default="mixtral-8x7b",
                   help="mixture of experts whose MoE block is measured at EP 1 beside the kernel model, or none "
                        "(default mixtral-8x7b at --moe-seq-len)")
    p.add_argument("--moe-seq-len", type=int_in(1, 1 << 20), default=None,
                   help="sequence of the MoE block (default: 2048, or the model's if shorter)")
    p.add_argument("--out", type=output_dir, default="out/gpu-check")
    args = p.parse_args(argv)
    try:
        mbs = parse_ints(args.micro_batches, "--micro-batches")
        devices = parse_ints(args.devices, "--devices") if args.devices is not None else None
        zb = None if args.zb_model == "none" else zb_spec(args.zb_model)
        llama = None if args.llama == "none" else _llama_spec(args.llama, args.llama_layers, args.llama_seq_len)
        llama_tp = parse_ints(args.llama_tp, "--llama-tp") if args.llama_tp is not None else None
        moe = None if args.moe == "none" else moe_spec(args.moe, args.moe_seq_len)
        return _main(args.device, args.model, args.gpu, args.dtype, mbs, args.repeats, devices,
                     args.run_layers, args.steps, Path(args.out), zb=zb, llama=llama, llama_tp=llama_tp, moe=moe)
    except ValueError as e:
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return 2


def moe_spec(model: str, seq_len: int | None = None):
    """``--moe``: a llama-kind mixture of experts (preset, YAML or config.json) at ``seq_len`` (default
    2048, or the model's if shorter), refused in one line where the kernel model does not price its
    block (:func:`cost_models.kernels.moe_block_times`: dense, latent attention)."""
    from cost_models import load_model
    spec = load_model(model)
    if not spec.is_moe or spec.kind != "llama":
        raise ValueError(f"--moe {model!r} is not a llama-kind mixture of experts (e.g. mixtral-8x7b, tiny-mixtral)")
    if spec.is_mla:
        raise ValueError(f"--moe {model!r} has latent attention, which the kernel model does not price; give a "
                         f"grouped-query one (e.g. mixtral-8x7b)")
    return replace(spec, layers=spec.dense_layers + 1, seq_len=seq_len or min(spec.seq_len, 2048))


def _llama_spec(model: str, layers: int, seq_len: int | None):
    from cost_models import load_model
    spec = load_model(model)
    if spec.kind != "llama":
        raise ValueError(f"--llama {model!r} is a {spec.kind} model; give a Llama preset or config.json")
    return replace(spec, layers=layers, seq_len=seq_len or min(spec.seq_len, 2048))


def _main(device: str, model: str, gpu_name: str, dtype: str, mbs, repeats: int, devices, run_layers, steps: int,
          out: Path, zb=None, llama=None, llama_tp=None, moe=None) -> int:
    import torch

    from cost_models import load_device, load_model
    from cost_models.layer_measurements import error_table, fit_constants
    from executor.device import check_device, select_device

    from .tables import fmt_table, markdown
    check_device(device)                                 # refuses cuda where CUDA is not available
    spec, gpu = load_model(model), load_device(gpu_name)
    gpu.peak(dtype)                                      # the preset has the precision, before any work
    if gpu.kernels is None:
        raise ValueError(f"device preset {gpu.name!r} has no kernel constants (kernels:) to check")
    n_gpus = torch.cuda.device_count() if device == "cuda" else 0
    devices = tuple(devices or (range(1, n_gpus + 1) if device == "cuda" else (1, 2)))
    if device == "cuda" and max(devices) > n_gpus:
        raise ValueError(f"--devices {max(devices)}: only {n_gpus} GPU(s) here, and NCCL needs one per rank")
    layers = run_layers or spec.layers
    if layers < max(devices):
        raise ValueError(f"--devices {max(devices)}: the run has {layers} blocks, at least one per rank is needed")
    if llama is not None:
        llama_tp = tuple(llama_tp or llama_tps(llama, n_gpus, device))
        if device == "cuda" and max(llama_tp) > n_gpus:
            raise ValueError(f"--llama-tp {max(llama_tp)}: only {n_gpus} GPU(s) here, and NCCL needs one per rank")
        for t in llama_tp:                                # T divides the heads, KV heads, FFN (and the sequence)
            llama.check_tensor_parallel(t, "--llama-tp", sequence_parallel=t == max(llama_tp) > 1)
    out.mkdir(parents=True, exist_ok=True)
    dev = select_device(device).device                   # the executor's one device choice (cuda:0 here)
    print(f"gpu_check: {spec.name} block, {dtype}, on {torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu'}"
          f" (kernel model: {gpu.name})")

    measured = measure_block(spec, mbs, dev, dtype, repeats)
    before = layer_table(spec, measured, gpu, dtype)
    _write_csv(before, out / "layers.csv")
    cols = ["micro_batch"] + [f"{k}_{s}" for k in KINDS for s in ("measured_ms", "model_ms", "error")]
    text = ["# gpu_check", "", f"{spec.name} block, {dtype}, kernel model of {gpu.name}", "",
            "## Layers: measured vs kernel model (preset constants)", "", markdown(_rounded(before, cols))]
    print(fmt_table(_rounded(before, cols).to_dict("records"), cols))

    ms = measurement_set(spec, measured, gpu, dtype)
    write_measurement_set(ms, out / "measurements")
    t0 = time.perf_counter()
    fitted, rms = fit_constants(ms)
    after = error_table(ms, fitted)
    start = error_table(ms)
    write_output(
        out / "fitted-constants.yaml",
        f"# kernel constants of {gpu.name} fitted on {spec.name} blocks ({dtype}), rms log error {rms:.3f}\n"
        "kernels: {" + ", ".join(f"{k}: {v:.6g}" for k, v in fitted.to_dict().items()) + "}\n", "constants")
    fit_rows = [{"micro_batch": a["batch"], "f_error_preset": s["f_error"], "f_error_fitted": a["f_error"],
                 "b_error_preset": s["b_error"], "b_error_fitted": a["b_error"]} for s, a in zip(start, after)]
    print(f"fit ({time.perf_counter() - t0:.1f} s): rms log error {rms:.3f}; constants: "
          + ", ".join(f"{k} {v:.4g}" for k, v in fitted.to_dict().items()))
    print(fmt_table(_rounded(fit_rows, list(fit_rows[0])).to_dict("records"), list(fit_rows[0])))
    text += ["", "## Kernel constants fitted on these measurements", "",
             f"rms log error {rms:.3f}: " + ", ".join(f"{k} {v:.4g}" for k, v in fitted.to_dict().items()), "",
             markdown(_rounded(fit_rows, list(fit_rows[0])))]

    run_model = replace(spec, layers=layers)
    runs = []
    for d in devices:
        t0 = time.perf_counter()
        row = run_pair(run_model, d, dtype, device, steps, microbatches=2 * d)
        runs.append(row)
        print(f"runs: D={d}: loss {row['loss_run']:.4f} vs reference {row['loss_reference']:.4f} "
              f"(max difference {row['max_loss_difference']:.2e}), step {row['step_ms_run']:.1f} ms vs "
              f"{row['step_ms_reference']:.1f} ms ({time.perf_counter() - t0:.1f} s)")
    _write_csv(runs, out / "runs.csv")
    text += ["", f"## Runs: pipetwin (dapple) vs the single-process reference, {layers} blocks", "",
             markdown(_rounded(runs, list(runs[0])))]
    wrote = ["report.md", "layers.csv", "runs.csv", "fitted-constants.yaml", "measurements/"]

    if zb is not None:
        print(f"zero bubble: {zb.name} block at micro-batch {zb.micro_batch}, sequence {zb.seq_len}")
        zb_rows = layer_table(zb, measure_block(zb, [zb.micro_batch], dev, dtype, repeats), gpu, dtype)
        _write_csv(zb_rows, out / "zb-layer.csv")
        print(fmt_table(_rounded(zb_rows, cols).to_dict("records"), cols))
        text += ["", f"## Zero Bubble layer: {zb.name} block (h {zb.hidden}, {zb.heads} heads, s {zb.seq_len}), "
                 f"measured vs kernel model of {gpu.name}", "", markdown(_rounded(zb_rows, cols))]
        wrote.append("zb-layer.csv")

    if llama is not None:
        print(f"llama: {llama.name}, {llama.layers} blocks, sequence {llama.seq_len}, T = "
              + ", ".join(map(str, llama_tp)))
        lrows = llama_runs(llama, llama_tp, dtype, device, steps)
        _write_csv(lrows, out / "llama-runs.csv")
        text += ["", f"## Llama runs: the tensor-parallel stage vs the single-process reference, {llama.name}, "
                 f"{llama.layers} blocks, sequence {llama.seq_len}", "", markdown(_rounded(lrows, list(lrows[0])))]
        wrote.append("llama-runs.csv")
    if moe is not None:
        print(f"moe: {moe.name} block (EP 1: {moe.experts} experts, top-{moe.top_k}) at micro-batch "
              f"{', '.join(map(str, mbs))}, sequence {moe.seq_len}")
        mrows = moe_table(moe, measure_moe_block(moe, mbs, dev, dtype, repeats), gpu, dtype)
        _write_csv(mrows, out / "moe-layer.csv")
        print(fmt_table(_rounded(mrows, cols).to_dict("records"), cols))
        text += ["", f"## MoE layer: {moe.name} block at EP 1 ({moe.experts} experts, top-{moe.top_k}, s "
                 f"{moe.seq_len}), measured vs kernel model of {gpu.name} at the routed rows per expert", "",
                 markdown(_rounded(mrows, cols))]
        wrote.append("moe-layer.csv")
    write_output(out / "report.md", "\n".join(text) + "\n", "report")
    print(f"wrote {out}/: " + ", ".join(wrote))
    return 0


def _rounded(rows: list[dict], cols: list[str]):
    import pandas as pd
    df = pd.DataFrame(rows)[cols]
    for c in cols:
        if c.endswith("_error") or c.startswith(("f_error", "b_error")):
            df[c] = df[c].map(lambda v: f"{v:+.1%}")
        elif df[c].dtype.kind == "f":
            df[c] = df[c].map(lambda v: f"{v:.4g}")
    return df


if __name__ == "__main__":
    sys.exit(main())
