"""``pipetwin calibrate``: measure this machine with the executor's code and write a profile."""
from __future__ import annotations

from pathlib import Path

NAME = "calibrate"
HELP = "measure per-layer, P2P, all-reduce and runtime costs here; write a profile the simulator loads"


def add_arguments(p):
    p.add_argument("--model", default="tiny", help="model preset or YAML file (default tiny)")
    p.add_argument("--ranks", type=int, default=2, help="ranks the predicted runs put on this host (default 2)")
    p.add_argument("--repeats", type=int, default=20, help="timings per measurement (median)")
    p.add_argument("--out", default="out/calibration.yaml", help="profile file (default out/calibration.yaml)")


def main(args) -> int:
    from tqdm import tqdm

    from calibration import calibrate, sitting_problems
    from cost_models import save_profile

    if args.ranks < 1 or args.repeats < 3:
        raise ValueError("--ranks must be >= 1 and --repeats >= 3")
    stages = ["layers", "layer embedding", "layer block", "layer head", "optimizer", "communication",
              "runtime (traced runs)"]
    with tqdm(total=len(stages), desc="calibrating", unit="step") as bar:
        def progress(msg):
            bar.set_postfix_str(msg)
            if msg in stages:   # the traced runs' rounds report too: they do not advance the bar
                bar.update(1)
        prof = calibrate(args.model, ranks=args.ranks, repeats=args.repeats, progress=progress)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
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
    for p in sitting_problems(prof):
        print(f"warning: host busy while calibrating ({p}); validate refuses this profile")
    return 0
