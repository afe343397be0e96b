"""dtp.topology.mesh against PyTorch: the coordinates, groups and mesh arguments of a layout are what
init_device_mesh builds on a gloo world, for several shapes and orders, EP carved out of DP
included; and the links follow the nodes."""
import itertools

import pytest

from dtp.topology import mesh as topology
from dtp.common.world import run_world


def _mesh_on_rank(rank, world_size, layouts):
    return [topology.mesh_groups_on_rank(rank, world_size, sizes, order) for sizes, order in layouts]


# Each world runs several layouts of its size (one gloo world, several meshes).
WORLDS = {
    8: [({"tp": 2, "pp": 2, "dp": 2}, ("tp", "pp", "dp")),
        ({"tp": 2, "pp": 2, "dp": 2}, ("dp", "tp", "pp")),
        ({"tp": 2, "pp": 1, "dp": 4, "ep": 2}, ("tp", "ep", "pp", "dp")),
        ({"tp": 2, "pp": 1, "dp": 4, "ep": 2}, ("dp", "pp", "tp", "ep")),
        ({"tp": 1, "pp": 2, "dp": 4, "ep": 4}, ("ep", "tp", "pp", "dp"))],
    12: [({"tp": 3, "pp": 2, "dp": 2}, ("pp", "dp", "tp")),
         ({"tp": 2, "cp": 3, "dp": 2}, ("tp", "cp", "dp")),
         ({"tp": 2, "pp": 1, "dp": 6, "ep": 3}, ("tp", "ep", "pp", "dp"))],
}


@pytest.fixture(scope="module")
def meshes():
    return {n: run_world(_mesh_on_rank, n, (layouts,), timeout_s=120) for n, layouts in WORLDS.items()}


@pytest.mark.parametrize("n, index", [(n, i) for n, layouts in WORLDS.items() for i in range(len(layouts))],
                         ids=lambda value: str(value))
def test_groups_and_coordinates_are_init_device_mesh_s(meshes, n, index):
    sizes, order = WORLDS[n][index]
    groups = topology.parallel_groups(sizes, order)
    shape, names = topology.device_mesh_arguments(sizes, order)
    for rank in range(n):
        from_torch = meshes[n][rank][index]
        coordinates = topology.rank_coordinates(rank, sizes, order)
        assert from_torch.pop("coordinate") == [coordinates[name] for name in names]
        for name, ranks in from_torch.items():
            assert [group for group in groups[name] if rank in group] == [ranks], (name, rank)
        assert topology.coordinates_to_rank(coordinates, sizes, order) == rank


def test_the_course_order_puts_tp_on_consecutive_ranks_and_dp_outermost():
    sizes = {"tp": 8, "pp": 8, "dp": 16}
    groups = topology.parallel_groups(sizes, ("tp", "pp", "dp"))
    assert groups["tp"][0] == list(range(8))
    assert groups["pp"][0] == list(range(0, 64, 8))
    assert groups["dp"][0] == list(range(0, 1024, 64))
    assert topology.dimension_links(sizes, ("tp", "pp", "dp"), 8) == {
        "tp": topology.INTRA_NODE, "pp": topology.INTER_NODE, "dp": topology.INTER_NODE}


def test_ep_carved_out_of_dp_keeps_the_world_and_leaves_the_node_when_tp_fills_it():
    """The source notes' 1024 GPUs: TP 8, EP 8 inside DP 16, PP 8."""
    sizes, order = {"tp": 8, "pp": 8, "dp": 16, "ep": 8}, topology.COURSE_ORDER
    assert topology.world_size(sizes) == 1024
    groups = topology.parallel_groups(sizes, order)
    assert groups["ep"][0] == list(range(0, 64, 8))  # 8 ranks, 8 apart: 8 nodes
    assert topology.nodes_spanned(groups["ep"][0], 8) == 8
    assert groups["expert_dp"][0] == [0, 512]  # each expert shard on 16/8 = 2 GPUs
    assert len(groups["dp"][0]) == 16 and set(groups["ep"][0]) < set(groups["dp"][0])
    with_tp1 = topology.parallel_groups({"tp": 1, "pp": 8, "dp": 128, "ep": 8}, order)
    assert topology.nodes_spanned(with_tp1["ep"][0], 8) == 1


@pytest.mark.parametrize("sizes", [{"tp": 2, "pp": 3, "dp": 4}, {"tp": 3, "pp": 1, "dp": 4, "ep": 2},
                                   {"tp": 1, "cp": 2, "dp": 6, "ep": 3}])
def test_every_rank_is_in_exactly_one_group_of_each_dimension_in_every_order(sizes):
    n = topology.world_size(sizes)
    for order in itertools.permutations(sizes):
        for name, groups in topology.parallel_groups(sizes, order).items():
            assert sorted(rank for group in groups for rank in group) == list(range(n)), (order, name)
            for group in groups:  # a group varies only its own dimension(s)
                coordinates = [topology.rank_coordinates(rank, sizes, order) for rank in group]
                fixed = [k for k in coordinates[0] if k not in (name, "dp", "ep", "expert_dp")]
                assert all(c[k] == coordinates[0][k] for c in coordinates for k in fixed)


@pytest.mark.parametrize("sizes, order, gpus_per_node, expected", [
    ({"tp": 3, "pp": 2, "dp": 2}, ("tp", "pp", "dp"), 4, {"tp": "inter-node", "pp": "inter-node", "dp": "inter-node"}),
    ({"tp": 2, "pp": 2, "dp": 2}, ("tp", "pp", "dp"), 4, {"tp": "intra-node", "pp": "intra-node", "dp": "inter-node"}),
    ({"tp": 2, "pp": 2, "dp": 2}, ("dp", "pp", "tp"), 4, {"tp": "inter-node", "pp": "intra-node", "dp": "intra-node"}),
    ({"tp": 2, "pp": 1, "dp": 8, "ep": 2}, ("tp", "ep", "pp", "dp"), 4,
     {"tp": "intra-node", "ep": "intra-node", "pp": "intra-node", "expert_dp": "inter-node", "dp": "inter-node"}),
])
def test_links(sizes, order, gpus_per_node, expected):
    assert topology.dimension_links(sizes, order, gpus_per_node) == expected


def test_a_layout_must_name_each_dimension_once_and_ep_must_divide_dp():
    with pytest.raises(ValueError, match="once"):
        topology.parallel_groups({"tp": 2, "dp": 2}, ("tp", "tp"))
    with pytest.raises(ValueError, match="carved out of DP"):
        topology.parallel_groups({"tp": 2, "dp": 3, "ep": 2}, ("tp", "ep", "dp"))
