"""Topology: where each rank sits in a multi-dimensional layout, the process groups of each
dimension, and which link each group's traffic rides.

Conventions (the chapter's, stated once):
- A layout is `sizes`, a dict of dimension sizes such as {"tp": 8, "pp": 8, "dp": 16}, and
  `order`, the dimensions from innermost to outermost. The course's order is TP innermost, then
  EP (or CP), PP, and DP outermost: `COURSE_ORDER`.
- Ranks are numbered in mixed radix: the innermost dimension varies fastest. With order
  ("tp", "pp", "dp"), rank = tp + t·(pp + p·dp).
- Expert parallelism is carved out of data parallelism, not multiplied into the world: with
  {"dp": d, "ep": e} (e divides d) the d data-parallel ranks are factored into e (placed where
  "ep" is in the order) times d/e (placed where "dp" is). The ranks that differ only in the
  first factor form an EP group (they hold different experts and exchange tokens); those that
  differ only in the second an "expert_dp" group (they hold the same experts and average their
  gradients); a rank's "dp" coordinate is its position in its whole DP group, ranks sorted.
- `torch.distributed.device_mesh.init_device_mesh` takes the dimensions outermost first (its
  mesh is a row-major array: the last dimension varies fastest), so its shape is the order
  reversed; `device_mesh_arguments` gives it, and with EP the DP group is the mesh's "ep" and
  "expert_dp" dimensions flattened.
- Nodes hold consecutive ranks: GPUs 0..g-1 are node 0, and so on. A dimension's traffic is
  "intra-node" (NVLink class) when every one of its groups lies inside one node, "inter-node"
  (the network) otherwise.

tests/topology/test_topology_layout.py checks these functions against init_device_mesh on gloo worlds.
"""
from __future__ import annotations

import functools
import math

import numpy as np

COURSE_ORDER = ("tp", "ep", "pp", "dp")  # innermost first
INTRA_NODE, INTER_NODE = "intra-node", "inter-node"


def _check(sizes: dict[str, int], order) -> None:
    names = set(sizes)
    if set(order) != names or len(order) != len(names):
        raise ValueError(f"order {tuple(order)} must name each dimension of {sorted(names)} once")
    if any(int(size) < 1 for size in sizes.values()):
        raise ValueError(f"sizes must be positive: {sizes}")
    if "ep" in sizes and ("dp" not in sizes or sizes["dp"] % sizes["ep"]):
        raise ValueError(f"ep = {sizes.get('ep')} must divide dp = {sizes.get('dp')}: EP is carved out of DP")


def factors(sizes: dict[str, int], order) -> list[tuple[str, int]]:
    """The dimensions the ranks are laid out along, innermost first, as (mesh name, size): with
    EP, "dp" stands for the d/e part of data parallelism left once EP is carved out of it, which
    the mesh calls "expert_dp"."""
    _check(sizes, order)
    if "ep" not in sizes:
        return [(name, int(sizes[name])) for name in order]
    rest = sizes["dp"] // sizes["ep"]
    return [("expert_dp", rest) if name == "dp" else (name, int(sizes[name])) for name in order]


def world_size(sizes: dict[str, int]) -> int:
    """Ranks in the layout: the product of the sizes, EP excluded (it lives inside DP)."""
    return math.prod(int(size) for name, size in sizes.items() if name != "ep")


def rank_coordinates(rank: int, sizes: dict[str, int], order) -> dict[str, int]:
    """Coordinates of `rank`: one per dimension in `sizes`, plus "expert_dp" with EP."""
    if not 0 <= rank < world_size(sizes):
        raise ValueError(f"rank {rank} is outside a world of {world_size(sizes)}")
    coordinates, rest, laid_out = {}, rank, factors(sizes, order)
    for name, size in laid_out:
        coordinates[name] = rest % size
        rest //= size
    if "ep" in sizes:  # the position in the DP group: its two factors, in their order
        first, second = [name for name, _ in laid_out if name in ("ep", "expert_dp")]
        coordinates["dp"] = coordinates[first] + dict(laid_out)[first] * coordinates[second]
    return coordinates


