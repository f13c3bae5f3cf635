"""The executor on real processes (gloo on the CPU) against the single-process reference.

Three spawns run the whole matrix (processes are reused across jobs): world size 2 holds every
schedule at D = 2 (``make check`` runs these alone), then on a second spawn split-backward variants,
an Adam run, bf16 and recomputation runs; world size 4 every schedule at D = 4 and at D = 2 x R = 2
replicas (marked slow, as the rest of this module). Each job trains 3 optimizer steps;
the losses and every final parameter (every model copy, every replica) must equal the reference
within 1e-5 relative (and within 1e-6 absolute with a split backward), and every rank's executed op
order must equal its program exactly. bf16 runs are held to the fp32 run (losses within 2%) and
to the bf16 reference (within 1e-2); measured peak activation bytes, with and without
recomputation and in bf16, to the simulator's with a profile of the measured per-layer bytes.
"""
import json
from pathlib import Path

import pytest
import torch

from executor.config import RunConfig, lowered_schedule
from executor.launch import LaunchError, run
from executor.reference import run_reference
from schedules import B, ScheduleError, W, build, lower, make_schedule, names
from schedules.ir import message_key, parse_op
from schedules.trace import COLUMNS, op_orders
from tests.helpers import assert_losses_equal, params_by_name, torchrun_cli

PAPER = ["gpipe", "dapple", "interleaved", "chimera", "bitpipe"]
SPLIT = ["zb-h1", "zb-h2", "zb-auto", "zb-v", "dualpipe-v", "bitpipe-zb"]      # the schedules with a split backward
PRECISION_SCHEDULES = ["dapple", "zb-v"]
METER_TWINS = ["dapple-D2", "interleaved-D2", "bitpipe-D2", "zb-v-D2", "dualpipe-v-D2", "dapple-recompute-selective-D2",
               "zb-v-recompute-full-D2", "zb-v-bf16-D2"]
BASE = dict(steps=3, optimizer="sgd", lr=0.05, collect_params=True, timeout=30.0)


def split_variant(name: str, D: int, N: int, *, defer: bool):
    """A split-backward version of a schedule: each B becomes B then W (right after it, or all
    W deferred to the end of the device's program)."""
    base = build(name, D, N)
    order = []
    for prog in base.programs:
        ops, tail = [], []
        for op in prog:
            ops.append((op.kind, op.mb, op.copy, op.stage))
            if op.kind == B:
                (tail if defer else ops).append((W, op.mb, op.copy, op.stage))
        order.append(ops + tail)
    return make_schedule(f"{name}-split{'-deferred' if defer else ''}", D, N, base.placement, order,
                         split_backward=True)


def _cases_families():
    """One world-2 run per family (``make check``)."""
    cases = {f"{s}-D2": (RunConfig.of(schedule=s, devices=2, microbatches=4, **BASE), None) for s in PAPER}
    for extra in names():  # schedules added later by other families run here too
        if extra in PAPER:
            continue
        try:
            cfg = RunConfig.of(schedule=extra, devices=2, microbatches=4, **BASE)
            lowered_schedule(cfg)
        except (ScheduleError, ValueError):
            continue
        cases[f"{extra}-D2"] = (cfg, None)
    return cases


def _cases_world2():
    cases = {}
    cfg = RunConfig.of(schedule="dapple", devices=2, microbatches=4, **BASE)
    cases["dapple-split-D2"] = (cfg, split_variant("dapple", 2, 4, defer=False))
    cases["bitpipe-split-deferred-D2"] = (cfg, split_variant("bitpipe", 2, 4, defer=True))
    text = str(Path(__file__).resolve().parent.parent / "schedules" / "ir.py")
    cases["gpipe-textdata-lookahead1-D2"] = (RunConfig.of(schedule="gpipe", devices=2, microbatches=4, data=text,
                                                      recv_lookahead=1, **BASE), None)
    cases["bitpipe-adam-D2"] = (RunConfig.of(schedule="bitpipe", devices=2, microbatches=4,
                                          **dict(BASE, optimizer="adam", lr=1e-3)), None)
    for name in PRECISION_SCHEDULES:
        cases[f"{name}-bf16-D2"] = (RunConfig.of(schedule=name, devices=2, microbatches=4, dtype="bf16", **BASE), None)
        for mode in ("selective", "full"):
            cases[f"{name}-recompute-{mode}-D2"] = (RunConfig.of(schedule=name, devices=2, microbatches=4,
                                                              recompute=mode, **BASE), None)
    for key in METER_TWINS:   # the same runs metered at every forward (executor.device)
        cfg, sched = cases[key] if key in cases else FAMILIES[key]
        cases[f"{key}-meter-every"] = (cfg.with_(meter_every_forward=True), sched)
    return cases


