import pytest
import simpy

from cost_models import UnitCostModel
from cost_models.base import StageCosts
from cost_models.network import PortNetwork
from schedules import build, lower
from schedules.trace import make_trace, op_orders, step_metrics
from sim import FairShare, SimOptions, run, simulate


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


def test_calibrated_allreduce_holds_cores_for_its_bytes_not_its_latency():
    """On calibrated CPU ranks (one host, a measured ring fit) an all-reduce's per-message latency
    passes in wall time, as a P2P message's does, and only its bytes hold a core, shared with the
    host's compute. Two replicas of one stage on one core: F + B of both (4 core-s) end at 4; the
    ring's latency 2 * lat passes once for both members; its bytes (S / bw of one core each) are
    shared on the core: 2 * S / bw. Time-sliced, the whole ring time is CPU work queued per member."""
    from cost_models.cluster import Cluster, LinkSpec
    from cost_models.device import DeviceSpec
    S, bw, lat = 3e3, 1e3, 0.5
    low = lower(build("gpipe", 1, 1), replicas=2)
    link = LinkSpec("p2p", 1e9, 0.0)
    net = Cluster(name="host", nodes=1, devices_per_node=2, device=DeviceSpec(name="cpu", calibrated=True),
                  intra=link, inter=link, collective=LinkSpec("ar", bw, lat))
    costs = costs_for(low, f=1.0, b=1.0, param_bytes=S)
    host = SimOptions(hosts=[0, 0], cores=1.0, comm_uses_cores=True)
    ar = simulate(low, costs, net, host)
    ar = ar[ar.kind == "ALLREDUCE"]
    assert ar.start.tolist() == [pytest.approx(4.0)] * 2
    assert ar.end.tolist() == [pytest.approx(4.0 + 2 * lat + 2 * S / bw)] * 2   # 11, not 4 + 2 * (2 lat + S / bw) = 12
    # with a core per member the bytes take S / bw: the ring time of the fit, as measured alone
    ar = simulate(low, costs, net, SimOptions(hosts=[0, 0], cores=2.0, comm_uses_cores=True))
    ar = ar[ar.kind == "ALLREDUCE"]
    assert (ar.end - ar.start).tolist() == [pytest.approx(2 * lat + S / bw)] * 2
    sliced = simulate(low, costs, net, SimOptions(hosts=[0, 0], cores=1.0, comm_uses_cores=True, time_slice=0.25))
    sliced = sliced[sliced.kind == "ALLREDUCE"]
    assert sliced.end.max() == pytest.approx(4.0 + 2 * (2 * lat + S / bw))


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


@pytest.mark.parametrize("jitter", [0.5, 1.0])
def test_jitter_keeps_the_mean_busy_time(jitter):
    """Per-op noise of mean 1: over 10 seeds x 4 devices x 512 ops the mean busy time stays within
    2% of the noiseless 3N (a normal factor clipped at 0.05 gave +9% at jitter 1, +140% at 5)."""
    low = lower(build("dapple", 4, 256))
    c = UnitCostModel().bind(low)
    busy = [b for seed in range(10) for b in run(low, c, None, SimOptions(jitter=jitter, seed=seed)).busy]
    assert sum(busy) / len(busy) == pytest.approx(3 * 256, rel=0.02)
    assert min(busy) > 0


def test_no_op_runs_faster_than_the_peak():
    """Transformer costs carry each op's FLOPs at the device's peak; a straggler factor below 1
    that would beat it is refused, naming the rank and the op; the modelled costs pass."""
    from cost_models.bind import bind
    from cost_models.job import Job, Layout
    from sim.engine import check_peak
    b = bind(Job(layout=Layout(schedule="dapple", devices=4, microbatches=8), model="gpt3-1.3b",
                 cluster="dgx-a100-4x8-ib"))
    floor = b.costs.meta["peak_floor"]
    assert floor["peak"] == 312e12
    ratio = min(t / lo for kind, table in (("F", b.costs.f), ("B", b.costs.b)) for row, lows in
                zip(table, floor[kind]) for t, lo in zip(row, lows))
    assert 1.0 < ratio < 4.0          # the kernels model: slower than the peak, not absurdly so
    check_peak(b.lowered, b.costs, SimOptions(slowdown={2: 1.5}))
    with pytest.raises(ValueError, match=r"rank 2 \(slowdown 0.001\).*faster than its FLOPs at the device's peak"):
        run(b.lowered, b.costs, b.network, SimOptions(slowdown={2: 0.001}))


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

    from experiments.common import write_chrome
    low = lower(build("dapple", 2, 2))
    tr = simulate(low, UnitCostModel().bind(low))
    write_chrome(tr, tmp_path / "t.json")
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    slices = [e for e in ev if e["ph"] == "X"]
    assert len(slices) == len(tr)
    assert {e["name"] for e in slices} >= {"F0.s0", "B1.s1", "OPT"}


# ---------------------------------------------------------------------- max-min fair sharing
INF = float("inf")


