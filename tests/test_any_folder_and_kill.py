"""Runs from any folder, a rank killed from outside is named, nothing outlives its parent.

- any folder: a working directory holding its own ``executor/``, ``schedules/``, ``experiments/``,
  ``sim/`` and ``cost_models/`` packages (whose import fails) cannot shadow pipetwin, neither for
  spawned workers (``pipetwin run``) nor under ``torchrun --no-python pipetwin run`` (the README's
  cluster line; also with ``--tp 2 --sequence-parallel``);
- kill: SIGKILL of rank 1 in the middle of a run (and of a rank of a tensor-parallel group) ends it
  with an error naming the rank and the signal (what the OOM killer does);
- nothing left running: SIGTERM, SIGHUP or SIGKILL of the main process of ``run``, ``sweep`` and
  ``validate`` leaves no rank, pool worker or resource tracker running 8 s later (SIGTERM and
  SIGHUP: exit status 128 + signal and one line, as Ctrl-C); the parent-pid watch (where there
  is no parent-death signal) ends an orphan (that would otherwise sleep 60 s).
"""
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow      # real processes started, killed and orphaned

BIN = Path(sys.executable).parent
PIPETWIN = BIN / "pipetwin"
TORCHRUN = BIN / "torchrun"
SHADOWS = ("executor", "schedules", "experiments", "sim", "cost_models")


@pytest.fixture()
def shadowing_folder(tmp_path):
    for name in SHADOWS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the user\\'s own {name} package')\n")
    return tmp_path


def _env():
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)     # as a user's shell: pipetwin found through its installation only
    return env


@pytest.mark.skipif(not PIPETWIN.exists(), reason="needs the pipetwin console script (pip install -e .)")
def test_run_from_a_folder_with_packages_of_the_same_names(shadowing_folder):
    p = subprocess.run([str(PIPETWIN), "run", "-s", "dapple", "-D", "2", "-N", "2", "--steps", "2", "--json"],
                       cwd=shadowing_folder, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert '"losses"' in p.stdout and "user's own" not in p.stderr


@pytest.mark.skipif(not (PIPETWIN.exists() and TORCHRUN.exists()), reason="needs pipetwin and torchrun scripts")
@pytest.mark.parametrize("tp", [1, 2])
def test_torchrun_console_script_from_a_shadowing_folder(shadowing_folder, tp):
    extra = ["--tp", "2", "--sequence-parallel"] if tp > 1 else []
    p = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", str(2 * tp), "--no-python", str(PIPETWIN),
                        "run", "-s", "dapple", "-D", "2", "-N", "2", "--steps", "1", "--device", "cpu", "--json",
                        *extra], cwd=shadowing_folder, env=_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    assert '"losses"' in p.stdout and f'"tp": {tp}' in p.stdout


