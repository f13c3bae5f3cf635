"""Starting the ranks: spawned local worker processes (CPU + gloo by default) or ``torchrun``.

``run(config)`` validates the schedule and the model split in the calling process (user errors
come out as ValueError before anything starts), then:

- under ``torchrun`` (``TORCHELASTIC_RUN_ID`` set by it, with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, checked by :func:`check_launch_env`):
  runs this process's rank in place;
  the device is ``cuda:LOCAL_RANK`` with NCCL when CUDA is available (see
  :mod:`executor.device`); rank 0 returns the result, the other ranks return None. On a cluster::

      torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
          --no-python pipetwin run --schedule bitpipe --devices 8 --microbatches 16 --dp 2 \\
          --model gpt3-1.3b --steps 20 --trace run.csv

  (T x C x D x R = 1 x 1 x 8 x 2 = 16 processes; every node runs the same command.) *Placement*: each process is the
  device (node ``GROUP_RANK``, GPU ``LOCAL_RANK``) = global device ``node * LOCAL_WORLD_SIZE +
  LOCAL_RANK``; it runs the pipeline rank that ``config.device_map`` puts on that device (a
  mapping name of :data:`cost_models.cluster.MAPPINGS`, e.g. BitPipe's ``copies-same-node``, laid
  over torchrun's nodes x processes per node; or an explicit rank -> device map from a plan),
  not the rank torchrun gave it (:func:`torchrun_placement`). The default (``sequential``,
  Megatron's order at T > 1) is the job's mapping. The process group is joined with the pipeline
  rank (the rendezvous store still comes from torchrun's rank 0); the rendezvous waits at most
  ``--timeout`` (at least 30 s) and ends naming the ranks that did not come
  (:func:`executor.worker.rendezvous`). Launcher variables without ``TORCHELASTIC_RUN_ID`` (left in a
  shell after a torchrun or SLURM session) are refused by ``pipetwin run`` at once, naming them
  (:func:`check_launch_env`); spawned workers never inherit them.
- otherwise: checks that the ranks fit in this host's memory (:func:`check_host_memory`), then
  spawns T x C x D x R worker processes on 127.0.0.1 with a free port and env:// rendezvous, i.e. the very
  code path torchrun uses, and watches them. Workers import pipetwin's own code whatever the
  working directory holds (a folder with its own ``executor/`` or ``schedules/`` package cannot
  shadow it: the cwd is taken off ``sys.path``, see :data:`WORKER_BOOT`). A worker that raises
  writes its traceback; a worker killed from outside (``kill -9``, the kernel's out-of-memory
  killer) is named with its signal; either way the launcher then stops all workers at once
  (SIGTERM, then SIGKILL) and raises :class:`LaunchError` naming the root cause first (the
  failures it caused in other ranks are listed after it); a user error the ranks find themselves
  (a model file's ranks that built different weights) is a ValueError of one line instead. Every
  worker dies with the launcher,
  ``kill -9`` of it included (:mod:`cost_models.lifeline`). A worker blocked on a message that
  never comes fails on its receive timeout with rank, op and peer. Nothing hangs. Rank 0 reports
  each finished step; on a terminal the launcher shows it as a progress bar on stderr.

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
from .faults import WORKDIR_ENV
from .host import PROCESS_BYTES, available_host_bytes
from .mesh import device_map_for, placement  # noqa: F401 - device_map_for: launch's API
from .worker import Job, local_env, topology

_WORKDIR_ENV = WORKDIR_ENV
_REPO = str(Path(__file__).resolve().parent.parent)
_PARENT_ENV = "PIPETWIN_PARENT"     # the launcher's pid: a rank ends when it does
# a worker's first code: the working directory ('' or '.') off sys.path, pipetwin's folder first, then
# end with the launcher (cost_models.lifeline: standard library only, the package's face is lazy;
# before the seconds of importing torch)
WORKER_BOOT = ("import os, sys; "
               "sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
               f"sys.path.insert(0, {_REPO!r}); "
               "from cost_models.lifeline import die_with_parent; "
               f"die_with_parent(int(os.environ[{_PARENT_ENV!r}])); "
               "from executor.launch import _worker_main; _worker_main()")


class LaunchError(RuntimeError):
    """A rank failed; the message holds its error and traceback."""


# what torchrun (torch.distributed.elastic's agent) sets in every process it starts; the run id is
# the one variable only it sets, so it alone decides
TORCHRUN_MARK = "TORCHELASTIC_RUN_ID"
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_VARS = (*TORCHRUN_VARS, "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                 TORCHRUN_MARK, "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE")
# the ones pipetwin reads (executor.worker.local_env / topology, executor.device): a leftover one would act
_READ_VARS = (*TORCHRUN_VARS, "GROUP_RANK")


def under_torchrun() -> bool:
    """This process is a rank torchrun started (not a worker pipetwin spawned)."""
    return TORCHRUN_MARK in os.environ and _WORKDIR_ENV not in os.environ


def check_launch_env() -> None:
    """Refuse, in one line, an environment that does not say unambiguously how this run starts:
    under torchrun, its variables missing or inconsistent; outside it, launcher variables left set
    (after a torchrun or SLURM session): they would make this process a rank of a world that does
    not exist. Spawned workers are not checked (the launcher sets their variables)."""
    env = os.environ
    if _WORKDIR_ENV in env:
        return
    if not under_torchrun():
        stray = [v for v in _READ_VARS if v in env]
        if stray:
            shown = " ".join(f"{v}={env[v][:20]}" for v in stray)
            slurm = " (in SLURM: srun torchrun ... --no-python pipetwin run ...)" \
                if "SLURM_PROCID" in env or "SLURM_JOB_ID" in env else ""
            raise ValueError(f"{shown} set, but not by torchrun (no {TORCHRUN_MARK}): 'unset {' '.join(stray)}' "
                             f"to train on spawned local ranks, or start pipetwin with torchrun{slurm}")
        return
    missing = [v for v in TORCHRUN_VARS if not env.get(v)]
    if missing:
        raise ValueError(f"{TORCHRUN_MARK} is set (a torchrun process) but {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not; start pipetwin with torchrun itself")
    try:
        rank, world, local, local_world, port = (int(env[v]) for v in
                                                 ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                  "MASTER_PORT"))
    except ValueError:
        bad = next(v for v in TORCHRUN_VARS[:4] + ("MASTER_PORT",) if not env[v].strip().isdigit())
        raise ValueError(f"torchrun's {bad}={env[bad][:40]!r} is not a whole number >= 0") from None
    if not (0 <= rank < world and 0 <= local < local_world <= world and world % local_world == 0
            and 0 < port < 65536):
        raise ValueError(f"torchrun's variables disagree: RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local} "
                         f"LOCAL_WORLD_SIZE={local_world} MASTER_PORT={port} (0 <= RANK < WORLD_SIZE, "
                         f"0 <= LOCAL_RANK < LOCAL_WORLD_SIZE, which divides WORLD_SIZE, a port in 1..65535)")


def run(config: RunConfig, schedule: Schedule | None = None, *, check: bool = True) -> RunResult | None:
    """Train with ``config`` (``schedule``: a custom lowered schedule instead of the named one;
    ``check=False`` skips its validation, for tests that run broken programs on purpose)."""
    return run_many([(config, schedule)], check=check)[0]


def run_many(jobs: Sequence[RunConfig | tuple[RunConfig, Schedule | None]], *, check: bool = True) -> list:
    """Run several configs (all with the same T x C x D x R) one after the other on one set of ranks."""
    planned = []
    for job in jobs:
        cfg, sched = job if isinstance(job, tuple) else (job, None)
        planned.append(Job(cfg, lowered_schedule(cfg, sched, check=check)))
    worlds = {(j.config.parallel.tp, j.config.parallel.cp, j.schedule.num_ranks) for j in planned}
    if len(worlds) != 1:
        raise ValueError(f"run_many needs one world size (T x C x D x R) and one T and C for all jobs; got "
                         f"{sorted(t * c * n for t, c, n in worlds)}")
    tp, cp, ranks = worlds.pop()
    world = tp * cp * ranks
    if under_torchrun():
        check_launch_env()
    maps = {j.config.device_map for j in planned}
    if len(maps) != 1 and (tp * cp > 1 or under_torchrun()):
        raise ValueError(f"run_many needs one device map for all jobs; got {sorted(map(str, maps))}")
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world:
            lay = planned[0].schedule
            raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes but the run needs T x C x D x R "
                             f"= {tp} x {cp} x {lay.num_devices} x {lay.replicas} = {world}")
        rank, device = torchrun_placement(planned[0].config.device_map, planned[0].schedule, tp, cp)
        launch_rank, world, local_rank, local_world = local_env()
        from .worker import RendezvousError, run_jobs
        try:
            return run_jobs(planned, rank, world, local_rank, local_world, launch_rank=launch_rank) \
                or [None] * len(planned)
        except RendezvousError as e:
            raise LaunchError(str(e)) from None
    if any(j.config.device == "auto" for j in planned):
        planned = [Job(j.config.with_(device="cpu") if j.config.device == "auto" else j.config, j.schedule)
                   for j in planned]
    check_host_memory(planned, world)
    return launch("executor.worker:run_spawned", planned, world)


def estimated_host_bytes(job: Job) -> float:
    """Host memory a spawned CPU job needs at least: every rank's process, weights + gradients +
    Adam state (16 B per fp32 parameter, per model copy, replica and CP rank) and the activations of
    min(N, D) micro-batches in flight per pipeline (1F1B's; GPipe keeps more; the C CP ranks keep
    1/C each)."""
    from cost_models.transformer import block_activation_bytes, model_params
    cfg, low = job.config, job.schedule
    if job.layout is not None:      # a model file's layer stack (executor.user_model)
        return low.num_ranks * PROCESS_BYTES + job.layout.host_bytes(low)
    spec = cfg.spec()
    fp32 = 4 / spec.dtype_bytes
    static = 16.0 * model_params(spec) * low.num_copies * low.replicas * cfg.parallel.cp
    # TP ranks keep whole inputs
    inflight = min(low.num_microbatches, low.num_devices) * low.replicas * cfg.parallel.tp
    acts = inflight * spec.layers * block_activation_bytes(spec) * fp32
    return low.num_ranks * cfg.parallel.tp * cfg.parallel.cp * PROCESS_BYTES + static + acts


def check_host_memory(jobs: Sequence[Job], world: int) -> None:
    """Refuse (ValueError) CPU jobs whose ranks cannot fit in this host's available memory, before
    spawning them (an allocation failure or the OOM killer later would waste the start-up)."""
    cpu = [j for j in jobs if j.config.device != "cuda"]
    avail = available_host_bytes()
    if not cpu or avail is None:
        return
    need = max(estimated_host_bytes(j) for j in cpu)
    if need > avail:
        gib = 2 ** 30
        raise ValueError(f"{world} ranks of model {cpu[0].config.model_name} need at least {need / gib:.1f} GiB of "
                         f"memory on this host but {avail / gib:.1f} GiB is available; use fewer ranks (-D/--dp), "
                         f"micro-batches or a smaller --model")


def torchrun_placement(device_map, sched: Schedule, tp: int = 1, cp: int = 1) -> tuple[int, int]:
    """(process-group rank, global device) of this torchrun process (:func:`executor.mesh.placement`)."""
    node, local, nodes, per_node = topology()
    return placement(device_map, sched, tp, node, local, nodes, per_node, cp)


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
                env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}   # none left over
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                           WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                           OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)),
                           PYTHONPATH=os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")])))
                env[_WORKDIR_ENV] = tmp
                env[_PARENT_ENV] = str(os.getpid())
                log = open(work / f"log.{rank}", "wb")
                procs.append(subprocess.Popen([sys.executable, "-c", WORKER_BOOT], env=env, stdout=log,
                                              stderr=subprocess.STDOUT, cwd=os.getcwd()))
                log.close()
            _watch(procs, work)
        finally:
            _stop(procs)
        return pickle.loads((work / "result.pkl").read_bytes())


def _watch(procs: list[subprocess.Popen], work: Path) -> None:
    bar = _Progress(work / "progress")
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes):
                return
            if any(c not in (None, 0) for c in codes):
                time.sleep(0.1)   # let the other deaths of the same cause land before judging
                died = {r: p.poll() for r, p in enumerate(procs) if p.poll() not in (None, 0)}
                _stop(procs)
                refusal = _refusal(work, len(procs), died)
                if refusal is not None:
                    raise ValueError(refusal)
                raise LaunchError(_failure_report(procs, work, died))
            bar.update()
            time.sleep(0.02)
    finally:
        bar.close()


class _Progress:
    """Rank 0's progress file (``done total what``, see :func:`executor.worker.report_progress`)
    as a tqdm bar on stderr when stderr is a terminal."""

    def __init__(self, path: Path):
        self.path, self.bar, self.seen = path, None, ""
        self.enabled = sys.stderr.isatty()

    def update(self) -> None:
        if not self.enabled:
            return
        try:
            text = self.path.read_text()
        except OSError:
            return
        if text == self.seen or text.count(" ") < 2:
            return
        self.seen = text
        done, total, what = text.split(" ", 2)
        if self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(total=int(total), desc=what.strip(), unit="step", leave=False, file=sys.stderr)
        self.bar.update(int(done) - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


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


def _signal_name(code: int) -> str:
    try:
        return f"{signal.Signals(-code).name} ({-code})"
    except ValueError:
        return f"signal {-code}"


def _refusal(work: Path, world: int, died: dict[int, int]) -> str | None:
    """The one line of a user error the ranks found themselves (an exception with ``refusal = True``,
    e.g. :class:`executor.user_model.RanksDisagree`) when it is the first error and no rank was
    killed from outside; else None (a failure, reported in full)."""
    if any(c < 0 for c in died.values()):
        return None
    first = min(((float(f.read_text().split("\n", 1)[0]), r) for r in range(world)
                 if (f := work / f"error.{r}").exists()), default=None)
    line = work / f"refusal.{first[1]}" if first is not None else None
    return line.read_text() if line is not None and line.exists() else None


def _failure_report(procs: list[subprocess.Popen], work: Path, died: dict[int, int] | None = None) -> str:
    """What went wrong, root cause first: ranks killed by a signal before the launcher stopped
    anything (``died``: rank -> exit code when the failure was seen), then the first Python error."""
    died = died or {}
    killed = [(r, c) for r, c in sorted(died.items()) if c < 0]
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
        if text.startswith("Traceback"):        # a RendezvousError is its line alone (_worker_main)
            lines.append(f"--- traceback of rank {rank} ---")
            lines.append(text.rstrip())
        told = {summary}
        for _, r, t in errors[1:]:
            last = t.strip().splitlines()[-1]
            if last not in told:     # the same rendezvous line from every rank: once
                told.add(last)
                lines.append(f"(then rank {r} failed: {last})")
    for rank, p in enumerate(procs):
        code = died.get(rank, p.returncode)
        if any(r == rank for _, r, _ in errors) or code in (0, None) or code < 0:
            continue
        tail = (work / f"log.{rank}").read_text(errors="replace")[-2000:]
        lines.insert(0, f"rank {rank} exited with code {code} without a Python error; its output:\n{tail}")
    if killed:
        injected = {r: f.read_text() for r, _ in killed if (f := work / f"injected.{r}").exists()}
        head = "; ".join(f"rank {r} was killed by {_signal_name(c)}" + (f" {injected[r]}" if r in injected else "")
                         for r, c in killed)
        outside = [c for r, c in killed if r not in injected]
        why = ("" if not outside else
               " from outside the run (kill -9, or the kernel's out-of-memory killer: see dmesg)"
               if any(-c == signal.SIGKILL for c in outside) else " from outside the run")
        lines.insert(0, head + why + ("; the errors below followed from it" if lines else ""))
    return "\n".join(lines) if lines else "a rank exited abnormally"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(target: str):
    mod, _, fn = target.partition(":")
    return getattr(importlib.import_module(mod), fn)


def _worker_main() -> None:
    """Entry point of a spawned rank (after :data:`WORKER_BOOT`): run the target, leave the result
    (rank 0) or the error."""
    work = Path(os.environ[_WORKDIR_ENV])
    rank = int(os.environ["RANK"])
    try:
        target, payload = pickle.loads((work / "job.pkl").read_bytes())
        result = _in_place(target, payload)
        if rank == 0:
            tmp = work / "result.tmp"
            tmp.write_bytes(pickle.dumps(result))
            tmp.rename(work / "result.pkl")
    except BaseException as e:  # noqa: BLE001 - everything must reach the launcher
        from .worker import RendezvousError
        if getattr(e, "refusal", False):    # a user error the ranks found: one line (see _refusal)
            (work / f"refusal.{rank}").write_text(str(e))
        what = f"{e}\n" if isinstance(e, RendezvousError) else traceback.format_exc()
        (work / f"error.{rank}").write_text(f"{time.time()!r}\n{what}")
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker_main()