def test_max_min_two_flows_one_throttled_upstream():
    # link A (10 B/s) carries flows 1 and 2; flow 2 also crosses B (4 B/s). Max-min: flow 2 gets
    # 4 (B saturates), flow 1 the remaining 6 of A. Flow 2 (40 B) ends at 10 s; by then flow 1 has
    # moved 60 of its 100 B and takes the rest at 10 B/s: 14 s. (Equal split: 5 and 4, 1 B/s idle.)
    ends = run_flows([(0, 100.0, {"A": 10.0}, INF), (0, 40.0, {"A": 10.0, "B": 4.0}, INF)])
    assert ends == [pytest.approx(14.0), pytest.approx(10.0)]


def test_max_min_parking_lot_chain():
    # links L1, L2, L3 of 1, 2, 3 B/s; a long flow crosses all three, one short flow per link.
    # Progressive filling: L1 saturates at level 1/2 (long + s1); then s2 rises to 2 - 1/2 = 1.5 on
    # L2 and s3 to 3 - 1/2 = 2.5 on L3. 1 B each: long and s1 end at 2, s2 at 2/3, s3 at 0.4
    # (equal split would give s2 1 and s3 1.5: 1.0 and 0.667).
    lot = {"L1": 1.0, "L2": 2.0, "L3": 3.0}
    ends = run_flows([(0, 1.0, lot, INF), (0, 1.0, {"L1": 1.0}, INF), (0, 1.0, {"L2": 2.0}, INF),
                      (0, 1.0, {"L3": 3.0}, INF)])
    assert ends == [pytest.approx(2.0), pytest.approx(2.0), pytest.approx(2 / 3), pytest.approx(0.4)]


def test_max_min_rates_by_hand():
    from types import SimpleNamespace

    from sim.flows import max_min_rates
    fl = lambda res, w=None, cap=INF, share=1.0: SimpleNamespace(  # noqa: E731
        resources=tuple(res), weights=tuple(w or [1.0] * len(res)), cap=cap, share=share, rate=0.0)
    # one flow standing for 3 identical ones (weight 3) next to a single one on a 12 B/s link:
    # each of the 4 real flows gets 3
    a, b = fl(["l"], [3.0]), fl(["l"])
    max_min_rates([a, b], {"l": 12.0})
    assert (a.rate, b.rate) == (pytest.approx(3.0), pytest.approx(3.0))
    # a capped flow (a compute op: 1 core) leaves the rest of a 3-core host to the others
    c1, c2, c3 = fl(["h"], cap=1.0), fl(["h"], cap=1.0), fl(["h"], cap=5.0)
    max_min_rates([c1, c2, c3], {"h": 3.0})
    assert [c1.rate, c2.rate, c3.rate] == [pytest.approx(1.0)] * 3
    max_min_rates([c1, c3], {"h": 3.0})
    assert [c1.rate, c3.rate] == [pytest.approx(1.0), pytest.approx(2.0)]
    # a transfer that keeps a core busy (0.01 core-s per byte, share 100 B/s per core) next to a
    # compute op on one core: each gets half of the core
    t, c = fl(["h", "link"], [0.01, 1.0], share=100.0), fl(["h"], cap=1.0)
    max_min_rates([t, c], {"h": 1.0, "link": 100.0})
    assert (t.rate, c.rate) == (pytest.approx(50.0), pytest.approx(0.5))


# ---------------------------------------------------------------------- replica symmetry
def _placed(name, D, N, R, cluster="dgx-a100-4x8-ib", mapping="sequential", eager=True, **cl):
    from dataclasses import replace

    from cost_models import TransformerCostModel, load_cluster, load_model
    c = replace(load_cluster(cluster), **cl)
    low = lower(build(name, D, N), replicas=R, eager=eager)
    return low, TransformerCostModel(load_model("gpt3-1.3b"), c.device).bind(low), c.place(low, mapping)


SYMMETRIC = [("dapple", 4, 8, 2, {}), ("dapple", 4, 8, 8, {}), ("gpipe", 8, 8, 4, {}),
             ("dapple", 8, 16, 4, {"nics_per_node": 1}), ("dapple", 4, 8, 8, {"nics_per_node": 1}),
             ("chimera", 4, 8, 4, {}), ("bitpipe", 4, 8, 4, {"mapping": "copies-same-node"}),
             ("zb-v", 4, 8, 8, {"cluster": "v100-2x8-25gbe", "nodes": 4}),
             ("interleaved", 4, 8, 4, {"eager": False}), ("dapple", 16, 16, 2, {"nodes": 4}),
             ("dapple", 8, 8, 4, {"fabric": "fat-tree", "nodes_per_leaf": 2, "oversubscription": 8.0}),
             ("zb-h1", 16, 16, 2, {"nodes": 4, "fabric": "rail", "nodes_per_leaf": 2, "oversubscription": 4.0})]


@pytest.mark.parametrize("name,D,N,R,kw", SYMMETRIC,
                         ids=[f"{c[0]}-D{c[1]}-R{c[3]}-{i}" for i, c in enumerate(SYMMETRIC)])
def test_replica_symmetry_equals_the_full_simulation(name, D, N, R, kw):
    low, costs, net = _placed(name, D, N, R, **kw)
    full = run(low, costs, net, SimOptions(exact=True))
    one = run(low, costs, net)
    assert one.simulated_replicas == 1 and one.full_reason is None
    assert full.simulated_replicas == R and full.full_reason == "exact simulation asked for"
    a, b = full.metrics(), one.metrics()
    assert b.iteration_time == pytest.approx(a.iteration_time, rel=1e-3)
    assert [p.peak_memory for p in b.per_device] == [p.peak_memory for p in a.per_device]
    assert [p.busy for p in b.per_device] == pytest.approx([p.busy for p in a.per_device])
    # the full simulation's metrics are the trace's
    tr = step_metrics(simulate(low, costs, net, SimOptions(exact=True)))
    assert tr.iteration_time == pytest.approx(a.iteration_time, rel=1e-12)


