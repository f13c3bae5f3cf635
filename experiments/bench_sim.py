"""Simulator speed, as ratios to a bare SimPy loop measured in the same run.

Run: ``python -m experiments.bench_sim [--repeat 3] [--no-planner] [--no-scaling] [--figure PNG]``.
Cases (each end to end: build, lower, validate, bind the costs, place on the cluster, simulate,
metrics; no per-op trace):

* ``bitpipe D=32 N=256`` (unit costs) against a bare SimPy loop with as many events (one
  process per device, one timeout per op of its program): aim <= 4x;
* a 1,024-GPU job, ``dapple D=16 R=64 N=128``, gpt-96 on ``dgx-a100-ib:128``, against a bare
  SimPy loop of 100,000 timeouts: aim <= 10x;
* a 10,240-GPU job, the same at R=640 on ``dgx-a100-ib:1280``: aim <= 50x;
* a 16,384-GPU tensor-parallel job, Llama-3-405B at TP 8 x PP 16 x DP 128 (interleaved, 2 chunks,
  N=16: Llama 3's 2,048 sequences per step, full recompute) on ``dgx-h100-ib:2048`` in Megatron's
  rank order [TP, DP, PP] (the default with T > 1: a stage's 128 replicas on 128 neighbouring
  nodes, 4 rail groups, so pipeline hops and ring hops cross the rail uplinks), through the typed
  job (:func:`sim.simulate_job`): aim <= 20x. The uplinks are non-blocking, so they never limit a
  rate and one replica is simulated (:mod:`sim.symmetry`);
* a 16,384-GPU long-context job, Llama-3-405B at TP 8 x CP 16 x PP 16 x DP 8 on 131,072-token
  sequences (interleaved, 2 chunks, N=16: Llama 3's 16 M tokens a step, full recompute) on
  ``dgx-h100-ib:2048`` in Llama 3's rank order [TP, CP, PP, DP] (``sequential``: a pipeline device is
  128 GPUs on 16 nodes, its K/V ring across them; the replicas alike, one simulated), through the
  typed job: aim <= 20x. (On ``h100-pods:2048`` the data-parallel ring crosses the spine between
  replicas 3 and 4 and 7 and 0, so four kinds of replica would be simulated.);
* a 131,072-GPU job, the same at DP 1,024 on ``h100-pods:16384`` (pods of 1,024 nodes on a spine
  oversubscribed 7:1: every pipeline hop crosses it, alike for every replica): aim <= 50x.
* a 2,048-GPU mixture of experts, DeepSeek-V3 as its report states the layout (DualPipe-V D=16
  N=120 R=128, EP 64, FP8, the F&B overlap: every overlapped pair a two-stream block) on
  ``h800-ib:256``: aim <= 20x.
* (unless ``--no-planner``) ``plan -m gpt-96 -G 1024`` on ``dgx-a100-ib:128`` (search, re-simulation
  and baselines): aim <= 10 s, shown also as a ratio to the 100k loop (run once: it takes minutes).

Each case runs ``--repeat`` times, interleaved with the bare loops so they share the machine's
noise; the best time of each counts and ``spread`` (slowest / fastest - 1) is the noise of the
sitting. ``peak MiB`` is the largest Python allocation of one run (tracemalloc, a separate
untimed run): bounded, since identical replicas keep no per-op records. The peak RSS of the
131,072-GPU case is measured in a process of its own (its high-water mark: ``VmHWM`` on Linux,
``resource.getrusage`` elsewhere, and what the run added to the process after its imports).

Unless ``--no-scaling``: how the time (as a ratio to a bare loop of 100,000 timeouts timed just
before it) and the memory (tracemalloc peak) of the Llama-3-405B job grow with GPUs (DP 64 .. 1,024
on ``h100-pods``), stages (PP 4 .. 32 at DP 128, N=32) and micro-batches (N 16 .. 128 at PP 16,
DP 128), the best of ``--repeat`` runs per point, with the log-log slope of each series, drawn in
``--figure`` (default ``out/bench_sim.png``).
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
import tracemalloc

import simpy

from cost_models import TransformerCostModel, UnitCostModel, load_cluster, load_model
from schedules import build, lower, validate
from sim import run


def bare_loop(ops_per_device: list[int]) -> float:
    """Seconds for one SimPy process per entry doing that many unit timeouts."""
    env = simpy.Environment()

    def dev(n):
        for _ in range(n):
            yield env.timeout(1.0)

    for n in ops_per_device:
        env.process(dev(n))
    t = time.perf_counter()
    env.run()
    return time.perf_counter() - t


def bitpipe_case(D: int = 32, N: int = 256):
    low = validate(lower(build("bitpipe", D, N)))
    res = run(low, UnitCostModel().bind(low))
    return res.metrics(), [len(p) for p in low.programs]


def cluster_case(R: int, D: int = 16, N: int = 128, model: str = "gpt-96", cluster: str = "dgx-a100-ib"):
    low = validate(lower(build("dapple", D, N), replicas=R))
    cl = load_cluster(f"{cluster}:{-(-D * R // 8)}")
    costs = TransformerCostModel(load_model(model), cl.device).bind(low)
    res = run(low, costs, cl.place(low))
    if res.simulated_replicas != 1:
        raise RuntimeError(f"R={R}: replicas were not simulated as one ({res.full_reason})")
    return res.metrics(), None


def tensor_parallel_case(R: int = 128, D: int = 16, N: int = 16, cluster: str = "dgx-h100-ib"):
    """Llama-3-405B at TP 8 x PP D x DP R, interleaved (2 chunks), N micro-batches, full recompute, in
    Megatron's rank order (the default) on ``cluster`` sized to 8 D R GPUs."""
    from cost_models.job import Job, Layout
    from cost_models.parallel import Parallel
    from sim import simulate_job
    job = Job(layout=Layout(schedule="interleaved", devices=D, microbatches=N, replicas=R),
              parallel=Parallel(tp=8, recompute="full"), model="llama3-405b", cluster=f"{cluster}:{D * R}")
    _, res = simulate_job(job, max_ops=None)
    if res.simulated_replicas != 1:
        raise RuntimeError(f"R={R}: replicas were not simulated as one ({res.full_reason})")
    return res.metrics(), None


