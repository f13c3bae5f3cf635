"""Runs from any folder, and a rank killed from outside is named.

- any folder: a working directory holding its own ``executor/``, ``schedules/``, ``experiments/``,
  ``sim/`` and ``cost_models/`` packages (whose import fails) cannot shadow pipetwin, neither for
  spawned workers (``pipetwin run``) nor under ``torchrun --no-python pipetwin run`` (the README's
  cluster line);
- kill: SIGKILL of rank 1 in the middle of a run ends it within 30 s with an error naming rank 1
  and the signal (what the OOM killer does).
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
def test_torchrun_console_script_from_a_shadowing_folder(shadowing_folder):
    p = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--no-python", str(PIPETWIN), "run",
                        "-s", "dapple", "-D", "2", "-N", "2", "--steps", "1", "--device", "cpu", "--json"],
                       cwd=shadowing_folder, env=_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    assert '"losses"' in p.stdout


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
def test_rank_killed_from_outside_is_named():
    p = subprocess.Popen([sys.executable, "-c", "import sys; from experiments.cli import main; sys.exit(main())",
                          "run", "-s", "dapple", "-D", "2", "-N", "4", "--steps", "100000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        workers, work = {}, None
        while time.monotonic() < deadline and p.poll() is None:    # wait until rank 0 finished a step
            workers = _workers_of(p.pid)
            if 1 in workers:
                env = (Path("/proc") / str(workers[1]) / "environ").read_bytes().decode(errors="replace")
                work = next(kv.split("=", 1)[1] for kv in env.split("\0") if kv.startswith("PIPETWIN_WORKDIR="))
                if (Path(work) / "progress").exists():
                    break
            time.sleep(0.1)
        assert work and (Path(work) / "progress").exists(), "the run did not get going"
        os.kill(workers[1], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=30)
        assert time.monotonic() - t0 < 30
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode != 0
    first = err.strip().splitlines()[0]
    assert "rank 1 was killed by SIGKILL (9)" in first, err[-2000:]