def _workers_of(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the worker processes a launcher spawned (their environment names the rank)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if "PIPETWIN_WORKDIR" in env:
            out[int(env["RANK"])] = int(d.name)
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the workers through /proc")
@pytest.mark.parametrize("extra,victim", [([], 1), (["--tp", "2", "--sequence-parallel"], 3)],
                         ids=["D2", "T2D2-tp-rank-1-of-stage-1"])
def test_rank_killed_from_outside_is_named(extra, victim):
    """SIGKILL of a rank mid-run (with tensor parallelism: TP rank 1 of pipeline rank 1, whose TP
    peer then waits in a collective) ends the run naming the rank and the signal."""
    p = subprocess.Popen([sys.executable, "-c", "import sys; from experiments.cli import main; sys.exit(main())",
                          "run", "-s", "dapple", "-D", "2", "-N", "4", "--steps", "100000", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        workers, work = {}, None
        while time.monotonic() < deadline and p.poll() is None:    # wait until rank 0 finished a step
            workers = _workers_of(p.pid)
            if victim in workers:
                env = (Path("/proc") / str(workers[victim]) / "environ").read_bytes().decode(errors="replace")
                work = next(kv.split("=", 1)[1] for kv in env.split("\0") if kv.startswith("PIPETWIN_WORKDIR="))
                if (Path(work) / "progress").exists():
                    break
            time.sleep(0.1)
        assert work and (Path(work) / "progress").exists(), "the run did not get going"
        os.kill(workers[victim], signal.SIGKILL)
        _, err = p.communicate(timeout=120)     # a hang guard, not a time bound
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode != 0
    first = err.strip().splitlines()[0]
    assert f"rank {victim} was killed by SIGKILL (9)" in first, err[-2000:]


# ---------------------------------------------------------------------- nothing left running
MAIN = "import sys; from experiments.cli import main; sys.exit(main())"


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a live process, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """pid -> start time of every process below ``root``."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (st := _stat(int(d.name))) is not None:
            children.setdefault(st[0], []).append(int(d.name))
    out, todo = {}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            st = _stat(c)
            if st is not None and st[1] != "Z":
                out[c] = st[2]
                todo.append(c)
    return out


def _survivors(procs: dict[int, int]) -> list[str]:
    """Those of ``procs`` (pid -> start time) still running (a zombie has ended)."""
    out = []
    for pid, start in procs.items():
        st = _stat(pid)
        if st is not None and st[2] == start and st[1] != "Z":
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120])
    return out


def _ranks(procs: dict[int, int], settled: float = 1.0) -> list[int]:
    """The executor's ranks among ``procs`` that have run for ``settled`` seconds at least (past
    their first lines, where a rank whose launcher is already gone ends on its own)."""
    now = float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK")
    found = []
    for pid, start in procs.items():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if b"PIPETWIN_WORKDIR=" in env and now - start >= settled * os.sysconf("SC_CLK_TCK"):
            found.append(pid)
    return found


def _kill_when(argv, ready, sig, tmp_path, what: str):
    """Start ``pipetwin argv``, wait until ``ready(descendants)``, send ``sig`` to the main process
    only; return (its exit status, its stderr, the processes below it still running 8 s later)."""
    err = open(tmp_path / "stderr", "w+")
    # SIGHUP as a terminal would send it: a suite run under nohup passes SIGHUP ignored to its children,
    # and pipetwin keeps an ignored signal ignored (cost_models.lifeline.interrupt_on_termination)
    p = subprocess.Popen([sys.executable, "-c", MAIN, *argv], stdout=subprocess.DEVNULL, stderr=err, cwd=tmp_path,
                         start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    below: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and p.poll() is None:
            below = _descendants(p.pid)
            if ready(below):
                break
            time.sleep(0.1)
        assert p.poll() is None and ready(below), f"{what} did not get going: {(tmp_path / 'stderr').read_text()}"
        below = _descendants(p.pid)
        os.kill(p.pid, sig)
        code = p.wait(timeout=15)
        deadline = time.monotonic() + 8
        while (left := _survivors(below)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return code, (tmp_path / "stderr").read_text(), left, len(below)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for pid, start in {**below, **_descendants(p.pid)}.items():     # nothing left behind a failed test
            st = _stat(pid)
            if st is not None and st[2] == start:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        err.close()


def _check_end(sig, code, err, left, started, want_started):
    assert started >= want_started, f"only {started} processes were running below the main one"
    assert left == [], f"left running after {signal.Signals(sig).name} of the main process: {left}"
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL
    else:
        assert code == 128 + sig and err.strip().splitlines()[-1] == f"pipetwin: stopped by {signal.Signals(sig).name}"
        assert "Traceback" not in err, err[-2000:]


LINUX_PROC = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the processes through /proc")
SIGNALS = [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL]


@LINUX_PROC
@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_run_leaves_no_rank_when_its_main_process_is_killed(sig, tmp_path):
    code, err, left, n = _kill_when(["run", "-s", "dapple", "-D", "2", "-N", "4", "--steps", "100000"],
                                    lambda below: len(_ranks(below)) == 2, sig, tmp_path, "run")
    _check_end(sig, code, err, left, n, 2)


@LINUX_PROC
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: signal.Signals(s).name)
def test_sweep_leaves_no_pool_worker_or_resource_tracker(sig, tmp_path):
    argv = ["sweep", "-s", "all", "-D", "2,4,8", "-N", "8,16,32,64", "--dp", "1,2", "-m", "gpt3-1.3b",
            "--workers", "2", "--no-figures", "--out", str(tmp_path / "sw")]

    def going(below):      # two pool workers and the resource tracker, and points coming in
        table = tmp_path / "sw" / "sweep.csv"
        return len(below) >= 3 and table.exists() and table.read_text().count("\n") >= 3
    code, err, left, n = _kill_when(argv, going, sig, tmp_path, "sweep")
    _check_end(sig, code, err, left, n, 3)


@LINUX_PROC
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: signal.Signals(s).name)
def test_validate_leaves_no_rank(sig, tmp_path):
    argv = ["validate", "--schedules", "dapple", "-D", "2", "--plot", str(tmp_path / "v.png")]
    code, err, left, n = _kill_when(argv, lambda below: len(_ranks(below)) >= 2, sig, tmp_path, "validate")
    _check_end(sig, code, err, left, n, 2)


@LINUX_PROC
def test_parent_watch_ends_an_orphan_where_there_is_no_parent_death_signal(tmp_path):
    """The fallback of cost_models.lifeline (platforms without prctl): a worker whose parent is
    killed with -9 ends (it checks every WATCH_SECONDS; the test waits up to 30 s, the orphan would sleep 60)."""
    ready = tmp_path / "ready"
    child = ("import os, time; from pathlib import Path; from cost_models import lifeline; "
             "lifeline._parent_death_signal = lambda: False; lifeline.die_with_parent(); "
             f"Path({str(ready)!r}).write_text(str(os.getpid())); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; "
                               f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"],
                              start_new_session=True)
    pid = None
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int(ready.read_text())
        start = _stat(pid)[2]
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30        # the orphan would sleep 60 s
        while _survivors({pid: start}) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _survivors({pid: start}) == [], "the orphan kept running"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if pid is not None and _survivors({pid: start}):
            os.kill(pid, signal.SIGKILL)


def test_termination_signals_raise_only_inside_the_block_and_ignored_ones_stay_ignored():
    from cost_models.lifeline import Terminated, interrupt_on_termination
    before = signal.getsignal(signal.SIGTERM)
    old_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)        # as under nohup
    try:
        with pytest.raises(Terminated) as e:
            with interrupt_on_termination():
                assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
                os.kill(os.getpid(), signal.SIGHUP)                  # ignored: nothing happens
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
        assert e.value.signum == signal.SIGTERM and isinstance(e.value, KeyboardInterrupt)
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGHUP, old_hup)
