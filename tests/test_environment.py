"""The environment (issue 47, item 3): launcher variables left in a shell are refused by ``run`` at
once, naming them; torchrun is told by TORCHELASTIC_RUN_ID alone and its variables are checked; a
rendezvous waits at most its stated bound and ends with one line naming the missing ranks; a
failed write to standard output is an error exit with one line. The process cases run as
subprocesses with bounded waits."""
import os
import socket
import subprocess
import sys
import time
import types

import pytest

from executor.launch import LAUNCHER_VARS, _failure_report, check_launch_env, launch, under_torchrun
from experiments.cli import main

RUN = ["run", "-s", "dapple", "-D", "2", "-N", "2", "--steps", "1"]
PIPETWIN = [sys.executable, "-m", "experiments"]
# the real command line with the rendezvous floor (30 s, for ranks that start seconds apart) lifted
PIPETWIN_NO_FLOOR = [sys.executable, "-c", "import sys, executor.worker as w; w.RENDEZVOUS_MIN_SECONDS = 0.0; "
                     "from experiments.cli import main; sys.exit(main())"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _clean_env(**extra) -> dict:
    """This process's environment without any launcher or SLURM variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("SLURM_")
           and k != "PIPETWIN_WORKDIR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return {**env, **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bounded(argv, env, bound: float, **kw):
    """Run ``argv``; it must end within ``bound`` seconds (the subprocess is killed at twice that)."""
    t0 = time.monotonic()
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=2 * bound, **kw)
    return p, time.monotonic() - t0


LEFTOVER = [
    (dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="10.1.2.3", MASTER_PORT="29500"),
     "RANK=1 WORLD_SIZE=2 MASTER_ADDR=10.1.2.3 MASTER_PORT=29500 set, but not by torchrun (no TORCHELASTIC_RUN_ID): "
     "'unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT' to train on spawned local ranks, or start pipetwin with "
     "torchrun"),
    (dict(LOCAL_RANK="3"),
     "LOCAL_RANK=3 set, but not by torchrun (no TORCHELASTIC_RUN_ID): 'unset LOCAL_RANK' to train on spawned local "
     "ranks, or start pipetwin with torchrun"),
    (dict(RANK="0", WORLD_SIZE="4", GROUP_RANK="1", SLURM_JOB_ID="77", SLURM_PROCID="0", SLURM_NTASKS="4"),
     "RANK=0 WORLD_SIZE=4 GROUP_RANK=1 set, but not by torchrun (no TORCHELASTIC_RUN_ID): 'unset RANK WORLD_SIZE "
     "GROUP_RANK' to train on spawned local ranks, or start pipetwin with torchrun (in SLURM: srun torchrun ... "
     "--no-python pipetwin run ...)"),
]


@pytest.mark.parametrize("env,line", LEFTOVER, ids=["rank-master", "local-rank", "slurm"])
def test_leftover_launcher_variables_are_named_in_process(monkeypatch, capsys, no_ranks, env, line):
    for k in (*LAUNCHER_VARS, "PIPETWIN_WORKDIR"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert not under_torchrun()
    for extra in ([], ["--reference"]):
        assert main(RUN + extra) == 2
        assert capsys.readouterr().err.splitlines() == ["pipetwin: error: " + line]


@pytest.mark.slow
def test_leftover_launcher_variables_are_refused_at_once():
    """The issue's case: a shell left with RANK / WORLD_SIZE / MASTER_* (a 61 s wait and torch's
    traceback before): one line, status 2, in the seconds it takes to start."""
    env, line = LEFTOVER[0]
    p, took = _bounded(PIPETWIN + RUN, _clean_env(**env), 30)
    assert p.returncode == 2 and p.stdout == "" and took < 30
    assert p.stderr.splitlines() == ["pipetwin: error: " + line]


@pytest.mark.parametrize("env,line", [
    (dict(RANK="1", WORLD_SIZE="2"), "TORCHELASTIC_RUN_ID is set (a torchrun process) but LOCAL_RANK, "
     "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not; start pipetwin with torchrun itself"),
    (dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="x"),
     "torchrun's MASTER_PORT='x' is not a whole number >= 0"),
    (dict(RANK="2", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="29500"),
     "torchrun's variables disagree: RANK=2 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 MASTER_PORT=29500 "
     "(0 <= RANK < WORLD_SIZE, 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE, which divides WORLD_SIZE, a port in 1..65535)"),
    (dict(RANK="1", WORLD_SIZE="6", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", MASTER_ADDR="h", MASTER_PORT="29500"),
     "torchrun's variables disagree: RANK=1 WORLD_SIZE=6 LOCAL_RANK=1 LOCAL_WORLD_SIZE=4 MASTER_PORT=29500 "
     "(0 <= RANK < WORLD_SIZE, 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE, which divides WORLD_SIZE, a port in 1..65535)"),
])
def test_torchrun_variables_are_checked(monkeypatch, env, line):
    for k in (*LAUNCHER_VARS, "PIPETWIN_WORKDIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert under_torchrun()
    with pytest.raises(ValueError) as e:
        check_launch_env()
    assert str(e.value) == line


def test_torchrun_is_told_by_its_run_id_alone(monkeypatch):
    for k in (*LAUNCHER_VARS, "PIPETWIN_WORKDIR"):
        monkeypatch.delenv(k, raising=False)
    check_launch_env()                               # nothing set: spawned ranks
    for k, v in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29500").items():
        monkeypatch.setenv(k, v)
    assert not under_torchrun()                      # the full env:// set alone is not torchrun
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    assert under_torchrun()
    check_launch_env()                               # torchrun's whole, consistent set
    monkeypatch.setenv("PIPETWIN_WORKDIR", "/tmp/x")  # a worker pipetwin spawned: never torchrun, never checked
    assert not under_torchrun()
    check_launch_env()


def _environment_of(payload, rank, world, local_rank, local_world):
    return {k: os.environ.get(k) for k in payload}


@pytest.mark.slow
def test_spawned_workers_inherit_no_launcher_variable(monkeypatch):
    """A leftover GROUP_RANK would put a spawned rank on node 1 (executor.worker.topology): the
    launcher gives its workers only the variables it sets."""
    for k, v in dict(GROUP_RANK="1", ROLE_RANK="3", TORCHELASTIC_RUN_ID="old", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    seen = launch("tests.test_environment:_environment_of",
                  ["GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK"], 1)
    assert seen == {"GROUP_RANK": None, "ROLE_RANK": None, "TORCHELASTIC_RUN_ID": None, "RANK": "0",
                    "WORLD_SIZE": "1", "LOCAL_RANK": "0"}


def _torchrun_env(rank: int, world: int, port: int) -> dict:
    return _clean_env(TORCHELASTIC_RUN_ID="test", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")


@pytest.mark.slow
def test_a_rendezvous_names_the_rank_that_never_came():
    """torchrun's rank 0 of 2 alone: it waits its stated bound (--timeout 3, the 30 s floor lifted)
    and ends with one line naming rank 1, status 1."""
    port = _free_port()
    p, took = _bounded(PIPETWIN_NO_FLOOR + RUN + ["--timeout", "3"], _torchrun_env(0, 2, port), 30)
    assert p.returncode == 1 and took < 30, p.stderr
    assert p.stderr.splitlines() == [
        f"pipetwin: run failed: rank 0 waited 3 s (the rendezvous bound: --timeout, at least 0 s) for rank 1 of "
        f"WORLD_SIZE 2 to join at MASTER_ADDR=127.0.0.1 MASTER_PORT={port}; start every rank with the same "
        f"WORLD_SIZE, MASTER_ADDR and MASTER_PORT"]


@pytest.mark.slow
def test_a_rank_without_its_store_says_so_within_the_bound():
    """torchrun's rank 1 with nothing at MASTER_ADDR:MASTER_PORT: one line within the bound."""
    port = _free_port()
    p, took = _bounded(PIPETWIN_NO_FLOOR + RUN + ["--timeout", "3"], _torchrun_env(1, 2, port), 30)
    assert p.returncode == 1 and took < 30, p.stderr
    assert p.stderr.splitlines() == [
        f"pipetwin: run failed: rank 1 could not reach the rendezvous (rank 0's store at MASTER_ADDR=127.0.0.1 "
        f"MASTER_PORT={port}) within 3 s: nothing listens there (Connection refused); start rank 0 with the same "
        f"MASTER_ADDR and MASTER_PORT on every rank"]