def _cases_world4():
    cases = {f"{s}-D4": (RunConfig.of(schedule=s, devices=4, microbatches=8, **BASE), None) for s in PAPER + SPLIT}
    cases.update({f"{s}-D2R2": (RunConfig.of(schedule=s, devices=2, microbatches=4, replicas=2, **BASE), None)
                  for s in PAPER})
    cases["chimera-noeager-D2R2"] = (RunConfig.of(schedule="chimera", devices=2, microbatches=4, replicas=2,
                                               eager=False, **BASE), None)
    for name, variant in (("chimera", "forward-doubling"), ("bitpipe", "greedy")):   # the non-default orders
        cases[f"{name}-{variant}-D4"] = (RunConfig.of(schedule=name, devices=4, microbatches=8, **BASE),
                                         build(name, 4, 8, variant=variant))
    return cases


FAMILIES = _cases_families()
# ``runs(group)``: "families" is the world-2 spawn of make check; 2 and 4 the slow ones
CASES = {"families": FAMILIES, 2: _cases_world2(), 4: _cases_world4()}
IDS = [(w, k) for w, cases in CASES.items() for k in cases]


def _params(ids):
    """The (group, case) parameters, every group but the families' marked slow."""
    return [pytest.param(w, k, id=k, marks=() if w == "families" else pytest.mark.slow) for w, k in ids]


def at2(runs, key):
    """The result of a world-2 case, from whichever spawn holds it."""
    return runs("families" if key in FAMILIES else 2)[key]


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(cfg):
        # no effect on the reference: the schedule, all-reduce placement, receives, recomputation
        key = cfg.with_(schedule="gpipe", eager=True, recv_lookahead=None, recompute="none")
        if key not in cache:
            cache[key] = run_reference(cfg)
        return cache[key]
    return get


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


FP32_IDS = [(w, k) for w, k in IDS if CASES[w][k][0].dtype == "fp32"]


@pytest.mark.parametrize("world,case", _params(FP32_IDS))
def test_losses_and_parameters_equal_reference(runs, references, world, case):
    cfg, sched, res = runs(world)[case]
    ref = references(cfg)
    assert_losses_equal(res, ref)
    if cfg.optimizer == "adam":
        assert res.losses[-1] < res.losses[0]  # it trains (3 SGD steps are within the batch noise)
    copies = {k.split("/", 1)[0] for k in res.params}
    assert len(copies) == sched.num_copies * sched.replicas
    by_name = params_by_name(res)
    assert set(by_name) == set(ref.params)
    for name, tensors in by_name.items():
        assert len(tensors) == sched.num_copies * sched.replicas
        if cfg.optimizer == "sgd":
            assert max(_rel(t, ref.params[name]) for t in tensors) <= 1e-5, name
            if sched.split_backward:    # the split backward's own bar: within 1e-6 of the reference
                assert max(float((t - ref.params[name]).abs().max()) for t in tensors) <= 1e-6, name
        for t in tensors[1:]:  # every copy of a stage, on every replica, ends with identical weights
            assert torch.equal(t, tensors[0]), name


@pytest.mark.parametrize("world,case", _params(IDS))
def test_executed_op_order_is_the_program(runs, world, case):
    """Each rank runs its program in order; an overlapped pair (DualPipe-V's own) as one block, as the
    simulator runs it (:func:`executor.runtime.execution_order`: the RECVs between the two first,
    then the F and the B, then the F's SEND / COPY)."""
    from executor.runtime import execution_order
    cfg, sched, res = runs(world)[case]
    trace = res.trace
    pairs = sched.meta.get("overlapped", ())
    for step in range(cfg.steps):
        orders = op_orders(trace, step)
        assert sorted(orders) == list(range(sched.num_ranks))
        for rank, tokens in orders.items():
            prog = sched.program(rank)
            assert tokens == [str(prog[k]) for block in execution_order(prog, pairs, rank) for k in block], \
                f"rank {rank} step {step}"