def test_symmetric_trace_is_the_full_trace():
    low, costs, net = _placed("dapple", 4, 8, 4, nics_per_node=1)
    key = ["device", "step", "seq"]
    full = simulate(low, costs, net, SimOptions(exact=True)).sort_values(key).reset_index(drop=True)
    one = simulate(low, costs, net).sort_values(key).reset_index(drop=True)
    assert len(one) == len(full)
    assert one["token"].tolist() == full["token"].tolist() and one["peer"].tolist() == full["peer"].tolist()
    assert one["start"].to_numpy() == pytest.approx(full["start"].to_numpy(), rel=1e-9, abs=1e-12)
    assert one["end"].to_numpy() == pytest.approx(full["end"].to_numpy(), rel=1e-9, abs=1e-12)


def test_asymmetric_replicas_fall_back_to_the_full_simulation():
    # D = 3 on 8-GPU nodes: replica 2 straddles two nodes, replica 0 does not
    low, costs, net = _placed("dapple", 3, 6, 4)
    res = run(low, costs, net)
    assert res.simulated_replicas == 4
    assert res.full_reason.startswith("replica ") and "not symmetric" in res.full_reason
    assert res.iteration_time == run(low, costs, net, SimOptions(exact=True)).iteration_time
    # a straggler in one replica only; the same slowdown in every replica keeps the symmetry
    low, costs, net = _placed("dapple", 4, 8, 2)
    assert run(low, costs, net, SimOptions(slowdown={5: 1.5})).full_reason == \
        "rank 5's slowdown differs from its replicas'"
    both = run(low, costs, net, SimOptions(slowdown={1: 1.5, 5: 1.5}))
    assert both.simulated_replicas == 1
    assert both.iteration_time == pytest.approx(
        run(low, costs, net, SimOptions(slowdown={1: 1.5, 5: 1.5}, exact=True)).iteration_time, rel=1e-3)
    assert run(low, costs, net, SimOptions(jitter=0.1)).full_reason == "per-op jitter makes replicas differ"
    # a slow link under one replica
    slow = run(low, costs, net, SimOptions(link_slowdown={"n0.g5.out": 4.0}))
    assert slow.simulated_replicas == 2 and "not symmetric" in slow.full_reason


@pytest.mark.parametrize("kw", [{"nodes": 6}, {"nodes": 6, "fabric": "rail", "nodes_per_leaf": 3,
                                         "oversubscription": 4.0}], ids=["flat", "rail"])
def test_alike_replicas_are_simulated_once_per_kind(kw):
    """D = 12 on 8-GPU nodes, R = 4: replicas 0 and 2 take 8 + 4 GPUs of two nodes, 1 and 3 take 4 + 8,
    so two kinds of replicas; one of each is simulated and the result is the full simulation's
    (iteration time, memory to the byte, busy time, the trace)."""
    low, costs, net = _placed("dapple", 12, 12, 4, **kw)
    full = run(low, costs, net, SimOptions(exact=True))
    two = run(low, costs, net)
    assert two.simulated_replicas == 2 and two.rep_of == [0, 1, 0, 1]
    assert "not symmetric" in two.full_reason and "2 kinds" in two.full_reason
    a, b = full.metrics(), two.metrics()
    assert b.iteration_time == pytest.approx(a.iteration_time, rel=1e-9)
    assert [p.peak_memory for p in b.per_device] == [p.peak_memory for p in a.per_device]
    assert [p.busy for p in b.per_device] == pytest.approx([p.busy for p in a.per_device])
    assert run(low, costs, net, max_ops=sum(map(len, low.programs)) * 2).simulated_replicas == 2
    key = ["device", "step", "seq"]
    tf = simulate(low, costs, net, SimOptions(exact=True)).sort_values(key).reset_index(drop=True)
    tt = simulate(low, costs, net).sort_values(key).reset_index(drop=True)
    assert len(tt) == len(tf) and tt["token"].tolist() == tf["token"].tolist()
    assert tt["peer"].tolist() == tf["peer"].tolist()
    assert tt["end"].to_numpy() == pytest.approx(tf["end"].to_numpy(), rel=1e-9, abs=1e-12)


def test_kinds_that_share_a_class_of_transfers_fall_back_to_every_replica():
    """dapple D = 4, R = 4 on two DGX A100 nodes with 2 GB/s NVLink and one link of replica 0
    (GPU 1 -> GPU 2 of node 0) slowed 4x: replicas 2 and 3 differ from replica 0 on the pairs that
    meet that link's contention, yet their other pairs fall in replica 0's classes. Simulating one
    replica of each kind would count those classes' traffic twice (+0.34% here); every replica is
    simulated instead, and the result is the full simulation's."""
    from dataclasses import replace

    from cost_models import TransformerCostModel, load_cluster, load_model
    c0 = load_cluster("dgx-a100-4x8-ib")
    c = replace(c0, nodes=2, intra=replace(c0.intra, bandwidth=2e9))
    low = lower(build("dapple", 4, 8), replicas=4)
    costs = TransformerCostModel(load_model("gpt3-1.3b"), c.device).bind(low)
    net = c.place(low, "sequential")
    slow = SimOptions(link_slowdown={net.path(1, 2)[0].name: 4.0})
    full = run(low, costs, net, replace(slow, exact=True))
    got = run(low, costs, net, slow)
    assert got.simulated_replicas == 4 and "share a class of transfers" in got.full_reason
    assert got.iteration_time == full.iteration_time
    assert run(low, costs, net).simulated_replicas == 1    # without the slow link: one replica, as before


