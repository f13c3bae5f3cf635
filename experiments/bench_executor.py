"""Throughput of pipetwin's executor against torch.distributed.pipelining's own runtime.

Same GPT (``executor.model``, same split and weights), same micro-batches, D = 2 ranks, gloo on
the CPU, one spawned world for everything, side by side:

    pipetwin dapple        vs  torch Schedule1F1B               (2 stages)
    pipetwin interleaved   vs  torch ScheduleInterleaved1F1B    (v = 2: 4 stages, looped)

Each variant runs ``--warmup`` steps, then ``--steps`` timed optimizer steps (barrier before and
after, wall clock of rank 0); variants alternate for ``--rounds`` rounds and the median is kept,
which evens out other load on the machine. Throughput is sequences per second; the ratio is
pipetwin / torch (> 1: pipetwin is faster). pipetwin runs with its tracing and activation-memory
measurement on (its default), and once more with memory measurement off.

    python -m experiments.bench_executor [--model tiny|FILE.yaml] [--microbatches 8] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

PAIRS = [("dapple", "Schedule1F1B", 1), ("interleaved", "ScheduleInterleaved1F1B", 2)]
LARGER = {"name": "bench-small", "kind": "gpt", "layers": 8, "hidden": 256, "heads": 8, "seq_len": 128,
          "vocab": 512, "micro_batch": 4, "dtype_bytes": 4}


def _ours(cfg, rank, world, ctx, groups):
    from executor.config import lowered_schedule
    from executor.worker import Job, setup_rank
    rs = setup_rank(Job(cfg, lowered_schedule(cfg)), rank, world, ctx, groups)

    def step(k):
        rs.runtime.run_step(k)
    return step


def _torch(cfg, schedule_cls: str, chunks: int, rank, world, ctx):
    from torch.distributed import pipelining as pp

    from executor.data import TokenSource
    from executor.model import StageModule, make_optimizer, stage_module
    spec = cfg.spec()
    D, N = world, cfg.microbatches
    S = D * chunks
    stage_ids = [rank + D * k for k in range(chunks)]
    modules = [stage_module(spec, S, s, seed=cfg.seed).to(ctx.device) for s in stage_ids]
    stages = [pp.PipelineStage(m, s, S, ctx.device) for m, s in zip(modules, stage_ids)]
    cls = getattr(pp, schedule_cls)
    sched = cls(stages[0] if chunks == 1 else stages, n_microbatches=N, loss_fn=StageModule.loss)
    optimizer = make_optimizer([p for m in modules for p in m.parameters()], cfg.optimizer, cfg.lr)
    data = TokenSource(spec, cfg.seed)
    has_first, has_last = 0 in stage_ids, S - 1 in stage_ids

    def step(k):
        batches = [data.batch(k, g, N) for g in range(N)]
        x = torch.cat([b[0] for b in batches]).to(ctx.device)
        y = torch.cat([b[1] for b in batches]).to(ctx.device)
        kwargs = {"target": y, "losses": []} if has_last else {}
        if has_first:
            sched.step(x, **kwargs)
        else:
            sched.step(**kwargs)
        optimizer.step()
        optimizer.zero_grad()
    return step


def _timed(step, warmup: int, steps: int, start: int) -> float:
    for k in range(warmup):
        step(start + k)
    dist.barrier()
    t0 = time.perf_counter()
    for k in range(steps):
        step(start + warmup + k)
    dist.barrier()
    return time.perf_counter() - t0


def bench_rank(payload, rank, world, local_rank, local_world):
    """Target of executor.launch.launch: every rank builds every variant, rank 0 returns timings."""
    from executor.worker import ProcessGroups, init_world
    base, rounds, warmup, steps = payload["config"], payload["rounds"], payload["warmup"], payload["steps"]
    ctx = init_world("cpu", rank, world, local_rank, local_world, base.timeout)
    groups = ProcessGroups(world, ctx.backend)
    variants = {}
    for ours, theirs, chunks in PAIRS:
        cfg = base.with_(schedule=ours, chunks=chunks if chunks > 1 else base.chunks)
        variants[f"pipetwin {ours}"] = _ours(cfg, rank, world, ctx, groups)
        variants[f"pipetwin {ours} (no memory measurement)"] = _ours(cfg.with_(measure_memory=False), rank, world,
                                                                    ctx, groups)
        variants[f"torch {theirs}"] = _torch(cfg, theirs, chunks, rank, world, ctx)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds):
        for name, step in variants.items():
            times[name].append(_timed(step, warmup, steps, start=r * (warmup + steps)))
    dist.barrier()
    dist.destroy_process_group()
    return times if rank == 0 else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_executor", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="preset or YAML (default tiny); 'larger' = a 256-wide GPT")
    p.add_argument("--microbatches", "-N", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from executor.config import RunConfig
    from executor.launch import launch
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "larger":
            model = str(Path(tmp) / "bench-small.yaml")
            Path(model).write_text(json.dumps(LARGER))  # JSON is YAML
        cfg = RunConfig(schedule="dapple", devices=2, microbatches=args.microbatches, model=model, steps=args.steps,
                        optimizer="sgd", lr=1e-3, device="cpu", timeout=120.0)
        spec = cfg.spec()
        times = launch("experiments.bench_executor:bench_rank",
                       {"config": cfg, "rounds": args.rounds, "warmup": args.warmup, "steps": args.steps}, 2)
    seqs = args.steps * args.microbatches * spec.micro_batch
    thr = {k: seqs / statistics.median(v) for k, v in times.items()}
    rows = []
    for ours, theirs, _chunks in PAIRS:
        a, b = thr[f"pipetwin {ours}"], thr[f"torch {theirs}"]
        c = thr[f"pipetwin {ours} (no memory measurement)"]
        rows.append({"pair": f"{ours} vs {theirs}", "pipetwin_seq_per_s": a, "pipetwin_nomem_seq_per_s": c,
                     "torch_seq_per_s": b, "ratio": a / b, "ratio_nomem": c / b})
    if args.json:
        json.dump({"model": spec.name, "devices": 2, "microbatches": args.microbatches, "backend": "gloo",
                   "steps": args.steps, "rounds": args.rounds, "results": rows,
                   "raw_seconds": times}, sys.stdout, indent=2)
        print()
        return 0
    print(f"model {spec.name} (L={spec.layers} h={spec.hidden} s={spec.seq_len} b={spec.micro_batch}), D=2, "
          f"N={args.microbatches}, gloo/CPU, median of {args.rounds} rounds x {args.steps} steps")
    for r in rows:
        print(f"  {r['pair']:<45} pipetwin {r['pipetwin_seq_per_s']:8.1f} seq/s "
              f"(no mem {r['pipetwin_nomem_seq_per_s']:8.1f})  torch {r['torch_seq_per_s']:8.1f} seq/s  "
              f"ratio {r['ratio']:.2f} (no mem {r['ratio_nomem']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
