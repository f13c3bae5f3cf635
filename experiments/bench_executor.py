"""Throughput of pipetwin's executor against torch.distributed.pipelining's own runtime.

Same GPT (``executor.model``, same split and weights), same micro-batches, same optimizer, D = 2
ranks, gloo on the CPU, one spawned world for everything, side by side, for every schedule both
have:

    pipetwin dapple        vs  torch Schedule1F1B                  (1 stage per rank)
    pipetwin interleaved   vs  torch ScheduleInterleaved1F1B       (v = 2: 4 stages, looped)
    pipetwin zb-h1         vs  torch ScheduleInterleavedZeroBubble (1 stage per rank: the same order)
    pipetwin zb-v          vs  torch ScheduleZBVZeroBubble         (V placement, split backward)
    pipetwin dualpipe-v    vs  torch ScheduleDualPipeV             (V placement, split backward)

pipetwin runs with its tracing and activation-memory metering on (its default), and once more
with metering off (``--no-memory``): the metering's own cost. Every variant first runs
``--warmup`` untimed steps; then a round times each variant once (``--steps`` optimizer steps,
barrier before and after, rank 0's wall clock). The three variants of a pair run back to back,
the pairs' order rotates from round to round and a pair's order reverses every other round, so
no variant always runs first or always follows the same one, and a slow spell of this shared
machine hits all of them alike. Per pair the ratio is pipetwin's throughput over torch's *within
each round*; the table shows its median over the rounds and the spread (the range of the per-round
ratios, and of each variant's step times: the machine's own noise). Each timed run also reads how
many cores' worth of CPU other processes used meanwhile (:mod:`executor.host`); ``quiet`` is the
median ratio over the rounds where both runs of the pair saw at most ``--max-foreign`` cores of it
(and how many rounds those were). ``--model tiny`` (default) or ``wide``, a 256-wide GPT, or a
preset / YAML.

    python -m experiments.bench_executor [--model tiny|wide|FILE.yaml] [-N 8] [--rounds 15] [--json]

The TP case (``--schedules`` name ``tp``) compares the blocks of tensor parallelism at T = 2 (the
same 2 ranks, gloo): the model's L transformer blocks built by pipetwin with its TP group
(:mod:`executor.tensor_parallel`, Megatron-style autograd functions) against the same blocks under
PyTorch's own tensor-parallel API (``parallelize_module`` with ``ColwiseParallel`` on the QKV and
MLP input, ``RowwiseParallel`` on the output projections, on a ``DeviceMesh``; DTensor weights and
gradients), same weights (the fused QKV rows put in per-head order first, so that both shard the
heads alike), same input: a step is N micro-batches of forward, backward of the mean square of
the output, then the SGD step. Its ratio is per round as for the pipelines (no metering variant:
the blocks run bare on both sides).

``--profile-step SCHEDULE`` instead runs cProfile over the steps of one pipetwin schedule and one
torch schedule on both ranks and prints where the time goes. ``--profile-ops SCHEDULE`` compares the
two at the level of torch's operators, per rank: ``--rounds`` steps of each, alternating, each between
two barriers, with the process's CPU, page faults and context switches per step (medians, and the
paired difference torch - pipetwin of the same round with its quartiles), then ``--steps`` steps of
each under ``torch.profiler`` (one at a time, alternating): every operator's self CPU time and calls
per step side by side (the sends and receives, the optimizer, zeroing and scaling of gradients,
copies included).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

# (pipetwin schedule, torch schedule class, stages per rank, V placement)
PAIRS = [("dapple", "Schedule1F1B", 1, False), ("interleaved", "ScheduleInterleaved1F1B", 2, False),
         ("zb-h1", "ScheduleInterleavedZeroBubble", 1, False), ("zb-v", "ScheduleZBVZeroBubble", 2, True),
         ("dualpipe-v", "ScheduleDualPipeV", 2, True)]
TP = ("tp", "parallelize_module", 2)    # (name, torch's API, T): the tensor-parallel blocks' pair
WIDE = {"name": "bench-wide", "kind": "gpt", "layers": 8, "hidden": 256, "heads": 8, "seq_len": 128,
        "vocab": 512, "micro_batch": 4, "dtype_bytes": 4}


def _ours(cfg, rank, world, ctx, groups):
    from executor.config import lowered_schedule
    from executor.worker import Job, setup_rank
    rs = setup_rank(Job(cfg, lowered_schedule(cfg)), rank, world, ctx, groups)

    def step(k):
        rs.runtime.run_step(k)
    return step


def _torch(cfg, schedule_cls: str, chunks: int, v_shape: bool, rank, world, ctx):
    from torch.distributed import pipelining as pp

    from executor.data import TokenSource
    from executor.model import lm_loss, make_optimizer, stage_module
    spec = cfg.spec()
    D, N = world, cfg.layout.microbatches
    S = D * chunks
    stage_ids = [rank, S - 1 - rank] if v_shape else [rank + D * k for k in range(chunks)]
    modules = [stage_module(spec, S, s, seed=cfg.seed).to(ctx.device) for s in stage_ids]
    stages = [pp.PipelineStage(m, s, S, ctx.device) for m, s in zip(modules, stage_ids)]
    cls = getattr(pp, schedule_cls)
    single = issubclass(cls, pp.schedules.PipelineScheduleSingle)
    sched = cls(stages[0] if single else stages, n_microbatches=N,
                loss_fn=lm_loss)
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


def _tp_blocks(spec, tp, seed: int) -> torch.nn.Module:
    """The spec's L transformer blocks (``executor.model.Block``) on one TP rank (``tp``: its place in
    the group; SINGLE: whole), initialised as the executor does (the whole model's weights, sharded)."""
    from executor.model import Block, init_parameters
    blocks = torch.nn.Sequential(*[Block(spec, tp) for _ in range(spec.layers)])
    init_parameters(blocks, seed, spec.layers, tp)
    return blocks


def _tp_step(blocks, spec, optimizer, microbatches: int, seed: int):
    """One step of a TP stack: ``microbatches`` forward + backward passes of the mean square of the
    output on the same replicated inputs on every rank, then the optimizer step; returns the loss sum."""
    def step(k):
        total = 0.0
        for g in range(microbatches):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + k * 1009 + g)
            x = torch.randn(spec.micro_batch, spec.seq_len, spec.hidden, generator=gen)
            loss = blocks(x).pow(2).mean()
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        return total
    return step


