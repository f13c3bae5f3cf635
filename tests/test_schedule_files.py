"""Schedules as files (:mod:`schedules.io`, ``--schedule-file``, ``pipetwin schedules --export``):
every family that torch.distributed.pipelining's CSV can express, exported and read back, has
the identical compute programs and placement and simulates to the same iteration time, to the
bit (unit costs for every admissible shape below; a model x cluster for one shape each); the
same for pipetwin's text form and every family; the two-copy families are refused by the CSV in
one line; a file that deadlocks is refused naming the rank and the op; the command line's rows;
a 2-rank training run of an exported CSV gives the losses of the run by name."""
import json

import pytest

from cost_models.files import load_schedule_file
from cost_models.job import Job, Layout
from experiments.cli import main
from schedules import ScheduleError, build, families, names
from schedules.io import FORMATS, ScheduleFile, export_text, from_text, parse_schedule_file
from schedules.registry import ALIASES, get
from sim import simulate_job

TWO_COPY = ["chimera", "bitpipe", "bitpipe-zb"]
SINGLE_COPY = [n for n in names() if n not in TWO_COPY]
# (D, N, family keyword arguments) tried per family; the shapes a family refuses are skipped
SHAPES = [(2, 4, {}), (4, 8, {}), (4, 5, {}), (3, 9, {}), (4, 8, {"chunks": 3}), (4, 8, {"variant": "@"})]


def shapes(name):
    """(D, N, family keyword arguments, schedule) for every shape of :data:`SHAPES` the family
    accepts (chunks only for the families that take them; "@": each non-default variant)."""
    fam, out = get(name), []
    for D, N, kw in SHAPES:
        if "chunks" in kw and not fam.takes_chunks:
            continue
        for kw2 in ([{"variant": v} for v in fam.variants[1:]] if "variant" in kw else [kw]):
            try:
                out.append((D, N, kw2, build(name, D, N, **kw2)))
            except ScheduleError:
                continue
    return out


def unit_time(layout: Layout) -> float:
    return simulate_job(Job(layout=layout, unit_costs=True))[1].metrics().iteration_time


def round_trip(tmp_path, sched, fmt) -> ScheduleFile:
    path = tmp_path / f"{sched.name}.{'csv' if fmt == 'torch-csv' else 'txt'}"
    path.write_text(export_text(sched, fmt))
    return load_schedule_file(path)


def test_the_two_copy_families_are_the_ones_with_two_copies():
    for name in names():
        assert (build(name, 2, 4).num_copies == 2) == (name in TWO_COPY), name


@pytest.mark.parametrize("name,fmt", [(n, f) for f in FORMATS for n in names()
                                      if f == "text" or n not in TWO_COPY])    # refused: see below
def test_export_import_same_programs_and_unit_time(tmp_path, name, fmt):
    cases = shapes(name)
    assert len(cases) >= 2, name
    for D, N, kw, sched in cases:
        sf = round_trip(tmp_path, sched, fmt)
        got = sf.schedule
        assert sf.format == fmt and (got.num_devices, got.num_microbatches) == (D, N)
        assert got.programs == sched.programs and got.placement == sched.placement
        assert (got.num_stages, got.split_backward) == (sched.num_stages, sched.split_backward)
        by_name = Layout(schedule=name, devices=D, microbatches=N, **kw)
        assert Layout.of_file(sf).build().programs == by_name.build(built=sched).programs
        assert unit_time(Layout.of_file(sf)) == unit_time(by_name), (name, D, N, kw)