@pytest.mark.parametrize("world,case", _params(IDS))
def test_trace_schema_clock_and_memory(runs, world, case):
    cfg, sched, res = runs(world)[case]
    t = res.trace
    assert list(t.columns) == COLUMNS and t.attrs["engine"] == "executor"
    assert (t["end"] >= t["start"]).all()
    # all activations are released by the end of every step
    last = t.sort_values("seq").groupby(["device", "step"]).tail(1)
    assert (last["kind"] == "OPTIM").all() and (last["act_mem"] == 0).all()
    # each device's peak: the most activation bytes its rows show, in Ma the run's one-micro-batch bytes
    assert [p["device"] for p in res.per_device] == sorted(t["device"].unique())
    for p in res.per_device:
        assert p["peak_activation_bytes"] == t[t["device"] == p["device"]]["act_mem"].max() > 0
        assert p["peak_activation_ma"] == pytest.approx(p["peak_activation_bytes"] / res.ma_bytes, rel=1e-12)
    # clocks are aligned: a message is never received before it was sent
    sends = {}
    for row in t[t["kind"] == "SEND"].itertuples():
        sends[(row.step, row.device, row.peer, message_key(parse_op(row.token)))] = row.start
    for row in t[t["kind"] == "RECV"].itertuples():
        sent = sends[(row.step, row.peer, row.device, message_key(parse_op(row.token)))]
        assert row.end >= sent, row.token
    spec = cfg.spec()   # messages travel in the run's precision: dtype_bytes follows --dtype
    msg = spec.micro_batch * spec.seq_len * spec.hidden * spec.dtype_bytes
    assert spec.dtype_bytes == (2 if cfg.dtype == "bf16" else 4)
    assert (t[t["kind"].isin(["SEND", "RECV"])]["bytes"] == msg).all()