def tp_variants(cfg, rank, world, groups) -> dict:
    """The TP pair's two steps (see the module docstring) on ``world`` = T ranks: pipetwin's blocks on
    its TP group and torch's blocks under ``parallelize_module`` on a 1-D ``DeviceMesh``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from executor.model import make_optimizer
    from executor.tensor_parallel import TensorParallel
    spec, T = cfg.spec(), world
    spec.check_tensor_parallel(T)
    ours = _tp_blocks(spec, TensorParallel(T, rank, groups.for_ranks(range(T), rank, "cpu")), cfg.seed)
    theirs = _tp_blocks(spec, TensorParallel(), cfg.seed)
    mesh = init_device_mesh("cpu", (T,))
    plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(), "fc": ColwiseParallel(),
            "out": RowwiseParallel()}
    with torch.no_grad():
        for blk in theirs:
            # rows [Q; K; V] -> [q0; k0; v0; q1; ...]: a contiguous shard holds whole heads of each
            for p in (blk.attn.qkv.weight, blk.attn.qkv.bias):
                p.copy_(p.reshape(3, T, -1, *p.shape[1:]).transpose(0, 1).reshape(p.shape))
            parallelize_module(blk, mesh, plan)
            blk.attn.heads = spec.heads // T       # the attention computes this rank's heads
    name = f"pipetwin TP block (T={T})"
    return {name: _tp_step(ours, spec, make_optimizer(list(ours.parameters()), cfg.optimizer, cfg.lr),
                           cfg.layout.microbatches, cfg.seed),
            f"torch {TP[1]} (T={T})": _tp_step(theirs, spec, make_optimizer(list(theirs.parameters()),
                                                                              cfg.optimizer, cfg.lr),
                                               cfg.layout.microbatches, cfg.seed)}


def tp_pair_names(T: int = TP[2]) -> list[str]:
    return [f"pipetwin TP block (T={T})", f"torch {TP[1]} (T={T})"]


def tp_check_rank(payload, rank, world, local_rank, local_world):
    """Target for the test: both TP variants' losses over ``steps`` steps (rank 0)."""
    from executor.worker import ProcessGroups, init_world
    cfg = payload["config"]
    ctx = init_world("cpu", rank, world, local_rank, local_world, cfg.timeout)
    variants = tp_variants(cfg, rank, world, ProcessGroups(world, ctx.backend))
    losses = {name: [step(k) for k in range(payload["steps"])] for name, step in variants.items()}
    dist.barrier()
    dist.destroy_process_group()
    return losses if rank == 0 else None


