"""``pipetwin calibrate``: measure this machine with the executor's code and write a profile."""
from __future__ import annotations

from pathlib import Path

from .checks import output_file, positive_int

NAME = "calibrate"
HELP = "measure per-layer, P2P, all-reduce and runtime costs here; write a profile the simulator loads"


def add_arguments(p):
    p.add_argument("--model", default="tiny", help="model preset or YAML file (default tiny)")
    p.add_argument("--ranks", type=positive_int, default=2,
                   help="ranks the predicted runs put on this host (default 2)")
    p.add_argument("--repeats", type=positive_int, default=20, help="timings per measurement (median, >= 3)")
    p.add_argument("--out", default="out/calibration.yaml", type=output_file,
                   help="profile file (default out/calibration.yaml)")


def calibrate_with_progress(model: str, ranks: int, repeats: int = 20):
    """:func:`calibration.calibrate` with a progress bar on stderr (one tick per stage)."""
    from tqdm import tqdm

    from calibration import calibrate, fit_ranks

    stages = ["layers", "layer embedding", "layer block", "layer head", "optimizer", "communication",
              "runtime (traced runs)"]
    if ranks > fit_ranks(ranks):
        stages.append("oversubscribed cores (traced runs)")
    with tqdm(total=len(stages), desc="calibrating", unit="step") as bar:
        def progress(msg):
            bar.set_postfix_str(msg)
            bar.update(1)
        return calibrate(model, ranks=ranks, repeats=repeats, progress=progress)


def main(args) -> int:
    from cost_models import load_model, save_profile

    if args.repeats < 3:
        raise ValueError(f"--repeats must be >= 3; got {args.repeats}")
    load_model(args.model)   # a bad --model fails before any measurement
    prof = calibrate_with_progress(args.model, args.ranks, args.repeats)
    out = Path(args.out)
    save_profile(prof, out)
    blk = prof.layers[1]
    print(f"profile {prof.name}: block F {blk.f * 1e3:.3f} ms, B {blk.b * 1e3:.3f} ms "
          f"(split {blk.b_input * 1e3:.3f} + {blk.w * 1e3:.3f}); P2P {prof.p2p.latency * 1e6:.0f} us + "
          f"{prof.p2p.bandwidth / 1e9:.2f} GB/s; all-reduce step {prof.allreduce.latency * 1e6:.0f} us + "
          f"{prof.allreduce.bandwidth / 1e9:.2f} GB/s; overheads "
          + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in prof.overhead) + f"; {prof.cores} cores"
          + (f", compute {prof.oversubscribed_slowdown:.2f}x slower with more ranks than cores"
             if prof.oversubscribed_slowdown > 1 else ""))
    print(f"wrote {out}")
    return 0
