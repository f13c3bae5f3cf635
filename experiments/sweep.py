"""Parameter sweeps: a grid of simulations, run on local worker processes or a Ray cluster.

A grid is the product of schedules x devices x micro-batches x data-parallel replicas x
tensor-parallel sizes x ZeRO stages x recomputations x micro-batch sizes x expert-parallel sizes
(:class:`Grid`) laid over
one job (the options the grid does not vary); each
point is a :class:`cost_models.job.Job` of its own (:meth:`Grid.jobs`), simulated exactly as
``pipetwin simulate --json`` simulates it (:func:`sim.simulate_job` and
:func:`experiments.common.metrics_record`), so a point's record *is* that JSON object.

Results go to ``DIR/sweep.csv`` (one row per point: :data:`COLUMNS`) and ``DIR/sweep.jsonl``
(the full record of each point). A point that cannot run (a schedule's requirement, a cluster too
small) is a row with its ``error``; an out-of-memory point is a row with ``out_of_memory`` True.

A folder belongs to one experiment: ``DIR/sweep.json`` holds the job every point shares (the
base job's :meth:`~cost_models.job.Job.record` without the grid's axes, file paths absolute) and
the grid. A rerun into the same folder with the same experiment resumes it (points already in
the CSV are skipped; another grid adds its points); with another model, cluster, recompute,
fabric, cost model, ... it is refused with one line naming what differs. Rows are appended whole
as they finish (one write of one line); a half-written last line (a killed sweep) is dropped and
its point rerun. One sweep at a time writes a folder (a lock on ``DIR/.sweep.lock``).
Figures: ``throughput.png`` (samples per second of every point that ran, best first) and
``pareto.png`` (peak memory in GiB against time per sample, the Pareto front marked).
"""
from __future__ import annotations

import contextlib
import csv
import io
import itertools
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from cost_models.bind import CostInputs, cluster_cost_model, load_inputs, stated
from cost_models.files import FileError, parse_json, read_text, write_output
from cost_models.job import DEFAULT_CLUSTER, DEFAULT_MODEL, Job

COLUMNS = ["schedule", "devices", "microbatches", "dp", "tp", "zero", "recompute", "micro_batch", "ep",
           "iteration_time", "throughput", "bubble_ratio", "peak_memory", "out_of_memory", "error"]
# The grid's axes: (CSV column, Grid field, the job's flat field: Job.with_'s name); the CSV key of a
# point is its values in this order. A new axis is a row here and a Grid field (and the option table's
# row in sweep's list grammar, experiments.options.COMMANDS).
AXES = (("schedule", "schedules", "schedule"), ("devices", "devices", "devices"),
        ("microbatches", "microbatches", "microbatches"), ("dp", "dp", "replicas"), ("tp", "tp", "tp"),
        ("zero", "zero", "zero"), ("recompute", "recompute", "recompute"),
        ("micro_batch", "micro_batch", "micro_batch"), ("ep", "ep", "ep"))
KEY = tuple(col for col, _, _ in AXES)


def _key(*values) -> tuple[str, ...]:
    return tuple("" if v is None else str(v) for v in values)


@dataclass(frozen=True)
class Impossible:
    """A point of the grid whose job cannot be made (its axes exclude each other, e.g. ZeRO-1 at
    R = 1): a row with ``error``, as a point that cannot run."""

    key: tuple[str, ...]
    error: str


def point_key(job: "Job | Impossible") -> tuple[str, ...]:
    """The CSV's key of a point (the grid's axes, as text)."""
    if isinstance(job, Impossible):
        return job.key
    lay, par = job.layout, job.parallel
    return _key(*(getattr(lay if hasattr(lay, f) else par, f) for _, _, f in AXES))