def _variants(base, rank, world, ctx, groups, pairs):
    out = {}
    for ours, theirs, chunks, v_shape in pairs:
        cfg = base.with_(schedule=ours, chunks=chunks)
        out[f"pipetwin {ours}"] = _ours(cfg, rank, world, ctx, groups)
        out[f"pipetwin {ours} (no memory metering)"] = _ours(cfg.with_(measure_memory=False), rank, world,
                                                             ctx, groups)
        out[f"torch {theirs}"] = _torch(cfg, theirs, chunks, v_shape, rank, world, ctx)
    return out


def _pair_names(ours: str, theirs: str) -> list[str]:
    return [f"pipetwin {ours}", f"pipetwin {ours} (no memory metering)", f"torch {theirs}"]


def round_order(blocks: list[list[str]], r: int) -> list[str]:
    """The variants of round ``r``: the blocks (one pair's variants each, kept back to back)
    rotated by ``r``, each block reversed in odd rounds."""
    k = r % len(blocks)
    return [name for b in blocks[k:] + blocks[:k] for name in (b if r % 2 == 0 else b[::-1])]


def _timed(step, steps: int, start: int) -> tuple[float, object]:
    """Wall seconds of ``steps`` steps between two barriers, and this rank's CPU window over them."""
    from executor.host import CpuMeter
    dist.barrier()
    meter = CpuMeter()
    t0 = time.perf_counter()
    for k in range(steps):
        step(start + k)
    dist.barrier()
    seconds = time.perf_counter() - t0
    return seconds, meter.stop()


def bench_rank(payload, rank, world, local_rank, local_world):
    """Target of executor.launch.launch: every rank builds every variant, rank 0 returns each
    variant's seconds per round and the cores' worth of other processes' CPU during each."""
    from executor.host import foreign_cores
    from executor.worker import ProcessGroups, init_world
    base, rounds, warmup, steps = payload["config"], payload["rounds"], payload["warmup"], payload["steps"]
    pairs = [p for p in PAIRS if p[0] in payload["schedules"]]
    ctx = init_world("cpu", rank, world, local_rank, local_world, base.timeout)
    groups = ProcessGroups(world, ctx.backend)
    variants = _variants(base, rank, world, ctx, groups, pairs)
    blocks = [_pair_names(ours, theirs) for ours, theirs, _, _ in pairs]
    if TP[0] in payload["schedules"]:
        variants |= tp_variants(base, rank, world, groups)
        blocks.append(tp_pair_names(world))
    for step in variants.values():
        for k in range(warmup):
            step(k)
    times: dict[str, list[float]] = {k: [] for k in variants}
    windows: dict[str, list] = {k: [] for k in variants}
    for r in range(rounds):
        for name in round_order(blocks, r):
            seconds, window = _timed(variants[name], steps, start=warmup + r * steps)
            times[name].append(seconds)
            windows[name].append(window)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(windows, gathered, dst=0)
    dist.barrier()
    dist.destroy_process_group()
    if rank:
        return None
    foreign = {k: [foreign_cores([w[k][r] for w in gathered]) for r in range(rounds)] for k in variants}
    cpu = {k: [sum(w[k][r].own for w in gathered) for r in range(rounds)] for k in variants}
    return {"seconds": times, "foreign_cores": foreign, "cpu_seconds": cpu}


