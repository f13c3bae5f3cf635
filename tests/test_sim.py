import pytest
import simpy

from cost_models import UnitCostModel
from cost_models.base import StageCosts
from cost_models.network import PortNetwork
from schedules import build, lower
from schedules.trace import make_trace, op_orders, step_metrics
from sim import FairShare, SimOptions, simulate


def run_flows(specs):
    """specs: list of (start_time, amount, resources, cap); returns completion times."""
    env = simpy.Environment()
    fs = FairShare(env)
    ends = [None] * len(specs)

    def proc(i, t0, amount, res, cap):
        yield env.timeout(t0)
        yield fs.start(amount, res, cap)
        ends[i] = env.now

    for i, sp in enumerate(specs):
        env.process(proc(i, *sp))
    env.run()
    return ends


def test_two_transfers_share_a_link_and_take_twice_as_long():
    one = run_flows([(0, 100.0, {"l": 10.0}, float("inf"))])
    two = run_flows([(0, 100.0, {"l": 10.0}, float("inf")), (0, 100.0, {"l": 10.0}, float("inf"))])
    assert one == [pytest.approx(10.0)]
    assert two == [pytest.approx(20.0), pytest.approx(20.0)]


def test_late_flow_gets_a_share_then_the_rest():
    # A alone for 5 s (50 B), then both at 5 B/s: A's remaining 50 B takes 10 s more; B then alone.
    ends = run_flows([(0, 100.0, {"l": 10.0}, float("inf")), (5, 100.0, {"l": 10.0}, float("inf"))])
    assert ends == [pytest.approx(15.0), pytest.approx(20.0)]


def test_processor_sharing_k_ops_on_c_cores():
    for k, c in [(3, 2), (4, 2), (2, 1)]:
        ends = run_flows([(0, 1.0, {"host": float(c)}, 1.0)] * k)
        assert ends == [pytest.approx(k / c)] * k
    # fewer ops than cores: each runs at one core
    assert run_flows([(0, 1.0, {"host": 2.0}, 1.0)]) == [pytest.approx(1.0)]


def costs_for(low, *, f=1.0, b=2.0, act_bytes=0.0, param_bytes=0.0):
    C, S, R = low.num_copies, low.num_stages, low.num_ranks
    tab = lambda v: tuple(tuple([v] * S) for _ in range(C))  # noqa: E731
    return StageCosts(time_unit="s", mem_unit="B", f=tab(f), b=tab(b), w=tab(0.0), act=tab(1.0), act_w=tab(0.0),
                      act_bytes=tab(act_bytes), grad_bytes=tab(act_bytes), param_bytes=tab(param_bytes),
                      static_mem=(0.0,) * R, optim_time=(0.0,) * R)


def test_p2p_time_is_latency_plus_bytes_over_bandwidth():
    low = lower(build("gpipe", 2, 1))
    net = PortNetwork(bandwidth=1e3, latency=0.5)
    tr = simulate(low, costs_for(low, act_bytes=2e3), net)
    recv = tr[(tr.kind == "RECV") & (tr.device == 1)].iloc[0]
    assert recv.end == pytest.approx(1.0 + 0.5 + 2.0)  # F on dev 0, latency, 2000 B at 1000 B/s
    f1 = tr[(tr.kind == "F") & (tr.device == 1)].iloc[0]
    assert f1.start == pytest.approx(3.5)


def test_ring_allreduce_closed_form():
    # R = 4 replicas of a 1-stage pipeline: all-reduce S bytes over n = 4 ranks
    S, bw, lat, n = 8e3, 1e3, 0.01, 4
    low = lower(build("gpipe", 1, 1), replicas=n)
    tr = simulate(low, costs_for(low, f=1.0, b=1.0, param_bytes=S), PortNetwork(bw, lat))
    ar = tr[tr.kind == "ALLREDUCE"]
    assert len(ar) == n
    expected = 2 * (n - 1) / n * S / bw + 2 * (n - 1) * lat
    assert (ar.end - ar.start).tolist() == [pytest.approx(expected)] * n
    assert tr.end.max() == pytest.approx(2.0 + expected)


def test_straggler_slows_the_whole_pipeline():
    low = lower(build("dapple", 4, 8))
    base = step_metrics(simulate(low, UnitCostModel().bind(low))).iteration_time
    slow = step_metrics(simulate(low, UnitCostModel().bind(low), options=SimOptions(slowdown={2: 2.0})))
    assert slow.iteration_time > base
    # the slow stage dominates the steady state: N*(F+B)*2 plus the fill/drain of the others
    assert slow.iteration_time >= 8 * 3 * 2


def test_jitter_is_seeded():
    low = lower(build("bitpipe", 4, 8))
    c = UnitCostModel().bind(low)
    a = simulate(low, c, options=SimOptions(jitter=0.1, seed=1))
    b = simulate(low, c, options=SimOptions(jitter=0.1, seed=1))
    d = simulate(low, c, options=SimOptions(jitter=0.1, seed=2))
    assert a.end.max() == b.end.max() != d.end.max()


def test_host_core_sharing_in_engine():
    low = lower(build("gpipe", 2, 4))
    c = costs_for(low, f=1.0, b=2.0)
    alone = simulate(low, c).end.max()
    shared = simulate(low, c, options=SimOptions(hosts=[0, 0], cores=1.0)).end.max()
    # on one core the two ranks' compute (2 * 4 * 3 = 24 core-seconds) is serialised
    assert alone == pytest.approx(3 * (4 + 1))
    assert shared == pytest.approx(24.0)


def test_trace_schema_and_executed_order():
    low = lower(build("chimera", 4, 4))
    tr = simulate(low, UnitCostModel().bind(low))
    assert list(tr.columns)[:5] == ["device", "step", "seq", "kind", "token"]
    assert tr.attrs["engine"] == "sim" and tr.attrs["time_unit"] == "F"
    orders = op_orders(tr)
    for r in range(4):
        assert orders[r] == [str(o) for o in low.program(r)]


def test_make_trace_metrics_by_hand():
    rows = [dict(device=0, step=0, seq=0, kind="F", token="F0.s0", copy=0, stage=0, chunk=0, microbatch=0,
                 peer=-1, start=0.0, end=1.0, bytes=0.0, act_mem=5.0),
            dict(device=1, step=0, seq=0, kind="F", token="F0.s1", copy=0, stage=1, chunk=0, microbatch=0,
                 peer=-1, start=1.0, end=2.0, bytes=0.0, act_mem=7.0)]
    m = step_metrics(make_trace(rows, static_mem={0: 10.0, 1: 20.0}))
    assert m.iteration_time == 2.0 and m.bubble_ratio == 0.5
    assert [(p.peak_activation, p.peak_memory) for p in m.per_device] == [(5.0, 15.0), (7.0, 27.0)]


def test_chrome_trace_is_valid_json(tmp_path):
    import json

    from schedules.trace import write_chrome
    low = lower(build("dapple", 2, 2))
    tr = simulate(low, UnitCostModel().bind(low))
    write_chrome(tr, tmp_path / "t.json")
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    slices = [e for e in ev if e["ph"] == "X"]
    assert len(slices) == len(tr)
    assert {e["name"] for e in slices} >= {"F0.s0", "B1.s1", "OPT"}