@dataclass(frozen=True, kw_only=True)
class Grid:
    """The axes of a sweep; ``micro_batch`` None: the model's own (or unit costs); ``zero``: ZeRO
    stages (0, 1); ``recompute``: none, selective, full; ``ep``: expert-parallel sizes of a mixture
    of experts (a size that does not fold onto a point's T x R is that point's error)."""

    schedules: tuple[str, ...]
    devices: tuple[int, ...]
    microbatches: tuple[int, ...]
    dp: tuple[int, ...]
    micro_batch: tuple[int | None, ...] = (None,)
    tp: tuple[int, ...] = (1,)
    zero: tuple[int, ...] = (0,)
    recompute: tuple[str, ...] = ("none",)
    ep: tuple[int, ...] = (1,)

    def jobs(self, base: Job) -> "list[Job | Impossible]":
        """One job per point: ``base`` with the point's layout, ZeRO stage, recomputation and micro-batch
        size (:class:`Impossible` where these exclude each other)."""
        out: list[Job | Impossible] = []
        for point in itertools.product(*(getattr(self, axis) for _, axis, _ in AXES)):
            try:
                out.append(base.with_(**{f: v for (_, _, f), v in zip(AXES, point)}))
            except ValueError as e:
                out.append(Impossible(_key(*point), str(e).splitlines()[0] if str(e) else type(e).__name__))
        return out


def parse_ints(text: str, option: str) -> tuple[int, ...]:
    """``"4,8"`` -> (4, 8): whole numbers >= 1, one-line error otherwise."""
    parts = [t.strip() for t in str(text).split(",")]
    if not parts or any(not p.isdigit() or int(p) < 1 for p in parts):
        raise ValueError(f"{option}: expected comma-separated whole numbers >= 1 (e.g. 4,8); got {text!r}")
    return tuple(dict.fromkeys(int(p) for p in parts))


def parse_choices(text: str, option: str, choices) -> tuple:
    """``"none,full"`` -> ("none", "full"): each one of ``choices`` (ints when they are), one-line
    error otherwise."""
    known = {str(c): c for c in choices}
    parts = [t.strip() for t in str(text).split(",")]
    bad = [p for p in parts if p not in known]
    if bad:
        raise ValueError(f"{option}: expected comma-separated values out of {', '.join(known)}; got {text!r}")
    return tuple(dict.fromkeys(known[p] for p in parts))


def run_point(job: "Job | Impossible") -> dict:
    """Simulate one point: ``{"row": CSV row, "record": simulate --json object or None}``. A point
    that cannot run is a row with its ``error`` (never an exception)."""
    from sim import simulate_job

    from .common import metrics_record
    row = dict(zip(KEY, point_key(job)))
    try:
        if isinstance(job, Impossible):
            raise ValueError(job.error)
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


# ---------------------------------------------------------------------- the folder
def experiment_record(grid: Grid, base: Job, inputs: CostInputs) -> dict:
    """What ``DIR/sweep.json`` holds: the job every point shares (the base job without the grid's
    axes, its defaults resolved with ``inputs`` (:func:`cost_models.bind.load_inputs`): the model,
    the cluster and the cost model that bind; model, cluster and profile files as absolute paths),
    the grid, and what every point assumes (``stated``: :func:`cost_models.bind.stated`, shown
    beside the table as in each point's JSONL record)."""
    job = base.record()
    if base.source == "transformer" and base.model is None:
        job["model"] = DEFAULT_MODEL
    if inputs.cluster is not None and base.source != "profile":
        job["cluster"]["name"] = job["cluster"]["name"] or DEFAULT_CLUSTER
        job["cost_model"] = cluster_cost_model(base.cost_model, inputs.cluster, base.source == "layer-profile",
                                               inputs.model if inputs.kind == "transformer" else None)
    job["parallel"] = {k: v for k, v in job["parallel"].items() if k not in ("micro_batch", "zero", "recompute", "tp",
                                                                              "ep")}
    job["layout"] = {k: v for k, v in job["layout"].items() if k not in ("schedule", "devices", "microbatches",
                                                                         "replicas")}
    for name in ("model", "profile"):
        job[name] = _absolute(job[name])
    job["cluster"]["name"] = _absolute(job["cluster"]["name"])
    return {"job": job, "grid": {k: list(v) for k, v in asdict(grid).items()}, "stated": stated(base, inputs)}


def _absolute(ref):
    """A file named by ``ref`` (``PATH`` or ``PATH:SUFFIX``) as an absolute path; a preset as it is."""
    if not isinstance(ref, str):
        return ref
    head, sep, tail = ref.partition(":")
    for path, rest in ((ref, ""), (head, sep + tail)):
        if path and os.path.isfile(path):
            return os.path.abspath(path) + rest
    return ref