def profile_rank(payload, rank, world, local_rank, local_world):
    """Target for ``--profile-step``: cProfile of the steps of one pipetwin and one torch schedule."""
    from executor.worker import ProcessGroups, init_world
    base, steps = payload["config"], payload["steps"]
    pairs = [p for p in PAIRS if p[0] == payload["schedule"]]
    ctx = init_world("cpu", rank, world, local_rank, local_world, base.timeout)
    groups = ProcessGroups(world, ctx.backend)
    variants = _variants(base, rank, world, ctx, groups, pairs)
    report = {}
    for name, step in variants.items():
        for k in range(3):
            step(k)
        prof = cProfile.Profile()
        dist.barrier()
        prof.enable()
        t0 = time.perf_counter()
        for k in range(steps):
            step(10 + k)
        seconds = time.perf_counter() - t0
        prof.disable()
        dist.barrier()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(payload["lines"])
        report[name] = (seconds / steps, buf.getvalue())
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(report, gathered, dst=0)
    dist.destroy_process_group()
    return gathered if rank == 0 else None


def _usage() -> dict:
    """This process's CPU, page faults and context switches so far, and the clock."""
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall_ms": time.perf_counter() * 1e3, "cpu_ms": (r.ru_utime + r.ru_stime) * 1e3, "sys_ms": r.ru_stime * 1e3,
            "minflt": r.ru_minflt, "vcsw": r.ru_nvcsw, "ivcsw": r.ru_nivcsw}


def ops_rank(payload, rank, world, local_rank, local_world):
    """Target for ``--profile-ops`` (see the module docstring): per variant (pipetwin with metering,
    torch) the per-step usage of every round and the profiled operators."""
    from torch.profiler import ProfilerActivity, profile

    from executor.worker import ProcessGroups, init_world
    base = payload["config"]
    pairs = [p for p in PAIRS if p[0] == payload["schedule"]]
    ctx = init_world("cpu", rank, world, local_rank, local_world, base.timeout)
    groups = ProcessGroups(world, ctx.backend)
    variants = {k: v for k, v in _variants(base, rank, world, ctx, groups, pairs).items() if "no memory" not in k}
    names = list(variants)
    step = 0
    for name in names:
        for _ in range(2):
            variants[name](step)
            step += 1
    usage = {k: [] for k in names}
    for r in range(payload["rounds"]):
        for name in (names if r % 2 == 0 else names[::-1]):
            dist.barrier()
            u0 = _usage()
            variants[name](step)
            step += 1
            u1 = _usage()
            dist.barrier()
            usage[name].append({k: u1[k] - u0[k] for k in u0})
    ops = {k: {} for k in names}
    for r in range(payload["steps"]):    # one profiled step at a time, alternating, so that a slow spell hits both
        for name in (names if r % 2 == 0 else names[::-1]):
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                variants[name](step)
                step += 1
            dist.barrier()
            for e in prof.key_averages():
                calls, us = ops[name].get(e.key, (0, 0.0))
                ops[name][e.key] = (calls + e.count, us + e.self_cpu_time_total)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object({"usage": usage, "ops": ops}, gathered, dst=0)
    dist.destroy_process_group()
    return gathered if rank == 0 else None


def usage_rows(usage: dict[str, list[dict]]) -> list[dict]:
    """Per variant the median of each per-step quantity; then, per quantity, the paired difference
    (second variant - first, round by round): median and quartiles."""
    names = list(usage)
    rows = [{"variant": n, **{k: statistics.median(u[k] for u in usage[n]) for k in usage[n][0]}} for n in names]
    if len(names) == 2:
        a, b = usage[names[0]], usage[names[1]]
        for pick, label in ((statistics.median, "median"), (lambda d: _quantile(d, 0.25), "q1"),
                            (lambda d: _quantile(d, 0.75), "q3")):
            rows.append({"variant": f"{label} of paired {names[1].split()[0]} - {names[0].split()[0]}",
                         **{k: pick([y[k] - x[k] for x, y in zip(a, b)]) for k in a[0]}})
    return rows


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear between order statistics)."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def op_rows(ours: dict, theirs: dict, steps: int, top: int) -> list[dict]:
    """Operators of two profiles (key -> (calls, self CPU microseconds) over ``steps`` steps) side by
    side per step, the ``top`` largest by either side's self time first."""
    keys = sorted(set(ours) | set(theirs), key=lambda k: (-max(ours.get(k, (0, 0))[1], theirs.get(k, (0, 0))[1]), k))
    rows = []
    for k in keys[:top]:
        (ca, ta), (cb, tb) = ours.get(k, (0, 0)), theirs.get(k, (0, 0))
        rows.append({"op": k, "pipetwin_ms": ta / 1e3 / steps, "torch_ms": tb / 1e3 / steps,
                     "pipetwin_calls": ca / steps, "torch_calls": cb / steps})
    return rows


