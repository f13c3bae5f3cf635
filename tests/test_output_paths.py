"""Output paths (issue 47, item 4): an output that is no file pipetwin may write (a named pipe, a
socket, a disk, a folder) is refused while parsing, without blocking; every output's format is its
extension, checked while parsing; an output that is one of the command's inputs (or another of its
outputs) is refused before any work; /dev/stdout, /dev/null and the like are written in place."""
import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cost_models.files import FileError, check_output_path, output_file, own_descriptor
from experiments.checks import FIGURE_FORMATS
from experiments.cli import main
from experiments.options import check_files_apart

SIM = ["simulate", "-s", "dapple", "-D", "2", "-N", "2", "--unit-costs"]
PIPETWIN = [sys.executable, "-m", "experiments"]
FIGURES = ".png, .pdf, .svg, .svgz, .eps, .ps, .jpg, .jpeg, .tif, .tiff, .webp"


def _one_line(capsys, argv) -> str:
    """main(argv): status 2 and exactly one stderr line, returned."""
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    return err[0]


def test_a_named_pipe_is_refused_in_process_within_a_bound(capsys, tmp_path):
    """In this process, watched: were the FIFO opened, the test would open its reading end after the
    bound (unblocking the writer) and fail, not hang."""
    import threading
    fifo = tmp_path / "t.csv"
    os.mkfifo(fifo)
    got = {}
    worker = threading.Thread(target=lambda: got.setdefault("rc", main(SIM + ["--trace", str(fifo)])), daemon=True)
    worker.start()
    worker.join(30)
    if worker.is_alive():
        with open(fifo, "rb") as f:
            f.read()
        worker.join(30)
        pytest.fail("the write to the FIFO blocked")
    assert got["rc"] == 2
    assert capsys.readouterr().err.splitlines() == [
        f"pipetwin: error: argument --trace: trace {fifo} is a named pipe (FIFO): writing it waits for a reader, "
        f"maybe forever; give a regular file (or /dev/stdout, /dev/null) (see pipetwin simulate --help)"]


@pytest.mark.slow
@pytest.mark.parametrize("flag,name,what", [("--trace", "t.csv", "trace"), ("--chrome-trace", "c.json", "Chrome trace"),
                                            ("--plot", "p.png", "figure")])
def test_a_named_pipe_is_refused_without_blocking(tmp_path, flag, name, what):
    """A FIFO would block the write until a reader comes (forever): refused while parsing, in a real
    process, within a bound; the same through a link to it."""
    fifo = tmp_path / name
    os.mkfifo(fifo)
    link = tmp_path / ("link" + Path(name).suffix)
    link.symlink_to(fifo)
    for target in (fifo, link):
        t0 = time.monotonic()
        p = subprocess.run(PIPETWIN + SIM + [flag, str(target)], capture_output=True, text=True, timeout=60)
        assert time.monotonic() - t0 < 60
        assert p.returncode == 2 and p.stdout == ""
        assert p.stderr.splitlines() == [
            f"pipetwin: error: argument {flag}: {what} {target} is a named pipe (FIFO): writing it waits for a "
            f"reader, maybe forever; give a regular file (or /dev/stdout, /dev/null) (see pipetwin simulate --help)"]


def test_a_socket_and_a_disk_are_refused():
    folder = tempfile.mkdtemp(dir="/tmp")       # a socket's path must be short (108 bytes)
    path = os.path.join(folder, "s.csv")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
        with pytest.raises(FileError) as e:
            check_output_path(path, "trace", ("csv",))
        assert str(e.value) == (f"trace {path} is a socket, not a file; give a regular file (or /dev/stdout, "
                                f"/dev/null)")
    os.unlink(path)
    os.rmdir(folder)
    disks = [f"/dev/{d}" for d in ("loop0", "sda", "vda", "nvme0n1") if os.path.exists(f"/dev/{d}")]
    for disk in disks[:1]:
        with pytest.raises(FileError, match=f"^trace {disk} is a block device \\(a disk\\); give a regular file"):
            check_output_path(disk, "trace", ("csv",))


def test_a_folder_is_refused(capsys, tmp_path):
    folder = tmp_path / "d.csv"
    folder.mkdir()
    assert _one_line(capsys, SIM + ["--trace", str(folder)]) == (
        f"pipetwin: error: argument --trace: trace {folder} is a folder; give a file name "
        f"(see pipetwin simulate --help)")


