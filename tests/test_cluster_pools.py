"""Clusters of mixed GPU pools (issue 45, items 1 and 2): the Pool record, global numbering, YAML,
the links between pools, and costs per device kind in the simulator (closed forms worked here)."""
from dataclasses import replace

import pytest

import cost_models as cm
from cost_models import LINK_TYPES, Cluster, SpecError, load_cluster, load_device
from cost_models.cluster import Pool, cluster_from_dict, tensor_parallel_groups
from cost_models.comm import allreduce_time, ring_allreduce_time
from cost_models.job import Job, Layout
from cost_models.transformer import TransformerCostModel
from sim import simulate_job

A100, H100 = load_device("a100"), load_device("h100")


def _pool(nodes, dpn, dev, intra="nvlink3", inter="ib-hdr", nics=1, name=""):
    return Pool(nodes=nodes, devices_per_node=dpn, device=dev, intra=LINK_TYPES[intra], inter=LINK_TYPES[inter],
                nics_per_node=nics, name=name)


def _tiny_mixed(path) -> str:
    """One A100 node of one GPU beside one H100 node of one GPU, joined by ib-hdr (a file)."""
    path.write_text("name: duo\npools:\n"
                    "  - {nodes: 1, device: a100, devices_per_node: 1, inter: ib-hdr}\n"
                    "  - {nodes: 1, device: h100, devices_per_node: 1, inter: ib-ndr}\n"
                    "between: ib-hdr\n")
    return str(path)


def test_one_pool_cluster_is_todays_cluster():
    """The old constructor and a one-pool ``pools=`` build the same cluster; its per-pool fields read
    through; replace() of those fields changes its pool; every preset of one kind round-trips to
    exactly today's dict (no 'pools' key)."""
    old = Cluster(name="t", nodes=2, devices_per_node=8, device=A100, intra=LINK_TYPES["nvlink3"],
                  inter=LINK_TYPES["ib-hdr"], nics_per_node=8)
    new = Cluster(name="t", pools=(_pool(2, 8, A100, nics=8),))
    assert old == new and not old.is_mixed and old.pools[0].name == "a100"
    assert (old.nodes, old.devices_per_node, old.device, old.nics_per_node, old.num_devices) == (2, 8, A100, 8, 16)
    assert replace(old, nodes=4).pools == (_pool(4, 8, A100, nics=8),)
    for name in cm.cluster_presets():
        c = load_cluster(name)
        if not c.is_mixed:
            d = c.to_dict()
            assert "pools" not in d and d["nodes"] == c.nodes and cluster_from_dict(d) == c
            assert [c.device_of(r) for r in (0, c.num_devices - 1)] == [c.device, c.device]


def test_mixed_numbering_pools_in_order_node_major():
    """a100-h100: GPUs 0-15 on nodes 0-1 (A100), 16-31 on nodes 2-3 (H100); per-pool fields refused."""
    c = load_cluster("a100-h100")
    assert c.is_mixed and c.num_devices == 32 and c.nodes == 4
    assert [c.pool_of(r) for r in (0, 15, 16, 31)] == [0, 0, 1, 1]
    assert (c.pool_gpus(0), c.pool_gpus(1)) == (range(0, 16), range(16, 32))
    assert [c.device_of(r).name for r in (15, 16)] == ["a100", "h100"]
    assert [(c.node_of(r), c.local_of(r), c.nic_of(r)) for r in (9, 17, 31)] == [(1, 1, 1), (2, 1, 1), (3, 7, 7)]
    assert c.devices_per_node == 8      # the pools agree on it
    for f in ("device", "intra", "inter"):
        with pytest.raises(SpecError, match=f"cluster 'a100-h100' is mixed .*no single {f}; ask per rank"):
            getattr(c, f)


def test_pools_yaml_round_trip(tmp_path):
    """to_dict -> cluster_from_dict is the identity for mixed presets and a file with an inline device."""
    for name in ("a100-h100", "consumer-mix"):
        c = load_cluster(name)
        assert cluster_from_dict(c.to_dict()) == c
    (tmp_path / "inline.yaml").write_text(
        "name: inl\npools:\n"
        "  - {nodes: 1, devices_per_node: 2, device: {name: slow, peak_flops: {fp16: 100 TFLOP/s}, memory: 16 GiB,"
        " efficiency: 0.5}, intra: pcie4, inter: eth-25g, name: old}\n"
        "  - {nodes: 2, devices_per_node: 2, device: a100, intra: nvlink3, inter: {type: ib-hdr, latency: 2 us}}\n"
        "between: {bandwidth: 10 Gb/s, latency: 50 us}\n")
    c = load_cluster(str(tmp_path / "inline.yaml"))
    assert [p.name for p in c.pools] == ["old", "a100"] and c.pools[0].device.peak("fp16") == 100e12
    assert c.pools[1].inter.latency == 2e-6 and c.between.bandwidth == 10e9 / 8
    assert cluster_from_dict(c.to_dict()) == c
    one = cluster_from_dict({"name": "solo", "pools": [{"nodes": 2, "devices_per_node": 8, "device": "h100",
                                                         "intra": "nvlink4", "inter": "ib-ndr", "name": "fast"}]})
    assert not one.is_mixed and one.pools[0].name == "fast" and cluster_from_dict(one.to_dict()) == one


