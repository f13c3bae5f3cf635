"""Bad input: every class of defect found on first contact exits with status 2 and one line on
stderr that names the option (or file) to change, fast, with no traceback; nothing hangs."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from experiments.cli import main

SIM = ["simulate", "-s", "dapple", "-D", "4", "-N", "8"]
UNIT = SIM + ["--unit-costs"]
RUN = ["run", "-s", "dapple", "-D", "2", "-N", "2", "--steps", "1"]
SWEEP = ["sweep", "-s", "dapple", "-D", "2", "-N", "2", "--no-figures", "--no-progress", "--workers", "1"]


def _plan(tmp_path: Path, **changes) -> str:
    """A real plan file (pipetwin plan --out) with fields of its 'plan' record changed."""
    path = tmp_path / "good.json"
    if not path.exists():
        assert main(["plan", "-m", "tiny", "-c", "v100-2x8-25gbe", "-G", "16", "--no-progress", "--no-baselines",
                     "--out", str(path)]) == 0
    rec = json.loads(path.read_text())
    rec["plan"].update(changes)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(rec))
    return str(bad)


# (id, argv (with {file} = an existing file, {dir} = an existing folder, {empty} = an empty file, {plan0} /
#  {plan_nostages} = plan files with a bad field), words the one line must contain)
CASES = [
    # hangs: NaN / inf / out-of-range numbers in every float option
    ("slowdown-nan", SIM + ["--slowdown", "2=nan"], ["--slowdown", "nan"]),
    ("slowdown-inf", SIM + ["--slowdown", "2=inf"], ["--slowdown", "inf"]),
    ("slowdown-zero", SIM + ["--slowdown", "2=0"], ["--slowdown"]),
    ("jitter-nan", UNIT + ["--jitter", "nan"], ["--jitter", "nan"]),
    ("jitter-inf", UNIT + ["--jitter", "inf"], ["--jitter"]),
    ("jitter-negative", UNIT + ["--jitter", "-0.1"], ["--jitter"]),
    ("slow-link-nan", SIM + ["--slow-link", "n0.g0.out=nan"], ["--slow-link"]),
    ("lr-negative", RUN + ["--lr", "-1"], ["--lr"]),
    ("lr-nan", RUN + ["--lr", "nan"], ["--lr"]),
    ("timeout-inf", RUN + ["--timeout", "inf"], ["--timeout"]),
    # hangs: sizes refused before an O(D^2) build
    ("D-huge-unit", ["simulate", "-s", "dapple", "-D", "100000", "-N", "8", "--unit-costs"], ["-D", "limit"]),
    ("D-huge-cluster", ["simulate", "-s", "dapple", "-D", "100000", "-N", "8"], ["-D", "limit"]),
    ("D-beyond-cluster", ["compare", "-D", "1000", "-N", "8"], ["--cluster", "1000 ranks"]),
    ("D-beyond-layers", ["run", "-s", "dapple", "-D", "1000", "-N", "8"], ["-D", "--model"]),
    ("N-huge", ["simulate", "-s", "dapple", "-D", "4", "-N", "10000000", "--unit-costs"], ["-N", "limit"]),
    ("N-huge-run", ["run", "-s", "dapple", "-D", "2", "-N", "10000000"], ["-N", "limit"]),
    ("N-zero", ["simulate", "-s", "dapple", "-D", "4", "-N", "0", "--unit-costs"], ["--microbatches"]),
    ("D-negative", ["bubbles", "-D", "-3"], ["--devices"]),
    ("steps-zero", RUN[:-1] + ["0"], ["--steps"]),
    # silent wrong results
    ("slow-link-unused", SIM + ["--slow-link", "n1.nic0.out=4"], ["--slow-link", "never crosses"]),
    ("slow-link-unknown", SIM + ["--slow-link", "nope=4"], ["--slow-link", "nope"]),
    ("profile-and-model", SIM + ["--profile", "{file}", "-m", "tiny"], ["--profile", "--model"]),
    ("unit-and-cluster", UNIT + ["-c", "dgx-a100-1x8"], ["--unit-costs", "--cluster"]),
    ("fault-unknown-token", RUN + ["--inject-fault", "1:F9.s1"], ["--inject-fault", "F9.s1"]),
    ("fault-rank-beyond", RUN + ["--inject-fault", "5:F0.s1"], ["--inject-fault", "ranks 0..1"]),
    ("fault-step-beyond", RUN + ["--inject-fault", "1:F0.s1:7"], ["--inject-fault", "steps"]),
    ("fault-syntax", RUN + ["--inject-fault", "nonsense"], ["--inject-fault", "RANK:TOKEN"]),
    # tracebacks: files
    ("plan-microbatches-0", ["simulate", "--plan", "{plan0}"], ["bad.json", "microbatches"]),
    ("plan-no-stages", ["run", "--plan", "{plan_nostages}"], ["bad.json", "stages"]),
    ("plan-missing", ["simulate", "--plan", "{dir}/none.json"], ["plan file", "does not exist"]),
    ("plan-folder", ["simulate", "--plan", "{dir}"], ["plan file", "folder"]),
    ("data-missing", RUN + ["--data", "{dir}/none.txt"], ["--data", "does not exist"]),
    ("data-folder", RUN + ["--data", "{dir}"], ["--data", "folder"]),
    ("data-empty", RUN + ["--data", "{empty}"], ["--data", "empty"]),
    ("model-file-empty", SIM + ["-m", "{empty}"], ["model file", "empty"]),
    ("model-yaml-nan", SIM + ["-m", "{nanmodel}"], ["nanmodel.yaml", "hidden"]),
    ("cluster-yaml-inf", SIM + ["-c", "{infcluster}"], ["infcluster.yaml", "bandwidth"]),
    ("profile-folder", SIM + ["--profile", "{dir}"], ["calibration profile", "folder"]),
    # tracebacks: output paths under an existing file, refused before any work
    ("plot-under-file", UNIT + ["--plot", "{file}/t.png"], ["--plot", "is a file"]),
    ("trace-under-file", RUN + ["--trace", "{file}/t.csv"], ["--trace", "is a file"]),
    ("plan-out-under-file", ["plan", "-m", "tiny", "-c", "v100-2x8-25gbe", "-G", "16", "--out", "{file}/p.json"],
     ["--out", "is a file"]),
    ("calibrate-out-under-file", ["calibrate", "--out", "{file}/c.yaml"], ["--out", "is a file"]),
    ("validate-plot-under-file", ["validate", "--plot", "{file}/v.png"], ["--plot", "is a file"]),
    ("validate-report-under-file", ["validate", "--report", "{file}/reports"], ["--report", "is a file"]),
    ("compare-out-is-file", ["compare", "-D", "2", "-N", "2", "--unit-costs", "--out", "{file}"], ["--out", "file"]),
    ("demo-out-is-file", ["demo", "--out", "{file}"], ["--out", "file"]),
    ("reproduce-unknown", ["reproduce", "nope"], ["target", "nope"]),
    # tracebacks and truncated files: a full disk (ENOSPC) is one line naming the path
    ("chrome-trace-disk-full", UNIT + ["--chrome-trace", "/dev/full"], ["Chrome trace /dev/full", "No space left"]),
    ("trace-disk-full", UNIT + ["--trace", "/dev/full"], ["trace /dev/full", "No space left"]),
    ("plot-disk-full", UNIT + ["--plot", "/dev/full"], ["figure /dev/full", "No space left"]),
    ("plan-out-disk-full", ["plan", "-m", "tiny", "-c", "v100-2x8-25gbe", "-G", "16", "--no-progress",
                            "--no-baselines", "--out", "/dev/full"], ["plan file /dev/full", "No space left"]),
    ("run-trace-disk-full", RUN + ["--trace", "/dev/full"], ["trace /dev/full", "No space left"]),
    # names over 255 bytes (ENAMETOOLONG), refused while parsing
    ("trace-name-too-long", UNIT + ["--trace", "{dir}/" + "t" * 300 + ".csv"], ["--trace", "304 bytes", "255"]),
    ("sweep-out-name-too-long", ["sweep", "-D", "2", "-N", "2", "--unit-costs", "--out", "{dir}/" + "d" * 300],
     ["--out", "300 bytes"]),
    ("calibrate-out-name-too-long", ["calibrate", "--out", "{dir}/" + "c" * 300 + "/p.yaml"], ["--out", "300 bytes"]),
    # silent wrong results: a sweep folder holds one experiment
    ("sweep-other-model", SWEEP + ["-m", "gpt3-1.3b", "--out", "{sweep}"],
     ["--out", "model 'tiny' there, 'gpt3-1.3b'"]),
    ("sweep-other-recompute", SWEEP + ["-m", "tiny", "--recompute", "full", "--out", "{sweep}"],
     ["--out", "recompute 'none' there, 'full' here", "another --out"]),
    ("sweep-other-fabric", SWEEP + ["-m", "tiny", "--fabric", "fat-tree", "--out", "{sweep}"],
     ["cluster.fabric None there, 'fat-tree' here"]),
    ("sweep-other-cost-model", SWEEP + ["-m", "tiny", "--cost-model", "linear", "--out", "{sweep}"],
     ["cost_model 'kernels' there, 'linear' here"]),
    ("sweep-other-cluster", SWEEP + ["-m", "tiny", "-c", "dgx-a100-1x8", "--out", "{sweep}"],
     ["cluster.name 'dgx-a100-4x8-ib' there, 'dgx-a100-1x8' here"]),
    ("sweep-folder-in-use", SWEEP + ["-m", "tiny", "--out", "{locked}"],
     ["--out", "is being written by another sweep", "another --out"]),
    ("sweep-folder-of-unknown-experiment", SWEEP + ["-m", "tiny", "--out", "{unrecorded}"],
     ["--out", "sweep.csv but no sweep.json"]),
    ("model-name-too-long", SIM + ["-m", "{dir}/" + "m" * 300 + ".yaml"], ["model file", "305 bytes"]),
]
if not torch.cuda.is_available():
    CASES.append(("device-cuda-without-gpu", RUN + ["--device", "cuda"], ["--device cuda", "CUDA"]))


@pytest.fixture()
def files(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    empty = tmp_path / "empty"
    empty.write_text("")
    (tmp_path / "nanmodel.yaml").write_text("layers: 4\nhidden: .nan\nheads: 4\nseq_len: 8\nvocab: 16\n")
    (tmp_path / "infcluster.yaml").write_text("nodes: 1\ndevices_per_node: 8\ndevice: a100\n"
                                              "intra: {type: nvlink3, bandwidth: .inf}\ninter: ib-hdr\n")
    made = {"file": str(f), "dir": str(tmp_path), "empty": str(empty), "nanmodel": str(tmp_path / "nanmodel.yaml"),
            "infcluster": str(tmp_path / "infcluster.yaml"), "tmp": tmp_path}
    yield made
    if "tmp_held" in made:
        made["tmp_held"].close()


def _fill(argv, files):
    out = []
    for a in argv:
        if "{plan0}" in a:
            a = _plan(files["tmp"], microbatches=0)
        elif "{plan_nostages}" in a:
            a = _plan(files["tmp"], stages=[])
        elif a == "{sweep}":        # a finished sweep of model tiny on the default cluster
            a = str(files["tmp"] / "sweep")
            assert main(SWEEP + ["-m", "tiny", "--out", a]) == 0
        elif a == "{locked}":       # a folder another sweep is writing (it holds the lock)
            import fcntl
            folder = files["tmp"] / "busy"
            folder.mkdir()
            held = open(folder / ".sweep.lock", "w")
            fcntl.flock(held, fcntl.LOCK_EX)
            files["tmp_held"] = held                # released when the test's files go
            a = str(folder)
        elif a == "{unrecorded}":   # a sweep table with no record of its experiment
            (files["tmp"] / "old").mkdir()
            (files["tmp"] / "old" / "sweep.csv").write_text("schedule,devices\n")
            a = str(files["tmp"] / "old")
        out.append(a.format(**{k: v for k, v in files.items() if not k.startswith("tmp")}))
    return out


@pytest.mark.parametrize("argv,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line(capsys, files, argv, words):
    argv = _fill(argv, files)
    capsys.readouterr()
    t0 = time.perf_counter()
    rc = main(argv)
    seconds = time.perf_counter() - t0
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("pipetwin: error: "), err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert seconds < 15, f"took {seconds:.1f} s to refuse"


@pytest.mark.parametrize("argv,word", [
    (["simulate", "-s", "dapple", "-D", "4", "-N", "8", "--slowdown", "2=nan"], "--slowdown"),
    (["run", "-s", "dapple", "-D", "100000", "-N", "8"], "-D"),
    (["run", "-s", "dapple", "-D", "2", "-N", "2", "--data", "/nonexistent/x.txt"], "--data"),
])
def test_bad_input_real_process(argv, word):
    """The same through the console entry point: one stderr line, status 2, within the time bound."""
    p = subprocess.run([sys.executable, "-c", "import sys; from experiments.cli import main; sys.exit(main())",
                        *argv], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and word in lines[0], p.stderr


def test_host_memory_checked_before_spawning(capsys):
    """A planned run that cannot fit in this host's memory is refused before any rank starts."""
    from executor.launch import available_host_bytes
    avail = available_host_bytes()
    if avail is None or avail > 150 * 2 ** 30:
        pytest.skip("needs a host with /proc/meminfo and < 150 GiB available (gpt-96 needs ~180 GB)")
    rc = main(["run", "-s", "dapple", "-D", "2", "-N", "2", "--model", "gpt-96", "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "GiB of memory on this host" in err and len(err.strip().splitlines()) == 1


def test_version_and_presets(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("pipetwin ")
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in ("tiny", "gpt3-1.3b", "dgx-a100-4x8-ib", "v100-2x8-25gbe", "a100", "h200"):
        assert f"  {name} " in out
    assert max(len(line) for line in out.splitlines()) <= 120


def test_outputs_fit_120_columns(capsys):
    """schedules (descriptions end with their sentence) and plan (details below the table) fit 120 columns."""
    assert main(["schedules"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 120
    blocks = [b for b in out.replace("\n" + " " * 20, " ").splitlines()]   # continuation lines joined
    assert len(blocks) == 9 and all(b.rstrip().endswith(".") for b in blocks), blocks
    assert "then a flush." in " ".join(out.split())
    assert main(["plan", "-m", "bert-48", "-c", "v100-2x8-25gbe", "-G", "64", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 120
    assert "  PipeDream planner: " in out


def test_tiny_memory_in_a_unit_that_fits(capsys):
    assert main(["simulate", "-s", "dapple", "-D", "2", "-N", "4", "-m", "tiny", "-c", "dgx-a100-1x8"]) == 0
    out = capsys.readouterr().out
    assert "memory in MiB" in out and "fits: peak" in out and "MiB on device" in out


def test_slow_link_crossed_by_some_compared_schedules(capsys):
    """compare: a slow link that some schedules cross is applied to them and a note names the others."""
    rc = main(["compare", "-D", "16", "-N", "16", "-m", "bert-48", "-c", "v100-2x8-25gbe", "--schedules",
               "dapple,gpipe", "--slow-link", "n0.nic0.out=10"])
    assert rc == 0 and "slow-link" not in capsys.readouterr().out


def test_simulate_without_network_refuses_to_drop_communication():
    from cost_models import TransformerCostModel, load_cluster, load_model
    from schedules import build, lower
    from sim import simulate
    low = lower(build("dapple", 2, 4))
    costs = TransformerCostModel(load_model("tiny"), load_cluster("dgx-a100-1x8").device).bind(low)
    with pytest.raises(ValueError, match="no network was given"):
        simulate(low, costs)
    free = simulate(low, costs, free_comm=True)
    placed = simulate(low, costs, load_cluster("dgx-a100-1x8").place(low))
    assert free.end.max() < placed.end.max()     # the network really adds the message times


def test_save_profile_creates_its_folder(tmp_path):
    """validate in a fresh folder: the calibration profile's folder (out/) is created when it is written."""
    from cost_models import load_profile, save_profile
    from tests.test_cost_models_specs import PROFILE
    src = tmp_path / "p.yaml"
    src.write_text(PROFILE)
    prof = load_profile(src)
    out = save_profile(prof, tmp_path / "fresh" / "out" / "calibration.yaml")
    assert load_profile(out) == prof


def test_profile_file_is_checked_where_it_is_used(capsys, tmp_path):
    """A profile field that is NaN is refused with the file and field named."""
    from tests.test_cost_models_specs import PROFILE
    bad = tmp_path / "nan.yaml"
    bad.write_text(PROFILE.replace("latency: 50 us", "latency: .nan"))
    assert main(SIM[:1] + ["-s", "dapple", "-D", "2", "-N", "2", "--profile", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "nan.yaml" in err and "p2p.latency" in err and len(err.strip().splitlines()) == 1


def test_validate_refuses_a_profile_that_does_not_model_more_ranks_than_cores(capsys, tmp_path):
    """A profile calibrated for 2 ranks on 2 cores (no time slice) cannot predict 4 ranks on them:
    validate says so before it runs anything; with a time slice it would go on (not run here)."""
    from tests.test_cost_models_specs import PROFILE
    prof = tmp_path / "two.yaml"
    prof.write_text(PROFILE.replace("threads: 1}", "threads: 1, ranks: 2}") + "cores: 2\n")
    assert main(["validate", "-D", "4", "--profile", str(prof)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "4 ranks on 2 cores" in err[0] and "for 2 ranks" in err[0] and "--ranks 4" in err[0]


def test_outputs_are_written_whole_or_not_at_all(tmp_path):
    """An error while writing leaves the old file as it was and no temporary file; a device is
    written in place (never replaced by a file); a full disk is one FileError naming the path."""
    from cost_models.files import FileError, output_file, write_output
    target = tmp_path / "t.csv"
    write_output(target, "old\n")
    with pytest.raises(RuntimeError):
        with output_file(target) as fh:
            fh.write("half a ro")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv"]
    write_output(target, b"new\n")
    assert target.read_text() == "new\n"
    (tmp_path / "link.csv").symlink_to(target)
    write_output(tmp_path / "link.csv", "through the link\n")
    assert (tmp_path / "link.csv").is_symlink() and target.read_text() == "through the link\n"
    (tmp_path / "link.csv").unlink()
    write_output("/dev/null", "x" * 1000)
    assert Path("/dev/null").is_char_device()
    with pytest.raises(FileError, match="trace /dev/full could not be written: No space left on device"):
        write_output("/dev/full", "x" * 100_000, "trace")
