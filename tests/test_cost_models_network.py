"""Clusters, paths, device mappings and communication closed forms."""
import pytest

import cost_models as cm
import schedules as S
from cost_models.cluster import Cluster, LinkSpec

A100x32 = cm.load_cluster("dgx-a100-4x8-ib")
V100x16 = cm.load_cluster("v100-2x8-25gbe")
FLAT = cm.load_cluster("v100-16x1-25gbe")
MB = 6_291_456  # GPT-96 boundary tensor, bytes


def small_cluster(nodes=2, dpn=4, nics=1, **kw):
    return Cluster(name="t", nodes=nodes, devices_per_node=dpn, device=cm.load_device("a100"),
                   intra=LinkSpec("x", 100e9, 2e-6), inter=LinkSpec("y", 10e9, 10e-6), nics_per_node=nics, **kw)


# ----------------------------------------------------------------------------- links and paths
def test_link_type_values():
    assert cm.LINK_TYPES["ib-hdr"].bandwidth == 25e9
    assert cm.LINK_TYPES["ib-ndr"].bandwidth == 50e9
    assert cm.LINK_TYPES["eth-25g"].bandwidth == 3.125e9
    assert V100x16.intra.kind == "nvlink2" and V100x16.inter.kind == "eth-25g" and V100x16.nics_per_node == 1
    assert A100x32.nics_per_node == 8 and A100x32.device.name == "a100"


def test_paths():
    p = A100x32.path(1, 5)
    assert [l.name for l in p] == ["n0.g1.out", "n0.g5.in"]
    assert [l.bandwidth for l in p] == [300e9, 300e9] and [l.latency for l in p] == [3e-6, 0.0]
    p = A100x32.path(3, 12)        # node 0 local 3 -> node 1 local 4: rail NICs 3 and 4
    assert [l.name for l in p] == ["n0.nic3.out", "n1.nic4.in"] and p[0].bandwidth == 25e9
    # one NIC per node: every cross-node flow of a node leaves through nic0
    assert [l.name for l in V100x16.path(2, 9)] == ["n0.nic0.out", "n1.nic0.in"]
    assert [l.name for l in V100x16.path(5, 10)][0] == "n0.nic0.out"
    assert A100x32.path(4, 4) == []
    assert len(A100x32.links()) == 4 * (2 * 8 + 2 * 8)
    with pytest.raises(cm.SpecError, match="rank 32"):
        A100x32.path(0, 32)


def test_p2p_time():
    assert cm.p2p_time(A100x32, 0, 1, MB) == pytest.approx(3e-6 + MB / 300e9)
    assert cm.p2p_time(A100x32, 7, 8, MB) == pytest.approx(5e-6 + MB / 25e9)
    assert cm.p2p_time(V100x16, 7, 8, MB) == pytest.approx(30e-6 + MB / 3.125e9)   # ~2.0 ms
    assert cm.p2p_time(A100x32, 3, 3, MB) == 0
    assert cm.p2p_time(cm.PortNetwork(1e9, 1e-5), 0, 1, 1e6) == pytest.approx(1e-5 + 1e-3)


def test_shared_link_halves_bandwidth():
    """Two transfers through one NIC take twice the bandwidth time of one (fair sharing)."""
    one = cm.step_time(V100x16, [(0, 8, MB)])
    two = cm.step_time(V100x16, [(0, 8, MB), (1, 9, MB)])
    assert one == pytest.approx(30e-6 + MB / 3.125e9)
    assert two - 30e-6 == pytest.approx(2 * (one - 30e-6))
    # with a NIC per GPU (rail) they do not share
    assert cm.step_time(A100x32, [(0, 8, MB), (1, 9, MB)]) == pytest.approx(cm.p2p_time(A100x32, 0, 8, MB))