def test_path_between_pools_uses_between():
    """Inside a pool a message crosses its pool's links; between pools it crosses the sender's NIC, the
    two NICs' gateway ports (``between``: 25 GB/s) and the receiver's NIC. A lone message of S bytes
    A100 -> H100 takes 5 us (ib-hdr) + 5 us (between) + S / min(25, 25, 25, 50 GB/s)."""
    c = load_cluster("a100-h100")
    assert [ln.name for ln in c.path(16, 17)] == ["n2.g0.out", "n2.g1.in"] and c.path(16, 17)[0].bandwidth == 450e9
    assert [(ln.name, ln.bandwidth) for ln in c.path(0, 8)] == [("n0.nic0.out", 25e9), ("n1.nic0.in", 25e9)]
    assert [(ln.name, ln.bandwidth) for ln in c.path(16, 24)] == [("n2.nic0.out", 50e9), ("n3.nic0.in", 50e9)]
    p = c.path(3, 27)
    assert [ln.name for ln in p] == ["n0.nic3.out", "n0.nic3.bx.out", "n3.nic3.bx.in", "n3.nic3.in"]
    assert [ln.bandwidth for ln in p] == [25e9, 25e9, 25e9, 50e9]
    S = 1e8
    assert cm.p2p_time(c, 3, 27, S) == pytest.approx(5e-6 + 5e-6 + S / 25e9, rel=1e-12)
    names = {ln.name for ln in c.links()}
    assert {"n0.nic3.bx.out", "n3.nic7.bx.in", "n3.g7.out"} <= names and len(names) == 4 * (8 * 2 + 8 * 4)


def test_tp_groups_stay_in_a_pool():
    """T=8 on a100-h100: one rank per node, each pool's links 8 ports wide, the gateway ports 8 NICs wide
    (8 x 25 GB/s); a group that would join two pools is refused."""
    g = tensor_parallel_groups(load_cluster("a100-h100"), 8)
    assert g.num_devices == 4 and [g.device_of(r).name for r in range(4)] == ["a100", "a100", "h100", "h100"]
    assert [ln.bandwidth for ln in g.path(1, 2)] == [8 * 25e9, 8 * 25e9, 8 * 25e9, 8 * 50e9]
    mixed = Cluster(name="odd", pools=(_pool(1, 8, A100), _pool(1, 8, H100, "nvlink4", "ib-ndr")),
                    between=LINK_TYPES["ib-hdr"])
    with pytest.raises(SpecError, match=r"--tp 16 .* pool 0 \(a100, 1 x 8\) .* never spans two device kinds"):
        tensor_parallel_groups(mixed, 16)


def _linear_job(cluster: str, **kw) -> Job:
    return Job.of(layout=Layout(schedule="dapple", **kw), model="gpt3-1.3b", cluster=cluster, cost_model="linear")


def test_stage_on_the_faster_pool_runs_at_its_device_rate(tmp_path):
    """D=2 on one A100 + one H100 (sequential: stage 0 on the A100, stage 1 on the H100), linear model,
    bf16, T=1: an op's time is its FLOPs / (peak x efficiency). So every stage's F on the A100 over
    its F on the H100 is (989.4e12 x 0.5945) / (312e12 x 0.5) = 3.7706..., and the simulated F of stage
    1 (on the H100) equals its FLOPs / 588.2e12 FLOP/s."""
    sim = simulate_job(_linear_job(_tiny_mixed(tmp_path / "duo.yaml"), devices=2, microbatches=4), trace=True)
    costs = sim.bound.costs
    assert costs.rank_kinds == (0, 1)
    a, h = costs.kinds
    ratio = (989.4e12 * 0.5945) / (312e12 * 0.5)
    for s in (0, 1):
        assert a.f[0][s] / h.f[0][s] == pytest.approx(ratio, rel=1e-12)
        assert a.b[0][s] / h.b[0][s] == pytest.approx(ratio, rel=1e-12)
    assert (costs.f[0][0], costs.f[0][1]) == (a.f[0][0], h.f[0][1])      # each stage on its rank's device
    tcm = TransformerCostModel(cm.load_model("gpt3-1.3b"), H100, compute="linear")
    layers, part = tcm.layers(), tcm.partition_for(2)
    flops = sum(x.flops_f for x in layers[part[0]:])          # stage 1: the layers after stage 0's
    tr = sim.result.trace()
    f1 = tr[(tr.kind == "F") & (tr.device == 1)]
    assert len(f1) == 4 and (f1.end - f1.start).tolist() == pytest.approx([flops / (989.4e12 * 0.5945)] * 4,
                                                                          rel=1e-12)
    assert sim.bound.report["memory_capacity_by_rank"] == [80 * 2**30, 80 * 2**30]


