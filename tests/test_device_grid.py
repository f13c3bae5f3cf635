"""The placement record (cost_models.cluster.DeviceGrid): what the rank -> device mappings read,
for a cluster and for the executor's torchrun nodes x processes per node alike."""
import dataclasses
import types

import pytest

import schedules as S
from cost_models import DeviceGrid, SpecError, load_cluster
from cost_models.cluster import MAPPINGS, map_copies_same_node, megatron_map, sequential_map
from executor.mesh import device_map_for


def lowered(name, D, N, R=1):
    return S.lower(S.build(name, D, N), replicas=R)


# (schedule, D, N, R, nodes, per node) -> (sequential, megatron): the maps the SimpleNamespace gave
MAPS = {
    ("dapple", 4, 4, 2, 2, 4): ((0, 1, 2, 3, 4, 5, 6, 7), (0, 2, 4, 6, 1, 3, 5, 7)),
    ("dapple", 2, 4, 3, 3, 2): ((0, 1, 2, 3, 4, 5), (0, 3, 1, 4, 2, 5)),
    ("gpipe", 4, 4, 1, 1, 8): ((0, 1, 2, 3), (0, 1, 2, 3)),
    ("bitpipe", 4, 4, 2, 4, 2): ((0, 1, 2, 3, 4, 5, 6, 7), (0, 2, 4, 6, 1, 3, 5, 7)),
}


@pytest.mark.parametrize("key", list(MAPS))
def test_sequential_and_megatron_maps_are_the_same_lists_on_the_grid(key):
    name, D, N, R, nodes, per_node = key
    low = lowered(name, D, N, R)
    seq, meg = MAPS[key]
    grid = DeviceGrid(nodes, per_node)
    assert sequential_map(low, grid) == seq
    assert megatron_map(low, grid) == meg
    # the executor's torchrun placement lays the same mapping over the same grid
    assert device_map_for("sequential", low, nodes, per_node) == seq
    assert device_map_for("megatron", low, nodes, per_node) == meg


def test_a_cluster_maps_through_its_grid():
    cl = load_cluster("dgx-a100-4x8-ib")
    assert cl.grid == DeviceGrid(4, 8, "cluster 'dgx-a100-4x8-ib'")
    assert cl.grid.num_devices == 32 == cl.num_devices
    low = lowered("bitpipe", 8, 8, 2)
    for name, mapping in MAPPINGS.items():
        assert mapping(low, cl) == mapping(low, cl.grid), name
        assert cl.place(low, name).device_map == mapping(low, DeviceGrid(4, 8)), name
    assert megatron_map(low, cl) == tuple((r % 8) * 2 + r // 8 for r in range(16))


def test_copies_same_node_on_torchruns_two_by_two():
    low = lowered("bitpipe", 4, 4)
    assert map_copies_same_node(low, DeviceGrid(2, 2)) == (0, 2, 3, 1) == device_map_for("copies-same-node", low, 2, 2)


@pytest.mark.parametrize("nodes, per_node, field, got", [(0, 8, "nodes", "0"), (2, True, "devices_per_node", "True"),
                                                         (1.5, 8, "nodes", "1.5")])
def test_a_bad_grid_is_one_line_naming_the_field(nodes, per_node, field, got):
    with pytest.raises(SpecError, match=rf"^torchrun: field '{field}' must be an integer >= 1; got {got}$"):
        DeviceGrid(nodes, per_node, "torchrun")


def test_the_grid_is_frozen_and_a_pretend_cluster_is_refused():
    grid = DeviceGrid(2, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        grid.nodes = 3
    low = lowered("dapple", 4, 4)
    with pytest.raises(TypeError, match="takes a DeviceGrid or a Cluster; got SimpleNamespace"):
        sequential_map(low, types.SimpleNamespace(nodes=2, devices_per_node=4, num_devices=8, name="x"))


def test_too_few_devices_names_the_grid():
    low = lowered("dapple", 4, 4, 2)
    with pytest.raises(SpecError, match=r"needs 8 ranks \(4 devices x 2 replicas\) but torchrun 1x2 has 2 devices"):
        megatron_map(low, DeviceGrid(1, 2, "torchrun 1x2"))
    with pytest.raises(ValueError, match="but torchrun 1x4 has 4 devices"):
        device_map_for("sequential", low, 1, 4)