def context_parallel_case(R: int = 8, D: int = 16, N: int = 16, C: int = 16, cluster: str = "dgx-h100-ib"):
    """Llama-3-405B at TP 8 x CP C x PP D x DP R on 131,072-token sequences, interleaved (2 chunks), N
    micro-batches, full recompute, in Llama 3's order [TP, CP, PP, DP] on ``cluster`` sized to 8 C D R
    GPUs."""
    from cost_models.job import Job, Layout
    from cost_models.parallel import Parallel
    from sim import simulate_job
    job = Job(layout=Layout(schedule="interleaved", devices=D, microbatches=N, replicas=R),
              parallel=Parallel(tp=8, cp=C, recompute="full", seq_len=131072), model="llama3-405b",
              cluster=f"{cluster}:{C * D * R}", device_map="sequential")
    _, res = simulate_job(job, max_ops=None)
    if res.simulated_replicas != 1:
        raise RuntimeError(f"R={R}: replicas were not simulated as one ({res.full_reason})")
    return res.metrics(), None


def deepseek_case():
    """DeepSeek-V3 on 2,048 H800s as its report states the layout (:mod:`experiments.reproduce.deepseek_v3`):
    DualPipe-V D=16 N=120 R=128, EP 64, ZeRO-1, FP8, hierarchical FP8 dispatch, the F&B overlap (phased
    costs: each pair one block of two streams), through the typed job."""
    from cost_models.job import Job
    from sim import simulate_job

    from .reproduce.deepseek_v3 import STATED
    _, res = simulate_job(Job.of(**STATED), max_ops=None)
    if res.simulated_replicas != 1:
        raise RuntimeError(f"deepseek-v3: replicas were not simulated as one ({res.full_reason})")
    return res.metrics(), None


def pods_case():
    return tensor_parallel_case(1024, cluster="h100-pods")