@pytest.mark.parametrize("flag,name,line", [
    ("--plot", "x.bmp", "figure {p}: its extension is '.bmp'; a figure is written as " + FIGURES),
    ("--plot", "x", "figure {p}: it has no extension; a figure is written as " + FIGURES),
    ("--trace", "x.tsv", "trace {p}: its extension is '.tsv'; a trace is written as .csv"),
    ("--chrome-trace", "x.csv", "Chrome trace {p}: its extension is '.csv'; a Chrome trace is written as .json"),
    ("--chrome-trace", "x.json.gz", "Chrome trace {p}: its extension is '.gz'; a Chrome trace is written as .json"),
])
def test_the_format_is_checked_while_parsing(capsys, tmp_path, no_ranks, flag, name, line):
    """Refused before anything is built or run (a run's ranks never start: no_ranks), nothing written."""
    p = tmp_path / name
    for argv in (SIM, ["run", "-s", "dapple", "-D", "2", "-N", "2", "--steps", "1"]):
        got = _one_line(capsys, argv + [flag, str(p)])
        assert got == f"pipetwin: error: argument {flag}: {line.format(p=p)} (see pipetwin {argv[0]} --help)"
    assert list(tmp_path.iterdir()) == []


def test_plan_and_calibrate_files_are_checked(capsys, tmp_path):
    """plan --out writes JSON, calibrate --out YAML: another extension is refused while parsing."""
    bad = tmp_path / "plan.yaml"
    assert _one_line(capsys, ["plan", "-m", "tiny", "-c", "v100-2x8-25gbe", "-G", "16", "--out", str(bad)]) == (
        f"pipetwin: error: argument --out: plan file {bad}: its extension is '.yaml'; a plan file is written as .json "
        f"(see pipetwin plan --help)")
    bad = tmp_path / "profile.json"
    assert _one_line(capsys, ["calibrate", "--out", str(bad)]) == (
        f"pipetwin: error: argument --out: calibration profile {bad}: its extension is '.json'; a calibration "
        f"profile is written as .yaml, .yml (see pipetwin calibrate --help)")


def test_a_text_schedule_is_not_written_under_a_csv_name(capsys, tmp_path):
    """--schedule-file reads a .csv name as torch's CSV: the text form written there would not read back."""
    out = tmp_path / "s.csv"
    assert _one_line(capsys, ["schedules", "--export", "dapple", "-D", "2", "-N", "4", "--format", "text",
                              "--out", str(out)]) == (
        f"pipetwin: error: --out {out}: a .csv name is read back as torch.distributed.pipelining CSV; write "
        f"--format text under another name (e.g. .txt) or use --format torch-csv")
    assert not out.exists()


def test_plan_and_bubbles_plots_are_checked_too(capsys, tmp_path):
    bad = tmp_path / "layouts.txt"
    assert _one_line(capsys, ["plan", "-m", "tiny", "-c", "v100-2x8-25gbe", "-G", "16", "--plot", str(bad)]).startswith(
        f"pipetwin: error: argument --plot: figure {bad}: its extension is '.txt'")
    assert _one_line(capsys, ["bubbles", "--plot", str(bad)]).startswith(
        f"pipetwin: error: argument --plot: figure {bad}: its extension is '.txt'")


def test_upper_case_extensions_and_devices_are_written(capsys, tmp_path):
    """.CSV / .PNG / .JSON count as their formats; /dev/null has no extension and takes any output."""
    argv = SIM + ["--trace", str(tmp_path / "T.CSV"), "--plot", str(tmp_path / "P.PNG"),
                  "--chrome-trace", str(tmp_path / "C.JSON")]
    assert main(argv) == 0
    assert (tmp_path / "T.CSV").read_text().startswith("device,step,seq,kind,token")
    assert (tmp_path / "P.PNG").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "C.JSON").read_text().startswith("{")
    assert main(SIM + ["--trace", "/dev/null", "--plot", "/dev/null", "--chrome-trace", "/dev/null"]) == 0