def test_replicas_on_two_kinds_all_reduce_after_the_slower(tmp_path):
    """D=1, R=2: replica 0 on the A100, replica 1 on the H100, N=4 micro-batches. Each replica computes
    N (F + B) alone; the gradient all-reduce starts when the slower (A100) replica reaches it, at
    T_a = N (F_a + B_a), and takes a ring of 2 over the pools' path: 2 (S/2 / 25 GB/s + 10 us)
    (ib-hdr's 5 us + between's 5 us a step); then each replica's optimizer step. So the iteration is
    T_a + ring(S) + optim_a, and the H100 replica's busy time is only N (F_h + B_h)."""
    sim = simulate_job(_linear_job(_tiny_mixed(tmp_path / "duo.yaml"), devices=1, microbatches=4, replicas=2))
    costs, res, net = sim.bound.costs, sim.result, sim.bound.network
    a, h = costs.kinds
    assert res.simulated_replicas == 2                    # the replicas differ: both simulated
    S = costs.param_bytes[0][0]
    ring = ring_allreduce_time(S, 2, 25e9, 10e-6)
    assert allreduce_time(net, [0, 1], S) == pytest.approx(ring, rel=1e-12)
    t_a = 4 * (a.f[0][0] + a.b[0][0])
    assert res.iteration_time == pytest.approx(t_a + ring + costs.optim_time[0], rel=1e-9)
    assert costs.optim_time == (a.optim_time[0], h.optim_time[1])
    assert res.busy[1] == pytest.approx(4 * (h.f[0][0] + h.b[0][0]), rel=1e-12)
    assert res.busy[0] == pytest.approx(t_a, rel=1e-12)