# ----------------------------------------------------------------------------- all-reduce
def test_ring_allreduce_closed_form():
    S_, n, B, a = 1e9, 8, 300e9, 3e-6
    assert cm.ring_allreduce_time(S_, n, B, a) == pytest.approx(2 * 7 / 8 * S_ / B + 14 * a)
    assert cm.ring_allreduce_time(S_, n, B, a) == pytest.approx(0.0058333 + 4.2e-5, rel=1e-4)
    assert cm.ring_allreduce_time(S_, 1, B, a) == 0
    assert cm.reduce_scatter_time(S_, 4, 1e9, 1e-6) == pytest.approx(0.75 + 3e-6)


def test_allreduce_inside_node_is_ring():
    t = cm.allreduce_time(A100x32, range(8), 1e9)
    assert t == pytest.approx(cm.ring_allreduce_time(1e9, 8, 300e9, 3e-6))
    assert cm.allreduce_kind(A100x32, [0, 5]) == "ring"
    assert cm.allreduce_time(A100x32, [2], 1e9) == 0


def test_allreduce_hierarchical_across_nodes():
    S_ = 1e9
    # 4 nodes x 8: RS inside over 8, 8 rail rings of S/8 over 4 nodes (own NIC each), AG inside
    want = 2 * (7 / 8 * S_ / 300e9 + 7 * 3e-6) + 2 * 3 / 4 * (S_ / 8) / 25e9 + 6 * 5e-6
    assert cm.allreduce_kind(A100x32, range(32)) == "hierarchical"
    assert cm.allreduce_time(A100x32, range(32), S_) == pytest.approx(want)
    # 2 nodes x 8 V100, one 25 GbE NIC: the 8 rings of a node share it -> S/B_inter as a whole
    want = 2 * (7 / 8 * S_ / 150e9 + 7 * 3e-6) + 2 * 1 / 2 * S_ / 3.125e9 + 2 * 30e-6
    assert cm.allreduce_time(V100x16, range(16), S_) == pytest.approx(want)
    # one device per node: the flat ring on the network
    assert cm.allreduce_time(FLAT, range(16), S_) == pytest.approx(cm.ring_allreduce_time(S_, 16, 3.125e9, 30e-6))
    # a stage pair split across nodes (Chimera/BitPipe copies under the sequential mapping)
    assert cm.allreduce_time(V100x16, [3, 12], S_) == pytest.approx(cm.ring_allreduce_time(S_, 2, 3.125e9, 30e-6))


@pytest.mark.parametrize("cluster,ranks", [
    (A100x32, range(32)), (A100x32, range(8)), (A100x32, [0, 9, 18, 27]), (A100x32, [0, 1, 8, 9, 16, 17]),
    (V100x16, range(16)), (V100x16, [3, 12]), (V100x16, [0, 1, 2, 8]), (FLAT, range(16)),
    (small_cluster(nics=2), range(8)), (cm.PortNetwork(1e9, 1e-5), range(5)),
])
def test_allreduce_steps_replay_the_closed_form(cluster, ranks):
    steps = cm.allreduce_steps(cluster, ranks, 1e8)
    assert cm.steps_time(cluster, steps) == pytest.approx(cm.allreduce_time(cluster, ranks, 1e8))
    # every rank sends and receives the same number of bytes in total
    sent = {}
    for st in steps:
        for s, _d, b in st:
            sent[s] = sent.get(s, 0) + b
    assert len(set(round(v) for v in sent.values())) == 1


def test_collective_fit_overrides_intra():
    c = small_cluster(collective=LinkSpec("fit", 1e9, 1e-4))
    assert cm.allreduce_time(c, range(4), 1e6) == pytest.approx(cm.ring_allreduce_time(1e6, 4, 1e9, 1e-4))


# ----------------------------------------------------------------------------- device mappings
def test_sequential_and_copies_same_node_mappings():
    c = small_cluster(nodes=2, dpn=4)
    bp = S.build("bitpipe", 8, 8)
    assert cm.sequential_map(bp, c) == tuple(range(8))
    dm = cm.map_copies_same_node(bp, c)
    assert dm == (0, 2, 4, 6, 7, 5, 3, 1)
    placed = c.place(bp, "copies-same-node")
    for s in range(bp.num_stages):
        assert len({placed.node_of(r) for r in bp.stage_group(s)}) == 1
    seq = c.place(bp, "sequential")
    assert any(len({seq.node_of(r) for r in bp.stage_group(s)}) == 2 for s in range(bp.num_stages))
    # the all-reduce of a stage pair is on NVLink under BitPipe's mapping
    assert cm.allreduce_time(placed, bp.stage_group(0), 1e9) < cm.allreduce_time(seq, bp.stage_group(0), 1e9) / 5