@pytest.mark.parametrize("name", [n for n in SINGLE_COPY if n != "zb-auto"])
def test_model_x_cluster_time_to_the_bit(tmp_path, name):
    """zb-auto by name orders its ops from the job's costs (an exported file holds its unit-cost order):
    its file is held against that order in test_export_import_same_programs_and_unit_time."""
    D, N, kw, sched = shapes(name)[1]          # D=4, N=8
    sf = round_trip(tmp_path, sched, "torch-csv")
    common = dict(model="gpt3-1.3b", cluster="dgx-a100-4x8-ib")
    by_name, want = simulate_job(Job(layout=Layout(schedule=name, devices=D, microbatches=N, **kw), **common))
    bound, got = simulate_job(Job(layout=Layout.of_file(sf), **common))
    assert got.metrics().iteration_time == want.metrics().iteration_time
    if by_name.lowered.meta.get("overlapped"):
        # a torch CSV holds no F&B pairs (DualPipe-V's): the file's run books each F whole, the
        # by-name run its pairs segment by segment (cost_models.memory.pair_memory), lower
        import dataclasses

        from cost_models.memory import peak_activation
        low = by_name.lowered
        plain = dataclasses.replace(low, meta={k: v for k, v in low.meta.items() if k != "overlapped"})
        assert [p.peak_activation for p in got.metrics().per_device] == list(peak_activation(plain, by_name.costs))
        assert [p.peak_activation for p in want.metrics().per_device] == list(peak_activation(low, by_name.costs))
    else:
        assert [p.peak_memory for p in got.metrics().per_device] == \
            [p.peak_memory for p in want.metrics().per_device]
    assert bound.report["schedule_file"].startswith(f"{sf.path} (torch.distributed.pipelining CSV, by its .csv name)")


@pytest.mark.parametrize("name", TWO_COPY)
def test_torch_csv_refuses_two_copies(name):
    with pytest.raises(ScheduleError) as e:
        export_text(build(name, 2, 4), "torch-csv")
    assert str(e.value) == (f"{name} runs 2 model copies (a stage index on two devices); "
                            f"torch.distributed.pipelining's CSV names a stage by its index alone, one rank per "
                            f"stage: export it with --format text")


def test_text_form_parses_back_with_full_match():
    s = from_text("# mine\n0: F0.s0 F1.s0 B0.s0 B1.s0\n\n1: F0.s1 B0.s1 F1.s1 B1.s1\n")
    assert s.programs == build("dapple", 2, 2).programs and s.to_text() == build("dapple", 2, 2).to_text()
    for text, msg in [("0: F0.s0 F0.s0x", "cannot parse op token 'F0.s0x'"),
                      ("0: F0.s0\n2: F0.s1", "device line 2 where device 1 comes next"),
                      ("0: F0.s0 SA0.s0>1", "SA0.s0>1 is not a compute op"),
                      ("0: F0.s0 F0.s1.k0\n1: F0.s1", "device 1: F0.s1 runs stage 1, which device 0 runs"),
                      ("0: F0.s0 F0.s1.k0 B0.s1.k1 B0.s0", "device 0: F0.s1 says chunk 0, but stage 1 is chunk 1"),
                      ("0: F0.s0 B0.s0\n1: F0.s2 B0.s2", "stage 1 never runs")]:
        with pytest.raises(ScheduleError, match=msg.replace("(", r"\(")):
            from_text(text)


def test_a_deadlocking_csv_is_refused_naming_rank_and_op():
    # rank 0 waits for micro-batch 0's gradient before it sends micro-batch 1's activation, which
    # rank 1 wants first: 1F1B with the last stage's forwards run ahead
    text = "0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n"
    with pytest.raises(ScheduleError) as e:
        parse_schedule_file(text, "dead.csv")
    assert str(e.value) == ("dead.csv (torch.distributed.pipelining CSV, by its .csv name): deadlock: rank 0 waits at "
                            "RG0.s0<1 for rank 1; rank 1 waits at RA1.s1<0 for rank 0")


def test_format_by_name_or_content():
    csv = export_text(build("zb-h1", 2, 4), "torch-csv")
    assert parse_schedule_file(csv, "a.sched").how == "by its content"
    assert parse_schedule_file(csv, "a.sched").format == "torch-csv"
    txt = export_text(build("zb-h1", 2, 4), "text")
    assert (parse_schedule_file(txt, "a.sched").format, parse_schedule_file(txt, "a").how) == ("text", "by its content")
    assert parse_schedule_file("# mine\n0F0,0B0\n\n1F0,1B0\n", "gap.csv").schedule.programs == \
        build("dapple", 2, 1).programs                          # comments and blank lines skipped
    with pytest.raises(ScheduleError, match=r"^idle.txt \(pipetwin text, by its content\): device 2 runs no op"):
        parse_schedule_file("0: F0.s0 B0.s0\n1: F0.s1 B0.s1\n2:\n", "idle.txt")
    with pytest.raises(ScheduleError, match=r"^a.csv \(torch.distributed.pipelining CSV, by its .csv name\): rank 0: "
                                            r"cannot parse PyTorch action 'F0.s0'"):
        parse_schedule_file(txt, "a.csv")