def _differences(old: dict, new: dict, where: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{where}{k}.")
        elif a != b:
            out.append(f"{where}{k} {a!r} there, {b!r} here")
    return out


def check_experiment(out: Path, record: dict) -> None:
    """Refuse (one line) a folder that holds another experiment's results; record this one."""
    meta, table = out / "sweep.json", out / "sweep.csv"
    if meta.exists():
        try:
            held = parse_json(read_text(meta, "sweep record"), meta.name)
            old, axes = held["job"], set(held["grid"])
        except (ValueError, KeyError, TypeError) as e:
            raise FileError(f"sweep record {meta} is not a sweep's ({' '.join(str(e).split())}); "
                            f"choose another --out") from None
        if axes != set(record["grid"]):
            raise ValueError(f"--out {out} holds a sweep whose grid has other axes ({', '.join(sorted(axes))}; this "
                             f"pipetwin's: {', '.join(sorted(record['grid']))}), written by another version of "
                             f"pipetwin; give another --out")
        diff = _differences(old, record["job"])
        if diff:
            raise ValueError(f"--out {out} holds the results of another experiment ({'; '.join(diff)}); give "
                             f"another --out (or remove the folder)")
    elif table.exists():
        raise ValueError(f"--out {out} holds a sweep.csv but no sweep.json saying which experiment it belongs "
                         f"to; give another --out")
    write_output(meta, json.dumps(record, indent=2) + "\n", "sweep record")


@contextlib.contextmanager
def folder_lock(out: Path):
    """Hold ``out/.sweep.lock`` (fcntl.flock) for the block; another holder: one-line refusal."""
    try:
        import fcntl
    except ImportError:             # no flock (Windows): no lock
        yield
        return
    path = out / ".sweep.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise FileError(f"sweep lock {path} cannot be created: {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise ValueError(f"--out {out} is being written by another sweep (pid {holder}); wait for it to "
                             f"finish or give another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)                # releases the lock


# ---------------------------------------------------------------------- the CSV
def _whole_lines(path: Path) -> str:
    """The text of ``path`` up to its last newline (a half-written last line left out; the folder
    is rewritten without it before anything is appended)."""
    if not path.exists():
        return ""
    text = read_text(path, "sweep table", allow_empty=True)
    return text[:text.rfind("\n") + 1]


def read_done(csv_path: Path) -> dict[tuple, dict]:
    """Rows already in ``sweep.csv``, by point key (whole rows only: see :func:`_whole_lines`)."""
    text = _whole_lines(csv_path)
    if not text:
        return {}
    rd = csv.DictReader(io.StringIO(text, newline=""))
    if rd.fieldnames != COLUMNS:
        raise ValueError(f"{csv_path} is not a sweep table (columns {rd.fieldnames}); choose another --out")
    return {tuple(r[k] for k in KEY): r for r in rd if None not in r.values() and None not in r}


def read_records(jsonl: Path, done: dict[tuple, dict]) -> dict[tuple, str]:
    """The JSONL line of each point whose row is done (lines of points not in the CSV, half-written
    or repeated ones are dropped)."""
    out = {}
    for line in _whole_lines(jsonl).splitlines():
        try:
            point = json.loads(line)["point"]
            key = tuple(point[k] for k in KEY)
        except (ValueError, KeyError, TypeError, RecursionError):    # not a point's line: dropped
            continue
        if key in done:
            out.setdefault(key, line)
    return out


def _line(row: dict) -> str:
    buf = io.StringIO()
    csv.DictWriter(buf, COLUMNS).writerow(row)
    return buf.getvalue()


class _Writer:
    """Appends each finished point: its JSONL record, then its CSV row, each as one write of whole lines."""

    def __init__(self, out: Path):
        self.csv_path, self.jsonl = out / "sweep.csv", out / "sweep.jsonl"
        try:
            self.fh = self.csv_path.open("a", newline="")
            if self.fh.tell() == 0:
                self._write(self.fh, self.csv_path, _line(dict(zip(COLUMNS, COLUMNS))))
            self.jh = self.jsonl.open("a")
        except OSError as e:
            raise FileError(f"sweep table {self.csv_path} could not be written: {e.strerror or e}") from None

    @staticmethod
    def _write(fh, path, text: str) -> None:
        try:
            fh.write(text)
            fh.flush()
        except OSError as e:
            raise FileError(f"sweep table {path} could not be written: {e.strerror or e}") from None

    def add(self, result: dict) -> None:
        if result["record"] is not None:
            self._write(self.jh, self.jsonl, json.dumps({"point": dict(zip(KEY, tuple(result["row"][k] for k in KEY))),
                                                         "record": result["record"]}) + "\n")
        self._write(self.fh, self.csv_path, _line(result["row"]))

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

    from cost_models.lifeline import die_with_parent
    ctx = multiprocessing.get_context("spawn")      # no inherited threads or locks
    others = set(multiprocessing.active_children())
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=die_with_parent,
                             initargs=(os.getpid(),)) as pool:
        futs = [pool.submit(run_point, job) for job in todo]
        try:
            for f in as_completed(futs):
                on_done(f.result())
        except BaseException:       # Ctrl-C, SIGTERM, a failed write: stop the points in flight too
            pool.shutdown(wait=False, cancel_futures=True)
            for p in set(multiprocessing.active_children()) - others:
                p.terminate()
            raise


def _ray(todo, address, on_done):
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'pipetwin[ray]'") from None
    started = not ray.is_initialized()
    if started:
        import logging
        ray.init(address=None if address in (None, "", "local") else address, ignore_reinit_error=True,
                 log_to_driver=False, include_dashboard=False, logging_level=logging.ERROR)
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
    point's row as the CSV holds it (text), in grid order. ``out`` holding another experiment, or
    being written by another sweep, is refused (ValueError, one line)."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FileError(f"--out {out} cannot be created: {e.strerror or e}") from None
    inputs = load_inputs(base)      # fail fast on what every point shares (a bad model, cluster or profile)
    with folder_lock(out):
        check_experiment(out, experiment_record(grid, base, inputs))
        done = read_done(out / "sweep.csv")
        records = read_records(out / "sweep.jsonl", done)
        _rewrite(out, list(done.values()), records)     # the folder as it will be appended to: whole, one each
        points = grid.jobs(base)
        keys = [point_key(j) for j in points]
        todo = [j for j, k in zip(points, keys) if k not in done]
        from tqdm import tqdm
        bar = tqdm(total=len(points), initial=len(points) - len(todo), desc="sweep", unit="point",
                   file=sys.stderr, disable=not progress)
        writer = _Writer(out)

        def on_done(result):
            writer.add(result)
            key = tuple(result["row"][k] for k in KEY)
            done[key] = result["row"]
            if result["record"] is not None:
                records[key] = json.dumps({"point": dict(zip(KEY, key)), "record": result["record"]})
            bar.update(1)

        try:
            if use_ray:
                _ray(todo, ray_address, on_done)
            else:
                _local(todo, workers or os.cpu_count() or 1, on_done)
        finally:
            writer.close()
            bar.close()
        rows = [{c: done[k][c] for c in COLUMNS} for k in keys if k in done]
        ours = set(keys)
        _rewrite(out, rows + [r for k, r in done.items() if k not in ours], records)
        table = read_done(out / "sweep.csv")       # as the CSV holds them (text), in grid order
        rows = [table[k] for k in keys]
    if figures:
        plot_sweep(rows, out, unit_costs=base.source == "unit")
    return rows


def _rewrite(out: Path, rows: list[dict], records: dict[tuple, str]) -> None:
    """The CSV (grid order first, then the rows of other grids of the same experiment) and the JSONL
    (one record per row that has one, in the same order), each replaced whole."""
    write_output(out / "sweep.csv", "".join(_line(r) for r in [dict(zip(COLUMNS, COLUMNS))] + rows), "sweep table")
    keys = [tuple(r[k] for k in KEY) for r in rows]
    write_output(out / "sweep.jsonl", "".join(records[k] + "\n" for k in keys if k in records), "sweep records")


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
                       + (f" T={r['tp']}" if r["tp"] != "1" else "")
                       + (f" ZeRO-{r['zero']}" if r["zero"] != "0" else "")
                       + (f" {r['recompute']}" if r["recompute"] != "none" else "")
                       + (f" b={r['micro_batch']}" if r["micro_batch"] else "")
                       + (f" EP={r['ep']}" if r["ep"] != "1" else ""))
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


__all__ = ["COLUMNS", "Grid", "Impossible", "point_key", "run_point", "run_sweep", "read_done", "pareto_front",
           "parse_ints", "parse_choices"]