def rss_of_pods_case() -> dict:
    """Peak RSS of the 131,072-GPU case run alone in a fresh process (MiB): the process's high-water
    mark, and the same after the imports (what the run itself added)."""
    out = subprocess.run([sys.executable, "-m", "experiments.bench_sim", "--rss-child"], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rss_mib() -> float:
    """The process's peak RSS so far: Linux's VmHWM (its own memory's high-water mark; ru_maxrss
    would also count the parent's before the exec), elsewhere ru_maxrss (bytes on macOS)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2 ** 10
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2 ** 20 if sys.platform == "darwin" else r / 2 ** 10


def _resident_mib() -> float:
    """The process's RSS now (Linux /proc; elsewhere its peak so far)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * resource.getpagesize() / 2 ** 20
    except OSError:
        return _rss_mib()


def _rss_child() -> int:
    import cost_models.job  # noqa: F401  (the imports the run needs, before the mark)
    import sim  # noqa: F401
    before = _resident_mib()
    pods_case()
    print(json.dumps({"import_MiB": before, "peak_MiB": _rss_mib()}))
    return 0


# the growth series: (name, x label, [(x, kwargs of tensor_parallel_case)])
SCALING = [
    ("GPUs (DP 64..1,024, PP 16, N 16, h100-pods)", "GPUs",
     [(8 * 16 * r, dict(R=r, cluster="h100-pods")) for r in (64, 128, 256, 512, 1024)]),
    ("stages (PP 4..32, DP 128, N 32)", "pipeline stages", [(d, dict(D=d, N=32)) for d in (4, 8, 16, 32)]),
    ("micro-batches (N 16..128, PP 16, DP 128)", "micro-batches", [(n, dict(N=n)) for n in (16, 32, 64, 128)]),
]


def slope(xs, ys) -> float:
    """Least-squares slope of log(y) on log(x): y grows as x^slope."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def scaling(series=SCALING, repeat: int = 1) -> list[dict]:
    """One record per point: series, x, seconds and ratio (to a bare loop of 100,000 timeouts timed
    just before it; the best of ``repeat`` runs each), peak_MiB (tracemalloc, one more run)."""
    rows = []
    for name, _, points in series:
        for x, kw in points:
            runs = []
            for _ in range(repeat):
                base = bare_loop([100_000])
                runs.append((_timed(lambda kw=kw: tensor_parallel_case(**kw))[0], base))
            rows.append({"series": name, "x": x, "seconds": min(t for t, _ in runs),
                         "ratio": min(t / b for t, b in runs),
                         "peak_MiB": _peak_mib(lambda kw=kw: tensor_parallel_case(**kw))})
    return rows


def scaling_figure(rows: list[dict], path, series=SCALING) -> None:
    """Log-log: time as a ratio to the bare 100k loop (left) and tracemalloc peak (right) against each
    series' x over its smallest, one line per series, the slope in the legend."""
    from .plots import plt, save_figure, series_style
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, col, what in ((axes[0], "ratio", "time of one run / bare loop of 100k timeouts"),
                          (axes[1], "peak_MiB", "peak Python memory (MiB)")):
        for i, (name, xlabel, _) in enumerate(series):
            pts = [r for r in rows if r["series"] == name]
            if len(pts) < 2:
                continue
            xs, ys = [p["x"] for p in pts], [p[col] for p in pts]
            rel = [x / xs[0] for x in xs]
            ax.loglog(rel, ys, label=f"{xlabel} (slope {slope(xs, ys):.2f})", **series_style(i))
        ax.set_xlabel("size / smallest size of the series")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("bench_sim: Llama-3-405B, TP 8, interleaved, Megatron's rank order")
    save_figure(fig, path)


def planner_case(G: int = 1024, cluster: str = "dgx-a100-ib:128"):
    from planner import plan_training
    # FLOP-rate costs, as the figures in out/bench_sim.png are measured
    res = plan_training("gpt-96", load_cluster(cluster), G, progress=False, cost_model="linear")
    return res, None


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _peak_mib(fn) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2 ** 20
    finally:
        tracemalloc.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-planner", action="store_true", help="leave the planner case out")
    p.add_argument("--no-memory", action="store_true", help="leave the tracemalloc pass and the RSS run out")
    p.add_argument("--no-scaling", action="store_true", help="leave the growth series and their figure out")
    p.add_argument("--figure", default="out/bench_sim.png", help="the growth figure (default out/bench_sim.png)")
    p.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.rss_child:
        return _rss_child()
    if a.repeat < 1:
        raise SystemExit("bench_sim: --repeat must be >= 1")
    if not a.no_scaling:
        from cost_models.files import FileError, check_output_path
        try:
            check_output_path(a.figure, "--figure")
        except FileError as e:
            print(f"bench_sim: {e}", file=sys.stderr)
            return 2
    cases = [("bitpipe D=32 N=256 (unit costs)", bitpipe_case, "events", 4.0),
             ("1,024 GPUs: dapple D=16 R=64 N=128, gpt-96, dgx-a100-ib:128", lambda: cluster_case(64), "100k", 10.0),
             ("10,240 GPUs: dapple D=16 R=640 N=128, gpt-96, dgx-a100-ib:1280", lambda: cluster_case(640), "100k",
              50.0),
             ("16,384 GPUs: T=8 D=16 R=128 N=16, llama3-405b, dgx-h100-ib:2048",
              tensor_parallel_case, "100k", 20.0),
             ("16,384 GPUs: T=8 C=16 D=16 R=8 N=16, llama3-405b 131k tokens, dgx-h100-ib:2048", context_parallel_case,
              "100k", 20.0),
             ("131,072 GPUs: T=8 D=16 R=1024 N=16, llama3-405b, h100-pods:16384", pods_case, "100k", 50.0),
             ("2,048 GPUs: deepseek-v3 dualpipe-v D=16 R=128 N=120, EP 64, F&B overlap, h800-ib:256", deepseek_case,
              "100k", 20.0)]
    if not a.no_planner:
        cases.append(("plan gpt-96 G=1024 on 1,024 A100s (dgx-a100-ib:128)", planner_case, "100k", None))
    _, per_dev = bitpipe_case()
    times = {name: [] for name, *_ in cases}
    bare_events, bare_100k = [], []
    info = {}
    for rep in range(a.repeat):
        for name, fn, _, _ in cases:
            if "plan" in name and rep:      # minutes a run: once (its spread is then 0)
                continue
            bare_100k.append(bare_loop([100_000]))
            bare_events.append(bare_loop(per_dev))
            dt, out = _timed(fn)
            times[name].append(dt)
            info[name] = out[0]
    b100, bev = min(bare_100k), min(bare_events)
    spread = lambda xs: max(xs) / min(xs) - 1  # noqa: E731
    print(f"bare SimPy loop, 100,000 timeouts: {b100:.3f} s (spread {spread(bare_100k):.0%}); with as many events as "
          f"bitpipe D=32 N=256 ({sum(per_dev):,} ops on {len(per_dev)} processes): {bev:.3f} s "
          f"(spread {spread(bare_events):.0%})")
    rows = []
    for name, fn, ref, aim in cases:
        best = min(times[name])
        base = bev if ref == "events" else b100
        row = {"case": name, "seconds": best, "spread": spread(times[name]), "reference": ref,
               "ratio": best / base, "aim": (f"<= {aim:g}x" if aim else "<= 10 s")}
        if not a.no_memory and "plan" not in name:
            row["peak_MiB"] = _peak_mib(fn)
        rows.append(row)
    from .tables import fmt_table
    cols = ["case", "seconds", "spread", "reference", "ratio", "aim"] + ([] if a.no_memory else ["peak_MiB"])
    print(fmt_table(rows, cols, {"seconds": "{:.3f}", "spread": "{:.0%}", "ratio": "{:.2f}x", "peak_MiB": "{:.0f}"}))
    for name, out in info.items():
        if hasattr(out, "iteration_time") and not hasattr(out, "search"):
            print(f"  {name}: iteration {out.iteration_time:.6g}, bubble {out.bubble_ratio:.4f}")
        elif hasattr(out, "search"):
            print(f"  {name}: search {out.search.seconds:.2f} s, baselines {out.baseline_seconds:.2f} s; best "
                  f"{out.best.plan.describe()} ({out.best.time:.4g} s simulated)")
    if not a.no_memory:
        rss = rss_of_pods_case()
        print(f"peak RSS of the 131,072-GPU case alone (VmHWM of its own process): {rss['peak_MiB']:.0f} "
              f"MiB, {rss['peak_MiB'] - rss['import_MiB']:.0f} MiB above the {rss['import_MiB']:.0f} MiB resident "
              f"after the imports")
    if not a.no_scaling:
        rows = scaling(repeat=a.repeat)
        print(f"growth (best of {a.repeat} run(s) per point, ratio to a 100k loop timed before each; peak_MiB: "
              f"tracemalloc; slope: d log y / d log x):")
        print(fmt_table(rows, ["series", "x", "seconds", "ratio", "peak_MiB"],
                        {"seconds": "{:.3f}", "ratio": "{:.2f}x", "peak_MiB": "{:.1f}"}))
        for name, _, _ in SCALING:
            pts = [r for r in rows if r["series"] == name]
            xs = [r["x"] for r in pts]
            print(f"  {name}: time (ratio) ~ x^{slope(xs, [r['ratio'] for r in pts]):.2f}, "
                  f"memory ~ x^{slope(xs, [r['peak_MiB'] for r in pts]):.2f}")
        scaling_figure(rows, a.figure)
        print(f"figure: {a.figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
