"""Starting the ranks: spawned local worker processes (CPU + gloo by default) or ``torchrun``.

``run(config)`` validates the schedule and the model split in the calling process (user errors
come out as ValueError before anything starts), then:

- under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set by it): runs this process's rank in place;
  the device is ``cuda:LOCAL_RANK`` with NCCL when CUDA is available (see
  :mod:`executor.device`); rank 0 returns the result, the other ranks return None. On a cluster::

      torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
          -m experiments run --schedule bitpipe --devices 8 --microbatches 16 --dp 2 \\
          --model gpt3-1.3b --steps 20 --trace run.csv

  (D x R = 16 processes; every node runs the same command.)
- otherwise: spawns D x R worker processes (``python -m executor.launch``) on 127.0.0.1 with a
  free port and env:// rendezvous, i.e. the very code path torchrun uses, and watches them. A
  worker that raises writes its traceback; the launcher then stops all workers at once (SIGTERM,
  then SIGKILL) and raises :class:`LaunchError` with the first failure's traceback (the root
  cause; the failures it caused in other ranks are listed after it). A worker blocked on a
  message that never comes fails on its receive timeout with rank, op and peer. Nothing hangs.

:func:`launch` is the generic part (any ``module:function`` target on every rank);
:func:`run_many` runs several jobs with the same world size on one set of processes.
"""
from __future__ import annotations

import importlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

from schedules import Schedule

from .config import RunConfig, RunResult, lowered_schedule
from .worker import Job, local_env

_WORKDIR_ENV = "PIPETWIN_WORKDIR"
_REPO = str(Path(__file__).resolve().parent.parent)


class LaunchError(RuntimeError):
    """A rank failed; the message holds its error and traceback."""


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and _WORKDIR_ENV not in os.environ


def run(config: RunConfig, schedule: Schedule | None = None, *, check: bool = True) -> RunResult | None:
    """Train with ``config`` (``schedule``: a custom lowered schedule instead of the named one;
    ``check=False`` skips its validation, for tests that run broken programs on purpose)."""
    return run_many([(config, schedule)], check=check)[0]


def run_many(jobs: Sequence[RunConfig | tuple[RunConfig, Schedule | None]], *, check: bool = True) -> list:
    """Run several configs (all with the same D x R) one after the other on one set of ranks."""
    planned = []
    for job in jobs:
        cfg, sched = job if isinstance(job, tuple) else (job, None)
        planned.append(Job(cfg, lowered_schedule(cfg, sched, check=check)))
    worlds = {j.schedule.num_ranks for j in planned}
    if len(worlds) != 1:
        raise ValueError(f"run_many needs one world size (D x R) for all jobs; got {sorted(worlds)}")
    world = worlds.pop()
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes but the schedule needs "
                             f"D x R = {world}")
        return _in_place("executor.worker:run_jobs", planned) or [None] * len(planned)
    if any(j.config.device == "auto" for j in planned):
        planned = [Job(j.config.with_(device="cpu") if j.config.device == "auto" else j.config, j.schedule)
                   for j in planned]
    return launch("executor.worker:run_jobs", planned, world)


def _in_place(target: str, payload):
    rank, world, local_rank, local_world = local_env()
    return _resolve(target)(payload, rank, world, local_rank, local_world)


def launch(target: str, payload: Any, world: int) -> Any:
    """Run ``target(payload, rank, world, local_rank, local_world)`` on ``world`` fresh processes
    and return rank 0's return value (see the module docstring for failure handling)."""
    with tempfile.TemporaryDirectory(prefix="pipetwin-") as tmp:
        work = Path(tmp)
        (work / "job.pkl").write_bytes(pickle.dumps((target, payload)))
        port = _free_port()
        procs = []
        try:
            for rank in range(world):
                env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                           WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                           OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)),
                           PYTHONPATH=os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")])))
                env[_WORKDIR_ENV] = tmp
                log = open(work / f"log.{rank}", "wb")
                procs.append(subprocess.Popen([sys.executable, "-m", "executor.launch"], env=env, stdout=log,
                                              stderr=subprocess.STDOUT, cwd=os.getcwd()))
                log.close()
            _watch(procs, work)
        finally:
            _stop(procs)
        return pickle.loads((work / "result.pkl").read_bytes())


def _watch(procs: list[subprocess.Popen], work: Path) -> None:
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return
        if any(c not in (None, 0) for c in codes):
            _stop(procs)
            raise LaunchError(_failure_report(procs, work))
        time.sleep(0.02)


def _stop(procs: list[subprocess.Popen]) -> None:
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 3.0
    for p in alive:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _failure_report(procs: list[subprocess.Popen], work: Path) -> str:
    errors = []
    for rank in range(len(procs)):
        f = work / f"error.{rank}"
        if f.exists():
            stamp, text = f.read_text().split("\n", 1)
            errors.append((float(stamp), rank, text))
    errors.sort()
    lines = []
    if errors:
        _, rank, text = errors[0]
        summary = text.strip().splitlines()[-1]
        lines.append(f"rank {rank} failed: {summary}")
        lines.append(f"--- traceback of rank {rank} ---")
        lines.append(text.rstrip())
        for _, r, t in errors[1:]:
            lines.append(f"(then rank {r} failed: {t.strip().splitlines()[-1]})")
    for rank, p in enumerate(procs):
        if any(r == rank for _, r, _ in errors) or p.returncode in (0, None, -signal.SIGTERM, -signal.SIGKILL):
            continue
        tail = (work / f"log.{rank}").read_text(errors="replace")[-2000:]
        lines.insert(0, f"rank {rank} exited with code {p.returncode} without a Python error; its output:\n{tail}")
    return "\n".join(lines) if lines else "a rank exited abnormally"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(target: str):
    mod, _, fn = target.partition(":")
    return getattr(importlib.import_module(mod), fn)


def _worker_main() -> None:
    """Entry point of a spawned rank: run the target, leave the result (rank 0) or the error."""
    work = Path(os.environ[_WORKDIR_ENV])
    rank = int(os.environ["RANK"])
    try:
        target, payload = pickle.loads((work / "job.pkl").read_bytes())
        result = _in_place(target, payload)
        if rank == 0:
            tmp = work / "result.tmp"
            tmp.write_bytes(pickle.dumps(result))
            tmp.rename(work / "result.pkl")
    except BaseException:  # noqa: BLE001 - everything must reach the launcher
        (work / f"error.{rank}").write_text(f"{time.time()!r}\n{traceback.format_exc()}")
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker_main()