def _megatron_job(tmp_path, exact=False, *, per=2, pod=None, over=1.0, pod_over=7.0, R=8, D=4):
    """llama3-8b at T=8 x D x R (interleaved, N=8) in Megatron's rank order (the default with T > 1)
    on D x R DGX H100 nodes in rail groups of ``per`` nodes (``over``:1 above them), in pods of
    ``pod`` nodes joined ``pod_over``:1 (None: one pod): stage d's R replicas sit on nodes
    d*R .. d*R+R-1, so every pipeline hop and the rings' hops between groups cross rail uplinks."""
    import yaml

    from cost_models.job import Job, Layout
    spec = dict(name="megatron-order", nodes=D * R, devices_per_node=8, device="h100", intra="nvlink4",
                inter="ib-ndr", nics_per_node=8, fabric="rail", nodes_per_leaf=per, oversubscription=over)
    if pod is not None:
        spec.update(nodes_per_pod=pod, pod_oversubscription=pod_over)
    path = tmp_path / f"c{per}-{pod}-{over}-{pod_over}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return Job.of(layout=Layout(schedule="interleaved", devices=D, microbatches=8, replicas=R), tp=8,
                  model="llama3-8b", cluster=str(path), recompute="full", exact=exact)


@pytest.mark.parametrize("R", [8, 6])
def test_non_blocking_rail_uplinks_leave_one_replica_in_megatron_order(tmp_path, R):
    """Rail groups of 2 nodes, non-blocking above (1:1): the data-parallel rings hop between groups
    at some replicas and not others, yet an uplink carries at most what its group's NICs send, so it
    never limits a rate; one replica is simulated and the iteration time is the full simulation's
    to the bit. Oversubscribed 2:1, the uplinks bind and the replicas differ: odd ones send their ring hop
    out of their group, even ones do not (2 kinds)."""
    from cost_models.comm import links_used
    from sim import simulate_job
    full = simulate_job(_megatron_job(tmp_path, exact=True, R=R))
    one = simulate_job(_megatron_job(tmp_path, R=R)).result
    assert "g0.rail0.up" in links_used(full.bound.lowered, full.bound.network)
    assert full.result.simulated_replicas == R and one.simulated_replicas == 1 and one.full_reason is None
    assert one.iteration_time == pytest.approx(full.result.iteration_time, rel=1e-12)
    peak = [p.peak_memory for p in full.result.metrics().per_device]
    assert [p.peak_memory for p in one.metrics().per_device] == peak
    if R == 8:
        over = simulate_job(_megatron_job(tmp_path, over=2.0)).result
        assert over.simulated_replicas == 2 and over.rep_of == [0, 1] * 4
        assert over.iteration_time == pytest.approx(simulate_job(_megatron_job(tmp_path, True, over=2.0))
                                                    .result.iteration_time, rel=1e-12)
        assert over.iteration_time > one.iteration_time * 1.001


def test_refinement_that_keeps_splitting_gives_up_for_the_full_simulation(tmp_path, monkeypatch):
    """Beyond REFINE_WORK signatures the refinement stops and every replica is simulated (a split
    travelling around the rings one hop per pass would end there anyway): the same iteration time."""
    import sim.symmetry
    from sim import simulate_job
    kinds = simulate_job(_megatron_job(tmp_path, pod=4, R=16)).result
    assert kinds.simulated_replicas == 4
    monkeypatch.setattr(sim.symmetry, "REFINE_WORK", 100)
    full = simulate_job(_megatron_job(tmp_path, pod=4, R=16)).result
    assert full.simulated_replicas == 16 and full.full_reason.startswith("the transfer classes still split after 1 ")
    assert full.iteration_time == pytest.approx(kinds.iteration_time, rel=1e-12)


@pytest.mark.parametrize("pod,kinds", [(8, 1), (16, 1), (4, 4), (12, None)])
def test_pods_on_an_oversubscribed_spine_equal_the_full_simulation(tmp_path, pod, kinds):
    """Pods joined 7:1: pods of 8 nodes hold one stage each (every pipeline hop crosses the spine,
    alike for all replicas: one simulated); pods of 16 hold two stages; pods of 4 split a stage's
    ring at replicas 3 -> 4 and 7 -> 0, so replicas differ by their place in the ring (4 kinds); pods
    of 12 (a stage and a half) leave every replica a kind of its own. Each is the full
    simulation's iteration time to the bit, and the spine costs time against a non-blocking one."""
    from sim import simulate_job
    got = simulate_job(_megatron_job(tmp_path, pod=pod)).result
    full = simulate_job(_megatron_job(tmp_path, True, pod=pod)).result
    assert got.simulated_replicas == (kinds or 8) and full.simulated_replicas == 8
    assert got.iteration_time == pytest.approx(full.iteration_time, rel=1e-12)
    free = simulate_job(_megatron_job(tmp_path, pod=pod, pod_over=1.0)).result
    assert free.simulated_replicas == 1 and got.iteration_time > free.iteration_time * 1.001


