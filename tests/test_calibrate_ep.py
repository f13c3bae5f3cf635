"""``pipetwin calibrate --ep`` and ``validate --ep``: a mixture of experts measured with the executor's
own code (the expert layers at their routed row counts, the all-to-all over E gloo ranks), the
profile's all-to-all fit and what the simulator prices with it, and the op order of an EP layout's
executor runs against the simulator's, with and without the overlapped F&B.

Nothing here asserts a time: the fit is checked against its own points and stated residual, the
prices against the closed forms of the fit, the orders exactly."""
from dataclasses import replace

import pytest

from calibration.compare import compare_series
from calibration.fit import measured_run
from calibration.host import host_profile, measure_host
from calibration.measure import A2A_SIZES, routed_counts
from calibration.simulate import simulate_with_profile
from calibration.sitting import RunSeries, SittingRules
from cost_models import load_model, load_profile, save_profile
from cost_models._spec import SpecError
from cost_models.job import Job
from cost_models.profile import LayerTiming
from executor.config import lowered_schedule
from executor.launch import run_many
from schedules.trace import op_orders

SPEC = load_model("tiny-mixtral")   # 4 MoE blocks, h 32, 8 experts top-2, micro-batch 2 x 16 tokens, fp32
T = SPEC.micro_batch * SPEC.seq_len  # 32 tokens a micro-batch


@pytest.fixture(scope="module")
def host():
    return measure_host("tiny-mixtral", ranks=4, repeats=3, ep=2)


@pytest.fixture(scope="module")
def profile(host, tmp_path_factory):
    """The profile calibrate --ep 2 writes from these measurements (before its runtime fit, which
    moves no all-to-all or expert field), read back from its file."""
    path = save_profile(host_profile(host), tmp_path_factory.mktemp("ep") / "calibration.yaml")
    return load_profile(path)