def test_upstream_names_are_aliases():
    assert ALIASES == {"1f1b": "dapple", "interleaved-1f1b": "interleaved", "zbv": "zb-v", "dualpipev": "dualpipe-v"}
    for alias, name in ALIASES.items():
        assert get(alias).name == name and alias not in families()
        assert Layout(schedule=alias, devices=2, microbatches=4).schedule == name
        assert build(alias, 2, 4).programs == build(name, 2, 4).programs


# ------------------------------------------------------------------------------ command line
def cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_export_then_simulate_and_compare(tmp_path, capsys):
    path = tmp_path / "zbv.csv"
    rc, out, _ = cli(capsys, "schedules", "--export", "zbv", "-D", "2", "-N", "4", "--format", "torch-csv",
                     "--out", str(path))
    assert rc == 0 and out == f"wrote {path}: zb-v D=2 N=4 as torch.distributed.pipelining CSV\n"
    rc, out, _ = cli(capsys, "schedules", "--export", "zb-v", "-D", "2", "-N", "4", "--format", "torch-csv")
    assert rc == 0 and out == path.read_text() and out.splitlines()[0].startswith("0F0,0F1,0F2,3F0,3I0,3W0")
    rc, out, _ = cli(capsys, "simulate", "--schedule-file", str(path), "--unit-costs", "--json")
    rec = json.loads(out)
    assert rc == 0 and rec["schedule"] == "zbv.csv" and rec["iteration_time"] == 12.5    # 3N + (D-1)/2
    assert rec["schedule_file"] == f"{path} (torch.distributed.pipelining CSV, by its .csv name): D=2 N=4, 4 stages, " \
                                   f"split backward"
    rc, out, _ = cli(capsys, "compare", "--schedules", "1f1b,zbv", "--schedule-file", str(path), "--unit-costs",
                     "--json")
    rows = {r["schedule"]: r["iteration_time"] for r in json.loads(out)["schedules"]}
    assert rc == 0 and rows == {"dapple": 15.0, "zb-v": 12.5, "zbv.csv": 12.5}


@pytest.mark.parametrize("argv,msg", [
    (["simulate", "--schedule-file", "{tmp}/none.csv", "--unit-costs"], "does not exist"),
    (["simulate", "--schedule-file", "{tmp}/bad.txt", "--unit-costs"],
     "bad.txt (pipetwin text, by its content): cannot parse op token 'F1.s1x'"),
    (["simulate", "--schedule-file", "{tmp}/ok.csv", "-D", "4", "--unit-costs"],
     "-D 4 disagrees with schedule file ok.csv, which has 2 devices; drop -D (the file fixes it)"),
    (["run", "--schedule-file", "{tmp}/ok.csv", "-N", "8"],
     "-N 8 disagrees with schedule file ok.csv, which has 4 micro-batches; drop -N (the file fixes it)"),
    (["compare", "--schedules", "dapple", "--schedule-file", "{tmp}/ok.csv", "-N", "8", "--unit-costs"],
     "-N 8 disagrees with schedule file ok.csv"),
    (["simulate", "--schedule-file", "{tmp}/ok.csv", "-s", "dapple", "--unit-costs"],
     "give --schedule or --schedule-file, not both"),
    (["simulate", "--schedule-file", "{tmp}/ok.csv", "--variant", "1p", "--unit-costs"],
     "--variant picks a family's order; schedule file ok.csv gives its own (drop --variant)"),
    (["run", "--schedule-file", "{tmp}/dead.csv"], "deadlock: rank 0 waits at RG0.s0<1 for rank 1"),
    (["compare", "--unit-costs"], "give --devices, --microbatches (or a --schedule-file FILE)"),
    (["schedules", "--export", "bitpipe", "-D", "2", "-N", "4", "--format", "torch-csv"],
     "bitpipe runs 2 model copies"),
    (["schedules", "--export", "dapple", "-D", "2"], "--export dapple needs -N, --format"),
    (["schedules", "-D", "2"], "-D apply to --export NAME; give it (or drop them)"),
    (["simulate", "--schedule-file", "{tmp}", "--unit-costs"], "argument --schedule-file: file {tmp} is a folder"),
    (["schedules", "--export", "dapple", "-D", "2", "-N", "4", "--format", "text", "--out", "{tmp}"],
     "argument --out: file {tmp} is a folder; give a file name"),
    (["schedules", "--export", "dapple", "-D", "2", "-N", "4", "--format", "text", "--out", "/proc/x.txt"],
     "argument --out: file /proc/x.txt cannot be written"),
    (["schedules", "--export", "dapple", "-D", "0", "-N", "4", "--format", "text"],
     "argument --devices/-D: must be an integer >= 1; got '0'"),
    (["schedules", "--export", "dapple", "-D", "2", "-N", "nan", "--format", "text"],
     "argument --microbatches/-N: must be an integer >= 1; got 'nan'"),
])
def test_cli_errors_one_line(tmp_path, capsys, argv, msg):
    (tmp_path / "bad.txt").write_text("0: F0.s0 B0.s0\n1: F1.s1x\n")
    (tmp_path / "ok.csv").write_text(export_text(build("dapple", 2, 4), "torch-csv"))
    (tmp_path / "dead.csv").write_text("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n")
    rc, _, err = cli(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in argv])
    msg = msg.replace("{tmp}", str(tmp_path))
    assert rc == 2 and err.startswith("pipetwin: error: ") and msg in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------------------ executor