@pytest.mark.parametrize("case", ["dapple-R8", "megatron-pods", "chimera-R4"])
def test_all_reduce_steps_run_alone_equal_one_event_per_step(tmp_path, monkeypatch, case):
    """A ring's steps whose flow has its links to itself and end before anything else happens run
    as one timeout (sim.engine._solo_steps): the iteration time and every rank's busy time and
    memory are those of one event per step, and far fewer events are processed."""
    from sim import simulate_job
    from sim.engine import _Engine

    def go():
        if case == "megatron-pods":
            return simulate_job(_megatron_job(tmp_path, pod=16, R=16)).result
        name, D, R = ("dapple", 4, 8) if case == "dapple-R8" else ("chimera", 4, 4)
        low, costs, net = _placed(name, D, 8, R)
        return run(low, costs, net)

    steps = []
    real_step = simpy.Environment.step
    monkeypatch.setattr(simpy.Environment, "step", lambda env: (steps.append(1), real_step(env))[1])
    fast = go()
    fast_events = len(steps)
    monkeypatch.setattr(_Engine, "_solo_steps", lambda self, lat, flows, left: (0, self.env.now))
    steps.clear()
    slow = go()
    assert fast.iteration_time == pytest.approx(slow.iteration_time, rel=1e-12)
    a, b = fast.metrics(), slow.metrics()
    assert [p.busy for p in a.per_device] == pytest.approx([p.busy for p in b.per_device], rel=1e-12)
    assert [p.peak_memory for p in a.per_device] == [p.peak_memory for p in b.per_device]
    assert fast_events < len(steps) * (0.5 if case == "megatron-pods" else 0.95)


def test_solo_duration_is_none_on_a_busy_link():
    env = simpy.Environment()
    fs = FairShare(env)
    assert fs.solo_duration(100.0, [("l", 10.0), ("m", (40.0, 2.0))]) == pytest.approx(10.0)
    fs.start(100.0, [("m", 40.0)])
    assert fs.solo_duration(100.0, [("l", 10.0), ("m", (40.0, 2.0))]) is None
    assert fs.solo_duration(100.0, [("l", 10.0)]) == pytest.approx(10.0)


def test_run_refuses_a_full_simulation_beyond_max_ops():
    low, costs, net = _placed("dapple", 3, 6, 4)          # replicas differ: every one is simulated
    with pytest.raises(ValueError, match=r"replicas are simulated one by one \(replica 1's .*beyond the limit of 100"):
        run(low, costs, net, max_ops=100)
    low, costs, net = _placed("dapple", 4, 8, 4)          # identical: one replica's ops count
    assert run(low, costs, net, max_ops=sum(map(len, low.programs))).simulated_replicas == 1


def run_sliced(cores, quantum, jobs):
    """jobs: list of (start_time, seconds) on time-sliced cores; returns completion times."""
    from sim.slicing import SlicedCores
    env = simpy.Environment()
    cpu = SlicedCores(env, cores, quantum)
    ends = [None] * len(jobs)

    def proc(i, t0, seconds):
        yield env.timeout(t0)
        yield cpu.run(seconds)
        ends[i] = env.now

    for i, (t0, s) in enumerate(jobs):
        env.process(proc(i, t0, s))
    env.run()
    return ends


def test_time_sliced_cores_take_turns_in_slices():
    # one core, 1 s slices: A 0-1, B 1-2 (done), A 2-3.5 (nobody waits: it keeps the core)
    assert run_sliced(1, 1.0, [(0, 2.5), (0, 1.0)]) == [pytest.approx(3.5), pytest.approx(2.0)]
    # three 1 s ops on two cores: two run at full speed, the third waits (processor sharing: 1.5 s each)
    assert run_sliced(2, 10.0, [(0, 1.0)] * 3) == [pytest.approx(1.0), pytest.approx(1.0), pytest.approx(2.0)]
    # a rank woken at 0.5 s waits for the slice in progress to end (2 s), then A resumes
    assert run_sliced(1, 2.0, [(0, 3.0), (0.5, 0.5)]) == [pytest.approx(3.5), pytest.approx(2.5)]
    # alone, work never waits, whatever the slice
    assert run_sliced(2, 0.3, [(0, 3.5), (1, 0.2)]) == [pytest.approx(3.5), pytest.approx(1.2)]


def test_time_slices_need_whole_cores_and_a_positive_slice():
    from sim.slicing import SlicedCores
    env = simpy.Environment()
    with pytest.raises(ValueError, match="whole number"):
        SlicedCores(env, 1.5, 1e-3)
    with pytest.raises(ValueError, match="time slice"):
        SlicedCores(env, 2, 0.0)
    with pytest.raises(ValueError, match="time_slice"):
        SimOptions(time_slice=float("nan"))