@pytest.mark.slow
def test_the_a2a_fit_reproduces_its_own_points_within_its_stated_residual(profile):
    pts = profile.meta["a2a_samples"]
    # one point per size: rows of width h = 32 fp32 (128 bytes), at least one per EP rank
    assert [b for b, _ in pts] == [max(2, s // 128) * 128 for s in A2A_SIZES]
    a = profile.all_to_all
    misses = [abs((a.latency + b / a.bandwidth) / t - 1.0) for b, t in pts]
    assert max(misses) == pytest.approx(profile.a2a_residual, rel=1e-9)
    assert all(m <= profile.a2a_residual * (1 + 1e-9) for m in misses)
    assert profile.ep == 2 and profile.name.endswith("-tiny-mixtral-ep2")


@pytest.mark.slow
def test_the_expert_layers_run_at_their_routed_row_counts(host):
    assert set(host.moe) == {"router", "experts", "experts_ep1"}      # tiny-mixtral has no shared expert
    assert host.moe["router"]["rows"] == T
    assert host.moe["experts_ep1"]["rows"] == T * SPEC.top_k         # dropless: every token's k pairs
    # EP rank 0's experts 0-3 get the pairs both EP ranks' micro-batches route to them
    counts = routed_counts(SPEC, 2)
    assert len(counts) == 2 and all(len(c) == SPEC.experts // 2 for c in counts)
    assert host.moe["experts"]["rows"] == sum(map(sum, counts))


@pytest.mark.slow
def test_layer_costs_add_each_moe_blocks_all_to_alls_from_the_fit(profile):
    a = profile.all_to_all
    one = lambda nbytes: a.latency + nbytes / a.bandwidth  # noqa: E731
    counts = one(8 * SPEC.experts)              # the per-expert counts: E int64
    rows = one(T * SPEC.top_k * SPEC.hidden * 4)  # dispatch or combine: n k h d = 8192 bytes a rank
    assert profile.a2a_times() == pytest.approx((counts, rows, rows), rel=1e-12)
    # F: four synchronous rounds a block at the in-run round cost c (calibrate's: the in-run P2P
    # latency, here without a runtime fit the ping-pong's), the counts' 8E bytes, the rows less the
    # fit's own counts' round (latency / 2) twice
    c = profile.a2a_round
    assert c == profile.p2p.latency
    part = a.latency / 2 + T * SPEC.top_k * SPEC.hidden * 4 / a.bandwidth
    f_a2a = 4 * c + 8 * SPEC.experts / a.bandwidth + 2 * part
    assert profile.a2a_forward_parts() == pytest.approx((3 * c + 8 * SPEC.experts / a.bandwidth, part, c, part),
                                                        rel=1e-12)
    lc = profile.layer_costs()
    for i, t in enumerate(profile.layers):
        moe = 1 <= i <= SPEC.layers
        assert lc.f[i] == pytest.approx(t.f + (f_a2a if moe else 0.0), rel=1e-12)
        assert lc.b_input[i] == pytest.approx(t.b_input + (2 * rows if moe else 0.0), rel=1e-12)
        assert lc.w[i] == t.w
    # the stages' F / B phases: per MoE block the dispatch's and combine's rows (F; the rounds are
    # compute); the two gradients (B)
    low = lowered_schedule(measured_run(_job("dapple"), 3))
    costs = profile.cost_model(low.num_stages).bind(low)
    for s in range(low.num_stages):          # 2 stages of 2 blocks
        assert costs.phases_f[0][s].comm_total == pytest.approx(2 * 2 * part, rel=1e-9)
        assert costs.phases_b[0][s].comm_total == pytest.approx(2 * 2 * rows, rel=1e-9)
        assert costs.phases_f[0][s].total == pytest.approx(costs.f[0][s], rel=1e-9)
    # experts measured alone slower than the whole block (a loaded host's spell), under a full backward
    # (dapple) and a split one (zb-v): the compute segments shrink to the rest, the all-to-alls stay
    slow = replace(profile, expert_layers=(("experts", LayerTiming(1.0, 1.0, 1.0, 2.0)),))
    for name in ("dapple", "zb-v"):
        low = lowered_schedule(measured_run(_job(name), 3))
        costs = slow.cost_model(low.num_stages).bind(low)
        blocks = SPEC.layers // low.num_stages
        for ph in (p for table in (costs.phases_f, costs.phases_b) for row in table for p in row):
            assert min(ph.compute) >= 0.0
        assert all(p.comm_total == pytest.approx(blocks * 2 * part, rel=1e-9) for p in costs.phases_f[0])


def _job(schedule: str, overlap: bool = False) -> Job:
    return Job.of(schedule=schedule, devices=2, microbatches=4, replicas=2, ep=2, model="tiny-mixtral",
                  overlap_fb=overlap)


CASES = {"dapple": _job("dapple"), "dapple+overlap": _job("dapple", True), "dualpipe-v": _job("dualpipe-v"),
         "zb-v+overlap": _job("zb-v", True)}


@pytest.fixture(scope="module")
def runs():
    cfgs = {k: measured_run(j, 3).with_(timeout=60.0) for k, j in CASES.items()}
    return {k: (cfg, res) for (k, cfg), res in zip(cfgs.items(), run_many(list(cfgs.values())))}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_validate_finds_the_executors_op_order_equal_to_the_simulators(runs, profile, case):
    """D 2 x R 2, EP 2 (the experts over the two replicas of each stage): every rank's executed order,
    every step, is the simulator's; where F&B pairs are overlapped (dapple with --overlap-fb, zb-v with
    it, dualpipe-v's own pairs) that is not the program's order (a pair runs as one block, its RECVs
    first), so the comparison is with the simulator's trace, as validate makes it."""
    cfg, res = runs[case]
    low = lowered_schedule(cfg)
    sim = simulate_with_profile(low, profile, steps=3)
    program = {r: [str(o) for o in low.program(r)] for r in range(low.num_ranks)}
    for step in range(3):
        got = op_orders(res.trace, step)
        assert sorted(got) == [0, 1, 2, 3]          # the 2 x 2 ranks, each replica's in the trace
        assert got == op_orders(sim, step)
        assert (got == program) == (case == "dapple")
    ser = RunSeries(config=cfg, runs=[res], rules=SittingRules(runs=1, max_runs=1, warmup=1, max_foreign=1e9))
    ser.settle()
    (comp,) = compare_series([ser], profile)
    assert comp.order_identical
    assert comp.schedule == {"dapple+overlap": "dapple+overlap", "zb-v+overlap": "zb-v+overlap"}.get(case, case)


EP_PROFILE = """\
format: pipetwin-calibration/1
name: test-ep
model: tiny-mixtral
layers:
  embedding: {f: 1.0e-5, b_input: 0.0, w: 2.0e-5}
  block: {f: 4.0e-4, b_input: 4.5e-4, w: 3.5e-4}
  head: {f: 1.0e-4, b_input: 1.0e-4, w: 1.0e-4}
p2p: {latency: 50 us, bandwidth: 2 GB/s}
allreduce: {latency: 80 us, bandwidth: 1 GB/s}
optimizer: {seconds_per_param: 2.0e-9}
ep: 2
all_to_all: {latency: 900 us, bandwidth: 0.4 GB/s}
expert_layers: {experts: {f: 1.0e-4, b_input: 1.0e-4, w: 1.0e-4, b: 2.0e-4}}
cores: 2
meta: {host: test, threads: 1}
"""


def test_a_moe_blocks_counts_rounds_are_compute_its_own_pair_cannot_hide(tmp_path):
    """EP_PROFILE with ``all_to_all.round: 2 ms`` (c): one MoE block's F is its compute (0.4 ms: 0.3
    before the dispatch, the experts' 0.1), the 4 synchronous rounds before the dispatch's rows (3c
    and the counts' 64 bytes / 0.4 GB/s = 0.16 us) and before the combine's (c) as compute, and
    the rows x = 450 us (the fit's 900 us less its own counts' round) + 8192 / 0.4 GB/s = 470.48 us
    twice as comm: phases compute 6.30016, comm 0.47048, compute 2.1, comm 0.47048 (ms), 9.34112
    in all. Its B (the fit's 920.48 us exchanges as comm, 0.1 ms experts, 0.35 ms rest) runs
    beside it: B's comm 0.92048 under F's first compute, B's 0.1 ms compute at 6.30016 (while
    F's rows run, ending 6.40016), B's second comm 6.77064 .. 7.69112 under F's 2.1 ms compute,
    B's last 0.35 ms compute after it (8.87064 .. 9.22064) while F's last rows run to 9.34112.
    The pair takes F's 9.34112 ms (sm_share 0): none of the 8.00016 ms of rounds is hidden. Had
    the rounds been comm (the old phases: compute 0.3, comm 6.47064, compute 0.1, comm 2.47048),
    they would have held the one comm stream: B's first exchange 0 .. 0.92048, F's 0.92048 ..
    7.39112, B's second to 8.3116, F's last to 10.78208 ms."""
    from cost_models.base import OpPhases
    from sim.overlap import overlapped_pair
    path = tmp_path / "ep.yaml"
    path.write_text(EP_PROFILE.replace("all_to_all: {latency: 900 us, bandwidth: 0.4 GB/s}",
                                       "all_to_all: {latency: 900 us, bandwidth: 0.4 GB/s, round: 2 ms}"))
    prof = load_profile(path)
    assert prof.a2a_round == pytest.approx(2e-3, rel=1e-12)
    assert load_profile(save_profile(prof, tmp_path / "again.yaml")).a2a_round == prof.a2a_round
    bad = tmp_path / "bad.yaml"
    bad.write_text(EP_PROFILE.replace("bandwidth: 0.4 GB/s}", "bandwidth: 0.4 GB/s, round: -1 ms}"))
    with pytest.raises(SpecError, match=r"all_to_all\.round"):
        load_profile(bad)
    c, x = 2e-3, 450e-6 + 8192 / 0.4e9
    fs, bs = prof.layer_segments(prof.layer_costs())
    f, b = OpPhases.from_segments(fs[1]), OpPhases.from_segments(bs[1])
    assert f.compute == pytest.approx((0.3e-3 + 3 * c + 64 / 0.4e9, 0.1e-3 + c), rel=1e-9)
    assert f.comm == pytest.approx((x, x), rel=1e-9)
    assert b.compute == pytest.approx((0.0, 0.1e-3, 0.35e-3), rel=1e-9, abs=1e-15)
    assert b.comm == pytest.approx((920.48e-6, 920.48e-6), rel=1e-9)
    pair = overlapped_pair(f, b, 0.0)
    assert pair.time == pytest.approx(0.4e-3 + 4 * c + 64 / 0.4e9 + 2 * x, rel=1e-9)     # 9.34112 ms
    assert pair.time == pytest.approx(9.34112e-3, rel=1e-6)
    as_comm = OpPhases.from_segments([("compute", 0.3e-3), ("comm", 3 * c + 64 / 0.4e9 + x), ("compute", 0.1e-3),
                                      ("comm", c + x)])
    assert overlapped_pair(as_comm, b, 0.0).time == pytest.approx(10.78208e-3, rel=1e-6)


def test_an_emulated_wire_makes_each_row_exchange_take_its_bytes_over_the_wire(tmp_path):
    """--a2a-wire W on a profile of EP 2: the dispatch and combine of S = n k h d = 32 x 2 x 32 x 4 =
    8192 bytes a rank take max(900 us + S / 0.4 GB/s, S / W): 4.096 ms at W = 2 MB/s (the wire's),
    the fit's 920.48 us at W = 1 GB/s (8.192 us on the wire: the gloo exchange is longer); the counts
    (64 bytes) keep the fit's 900.16 us. A job with the knob binds its profile so: each stage of
    dapple D 2 (2 MoE blocks) has 2 x 2 x (S / W - 450 us) comm seconds in F (the rows after each
    exchange's counts' round, priced as compute at the fit's 450 us a round), 2 x 2 rows in B."""
    from cost_models.job import Faults
    from sim.job import simulate_job
    path = tmp_path / "ep.yaml"
    path.write_text(EP_PROFILE)
    prof = load_profile(path)
    counts, fit = 900e-6 + 64 / 0.4e9, 900e-6 + 8192 / 0.4e9
    assert prof.a2a_times() == pytest.approx((counts, fit, fit), rel=1e-12)
    assert replace(prof, a2a_wire=2e6).a2a_times() == pytest.approx((counts, 8192 / 2e6, 8192 / 2e6), rel=1e-12)
    assert replace(prof, a2a_wire=1e9).a2a_times() == pytest.approx((counts, fit, fit), rel=1e-12)
    job = Job.of(schedule="dapple", devices=2, microbatches=4, replicas=2, ep=2, profile=str(path),
                 faults=Faults(a2a_wire=2e6))
    costs = simulate_job(job).bound.costs
    for s in range(2):
        # the rounds (4 a block at the fit's latency / 2 = 450 us, no a2a_round in the file) are
        # compute; the rows' comm is what the wire leaves after the round: 4.096 ms - 450 us
        assert costs.phases_f[0][s].comm_total == pytest.approx(2 * 2 * (8192 / 2e6 - 450e-6), rel=1e-9)
        assert costs.phases_f[0][s].total - costs.phases_f[0][s].comm_total == pytest.approx(
            costs.f[0][s] - 2 * 2 * (8192 / 2e6 - 450e-6), rel=1e-9)
        assert costs.phases_b[0][s].comm_total == pytest.approx(2 * 2 * 8192 / 2e6, rel=1e-9)


def _layer(f: float, b_input: float, w: float) -> dict:
    return {"f": f, "b_input": b_input, "w": w, "b": b_input + w, "act": 1000.0, "act_w": 500.0,
            "act_recompute": {"selective": 800.0, "full": 100.0}}


def _synthetic_host():
    """A host of tiny-mixtral at E 2 with made-up alone times (ms): a MoE block 1.0 / 1.2 / 0.4 at
    E 1, its experts 0.4 / 0.8 / 0.2 at E 1 and 0.3 / 0.5 / 0.1 at E 2 (so 0.9 / 0.9 / 0.3 at E 2:
    :func:`calibration.host.block_at_ep`); an all-to-all of S bytes 1e-4 + S / 1e9 s exactly."""
    from calibration.host import HostMeasurements, block_at_ep, kept_bytes
    ms = 1e-3
    moe = {"router": _layer(0.05 * ms, 0.1 * ms, 0.02 * ms), "experts": _layer(0.3 * ms, 0.5 * ms, 0.1 * ms),
           "experts_ep1": _layer(0.4 * ms, 0.8 * ms, 0.2 * ms)}
    block = _layer(1.0 * ms, 1.2 * ms, 0.4 * ms)
    emb, head = _layer(0.01 * ms, 0.02 * ms, 0.01 * ms), _layer(0.07 * ms, 0.1 * ms, 0.05 * ms)
    per1 = [emb] + [block] * SPEC.layers + [head]
    per2 = [emb] + [block_at_ep(block, moe, 2)] * SPEC.layers + [head]
    line = [(b, 1e-4 + b / 1e9) for b in (4096.0, 65536.0, 1048576.0)]
    comm = {"p2p": line, "allreduce": line, "grad_copy_per_byte": 0.0}
    return HostMeasurements(model="tiny-mixtral", label="tiny-mixtral", model_spec=SPEC, micro_batch=None, ranks=4,
                            threads=1, per=per2, dtype="fp32", kept=kept_bytes(per2), optimizer=1e-9, data=0.0,
                            comm=comm, ep=2, moe=moe, a2a=tuple(line), per_ep1=per1)


def test_the_runtime_fit_prices_the_traced_runs_at_ep1_and_the_profile_at_its_ep(monkeypatch):
    """Calibration's traced runs are E = 1 (every expert local, no all-to-all: runtime_configs), so the
    runtime fit must simulate them so: priced at E 2, each MoE block's F carried counts + dispatch +
    combine = 3 x 1e-4 + (64 + 2 x 8192) / 1e9 s and its B 2 x (1e-4 + 8192 / 1e9) s that those runs
    never spent, and the fitted scales shrank the compute to make room (tiny-mixtral: F scaled 0.78
    while its traced F ops ran ~3x their alone time). The fit's profile is the E 1 one; the profile
    kept is at E 2 with the fitted scales on its own (E 2) layer times, all-to-alls on top."""
    from calibration import host as H
    h = _synthetic_host()
    ms = 1e-3
    traced = h.traced()
    assert (traced.ep, traced.a2a, traced.per_ep1) == (1, (), None)
    fit_prof = H.host_profile(traced)
    assert fit_prof.ep == 1 and fit_prof.all_to_all is None and fit_prof.a2a_times() == (0.0, 0.0, 0.0)
    lc = fit_prof.layer_costs()
    assert lc.f[1:-1] == pytest.approx((1.0 * ms,) * SPEC.layers, rel=1e-12)        # the E 1 block, bare
    assert lc.b_input[1:-1] == pytest.approx((1.2 * ms,) * SPEC.layers, rel=1e-12)
    # at E 2: the block 1.0 + 0.3 - 0.4 = 0.9 ms, then the counts (64 B), dispatch, combine (8192 B each)
    # F: 4 synchronous rounds at the in-run P2P latency c = 1e-4 (no extra fitted here) + the counts'
    # 64 B + the rows less the fit's own counts' round (1e-4 / 2) twice; B: the fit's exchanges
    rows, c = 1e-4 + 8192 / 1e9, 1e-4
    f_a2a = 4 * c + 64 / 1e9 + 2 * (0.5e-4 + 8192 / 1e9)
    lc2 = H.host_profile(h).layer_costs()
    assert lc2.f[1:-1] == pytest.approx((0.9 * ms + f_a2a,) * SPEC.layers, rel=1e-9)
    assert lc2.b_input[1:-1] == pytest.approx((0.9 * ms + 2 * rows,) * SPEC.layers, rel=1e-9)

    # fit_profile: the fits see the E 1 profile; the kept one is E 2 with their scale
    seen = []

    def fit_runtime(base, make):
        seen.append(make({"F": 1.0}, {}))
        return {"F": 3.0, "B": 2.0, "Bi": 2.0, "W": 1.5, "OPTIM": 1.0}, {"F": 0.0, "B": 0.0, "W": 0.0}

    def fit_communication(base, make):
        seen.append(make(0.0, 1.0))
        return 0.0, 1.0
    monkeypatch.setattr(H, "fit_runtime", fit_runtime)
    monkeypatch.setattr(H, "fit_communication", fit_communication)
    monkeypatch.setattr(H, "fit_ranks", lambda ranks, tp: 2)
    prof = H.fit_profile(h, [])
    assert [(p.ep, p.all_to_all) for p in seen] == [(1, None), (1, None)]
    assert seen[0].layer_costs().f[1] == pytest.approx(1.0 * ms, rel=1e-12)
    assert prof.ep == 2 and prof.all_to_all is not None
    assert prof.layer_costs().f[1] == pytest.approx(3.0 * 0.9 * ms + f_a2a, rel=1e-9)
    assert prof.a2a_round == pytest.approx(prof.p2p.latency, rel=1e-12)      # the in-run P2P latency