@pytest.mark.slow
def test_a_store_port_in_use_is_named():
    """torchrun's rank 0 (no agent store) hosting on a port another process holds: one line at once."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p, took = _bounded(PIPETWIN_NO_FLOOR + RUN + ["--timeout", "3"], _torchrun_env(0, 2, port), 30)
    assert p.returncode == 1 and took < 30, p.stderr
    [line] = p.stderr.splitlines()
    assert line.startswith(f"pipetwin: run failed: rank 0 could not host the rendezvous at MASTER_ADDR=127.0.0.1 "
                           f"MASTER_PORT={port}: ") and "EADDRINUSE" in line, line
    assert line.endswith("; give MASTER_PORT a free port (the same on every rank)"), line


def test_a_folder_output_that_is_a_pipe_says_so(capsys, tmp_path):
    fifo = tmp_path / "out"
    os.mkfifo(fifo)
    assert main(["compare", "-D", "2", "-N", "2", "--unit-costs", "--out", str(fifo)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"pipetwin: error: argument --out: folder {fifo} is a named pipe (FIFO), not a folder "
        f"(see pipetwin compare --help)"]


RENDEZVOUS = ("import sys, time, executor.worker as w\n"
              "t = time.monotonic()\n"
              "try:\n"
              "    w.rendezvous(int(sys.argv[1]), 3, 3.0)\n"
              "    print('joined')\n"
              "except w.RendezvousError as e:\n"
              "    print(f'{time.monotonic() - t:.1f}', e)\n")


@pytest.mark.slow
def test_every_rank_that_came_names_the_one_that_did_not():
    """Ranks 0 and 2 of 3 meet, rank 1 never comes: after 3 s both end with one line naming it (rank
    0, the store's host, tells rank 2 its line before its store goes, unless rank 2's own bound
    came first: then rank 2's own line, after its own 3 s)."""
    port = _free_port()
    env = _clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = [subprocess.Popen([sys.executable, "-c", RENDEZVOUS, str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 2)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    line = ("rank {} waited 3 s (the rendezvous bound: --timeout, at least 30 s) for rank 1 of WORLD_SIZE 3 to join "
            f"at MASTER_ADDR=127.0.0.1 MASTER_PORT={port}; start every rank with the same WORLD_SIZE, MASTER_ADDR "
            f"and MASTER_PORT")
    took, text = outs[0].split(" ", 1)
    assert text == line.format(0) and 2.9 <= float(took) < 10, outs
    took, text = outs[1].split(" ", 1)
    # rank 0's line is relayed when rank 0's bound passes, which began before rank 2 started (by the
    # start of a Python process, under a second on a loaded host): rank 2 has waited less than 3 s
    assert (text == line.format(0) and 2.0 <= float(took) < 10) or \
        (text == line.format(2) and 2.9 <= float(took) < 10), outs


def test_a_rendezvous_failure_is_its_line_alone(tmp_path):
    """The launcher's report of spawned ranks that ended on one rendezvous line: that line once, no
    traceback (a Python error keeps its traceback)."""
    line = "rank 0 waited 30 s (...) for rank 1 of WORLD_SIZE 3 to join at MASTER_ADDR=127.0.0.1 MASTER_PORT=1"
    (tmp_path / "error.0").write_text(f"1.0\n{line}\n")
    (tmp_path / "error.2").write_text(f"1.1\n{line}\n")
    procs = [types.SimpleNamespace(returncode=c) for c in (1, None, 1)]
    assert _failure_report(procs, tmp_path, {0: 1, 2: 1}) == f"rank 0 failed: {line}"
    (tmp_path / "error.2").write_text("1.1\nTraceback (most recent call last):\n  ...\nKeyError: 'x'\n")
    assert _failure_report(procs, tmp_path, {0: 1, 2: 1}).splitlines() == [
        f"rank 0 failed: {line}", "(then rank 2 failed: KeyError: 'x')"]


class _Broken:
    """A standard output whose reader has gone."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")

    def isatty(self):
        return False


def test_a_broken_standard_output_is_an_error_in_process(monkeypatch, capsys):
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdout", _Broken())
    assert main(["presets"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "pipetwin: error: standard output cannot be written: its reader has gone (broken pipe); the output is lost"]
    assert isinstance(sys.stdout, _Broken)     # given back as it was


@pytest.mark.slow
@pytest.mark.parametrize("how,why", [("closed", "it is closed"), ("pipe", "its reader has gone (broken pipe)"),
                                     ("full", "No space left on device")])
@pytest.mark.parametrize("argv", [["presets"], ["simulate", "-s", "dapple", "-D", "2", "-N", "2", "--unit-costs"]])
def test_a_failed_write_to_standard_output_is_an_error_exit(how, why, argv):
    """``>&-``, ``| head -0`` (the reader gone before the first write), ``> /dev/full``: status 2 and
    one line on stderr (before: status 0 having printed nothing)."""
    env = _clean_env()
    if how == "closed":
        p = subprocess.run(["bash", "-c", 'exec "$@" >&-', "-", *PIPETWIN, *argv], env=env, capture_output=False,
                           stderr=subprocess.PIPE, text=True, timeout=60)
        err = p.stderr
    elif how == "pipe":
        r, w = os.pipe()
        os.close(r)
        p = subprocess.run(PIPETWIN + argv, env=env, stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
        os.close(w)
        err = p.stderr
    else:
        with open("/dev/full", "w") as full:
            p = subprocess.run(PIPETWIN + argv, env=env, stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
        err = p.stderr
    assert p.returncode == 2
    assert err.splitlines() == [f"pipetwin: error: standard output cannot be written: {why}; the output is lost"]