def test_time_sliced_host_by_hand():
    """Two ranks on one core, 1F1B with D = 2, N = 2 (F 1 s, B 2 s, a receive 0.01 s of CPU, free
    messages): every piece of CPU work queues for the core, first come first served.

    Slices longer than any op: rank 0 runs F0 [0, 1] and F1 [1, 2] (asked for before rank 1's
    receive, woken by F0's message at 1); rank 1 takes its activation [2, 2.01], F0 [2.01, 3.01],
    B0 [3.01, 5.01]; both receives follow (rank 1's first: it asked first) [5.01, 5.03]; rank 1's
    F1 [5.03, 6.03], rank 0's B0 [6.03, 8.03], rank 1's B1 [8.03, 10.03], rank 0's last gradient
    [10.03, 10.04] and B1 [10.04, 12.04]. Rows start when a rank asks for the core.

    0.5 s slices: rank 0's F1 is preempted at 1.5 by rank 1's receive [1.5, 1.51] and finishes
    [1.51, 2.01]; rank 1's F0 then runs [2.01, 3.01] (nobody waits: it keeps the core)."""
    from dataclasses import replace
    low = lower(build("dapple", 2, 2))
    costs = replace(costs_for(low, f=1.0, b=2.0), recv_time=0.01)

    def ends(q):
        tr = simulate(low, costs, None, SimOptions(hosts=[0, 0], cores=1.0, time_slice=q))
        tr = tr[tr["kind"] != "OPTIM"]
        return {(int(r.device), r.token): (round(r.start, 9), round(r.end, 9)) for r in tr.itertuples()}

    long = ends(100.0)
    assert long[(0, "F0.s0")] == (0.0, 1.0) and long[(0, "F1.s0")] == (1.0, 2.0)
    assert long[(1, "RA0.s1<0")] == (0.0, 2.01) and long[(1, "F0.s1")] == (2.01, 3.01)
    assert long[(1, "B0.s1")] == (3.01, 5.01) and long[(1, "RA1.s1<0")] == (5.01, 5.02)
    assert long[(0, "RG0.s0<1")] == (2.0, 5.03) and long[(1, "F1.s1")] == (5.02, 6.03)
    assert long[(0, "B0.s0")] == (5.03, 8.03) and long[(1, "B1.s1")] == (6.03, 10.03)
    assert long[(0, "RG1.s0<1")] == (8.03, 10.04) and long[(0, "B1.s0")] == (10.04, 12.04)
    short = ends(0.5)
    assert short[(1, "RA0.s1<0")] == (0.0, 1.51) and short[(0, "F1.s0")] == (1.0, 2.01)
    assert short[(1, "F0.s1")] == (1.51, 3.01)
    # processor sharing does the same work in the same time here (one core, never idle), but
    # stretches the ops that overlap
    tr = simulate(low, costs, None, SimOptions(hosts=[0, 0], cores=1.0))
    assert step_metrics(tr).iteration_time == pytest.approx(12.04)
    assert tr.loc[(tr["device"] == 0) & (tr["token"] == "F1.s0"), "end"].item() > 2.0


def test_host_model_is_chosen_once_from_the_options():
    """No hosts: the GPU path, whose work function is None (the engine's loop advances the clock
    itself); hosts: processor sharing, or time slices with ``time_slice``; transfers add the host
    cores to their path only under processor sharing with ``comm_uses_cores``."""
    from sim.cores import NoHost, SharedCores, TimeSlicedCores, host_model
    env = simpy.Environment()
    fs = FairShare(env)
    none = host_model(env, fs, None, 1.0, None, True)
    assert isinstance(none, NoHost) and none.work(0) is None and none.transfer(0, 1, [("l", 10.0)]) == ([], 1.0)
    shared = host_model(env, fs, [0, 1], {1: 3.0}, None, True)
    assert isinstance(shared, SharedCores) and (shared.cores(0), shared.cores(1)) == (1.0, 3.0)
    assert shared.transfer(0, 1, [("l", 10.0), ("m", 4.0)]) == (
        [("host0.cores", (1.0, 0.25)), ("host1.cores", (3.0, 0.25))], 4.0)
    assert host_model(env, fs, [0, 1], 2.0, None, False).transfer(0, 1, [("l", 10.0)]) == ([], 1.0)
    sliced = host_model(env, fs, [0, 0], 2.0, 0.5, True)
    assert isinstance(sliced, TimeSlicedCores) and sliced.transfer(0, 1, [("l", 10.0)]) == ([], 1.0)
    ends = []

    def rank(seconds):
        yield sliced.work(0)(seconds)
        ends.append(env.now)

    for s in (1.0, 1.0, 1.0):
        env.process(rank(s))
    env.run()
    # three 1 s jobs on two cores in 0.5 s slices, round robin: the first two run [0, 0.5], the third
    # and the first [0.5, 1], the second and the third [1, 1.5] (processor sharing: all end at 1.5)
    assert ends == [pytest.approx(1.0), pytest.approx(1.5), pytest.approx(1.5)]

