"""Parameter sweeps: a grid of simulations, run on local worker processes or a Ray cluster.

A grid is the product of schedules x devices x micro-batches x data-parallel replicas x
micro-batch sizes (:class:`Grid`) laid over one job (the options the grid does not vary); each
point is a :class:`cost_models.job.Job` of its own (:meth:`Grid.jobs`), simulated exactly as
``pipetwin simulate --json`` simulates it (:func:`sim.simulate_job` and
:func:`experiments.common.metrics_record`), so a point's record *is* that JSON object.

Results go to ``DIR/sweep.csv`` (one row per point: :data:`COLUMNS`) and ``DIR/sweep.jsonl``
(the full record of each point). A point that cannot run (a schedule's requirement, a cluster too
small) is a row with its ``error``; an out-of-memory point is a row with ``out_of_memory`` True.
Points already in the CSV are skipped (resume after an interruption: rows are appended as they
finish). Figures: ``throughput.png`` (samples per second of every point that ran, best first)
and ``pareto.png`` (peak memory in GiB against time per sample, the Pareto front marked).
"""
from __future__ import annotations

import csv
import itertools
import json
import math
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from cost_models.job import Job

COLUMNS = ["schedule", "devices", "microbatches", "dp", "tp", "micro_batch", "iteration_time", "throughput",
           "bubble_ratio", "peak_memory", "out_of_memory", "error"]
KEY = ("schedule", "devices", "microbatches", "dp", "tp", "micro_batch")


def point_key(job: Job) -> tuple[str, ...]:
    """The CSV's key of a point (the grid's axes, as text)."""
    lay = job.layout
    return (lay.schedule, str(lay.devices), str(lay.microbatches), str(lay.replicas), str(lay.tp),
            "" if job.micro_batch is None else str(job.micro_batch))


@dataclass(frozen=True, kw_only=True)
class Grid:
    """The axes of a sweep; ``micro_batch`` None: the model's own (or unit costs)."""

    schedules: tuple[str, ...]
    devices: tuple[int, ...]
    microbatches: tuple[int, ...]
    dp: tuple[int, ...]
    micro_batch: tuple[int | None, ...] = (None,)
    tp: tuple[int, ...] = (1,)

    def jobs(self, base: Job) -> list[Job]:
        """One job per point: ``base`` with the point's layout and micro-batch size."""
        return [replace(base.with_layout(schedule=s, devices=d, microbatches=n, replicas=r, tp=t), micro_batch=b)
                for s, d, n, r, t, b in itertools.product(self.schedules, self.devices, self.microbatches, self.dp,
                                                          self.tp, self.micro_batch)]


def parse_ints(text: str, option: str) -> tuple[int, ...]:
    """``"4,8"`` -> (4, 8): whole numbers >= 1, one-line error otherwise."""
    parts = [t.strip() for t in str(text).split(",")]
    if not parts or any(not p.isdigit() or int(p) < 1 for p in parts):
        raise ValueError(f"{option}: expected comma-separated whole numbers >= 1 (e.g. 4,8); got {text!r}")
    return tuple(dict.fromkeys(int(p) for p in parts))


def run_point(job: Job) -> dict:
    """Simulate one point: ``{"row": CSV row, "record": simulate --json object or None}``. A point
    that cannot run is a row with its ``error`` (never an exception)."""
    from sim import simulate_job

    from .common import metrics_record
    row = dict(zip(KEY, point_key(job)))
    try:
        bound, res = simulate_job(job)
        rec = metrics_record(res, **bound.report)
    except (ValueError, FileNotFoundError) as e:       # what `pipetwin simulate` reports as a user error
        row.update(iteration_time="", throughput="", bubble_ratio="", peak_memory="", out_of_memory="",
                   error=str(e).splitlines()[0] if str(e) else type(e).__name__)
        return {"row": row, "record": None}
    b = rec.get("micro_batch")
    lay = job.layout
    samples = lay.microbatches * lay.replicas * (b if b else 1)
    row.update(iteration_time=rec["iteration_time"], throughput=samples / rec["iteration_time"],
               bubble_ratio=rec["bubble_ratio"], peak_memory=max(p["peak_memory"] for p in rec["per_device"]),
               out_of_memory=rec.get("out_of_memory", ""), error="")
    return {"row": row, "record": rec}


# ---------------------------------------------------------------------- the CSV
def read_done(csv_path: Path) -> dict[tuple, dict]:
    """Rows already in ``sweep.csv``, by point key."""
    if not csv_path.exists():
        return {}
    with csv_path.open(newline="") as fh:
        rd = csv.DictReader(fh)
        if rd.fieldnames != COLUMNS:
            raise ValueError(f"{csv_path} is not a sweep table (columns {rd.fieldnames}); choose another --out")
        return {tuple(r[k] for k in KEY): r for r in rd}


class _Writer:
    def __init__(self, out: Path):
        self.csv_path, self.jsonl = out / "sweep.csv", out / "sweep.jsonl"
        new = not self.csv_path.exists()
        self.fh = self.csv_path.open("a", newline="")
        self.w = csv.DictWriter(self.fh, COLUMNS)
        if new:
            self.w.writeheader()
        self.jh = self.jsonl.open("a")

    def add(self, result: dict) -> None:
        self.w.writerow(result["row"])
        self.fh.flush()
        if result["record"] is not None:
            self.jh.write(json.dumps({"point": dict(zip(KEY, tuple(result["row"][k] for k in KEY))),
                                      "record": result["record"]}) + "\n")
            self.jh.flush()

    def close(self):
        self.fh.close()
        self.jh.close()