def print_ops(report: list[dict], steps: int, rounds: int, top: int) -> None:
    """``--profile-ops``'s tables, one pair per rank."""
    from .tables import fmt_table
    ucols = ["variant", "wall_ms", "cpu_ms", "sys_ms", "minflt", "vcsw", "ivcsw"]
    for rank, rep in enumerate(report):
        print(f"===== rank {rank}: per step over {rounds} alternating rounds (medians; paired = same round)")
        print(fmt_table(usage_rows(rep["usage"]), ucols, {c: "{:.1f}" for c in ucols[1:]}))
        ours, theirs = list(rep["ops"])
        print(f"===== rank {rank}: torch.profiler, self CPU ms and calls per step ({steps} steps each)")
        print(fmt_table(op_rows(rep["ops"][ours], rep["ops"][theirs], steps, top),
                        ["op", "pipetwin_ms", "torch_ms", "pipetwin_calls", "torch_calls"],
                        {"pipetwin_ms": "{:.2f}", "torch_ms": "{:.2f}", "pipetwin_calls": "{:.0f}",
                         "torch_calls": "{:.0f}"}))


def summarize(times: dict[str, list[float]], seqs: int, pairs, foreign: dict[str, list] | None = None,
              max_foreign: float = 0.15, cpu: dict[str, list[float]] | None = None, tp: bool = False) -> list[dict]:
    """Per pair (and with ``tp`` the TP pair, whose variants ``times`` holds, last): medians and
    spreads of throughput and of the per-round ratios; with ``foreign``
    (cores' worth of other processes' CPU per variant and round) also the median ratio over the
    quiet rounds, where both runs of the pair saw at most ``max_foreign`` of it; with ``cpu`` (the
    ranks' own CPU seconds per variant and round) the per-round ratio of CPU used, torch's over
    pipetwin's, and the metering's share of it (CPU time barely moves when other processes take
    turns on the cores, wall time does)."""
    rows = []
    for ours, theirs, _, _ in pairs:
        na, nc, nb = _pair_names(ours, theirs)
        a, c, b = times[na], times[nc], times[nb]
        ratio = [tb / ta for ta, tb in zip(a, b)]            # throughput ours / theirs, same round
        ratio_nomem = [tb / tc for tc, tb in zip(c, b)]
        metering = [ta / tc - 1.0 for ta, tc in zip(a, c)]    # metering's cost, same round
        row = {"pair": f"{ours} vs {theirs}", "pipetwin_seq_per_s": seqs / statistics.median(a),
               "pipetwin_nomem_seq_per_s": seqs / statistics.median(c),
               "torch_seq_per_s": seqs / statistics.median(b),
               "ratio": statistics.median(ratio), "ratio_min": min(ratio), "ratio_max": max(ratio),
               "ratio_nomem": statistics.median(ratio_nomem),
               "metering_cost": statistics.median(metering),
               "spread_pipetwin": max(a) / min(a) - 1.0, "spread_torch": max(b) / min(b) - 1.0}
        if foreign is not None:
            row.update(_quiet_rounds(ratio, foreign[na], foreign[nb], max_foreign))
        if cpu is not None:
            ca, cc, cb = cpu[na], cpu[nc], cpu[nb]
            row.update({"cpu_ratio": statistics.median([y / x for x, y in zip(ca, cb)]),
                        "metering_cpu": statistics.median([x / z - 1.0 for x, z in zip(ca, cc)])})
        rows.append(row)
    if tp and all(n in times for n in tp_pair_names()):
        na, nb = tp_pair_names()
        a, b = times[na], times[nb]
        ratio = [tb / ta for ta, tb in zip(a, b)]
        row = {"pair": f"{TP[0]} vs {TP[1]}", "pipetwin_seq_per_s": seqs / statistics.median(a),
               "torch_seq_per_s": seqs / statistics.median(b), "ratio": statistics.median(ratio),
               "ratio_min": min(ratio), "ratio_max": max(ratio), "ratio_nomem": None, "metering_cost": None,
               "spread_pipetwin": max(a) / min(a) - 1.0, "spread_torch": max(b) / min(b) - 1.0}
        if foreign is not None:
            row.update(_quiet_rounds(ratio, foreign[na], foreign[nb], max_foreign))
        if cpu is not None:
            row.update({"cpu_ratio": statistics.median([y / x for x, y in zip(cpu[na], cpu[nb])]),
                        "metering_cpu": None})
        rows.append(row)
    return rows