# ---------------------------------------------------------------------- results pinned to the bit
PINNED_PROFILE = {
    "format": "pipetwin-calibration/1", "name": "pinned-cpu", "model": "tiny",
    "layers": {"embedding": {"f": 1.0e-5, "b_input": 0.0, "w": 2.0e-5},
               "block": {"f": 4.0e-4, "b_input": 4.5e-4, "w": 3.5e-4},
               "head": {"f": 1.0e-4, "b_input": 1.0e-4, "w": 1.0e-4}},
    "p2p": {"latency": "50 us", "bandwidth": "2 GB/s"}, "allreduce": {"latency": "80 us", "bandwidth": "1 GB/s"},
    "optimizer": {"seconds_per_param": 2.0e-9},
    "overhead": {"F": 5.0e-5, "B": 4.0e-5, "W": 4.0e-5, "SEND": 9.0e-5, "RECV": 3.0e-5, "OPTIM": 2.0e-4},
    "grad_copy_per_byte": 2.0e-10, "copy_time": 1.0e-5, "cores": 2, "time_slice": "4 ms", "memory": "4 GiB",
}


def _pinned_unit(name, D, N, R=1, **opts):
    low = lower(build(name, D, N), replicas=R)
    return run(low, UnitCostModel().bind(low), None, SimOptions(**opts), trace=True)


def _pinned_port(name, D, N, R, **opts):
    """Hand-made costs with every CPU overhead (send, receive, copy, flattening, optimizer) on a
    port network: the GPU path without hosts, the host paths with them."""
    from dataclasses import replace
    low = lower(build(name, D, N), replicas=R)
    costs = replace(costs_for(low, f=1.0, b=2.0, act_bytes=300.0, param_bytes=2e3), send_time=0.03,
                    recv_time=0.02, copy_time=0.01, grad_copy_per_byte=1e-4,
                    optim_time=tuple(0.1 + 0.01 * r for r in range(low.num_ranks)))
    return run(low, costs, PortNetwork(bandwidth=1e3, latency=0.05), SimOptions(**opts), trace=True)


def _pinned_placed(name, D, N, R, *, opts=None, **kw):
    low, costs, net = _placed(name, D, N, R, **kw)
    return run(low, costs, net, SimOptions(**(opts or {})), trace=True)


def _pinned_profile(name, D, N, R=1, steps=2, **profile):
    """A calibrated CPU host (``sim.host.on_one_host``): D * R ranks on the profile's 2 cores, time-sliced
    when they outnumber them (unless ``time_slice`` is None), processor sharing otherwise."""
    from cost_models.profile import profile_from_dict
    from sim.host import HostCores, on_one_host
    prof = profile_from_dict({**PINNED_PROFILE, **profile}, "pinned")
    low = lower(build(name, D, N), replicas=R)
    costs = prof.cost_model(low.num_stages).bind(low)
    opts = on_one_host(SimOptions(steps=steps), low.num_ranks, HostCores.of(prof))
    return run(low, costs, prof.cluster(low.num_ranks), opts, trace=True)


PINNED = {
    # no host: the GPU path (unit costs, every family, steps, jitter, a straggler)
    "unit-gpipe": lambda: _pinned_unit("gpipe", 4, 8),
    "unit-dapple-2steps-jitter": lambda: _pinned_unit("dapple", 4, 8, steps=2, jitter=0.1, seed=3),
    "unit-interleaved": lambda: _pinned_unit("interleaved", 4, 8),
    "unit-chimera-slow": lambda: _pinned_unit("chimera", 4, 8, slowdown={1: 1.5}),
    "unit-bitpipe-R2": lambda: _pinned_unit("bitpipe", 4, 8, R=2),
    "unit-zb-h1": lambda: _pinned_unit("zb-h1", 4, 8),
    "unit-zb-v": lambda: _pinned_unit("zb-v", 4, 8),
    "unit-dualpipe-v": lambda: _pinned_unit("dualpipe-v", 4, 8),
    "unit-bitpipe-zb": lambda: _pinned_unit("bitpipe-zb", 4, 8),
    # no host, with send / receive / copy / flattening / optimizer times and all-reduces
    "port-dapple-R2": lambda: _pinned_port("dapple", 2, 4, 2),
    "port-bitpipe-R2-2steps": lambda: _pinned_port("bitpipe", 2, 4, 2, steps=2),
    "port-zb-v-R2-exact": lambda: _pinned_port("zb-v", 2, 4, 2, exact=True),
    # hosts sharing cores (processor sharing), compute alone and with transfers on the cores
    "port-dapple-R2-shared": lambda: _pinned_port("dapple", 2, 4, 2, hosts=[0, 0, 1, 1], cores={0: 1.0, 1: 2.0}),
    "port-chimera-R2-shared-comm": lambda: _pinned_port("chimera", 2, 4, 2, hosts=[0, 0, 0, 1], cores=2.0,
                                                        comm_uses_cores=True, steps=2),
    # time-sliced hosts
    "port-dapple-R2-sliced": lambda: _pinned_port("dapple", 2, 4, 2, hosts=[0, 0, 0, 0], cores=1.0,
                                                  time_slice=0.25, steps=2),
    "port-zb-h1-R2-sliced-comm": lambda: _pinned_port("zb-h1", 2, 4, 2, hosts=[0, 0, 1, 1], cores=1.0,
                                                      comm_uses_cores=True, time_slice=0.4),
    # a placed GPU cluster: replica symmetry, one replica per kind, every replica
    "placed-dapple-R4": lambda: _pinned_placed("dapple", 4, 8, 4, nics_per_node=1),
    "placed-dapple-D12-R4-kinds": lambda: _pinned_placed("dapple", 12, 12, 4, nodes=6),
    "placed-bitpipe-R2-slowlink": lambda: _pinned_placed("bitpipe", 4, 8, 2, opts={
        "link_slowdown": {"n0.g5.out": 4.0}, "steps": 2}),
    # calibrated CPU hosts: shared cores (a core per rank), time slices (more ranks than cores)
    "profile-dapple-D2-shared": lambda: _pinned_profile("dapple", 2, 4),
    "profile-gpipe-D2-R2-sliced": lambda: _pinned_profile("gpipe", 2, 4, R=2),
    "profile-zb-h1-D4-sliced": lambda: _pinned_profile("zb-h1", 4, 8, first_stage_all_in_w=True),  # older profiles
    "profile-chimera-D4-shared-oversubscribed": lambda: _pinned_profile("chimera", 4, 4, time_slice=None),
    "profile-dapple-D2-R2-shared-4cores": lambda: _pinned_profile("dapple", 2, 4, R=2, cores=4),
}