def test_simulate_shows_pools(tmp_path, capsys):
    """simulate on a100-h100 prints one line of busy and bubble per pool, (--json: ``pools``), each the
    mean busy share of its ranks: here D=2 x R=16 placed Megatron's way puts stage 0 on the A100s and
    stage 1 on the H100s, so the pools' busy shares are those of ranks 0 and 16."""
    from experiments.cli import main
    argv = ["simulate", "-c", "a100-h100", "-m", "gpt3-1.3b", "-D", "2", "-N", "8", "--dp", "16", "-s", "1f1b",
            "--device-map", "megatron", "--cost-model", "linear"]
    assert main(argv + ["--json"]) == 0
    import json
    rec = json.loads(capsys.readouterr().out)
    it = rec["iteration_time"]
    busy = {row["device"]: row["busy"] for row in rec["per_device"]}
    a, h = rec["pools"]
    assert (a["name"], a["gpus_used"], h["name"], h["gpus_used"]) == ("a100", 16, "h100", 16)
    assert a["busy"] == pytest.approx(busy[0] / it, rel=1e-12) and h["busy"] == pytest.approx(busy[1] / it, rel=1e-12)
    assert a["bubble_ratio"] == pytest.approx(1 - a["busy"], rel=1e-12)
    assert [row["pool"] for row in rec["per_device"][:2]] == ["a100", "h100"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"pools: a100 x16 busy {a['busy']:.1%} bubble {a['bubble_ratio']:.1%} | h100 x16 busy " \
           f"{h['busy']:.1%}" in out


def test_one_cost_model_for_every_pool(tmp_path):
    """A mixed cluster is priced by one cost model: kernels where every pool's device has kernel
    constants (a100-h100), linear where one has none (an A100 pool beside an RTX 3090 pool)."""
    from cost_models.bind import cluster_cost_model
    (tmp_path / "a100-3090.yaml").write_text(
        "pools:\n  - {nodes: 1, device: a100, devices_per_node: 4, intra: nvlink3, inter: ib-hdr}\n"
        "  - {nodes: 1, device: rtx-3090, devices_per_node: 4, intra: pcie4, inter: eth-25g}\nbetween: eth-25g\n")
    model = cm.load_model("gpt3-1.3b")
    assert cluster_cost_model(None, load_cluster("a100-h100"), False, model) == "kernels"
    mixed = load_cluster(str(tmp_path / "a100-3090.yaml"))
    assert cluster_cost_model(None, mixed, False, model) == "linear"
    job = Job.of(layout=Layout(schedule="dapple", devices=2, microbatches=4), model="gpt3-1.3b",
                 cluster=str(tmp_path / "a100-3090.yaml"), tp=4)
    bound = simulate_job(job).bound
    assert bound.report["cost_model"] == "linear" and [k.meta["cost_model"] for k in bound.costs.kinds] == \
        ["linear", "linear"]


def test_pools_of_unequal_nodes():
    """tests/data/pools/uneven.yaml: one node of 8 A100s, then two nodes of 4 RTX 3090s: GPU 8 is local 0
    of node 1, GPU 13 local 1 of node 2; T=4 gives the A100 node 2 groups and each 3090 node 1, so the
    grouped cluster has 4 ranks, ranks 0-1 on the A100s. The A100 node has one NIC, which its two groups
    share (as their GPUs would), so its port to the other pool stays one ``between`` (eth-25g: 25 Gb/s =
    3.125 GB/s)."""
    from pathlib import Path
    c = load_cluster(str(Path(__file__).parent / "data" / "pools" / "uneven.yaml"))
    assert (c.num_devices, c.nodes) == (16, 3)
    assert [(c.node_of(g), c.local_of(g), c.device_of(g).name) for g in (7, 8, 13)] == \
        [(0, 7, "a100"), (1, 0, "rtx-3090"), (2, 1, "rtx-3090")]
    g = tensor_parallel_groups(c, 4)
    assert [p.devices_per_node for p in g.pools] == [2, 1] and [g.pool_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert g.path(1, 2)[0].name == "n0.nic0.out" and g.path(1, 2)[1].bandwidth == 25e9 / 8
    with pytest.raises(SpecError, match="no single devices_per_node"):
        assert c.devices_per_node is None      # never reached: the property refuses


def test_memory_judged_on_each_ranks_device():
    """consumer-mix, T=4, D=3 (stage s on pool s): the 8 GiB RTX 2080 (rank 1) is judged against its
    own 8 GiB less the default reserve (1 GiB + 5%), the 24 GiB cards against 24 GiB; the summary names
    the fullest rank for its device, rank 1."""
    from cost_models.memory import default_reserve, memory_report
    job = Job.of(layout=Layout(schedule="dapple", devices=3, microbatches=8), model="gpt3-1.3b",
                 cluster="consumer-mix", tp=4)
    bound = simulate_job(job).bound
    rep = memory_report(bound.lowered, bound.costs)
    gib = 2**30
    assert rep.capacities == (24 * gib, 8 * gib, 24 * gib)
    usable = [c - default_reserve(c) for c in rep.capacities]
    fullest = max(range(3), key=lambda r: (rep.peak[r] + rep.transient) / usable[r])
    assert fullest == 1 and "on rank 1" in rep.summary() and f"of {8:g} GiB" in rep.summary()


def test_presets_show_pools_and_consumer_cards(capsys):
    """`pipetwin presets clusters` lists a mixed preset pool by pool; the consumer cards carry their
    datasheet numbers (dense tensor FP16 with FP32 accumulate, memory, bandwidth), Turing without bf16."""
    from experiments.cli import main
    assert main(["presets", "clusters"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("a100-h100 2 node(s) x 8 a100 (intra nvlink3 300 GB/s, inter ib-hdr 200 Gb/s x 8 NIC(s)/node) + 2 node(s) "
            "x 8 h100 (intra nvlink4 450 GB/s, inter ib-ndr 400 Gb/s x 8 NIC(s)/node); pools joined by ib-hdr 200 Gb/s "
            "per NIC (32 devices)") in out
    gib = 2**30
    want = {"rtx-3090": (71e12, True, 24 * gib, 936e9), "rtx-2080": (42.4e12, False, 8 * gib, 448e9),
            "rtx-2080-ti": (56.9e12, False, 11 * gib, 616e9), "titan-rtx": (130e12, False, 24 * gib, 672e9)}
    for name, (fp16, bf16, mem, bw) in want.items():
        d = load_device(name)
        assert (d.peak("fp16"), d.has("bf16"), d.memory_bytes, d.memory_bandwidth) == (fp16, bf16, mem, bw)
    c = load_cluster("consumer-mix")
    assert [p.device.name for p in c.pools] == ["rtx-3090", "rtx-2080", "titan-rtx"] and c.between.kind == "eth-10g"
    assert LINK_TYPES["nvlink-bridge-ga102"].bandwidth == 4 * 14.0625e9 and LINK_TYPES["eth-10g"].bandwidth == 1.25e9
