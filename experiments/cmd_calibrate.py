"""``pipetwin calibrate``: measure this machine with the executor's code and write a profile.

``--model`` is a GPT preset / YAML file, or a model file ``PATH.py:FUNC`` (see
:mod:`executor.user_model`): then every one of its layers is measured (F, B, split B and W, kept
bytes, output bytes, parameters, FLOPs) at ``--micro-batch`` samples, and the profile feeds
``pipetwin simulate / compare / bubbles --profile``, ``pipetwin plan --profile`` and
``pipetwin validate --profile`` for that model.
"""
from __future__ import annotations

from pathlib import Path

from .options import add_options

NAME = "calibrate"
HELP = "measure per-layer, P2P, all-reduce and runtime costs here; write a profile the simulator loads"


def add_arguments(p):
    add_options(p, NAME)


def calibrate_with_progress(model: str, ranks: int, repeats: int = 20, *, micro_batch: int | None = None,
                            runtime_steps: int = 20, runtime_repeats: int = 3, dtype: str = "fp32", tp: int = 1,
                            ep: int = 1):
    """:func:`calibration.calibrate` with a progress bar on stderr (one tick per stage). A bad
    ``--model`` (preset, YAML file or model file) fails here, before any measurement."""
    from tqdm import tqdm

    from calibration import calibrate
    from cost_models import is_model_ref, load_model

    if is_model_ref(model):
        if tp > 1:
            raise ValueError(f"--tp {tp} splits the built-in GPT's layers; a model file's layers are not split "
                             f"(calibrate {model} with --tp 1)")
        if ep > 1:
            raise ValueError(f"--ep {ep} splits a mixture of experts' routed experts; a model file's layers are not "
                             f"split (calibrate {model} with --ep 1)")
        from executor.user_model import DEFAULT_MICRO_BATCH, stack_layout
        n = stack_layout(model, 1, micro_batch=micro_batch or DEFAULT_MICRO_BATCH).num_layers
        layers = [f"layer {i}" for i in range(n)]
    else:
        from calibration.host import check_ep
        spec = load_model(model)
        if tp > 1:
            from executor.config import check_tensor_parallel
            check_tensor_parallel(spec, tp)
        check_ep(spec, ep, tp)
        layers = ["layer embedding", "layer block", "layer head"] + (["expert layers"] if spec.is_moe else [])
    stages = ["layers", *layers, "optimizer", "communication", *(["all-to-all"] if ep > 1 else []),
              "runtime (traced runs)"]
    with tqdm(total=len(stages), desc="calibrating", unit="step") as bar:
        def progress(msg):
            bar.set_postfix_str(msg)
            if msg in stages:   # the traced runs' rounds report too: they do not advance the bar
                bar.update(1)
        return calibrate(model, ranks=ranks, repeats=repeats, progress=progress, micro_batch=micro_batch,
                         runtime_steps=runtime_steps, runtime_repeats=runtime_repeats, dtype=dtype, tp=tp, ep=ep)


def save_measured(prof, out: Path) -> Path:
    """Save the profile to ``out``; when that write fails at the end (a disk filled up during the
    measurement), keep the measurement in a file of the temporary folder and name both in the one
    line of the error, so minutes of measuring are not lost."""
    import tempfile

    from cost_models import save_profile
    from cost_models.files import FileError
    try:
        return save_profile(prof, out)
    except FileError as e:
        try:
            kept = save_profile(prof, Path(tempfile.mkdtemp(prefix="pipetwin-calibrate-")) / out.name)
        except FileError:
            raise e from None
        raise FileError(f"{e}; the measured profile was kept in {kept} (copy it where you want it)") from None