def _fingerprint(res) -> str:
    """SHA-256 of everything a run returns, floats by their exact repr: per-step iteration times,
    busy time and peak activation per rank, the replicas simulated, and the full trace (every
    column of every row) with its metadata."""
    import hashlib
    tr = res.trace()
    parts = [repr(res.iteration_times), repr(res.busy), repr(res.peak_activation), repr(res.simulated_replicas),
             repr(res.full_reason), repr(sorted((k, repr(v)) for k, v in tr.attrs.items())), repr(list(tr.columns))]
    parts += [repr(tr[col].tolist()) for col in tr.columns]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


# the engine's output for each case; print them with `python tests/test_sim.py`
PINNED_FINGERPRINTS = {
    'placed-bitpipe-R2-slowlink': '5db70d7374687b4f295e39a73271f364',   # iteration 0.2982369421077262
    'placed-dapple-D12-R4-kinds': '86b16e8d9ab627b29d2626ac998a0322',   # iteration 0.3397194756874272
    'placed-dapple-R4': '8ee9e4559315627447c621aafb5a52e5',   # iteration 0.43699324334607775
    'port-bitpipe-R2-2steps': '2c8361589b267f6b2feef2b9556ce11d',   # iteration 34.43999999999998
    'port-chimera-R2-shared-comm': 'cf964eed64ae56f2fb89d16ca894eaa1',   # iteration 34.56333333333332
    'port-dapple-R2': '52c93304f85e1931f32ae81a32fd2cae',   # iteration 19.37
    'port-dapple-R2-shared': '75a59b4616b6d5b0bf57f6cec8d7a8a0',   # iteration 27.740000000000002
    'port-dapple-R2-sliced': '44c6f55b100e56ac1c6b94a5ed84cfc7',   # iteration 57.15999999999998
    'port-zb-h1-R2-sliced-comm': '142f6abd2b55c991e7b39c0e69f2b81b',   # iteration 27.919999999999984
    'port-zb-v-R2-exact': '2b81a68b560d53fddb2d6b5b8fc068ff',   # iteration 33.60000000000001
    'profile-chimera-D4-shared-oversubscribed': '41f06b2568fc5190bc29ec906da3ebcd',   # iteration 0.02796741440000002
    'profile-dapple-D2-R2-shared-4cores': '114ec9c95e91857e1d3656b7eac19e3f',   # iteration 0.03177876480000001
    'profile-dapple-D2-shared': '1417b1a0bec2d9f2dd4eb813f9b0c3b9',   # iteration 0.030385152000000006
    'profile-gpipe-D2-R2-sliced': 'a2bf20735cd344ec8b737152dc7848dc',   # iteration 0.04744419840000004
    'profile-zb-h1-D4-sliced': '5de2d0fb52f26e1e9c777e32acf79f6a',   # iteration 0.05180508800000009
    'unit-bitpipe-R2': '0f90add6a7a384443fb329cccf4190cf',   # iteration 27.0
    'unit-bitpipe-zb': '7cc4a2a9c77438f313831b84d17992c9',   # iteration 24.5
    'unit-chimera-slow': '36fe46d76ef6f967dc80ef8a32fc8961',   # iteration 39.0
    'unit-dapple-2steps-jitter': '3dbdef599f561c24dbd68303eb5f8a08',   # iteration 39.12184341101204
    'unit-dualpipe-v': 'ae716c80dc878bf2a99e1130936c3f3e',   # iteration 25.5
    'unit-gpipe': '7fb672ed3e011811e540a369a640fa81',   # iteration 33.0
    'unit-interleaved': '610f9467a36cf8e66a57b7177d3d31f6',   # iteration 28.5
    'unit-zb-h1': 'e3c3e7e0ab446c2cd289f62b2cf1d337',   # iteration 27.0
    'unit-zb-v': 'b66fba4dc498e0ce34beb1dbb0a15357',   # iteration 25.5
}


@pytest.mark.parametrize("case", sorted(PINNED))
def test_results_are_pinned_to_the_bit(case):
    """Every case's iteration times, busy times, memory and full trace are those the fingerprint
    recorded, to the last bit: a change to the engine's structure must not move a single float."""
    assert _fingerprint(PINNED[case]()) == PINNED_FINGERPRINTS[case]


if __name__ == "__main__":
    for case in sorted(PINNED):
        res = PINNED[case]()
        print(f"    {case!r}: {_fingerprint(res)!r},   # iteration {res.iteration_time!r}")