# ---------------------------------------------------------------------- running
def _local(todo, workers, on_done):
    if workers == 1:
        for job in todo:
            on_done(run_point(job))
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    ctx = multiprocessing.get_context("spawn")      # no inherited threads or locks
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futs = [pool.submit(run_point, job) for job in todo]
        for f in as_completed(futs):
            on_done(f.result())


def _ray(todo, address, on_done):
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'pipetwin[ray]'") from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=None if address in (None, "", "local") else address, ignore_reinit_error=True,
                 log_to_driver=False, include_dashboard=False)
    try:
        remote = ray.remote(run_point)
        pending = [remote.remote(job) for job in todo]
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            on_done(ray.get(ready[0]))
    finally:
        if started:
            ray.shutdown()


def run_sweep(grid: Grid, base: Job, out, *, workers: int | None = None, ray_address: str | None = None,
              use_ray: bool = False, progress: bool = False, figures: bool = True) -> list[dict]:
    """Run every point of ``grid`` over job ``base`` not yet in ``out/sweep.csv``; return every
    point's row as the CSV holds it (text), in grid order."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    done = read_done(out / "sweep.csv")
    points = grid.jobs(base)
    keys = [point_key(j) for j in points]
    todo = [j for j, k in zip(points, keys) if k not in done]
    from tqdm import tqdm
    bar = tqdm(total=len(points), initial=len(points) - len(todo), desc="sweep", unit="point", file=sys.stderr,
               disable=not progress)
    writer = _Writer(out)
    fresh: dict[tuple, dict] = {}

    def on_done(result):
        writer.add(result)
        key = tuple(result["row"][k] for k in KEY)
        fresh[key] = result["row"]
        bar.update(1)

    try:
        if use_ray:
            _ray(todo, ray_address, on_done)
        else:
            _local(todo, workers or os.cpu_count() or 1, on_done)
    finally:
        writer.close()
        bar.close()
    rows = []
    for k in keys:
        r = fresh.get(k) or done.get(k)
        if r is not None:
            rows.append({c: r[c] for c in COLUMNS})
    _rewrite(out, rows)
    done = read_done(out / "sweep.csv")         # as the CSV holds them (text), in grid order
    rows = [done[k] for k in keys if k in done]
    if figures:
        plot_sweep(rows, out, unit_costs=base.source == "unit")
    return rows


def _rewrite(out: Path, rows: list[dict]) -> None:
    """The CSV in grid order once every point is in (rows were appended as they finished)."""
    tmp = out / "sweep.csv.tmp"
    with tmp.open("w", newline="") as fh:
        w = csv.DictWriter(fh, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    tmp.replace(out / "sweep.csv")


def _num(v) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (time, memory) no other point beats in both (ties kept once)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def pareto_points(rows: list[dict], unit_costs: bool = False) -> list[tuple[float, float]]:
    """(time per sample, peak memory) of rows that ran: time per sample, not iteration time, so
    points of different global batches (N x R x b) compare; memory in GiB (Ma with unit costs)."""
    div = 1 if unit_costs else 2 ** 30
    return [(1.0 / float(r["throughput"]), float(r["peak_memory"]) / div) for r in rows]


def plot_sweep(rows: list[dict], out: Path, *, unit_costs: bool = False) -> None:
    from .plots import plt, save_figure
    ok = [r for r in rows if not r["error"] and _num(r["throughput"]) is not None]
    label = lambda r: (f"{r['schedule']} D={r['devices']} N={r['microbatches']} R={r['dp']}"  # noqa: E731
                       + (f" b={r['micro_batch']}" if r["micro_batch"] else ""))
    ok.sort(key=lambda r: -float(r["throughput"]))
    fig, ax = plt.subplots(figsize=(8, 0.3 * max(4, len(ok)) + 1))
    colours = ["tab:red" if str(r["out_of_memory"]) == "True" else "tab:blue" for r in ok]
    ax.barh(range(len(ok)), [float(r["throughput"]) for r in ok], color=colours)
    ax.set_yticks(range(len(ok)), [label(r) for r in ok], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("throughput (samples per time unit; red: out of memory)")
    ax.set_title(f"sweep: {len(ok)} of {len(rows)} points ran")
    save_figure(fig, out / "throughput.png")
    pts = pareto_points(ok, unit_costs)
    fig, ax = plt.subplots(figsize=(7, 5))
    if pts:
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], c=colours, s=18)
        front = pareto_front(pts)
        fx = [pts[i][0] for i in front]
        fy = [pts[i][1] for i in front]
        ax.step(fx, fy, where="post", color="black", linewidth=1, label="Pareto front")
        for i in front:
            ax.annotate(label(ok[i]), pts[i], fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.legend()
    ax.set_xlabel("time per sample (iteration time / global batch; F with unit costs, else s)")
    ax.set_ylabel("peak memory per device (" + ("Ma, unit costs)" if unit_costs else "GiB)"))
    ax.set_title("memory vs time per sample (red: out of memory)")
    save_figure(fig, out / "pareto.png")


__all__ = ["COLUMNS", "Grid", "point_key", "run_point", "run_sweep", "read_done", "pareto_front", "parse_ints"]