def coordinates_to_rank(coordinates: dict[str, int], sizes: dict[str, int], order) -> int:
    """The inverse of `rank_coordinates` (uses the laid-out coordinates: tp, pp, ep, expert_dp, ...)."""
    rank = 0
    for name, size in reversed(factors(sizes, order)):
        rank = rank * size + coordinates[name]
    return rank


def _rank_grid(sizes: dict[str, int], order) -> tuple[np.ndarray, list[str]]:
    """All ranks as an array with one axis per laid-out dimension, outermost first (the
    DeviceMesh's view), and the axes' names."""
    laid_out = list(reversed(factors(sizes, order)))
    return np.arange(world_size(sizes)).reshape([size for _, size in laid_out]), [name for name, _ in laid_out]


def _groups_along(names: tuple[str, ...], sizes: dict[str, int], order) -> np.ndarray:
    """One row per group of ranks that differ only along the laid-out dimensions `names`,
    ranks ascending within a row, rows in ascending order of their first rank."""
    grid, axis_names = _rank_grid(sizes, order)
    axes = sorted(axis_names.index(name) for name in names)
    kept = [axis for axis in range(grid.ndim) if axis not in axes]
    groups = np.transpose(grid, kept + axes).reshape(-1, math.prod(grid.shape[a] for a in axes))
    return groups[np.argsort(groups[:, 0])]


def parallel_groups(sizes: dict[str, int], order) -> dict[str, list[list[int]]]:
    """Every process group of each dimension: {"tp": [[0, 1], [2, 3], ...], ...}, each group's
    ranks sorted and the groups sorted by their first rank. With EP: "dp" is the whole DP group
    (dense gradients), "ep" the groups exchanging tokens, "expert_dp" the groups averaging the
    experts' gradients."""
    return {name: _groups_along(along, sizes, order).tolist()
            for name, along in _group_dimensions(sizes, order).items()}


def _group_dimensions(sizes: dict[str, int], order) -> dict[str, tuple[str, ...]]:
    """Each group name and the laid-out dimensions its groups vary along."""
    along = {name: (name,) for name, _ in factors(sizes, order)}
    return {**along, "dp": ("ep", "expert_dp")} if "ep" in sizes else along


def device_mesh_arguments(sizes: dict[str, int], order) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(mesh_shape, mesh_dim_names) for init_device_mesh("cpu", ...): outermost first."""
    laid_out = list(reversed(factors(sizes, order)))
    return tuple(size for _, size in laid_out), tuple(name for name, _ in laid_out)


def dimension_links(sizes: dict[str, int], order, gpus_per_node: int) -> dict[str, str]:
    """For each group name of `parallel_groups`: INTRA_NODE if every group lies inside one node
    of `gpus_per_node` consecutive ranks, INTER_NODE otherwise."""
    return dict(_links(tuple(sizes.items()), tuple(order), gpus_per_node))


@functools.lru_cache(maxsize=4096)
def _links(size_items: tuple, order: tuple, gpus_per_node: int) -> tuple:
    sizes, links = dict(size_items), []
    for name, along in _group_dimensions(sizes, order).items():
        nodes = _groups_along(along, sizes, order) // gpus_per_node
        links.append((name, INTRA_NODE if np.all(nodes == nodes[:, :1]) else INTER_NODE))
    return tuple(links)


def nodes_spanned(group: list[int], gpus_per_node: int) -> int:
    """How many nodes the ranks of one group sit on."""
    return len({rank // gpus_per_node for rank in group})


def mesh_groups_on_rank(rank: int, world: int, sizes: dict[str, int], order) -> dict[str, list[int]]:
    """Inside a gloo rank: build the layout's DeviceMesh with init_device_mesh and return the
    ranks of this rank's group along each dimension, read back from the process groups torch
    created (with EP, the DP group is the "ep" and "expert_dp" dimensions flattened)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = device_mesh_arguments(sizes, order)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    groups = {name: sorted(dist.get_process_group_ranks(mesh.get_group(name))) for name in names}
    if "ep" in sizes:
        both = tuple(name for name in names if name in ("ep", "expert_dp"))  # in the mesh's order
        groups["dp"] = sorted(dist.get_process_group_ranks(mesh[both]._flatten("dp").get_group()))
    groups["coordinate"] = list(mesh.get_coordinate())
    return groups