def test_mapping_single_copy_and_replicas():
    c = small_cluster(nodes=2, dpn=4)
    dp = S.build("dapple", 4, 4)
    assert cm.map_copies_same_node(dp, c) == (0, 1, 2, 3)
    ch = S.lower(S.build("chimera", 4, 4), replicas=2)
    assert cm.stage_sharing_groups(ch) == [[0, 3], [1, 2], [4, 7], [5, 6]]
    assert cm.stage_sharing_groups(ch, include_replicas=True) == [[0, 3, 4, 7], [1, 2, 5, 6]]
    dm = cm.map_copies_same_node(ch, c, include_replicas=True)
    assert {dm[r] // 4 for r in (0, 3, 4, 7)} == {0} and {dm[r] // 4 for r in (1, 2, 5, 6)} == {1}
    with pytest.raises(cm.SpecError, match="needs 16 ranks"):
        cm.sequential_map(S.lower(S.build("dapple", 8, 8), replicas=2), c)
    with pytest.raises(cm.SpecError, match="mapping"):
        c.place(dp, "random")


def test_device_map_validation():
    c = small_cluster()
    with pytest.raises(cm.SpecError, match="two ranks on device 1"):
        c.with_device_map([0, 1, 1])
    with pytest.raises(cm.SpecError, match="device_map entry 8"):
        c.with_device_map([8])
    m = c.with_device_map([4, 0])
    assert m.num_ranks == 2 and m.node_of(0) == 1 and [l.name for l in m.path(0, 1)] == ["n1.nic0.out", "n0.nic0.in"]


# ----------------------------------------------------------------------------- sizes and fabrics
def test_cluster_sizes():
    c = cm.load_cluster("dgx-h100-ib:128")
    assert (c.nodes, c.num_devices, c.name) == (128, 1024, "dgx-h100-ib:128")
    assert c.fabric == "rail" and c.nodes_per_leaf == 32 and c.inter.kind == "ib-ndr"
    assert cm.with_nodes(A100x32, 16).num_devices == 128
    assert cm.load_cluster("dgx-a100-4x8-ib:2").nodes == 2
    for bad in ("dgx-h100-ib:0", "dgx-h100-ib:x", "dgx-h100-ib:-3"):
        with pytest.raises(cm.SpecError, match="whole number >= 1"):
            cm.load_cluster(bad)
    with pytest.raises(cm.SpecError, match="whole number >= 1"):
        cm.with_nodes(A100x32, 0)
    for over in (0.5, float("nan"), float("inf")):
        with pytest.raises(cm.SpecError, match="oversubscription"):
            cm.with_fabric(A100x32, "fat-tree", over)
    with pytest.raises(cm.SpecError, match="unknown fabric"):
        cm.with_fabric(A100x32, "torus")


def test_fat_tree_paths_and_oversubscription():
    # 4 nodes, 2 per leaf, 1 NIC of 10 GB/s each, oversubscribed 2:1: a leaf has 2 x 10 GB/s down, 10 up
    c = small_cluster(nodes=4, fabric="fat-tree", nodes_per_leaf=2, oversubscription=2.0)
    inside = c.path(0, 4)             # node 0 -> node 1, one leaf
    assert [l.name for l in inside] == ["n0.nic0.out", "n1.nic0.in"]
    across = c.path(0, 8)             # node 0 -> node 2, leaf 0 -> leaf 1
    assert [l.name for l in across] == ["n0.nic0.out", "leaf0.up", "leaf1.down", "n2.nic0.in"]
    assert [l.bandwidth for l in across] == [10e9, 10e9, 10e9, 10e9]
    # two nodes of leaf 0 send to leaf 1 at once: the uplink halves each (the NICs alone would not)
    one = cm.step_time(c, [(0, 8, MB)])
    two = cm.step_time(c, [(0, 8, MB), (4, 12, MB)])
    assert two - 10e-6 == pytest.approx(2 * (one - 10e-6))
    flat = small_cluster(nodes=4)
    assert cm.step_time(flat, [(0, 8, MB), (4, 12, MB)]) == pytest.approx(one)
    assert {"leaf0.up", "leaf1.down"} <= {l.name for l in c.links()}


def test_rail_paths():
    c = small_cluster(nodes=4, dpn=4, nics=4, fabric="rail", nodes_per_leaf=2, oversubscription=4.0)
    # same rail (local 1 -> local 1) in one group: NIC to NIC through the rail switch
    assert [l.name for l in c.path(1, 5)] == ["n0.nic1.out", "n1.nic1.in"]
    # another rail, or another group: up to the spine and down; a rail switch has 2 nodes x 10 GB/s / 4
    p = c.path(3, 4)
    assert [l.name for l in p] == ["n0.nic3.out", "g0.rail3.up", "g0.rail0.down", "n1.nic0.in"]
    assert p[1].bandwidth == pytest.approx(2 * 10e9 / 4)
    assert [l.name for l in c.path(1, 9)] == ["n0.nic1.out", "g0.rail1.up", "g1.rail1.down", "n2.nic1.in"]
    names = {l.name for l in c.links()}
    assert {"g0.rail3.up", "g1.rail0.down"} <= names and len(names) == len(c.links())


def test_pod_paths_cross_the_spine():
    # 8 nodes of 4 GPUs and 4 NICs, rail groups of 2 nodes, pods of 4 nodes joined 7:1
    c = small_cluster(nodes=8, dpn=4, nics=4, fabric="rail", nodes_per_leaf=2, nodes_per_pod=4,
                      pod_oversubscription=7.0)
    # inside a pod: as without pods (one rail of one group; another group of the pod)
    assert [l.name for l in c.path(1, 5)] == ["n0.nic1.out", "n1.nic1.in"]
    assert [l.name for l in c.path(1, 9)] == ["n0.nic1.out", "g0.rail1.up", "g1.rail1.down", "n2.nic1.in"]
    # pod 0 -> pod 1: up the rail group, up the pod, down the other pod, down its rail group
    p = c.path(1, 16 + 2)
    assert [l.name for l in p] == ["n0.nic1.out", "g0.rail1.up", "pod0.up", "pod1.down", "g2.rail2.down",
                                   "n4.nic2.in"]
    # a pod's uplink: its 4 nodes x 4 NICs x 10 GB/s / 7
    assert p[2].bandwidth == pytest.approx(4 * 4 * 10e9 / 7) and p[3].bandwidth == p[2].bandwidth
    assert {"pod0.up", "pod0.down", "pod1.up", "pod1.down"} <= {l.name for l in c.links()}
    # the last pod may hold fewer nodes: its links are that much narrower
    c6 = cm.with_nodes(c, 6)
    assert c6.path(16, 0)[2].name == "pod1.up" and c6.path(16, 0)[2].bandwidth == pytest.approx(2 * 4 * 10e9 / 7)
    with pytest.raises(cm.SpecError, match=r"nodes_per_pod \(3\) must be a multiple of nodes_per_leaf \(2\)"):
        small_cluster(nodes=8, fabric="rail", nodes_per_leaf=2, nodes_per_pod=3)
    # the preset: Llama 3's spine ratio, pods of 1,024 nodes; round trip through a dict
    h = cm.load_cluster("h100-pods:16384")
    assert (h.nodes_per_pod, h.pod_oversubscription, h.num_devices) == (1024, 7.0, 131072)
    assert cm.cluster_from_dict(h.to_dict()) == h
    assert "pods of 1024 node(s) 7:1" in h.describe()