def test_every_figure_format_is_one_matplotlib_writes(tmp_path):
    """FIGURE_FORMATS: each one matplotlib's (Agg) and written by save_figure with its magic bytes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.plots import save_figure
    assert set(FIGURE_FORMATS) <= set(plt.figure().canvas.get_supported_filetypes())
    plt.close("all")
    magic = {"png": b"\x89PNG", "pdf": b"%PDF", "svg": b"<?xml", "svgz": b"\x1f\x8b", "eps": b"%!PS", "ps": b"%!PS",
             "jpg": b"\xff\xd8", "jpeg": b"\xff\xd8", "tif": b"II*\x00", "tiff": b"II*\x00", "webp": b"RIFF"}
    assert sorted(magic) == sorted(FIGURE_FORMATS)
    for fmt in FIGURE_FORMATS:
        fig, ax = plt.subplots(figsize=(1, 1))
        ax.plot([0, 1], [0, 1])
        save_figure(fig, tmp_path / f"f.{fmt}")
        assert (tmp_path / f"f.{fmt}").read_bytes().startswith(magic[fmt]), fmt


@pytest.mark.slow
def test_dev_stdout_is_written_through_the_descriptor(tmp_path):
    """--trace /dev/stdout with standard output a pipe or a file: the CSV (header and 18 ops of D=2
    N=2 dapple: 2 x (4 compute + 4 messages + OPT) rows), then the summary, neither truncating the
    other (the path is not opened anew: the descriptor is written)."""
    p = subprocess.run(PIPETWIN + SIM + ["--trace", "/dev/stdout"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "device,step,seq,kind,token,copy,stage,chunk,microbatch,peer,start,end,bytes,act_mem"
    assert lines[19].startswith("dapple: D=2 N=2 R=1  iteration 9 F")
    with open(tmp_path / "out.txt", "w") as f:
        assert subprocess.run(PIPETWIN + SIM + ["--trace", "/dev/stdout"], stdout=f, timeout=60).returncode == 0
    assert (tmp_path / "out.txt").read_text() == p.stdout
    assert own_descriptor("/dev/stdout") == 1 and own_descriptor("/dev/fd/2") == 2
    assert own_descriptor("/dev/fd/987") is None and own_descriptor(tmp_path / "x") is None


def test_an_output_onto_an_input_is_refused_before_any_work(capsys, tmp_path, no_ranks):
    """The schedule file (named through a link too), a Hugging Face config, a model YAML, a data file,
    an expert-load histogram (read while parsing):
    each refused as the output of the command that reads it, in one line, the file unchanged."""
    sched = tmp_path / "s.csv"
    assert main(["schedules", "--export", "dapple", "-D", "2", "-N", "4", "--format", "torch-csv",
                 "--out", str(sched)]) == 0
    hf = tmp_path / "config.json"
    hf.write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}')
    load = tmp_path / "load.csv"
    load.write_text("10, 12, 9, 11, 30, 8, 10, 10\n")
    model = tmp_path / "m.yaml"
    model.write_text("layers: 4\nhidden: 64\nheads: 4\nseq_len: 8\nvocab: 16\n")
    data = tmp_path / "d.csv"
    data.write_text("some text to train on\n" * 10)
    (tmp_path / "alias.csv").symlink_to(sched)
    cases = [
        (["simulate", "--schedule-file", str(sched), "--unit-costs", "--trace", str(sched)], "--trace", sched,
         "--schedule-file", sched),
        (["simulate", "--schedule-file", str(sched), "--unit-costs", "--trace", str(tmp_path / "alias.csv")],
         "--trace", tmp_path / "alias.csv", "--schedule-file", sched),
        (["simulate", "-s", "dapple", "-D", "2", "-N", "4", "-m", str(hf), "--chrome-trace", str(hf)],
         "--chrome-trace", hf, "--model", hf),
        (["plan", "-m", str(hf), "-c", "dgx-h100-ib:1", "-G", "16", "--out", str(hf)], "--out", hf, "--model", hf),
        (["calibrate", "-m", str(model), "--out", str(model)], "--out", model, "--model", model),
        (["simulate", "-s", "dapple", "-D", "2", "-N", "4", "-m", "mixtral-8x7b", "-c", "dgx-h100-ib:1",
          "--expert-load", str(load), "--trace", str(load)], "--trace", load, "--expert-load", load),
        (["run", "-s", "dapple", "-D", "2", "-N", "2", "--data", str(data), "--trace", str(data)], "--trace", data,
         "--data", data),
    ]
    for argv, out_flag, out, in_flag, read in cases:
        before = read.read_bytes()
        got = _one_line(capsys, argv)
        assert got == (f"pipetwin: error: {out_flag} {out} is the file {in_flag} reads ({read}); writing it would "
                       f"overwrite that input: give {out_flag} another path"), got
        assert read.read_bytes() == before


def test_two_outputs_onto_one_file_are_refused():
    """Two outputs naming one file (through a link too) are refused; devices may be named by both."""
    def args(a, b):
        return argparse.Namespace(_files={"a": ("--a", "out"), "b": ("--b", "out")}, a=a, b=b)
    with tempfile.TemporaryDirectory() as d:
        os.symlink(os.path.join(d, "x.out"), os.path.join(d, "y.out"))
        for b in ("x.out", "y.out"):
            with pytest.raises(ValueError) as e:
                check_files_apart(args(os.path.join(d, "x.out"), os.path.join(d, b)))
            assert str(e.value) == f"--a and --b both write {os.path.join(d, b)}; give each its own file"
        check_files_apart(args("/dev/null", "/dev/null"))
        check_files_apart(args(os.path.join(d, "x.out"), os.path.join(d, "z.out")))


def test_output_file_writes_in_place_to_a_device_only():
    """output_file: /dev/null in place; a FIFO made after the parse is refused at write time too."""
    with output_file("/dev/null", "trace") as fh:
        fh.write("x")
    with tempfile.TemporaryDirectory() as d:
        fifo = os.path.join(d, "late.csv")
        os.mkfifo(fifo)
        with pytest.raises(FileError, match="is a named pipe"):
            with output_file(fifo, "trace") as fh:
                fh.write("x")