@pytest.mark.parametrize("case", ["chimera-D2", "bitpipe-D2"])
def test_allreduce_rows_end_when_the_sum_is_ready(runs, case):
    """On gloo an ALLREDUCE row spans launch to completion, like the simulator's: one per step,
    stage and member (the two copies of each stage), no member has the sum before the last member
    launched it, and OPT waits for it."""
    cfg, low, res = runs("families")[case]
    tr = res.trace
    ars = tr[tr["kind"] == "ALLREDUCE"]
    assert len(ars) == cfg.steps * low.num_stages * 2
    for (step, stage), g in ars.groupby(["step", "stage"]):
        assert len(g) == 2 and (g["end"] >= g["start"].max()).all(), (step, stage)
        for row in g.itertuples():
            opt = tr[(tr["kind"] == "OPTIM") & (tr["device"] == row.device) & (tr["step"] == step)]
            assert row.end <= float(opt["end"].iloc[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", PRECISION_SCHEDULES)
def test_bf16_losses_agree_with_fp32_and_the_bf16_reference(runs, references, name):
    """bf16 autocast with fp32 master weights: the losses of 3 steps within 2% of the fp32 run's and
    within 1e-2 of the bf16 single-process reference's (which has no bf16 stage boundaries)."""
    _, _, fp32 = at2(runs, f"{name}-D2")
    cfg, _, bf16 = at2(runs, f"{name}-bf16-D2")
    ref = references(cfg)
    assert ref.config.dtype == "bf16" and len(bf16.losses) == 3
    for got, want, want_ref in zip(bf16.losses, fp32.losses, ref.losses):
        assert abs(got - want) <= 0.02 * abs(want)
        assert abs(got - want_ref) <= 1e-2
    assert bf16.losses != fp32.losses          # it really ran in bf16
    assert all(torch.isfinite(p).all() for p in bf16.params.values())


_BYTES = {}


def _bytes_profile(spec, dtype: str):
    """A calibration profile with the executor's measured per-layer bytes (timings are irrelevant to
    the simulated memory: a device's activation memory follows its own program order)."""
    from calibration import kept_bytes
    from calibration.measure import measure_layers
    from cost_models.profile import CalibrationProfile, LayerTiming
    from cost_models.cluster import LinkSpec
    from executor.precision import Precision
    if dtype not in _BYTES:
        layers = measure_layers(spec, 1, bytes_only=True, precision=Precision(dtype))
        per = [layers["embedding"]] + [layers["block"]] * spec.layers + [layers["head"]]
        _BYTES[dtype] = CalibrationProfile(
            name=f"bytes-{dtype}", model=spec, layers=tuple(LayerTiming(1e-3, 1e-3, 1e-3, 2e-3) for _ in per),
            p2p=LinkSpec("p2p", 1e9, 1e-5), allreduce=LinkSpec("ar", 1e9, 1e-5), cores=2, precision=dtype,
            **kept_bytes(per))
    return _BYTES[dtype]


@pytest.mark.slow
@pytest.mark.parametrize("key", METER_TWINS)
def test_metering_one_forward_per_stage_equals_metering_every_forward(runs, key):
    """The runtime meters the first forward of each stage in the run and accounts the others (those
    of the later steps too) with its bytes: every rank's activation bytes after every op of all 3
    steps, and its peak, equal those of the same run metered tensor by tensor at every forward
    (with recomputation and in bf16 too)."""
    _, _, sampled = at2(runs, key)
    _, _, every = at2(runs, f"{key}-meter-every")
    assert [d["peak_activation_bytes"] for d in sampled.per_device] == \
           [d["peak_activation_bytes"] for d in every.per_device]
    cols = ["device", "step", "seq", "act_mem"]
    a = sampled.trace[cols].sort_values(cols[:3]).reset_index(drop=True)
    b = every.trace[cols].sort_values(cols[:3]).reset_index(drop=True)
    assert a.equals(b)


MEMORY_CASES = [(n, k) for n in PRECISION_SCHEDULES for k in ("", "recompute-selective-", "recompute-full-", "bf16-")]


@pytest.mark.slow
@pytest.mark.parametrize("name,kind", MEMORY_CASES, ids=[f"{n}-{k or 'none-'}D2" for n, k in MEMORY_CASES])
def test_peak_activation_memory_equals_the_simulators(runs, name, kind):
    """Measured peak activation bytes per rank equal the simulator's, with the profile's measured
    per-layer bytes and the run's recomputation mode, within 1% (fp32 and bf16); recomputation
    lowers what is kept from F to B, and full recomputation lowers every rank's peak of a 1F1B."""
    from schedules.trace import step_metrics
    from calibration import simulate_with_profile
    cfg, low, res = at2(runs, f"{name}-{kind}D2")
    prof = _bytes_profile(cfg.spec(), cfg.dtype)
    sim = step_metrics(simulate_with_profile(low, prof, recompute=cfg.parallel.recompute)).per_device
    measured = [d["peak_activation_bytes"] for d in res.per_device]
    for m, s_ in zip(measured, (p.peak_activation for p in sim)):
        assert abs(s_ - m) <= 0.01 * m, (measured, [p.peak_activation for p in sim])
    if cfg.parallel.recompute != "none":
        _, _, base = at2(runs, f"{name}-D2")
        assert res.ma_bytes < base.ma_bytes              # kept F -> B per micro-batch
        peaks = [d["peak_activation_bytes"] for d in base.per_device]
        assert all(m <= b for m, b in zip(measured, peaks)) and sum(measured) < sum(peaks)
        if cfg.parallel.recompute == "full" and not low.split_backward:
            assert all(m < 0.2 * b for m, b in zip(measured, peaks))


@pytest.mark.slow
def test_recv_timeout_names_rank_op_and_peer():
    """A lowered program that never sends one activation: rank 1's receive times out."""
    low = lower(build("gpipe", 2, 2))
    progs = [list(p) for p in low.programs]
    progs[0].remove(parse_op("SA1.s0>1"))
    broken = low.with_programs(progs)
    cfg = RunConfig.of(schedule="gpipe", devices=2, microbatches=2, steps=1, timeout=2.0)
    with pytest.raises(ScheduleError):
        lowered_schedule(cfg, broken)  # validation catches it before anything starts
    with pytest.raises(LaunchError, match=r"rank 1 step 0: RA1\.s1<0 waiting for rank 0: nothing arrived within 2 s"):
        run(cfg, broken, check=False)


@pytest.mark.slow
def test_cli_run_json_trace_and_reference(tmp_path, capfd):
    """``pipetwin run --json`` (in this process; its ranks spawned as always): the JSON alone on
    standard output, each device's peak the largest activation bytes of its rows in the trace file,
    the reference's peak D Ma (one micro-batch through the whole model), the losses the reference's."""
    import pandas as pd

    from experiments.cli import main
    common = ["run", "-s", "interleaved", "-D", "2", "-N", "4", "--steps", "3", "--json"]
    csv, chrome = tmp_path / "t.csv", tmp_path / "t.json"
    assert main(common + ["--trace", str(csv), "--chrome-trace", str(chrome)]) == 0
    out = json.loads(capfd.readouterr().out)
    assert len(out["losses"]) == 3 and len(out["iteration_times"]) == 3
    trace = pd.read_csv(csv)
    assert list(trace.columns) == COLUMNS
    assert [(d["device"], d["peak_activation_bytes"]) for d in out["per_device"]] == \
        [(dev, int(trace[trace.device == dev].act_mem.max())) for dev in (0, 1)]
    events = json.loads(chrome.read_text())["traceEvents"]
    assert sum(e.get("cat") == "F" for e in events) == len(trace[trace.kind == "F"]) == 3 * 4 * 4   # steps x N x stages
    assert main(common + ["--reference"]) == 0
    ref = json.loads(capfd.readouterr().out)
    assert ref["engine"] == "reference" and ref["per_device"][0]["peak_activation_ma"] == 2.0
    for a, b in zip(out["losses"], ref["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)


@pytest.mark.slow
def test_cli_crashed_rank_ends_the_run_with_its_traceback(capsys):
    from experiments.cli import main
    assert main(["run", "-s", "dapple", "-D", "2", "-N", "4", "--steps", "2", "--timeout", "20",
                 "--inject-fault", "1:B1.s1:1"]) == 1
    err = capsys.readouterr().err
    assert "rank 1 failed: RuntimeError: injected fault: rank 1 step 1 at B1.s1" in err
    assert "Traceback" in err and "runtime.py" in err


def test_cli_bad_schedule_is_a_user_error(capsys, no_ranks):
    from experiments.cli import main
    assert main(["run", "-s", "chimera", "-D", "3", "-N", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pipetwin: error: ") and "even number of devices" in err


@pytest.mark.slow
def test_torchrun_placement_follows_the_device_map(tmp_path):
    """Under torchrun each process runs the pipeline rank the device map puts on its (node, local
    rank), not torchrun's rank: 2 simulated nodes x 2 processes (torchrun's environment variables,
    gloo on the CPU), BitPipe D = 4 with copies-same-node (both copies of a stage on one node).
    The map is [0, 2, 3, 1]: the process at node 0 / local rank 1 (torchrun rank 1) runs pipeline
    rank 3. Losses equal the single-process reference."""
    from cost_models.cluster import DeviceGrid, map_copies_same_node
    from executor.launch import device_map_for
    args = ["-s", "bitpipe", "-D", "4", "-N", "4", "--steps", "2", "--device", "cpu", "--optimizer", "sgd",
            "--lr", "0.05", "--device-map", "copies-same-node", "--timeout", "60", "--json"]
    low = lowered_schedule(RunConfig.of(schedule="bitpipe", devices=4, microbatches=4))
    want = device_map_for("copies-same-node", low, 2, 2)
    assert want == (0, 2, 3, 1) == map_copies_same_node(low, DeviceGrid(2, 2))
    outs = torchrun_cli(args)
    printed = [i for i, o in enumerate(outs) if o.strip()]
    assert printed == [0]                     # torchrun rank 0 sits on device 0 = pipeline rank 0's
    res = json.loads(outs[0])
    placement = res["placement"]
    assert [p["device"] for p in placement] == list(want)
    assert [(p["node"], p["local_rank"]) for p in placement] == [divmod(d, 2) for d in want]
    ref = run_reference(RunConfig.of(schedule="bitpipe", devices=4, microbatches=4, steps=2, optimizer="sgd", lr=0.05))
    for a, b in zip(res["losses"], ref.losses):
        assert abs(a - b) <= 1e-5 * abs(b)