def main(args) -> int:
    from calibration import sitting_problems

    if args.repeats < 3:
        raise ValueError(f"--repeats must be >= 3; got {args.repeats}")
    prof = calibrate_with_progress(args.model, args.ranks, args.repeats, micro_batch=args.micro_batch,
                                   runtime_steps=args.runtime_steps, runtime_repeats=args.runtime_repeats,
                                   dtype=args.dtype, tp=args.tp, ep=args.ep)
    out = Path(args.out)
    save_measured(prof, out)
    if prof.is_stack:
        _print_stack(prof)
        f, b = sum(t.f for t in prof.layers), sum(t.b for t in prof.layers)
        compute = (f"model {prof.model_name} at micro-batch {prof.micro_batch}: {prof.model.num_layers} layers, "
                   f"F {f * 1e3:.3f} ms, B {b * 1e3:.3f} ms in all")
    else:
        blk = prof.layers[1]
        compute = (f"block F {blk.f * 1e3:.3f} ms, B {blk.b * 1e3:.3f} ms "
                   f"(split {blk.b_input * 1e3:.3f} + {blk.w * 1e3:.3f} = {(blk.b_input + blk.w) / blk.b:.2f} x B)")
    print(f"profile {prof.name} ({prof.precision}): {compute}; P2P {prof.p2p.latency * 1e6:.0f} us + "
          f"{prof.p2p.bandwidth / 1e9:.2f} GB/s; all-reduce step {prof.allreduce.latency * 1e6:.0f} us + "
          f"{prof.allreduce.bandwidth / 1e9:.2f} GB/s; overheads "
          + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in prof.overhead) + f"; {prof.cores} cores"
          + (f"; T={prof.tp}: layers per TP rank, TP all-reduce step {prof.tp_allreduce.latency * 1e6:.0f} us + "
             f"{prof.tp_allreduce.bandwidth / 1e9:.2f} GB/s" if prof.tp > 1 else "")
          + (f", compute {prof.oversubscribed_slowdown:.2f}x slower with more ranks than cores"
             if prof.oversubscribed_slowdown > 1 else "")
          + (f", time-sliced in {prof.time_slice * 1e3:.0f} ms slices with more ranks than cores"
             if prof.time_slice else ""))
    if prof.expert_layers:
        print(moe_line(prof))
    print(f"wrote {out}")
    for p in sitting_problems(prof):
        print(f"warning: calibration runs did not settle ({p}); validate refuses this profile")
    return 0


def moe_line(prof) -> str:
    """The expert layers (F + B measured alone, ms) and, at E > 1, the all-to-all fit with its residual
    and the points it was fitted on."""
    ex = dict(prof.expert_layers)
    parts = ", ".join(f"{k} {(t.f + (t.b if t.b is not None else t.b_input + t.w)) * 1e3:.3f} ms"
                      for k, t in ex.items())
    line = f"expert layers (F + B alone): {parts}"
    if prof.ep > 1:
        a = prof.all_to_all
        pts = prof.meta.get("a2a_samples") or []
        line += (f"; EP {prof.ep} all-to-all {a.latency * 1e6:.0f} us + {a.bandwidth / 1e9:.2f} GB/s (largest miss on "
                 f"its {len(pts)} points {prof.a2a_residual:.1%}: "
                 + ", ".join(f"{int(b) >> 10} KiB {t * 1e3:.2f} ms" for b, t in pts) + ")")
    return line


def _print_stack(prof) -> None:
    """One row per layer of a model file's profile (times in the run, as fitted)."""
    from .tables import fmt_table
    st = prof.model
    rows = [{"layer": i, "name": name, "params": int(p), "f_ms": t.f * 1e3, "b_ms": t.b * 1e3,
             "b_input_ms": t.b_input * 1e3, "w_ms": t.w * 1e3, "kept_B": int(k), "out_B": int(o),
             "fwd_MFLOP": fl[0] / 1e6}
            for i, (name, p, t, k, o, fl) in enumerate(zip(st.layer_names, st.params, prof.layers, st.act_first,
                                                           st.out_bytes, st.flops))]
    print(fmt_table(rows, list(rows[0]), {"f_ms": "{:.3f}", "b_ms": "{:.3f}", "b_input_ms": "{:.3f}",
                                          "w_ms": "{:.3f}", "fwd_MFLOP": "{:.3f}"}))