def _quiet_rounds(ratio: list[float], load_a: list, load_b: list, max_foreign: float) -> dict:
    """The other processes' cores in each round (the larger of the pair's two runs) and the ratio over the
    rounds where that stayed within ``max_foreign``."""
    load = [max(x or 0.0, y or 0.0) for x, y in zip(load_a, load_b)]
    quiet = [q for q, f in zip(ratio, load) if f <= max_foreign]
    return {"foreign_cores": statistics.median(load), "quiet_rounds": len(quiet),
            "ratio_quiet": statistics.median(quiet) if quiet else None}


def print_table(rows: list[dict], spec, *, microbatches: int, rounds: int, steps: int, max_foreign: float) -> None:
    """The sitting's table as ``main`` prints it (also from a ``--json`` file's results)."""
    from .tables import fmt_table
    print(f"model {spec.name} (L={spec.layers} h={spec.hidden} s={spec.seq_len} b={spec.micro_batch}), D=2, "
          f"N={microbatches}, gloo/CPU; {rounds} interleaved rounds x {steps} steps; ratio = "
          f"pipetwin / torch throughput per round (median, min-max); spread = slowest / fastest round - 1; "
          f"foreign = other processes' CPU (cores, median); quiet = median ratio over the rounds with at most "
          f"{max_foreign:g} cores of it (how many); cpu_ratio = torch / pipetwin CPU seconds of both ranks "
          f"per round (median), metering_cpu = the metering's CPU cost"
          + (f"; {TP[0]} = the {spec.layers} transformer blocks at T={TP[2]} on the same ranks (no pipeline)"
             if any(r["pair"].startswith(f"{TP[0]} vs") for r in rows) else ""))
    rows = [dict(r) for r in rows]
    for row in rows:
        row["quiet"] = "-" if row["ratio_quiet"] is None else f"{row['ratio_quiet']:.2f} ({row['quiet_rounds']})"
    print(fmt_table(rows, ["pair", "pipetwin_seq_per_s", "torch_seq_per_s", "ratio", "ratio_min", "ratio_max",
                           "ratio_nomem", "metering_cost", "spread_pipetwin", "spread_torch", "foreign_cores",
                           "quiet", "cpu_ratio", "metering_cpu"],
                    {"pipetwin_seq_per_s": "{:.1f}", "torch_seq_per_s": "{:.1f}", "ratio": "{:.2f}",
                     "ratio_min": "{:.2f}", "ratio_max": "{:.2f}", "ratio_nomem": "{:.2f}",
                     "metering_cost": "{:+.1%}", "spread_pipetwin": "{:.0%}", "spread_torch": "{:.0%}",
                     "foreign_cores": "{:.2f}", "cpu_ratio": "{:.2f}", "metering_cpu": "{:+.1%}"}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bench_executor", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny (default), wide (a 256-wide GPT), a preset or a YAML file")
    p.add_argument("--microbatches", "-N", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps per variant and round (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of every variant before the rounds (default 1)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    p.add_argument("--max-foreign", type=float, default=0.15,
                   help="cores' worth of other processes' CPU a quiet round may see (default 0.15)")
    p.add_argument("--schedules", default=",".join([x[0] for x in PAIRS] + [TP[0]]),
                   help=f"pipetwin schedules to compare, and {TP[0]} for the tensor-parallel blocks (default all)")
    p.add_argument("--profile-step", metavar="SCHEDULE", help="cProfile one pipetwin schedule and its torch pair")
    p.add_argument("--profile-ops", metavar="SCHEDULE",
                   help="per-step CPU and page faults over --rounds paired steps, then torch.profiler's operators "
                        "over --steps steps: one pipetwin schedule and its torch pair, per rank")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for name, low in (("microbatches", 1), ("steps", 1), ("warmup", 0), ("rounds", 1)):
        if getattr(args, name) < low:
            p.error(f"--{name} must be >= {low}; got {getattr(args, name)}")
    if not args.max_foreign >= 0:
        p.error(f"--max-foreign must be >= 0; got {args.max_foreign}")

    from executor.config import RunConfig
    from executor.launch import launch
    wanted = [s.strip() for s in args.schedules.split(",") if s.strip()]
    unknown = sorted(set(wanted) - {x[0] for x in PAIRS} - {TP[0]})
    unknown += [s for s in (args.profile_step, args.profile_ops) if s and s not in {x[0] for x in PAIRS}]
    if unknown:
        raise SystemExit(f"bench_executor: error: no torch pair for {', '.join(unknown)}; choose from "
                         f"{', '.join(x[0] for x in PAIRS)}")
    pairs = [x for x in PAIRS if x[0] in wanted]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "wide":
            model = str(Path(tmp) / "bench-wide.yaml")
            Path(model).write_text(json.dumps(WIDE))  # JSON is YAML
        cfg = RunConfig.of(schedule="dapple", devices=2, microbatches=args.microbatches, model=model, steps=args.steps,
                        optimizer="sgd", lr=1e-3, device="cpu", timeout=300.0)
        spec = cfg.spec()
        if args.profile_step:
            report = launch("experiments.bench_executor:profile_rank",
                            {"config": cfg, "schedule": args.profile_step, "steps": args.steps, "lines": 25}, 2)
            for r, rep in enumerate(report):
                for name, (sec, text) in rep.items():
                    print(f"===== rank {r}: {name}: {sec * 1e3:.1f} ms per step (under cProfile)\n{text}")
            return 0
        if args.profile_ops:
            report = launch("experiments.bench_executor:ops_rank",
                            {"config": cfg, "schedule": args.profile_ops, "steps": args.steps,
                             "rounds": args.rounds}, 2)
            print(f"model {spec.name}, D=2, N={args.microbatches}: pipetwin {args.profile_ops} (tracing and "
                  f"metering on) vs its torch pair")
            print_ops(report, args.steps, args.rounds, top=30)
            return 0
        out = launch("experiments.bench_executor:bench_rank",
                       {"config": cfg, "rounds": args.rounds, "warmup": args.warmup, "steps": args.steps,
                        "schedules": wanted}, 2)
    seqs = args.steps * args.microbatches * spec.micro_batch
    rows = summarize(out["seconds"], seqs, pairs, out["foreign_cores"], args.max_foreign, out["cpu_seconds"],
                     tp=TP[0] in wanted)
    if args.json:
        json.dump({"model": spec.name, "devices": 2, "microbatches": args.microbatches, "backend": "gloo",
                   "steps": args.steps, "rounds": args.rounds, "results": rows, "raw_seconds": out["seconds"],
                   "foreign_cores": out["foreign_cores"], "cpu_seconds": out["cpu_seconds"]},
                  sys.stdout, indent=2)
        print()
        return 0
    print_table(rows, spec, microbatches=args.microbatches, rounds=args.rounds, steps=args.steps,
                max_foreign=args.max_foreign)
    return 0


if __name__ == "__main__":
    sys.exit(main())