def test_run_of_an_exported_csv_gives_the_losses_of_the_run_by_name(tmp_path):
    from executor.config import RunConfig
    from executor.launch import run_many
    path = tmp_path / "zbh1.csv"
    path.write_text(export_text(build("zb-h1", 2, 4), "torch-csv"))
    sf = load_schedule_file(path)
    by_file = RunConfig.from_job(Job(layout=Layout.of_file(sf), model="tiny"), steps=2)
    by_name = RunConfig.from_job(Job(layout=Layout(schedule="zb-h1", devices=2, microbatches=4), model="tiny"),
                                 steps=2)
    assert by_file.layout.schedule == "zbh1.csv" and by_file.layout.schedule_file is sf
    got, want = run_many([by_file, by_name])
    assert got.losses == want.losses and len(got.losses) == 2
    ops = lambda r: sorted(zip(r.trace.device, r.trace.kind, r.trace.microbatch, r.trace.stage))  # noqa: E731
    assert ops(got) == ops(want)


@pytest.mark.slow
def test_every_family_exported_and_run_from_its_file_trains_the_losses_of_the_run_by_name(tmp_path):
    """Every single-copy family through torch's CSV and every family through the text form, D = 2,
    N = 4, 2 steps of the tiny GPT, all in one launch: each file's run has exactly the losses of the
    family run by name (the same ops on the same ranks)."""
    from executor.config import RunConfig
    from executor.launch import run_many
    cases = [(n, "torch-csv") for n in SINGLE_COPY] + [(n, "text") for n in names()]
    cfgs = []
    for fmt in FORMATS:
        (tmp_path / fmt).mkdir()
    for name, fmt in cases:
        sf = round_trip(tmp_path / fmt, build(name, 2, 4), fmt)
        cfgs += [RunConfig(job=Job(layout=Layout.of_file(sf), model="tiny"), steps=2),
                 RunConfig(job=Job(layout=Layout(schedule=name, devices=2, microbatches=4), model="tiny"), steps=2)]
    results = run_many(cfgs)
    assert len(results) == 2 * len(cases) == 2 * (8 + 11)
    for (name, fmt), got, want in zip(cases, results[::2], results[1::2]):
        assert got.losses == want.losses and len(got.losses) == 2, (name, fmt)


def test_a_job_with_a_schedule_file_is_plain_data_and_picklable(tmp_path):
    import pickle
    path = tmp_path / "mine.txt"
    path.write_text(export_text(build("interleaved", 2, 4), "text"))
    job = Job(layout=Layout.of_file(load_schedule_file(path), replicas=2), unit_costs=True)
    lay = json.loads(json.dumps(job.record()))["layout"]
    assert lay == {"schedule": "mine.txt", "devices": 2, "microbatches": 4, "replicas": 2, "chunks": 2,
                   "variant": None, "memory_limit": None, "schedule_file": str(path), "stage_replicas": None}
    back = pickle.loads(pickle.dumps(job))
    assert back == job and back.layout.schedule_file.schedule.programs == build("interleaved", 2, 4).programs
    assert back.layout.build().replicas == 2 and back.layout.num_stages() == 4
