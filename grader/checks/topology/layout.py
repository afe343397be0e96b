"""Exercises 1 and 2 of the topology chapter: rank <-> coordinates, process groups and the
device mesh of a layout, and which link each dimension's traffic rides."""
from __future__ import annotations

import math

import numpy as np
import torch.distributed as dist

from dtp.topology import mesh as topology

from ...compare import CheckFailed, expect
from ...registry import Check, exercise
from ..common import completed_worlds, raise_world_failure, run_worlds

LAYOUT_REFERENCES = ("dtp.topology.mesh.rank_coordinates", "dtp.topology.mesh.parallel_groups",
                     "dtp.topology.mesh.device_mesh_arguments", "dtp.topology.mesh.coordinates_to_rank",
                     "dtp.topology.mesh.factors", "dtp.topology.mesh.mesh_groups_on_rank")
LINK_REFERENCES = ("dtp.topology.mesh.dimension_links", "dtp.topology.mesh._links")  # _links: its cached body


def _describe_layout(sizes: dict, order) -> str:
    return f"sizes {sizes}, order {tuple(order)}"


def _as_ints(value) -> list | None:
    """A list of Python ints from a list, tuple or array of integers, or None."""
    try:
        items = list(np.asarray(value).reshape(-1).tolist()) if isinstance(value, np.ndarray) else list(value)
    except TypeError:
        return None
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in items):
        return None
    return [int(v) for v in items]


def _normalised_groups(groups, what: str) -> list[list[int]]:
    expect(isinstance(groups, (list, tuple, np.ndarray)), f"{what} should be a list of groups (lists of ranks)")
    result = []
    for group in groups:
        ranks = _as_ints(group)
        expect(ranks is not None, f"{what} should hold lists of integer ranks")
        result.append(ranks)
    return result



# --- 1. rank <-> coordinates, groups, the device mesh ----------------------------------------------

def _random_layout(rng, with_ep: bool) -> tuple[dict, list]:
    """A layout of 2 to 64 ranks in a random order; with EP, DP is 2·e or more."""
    names = ["tp", "pp", "dp"] + (["cp"] if rng.random() < 0.3 and not with_ep else [])
    while True:
        sizes = {name: int(rng.integers(1, 5)) for name in names}
        if with_ep:
            sizes["ep"] = int(rng.integers(2, 4))
            sizes["dp"] = sizes["ep"] * int(rng.integers(2, 4))
        if 2 <= topology.world_size(sizes) <= 64 and sum(size > 1 for size in sizes.values()) >= 2 + with_ep:
            order = list(sizes)
            rng.shuffle(order)
            return sizes, order


def _orders_to_avoid(sizes: dict) -> set[tuple]:
    """Orders an answer that ignores `order` would use instead: the course's (TP innermost, then
    EP or CP, PP, DP outermost), the one `sizes` lists, alphabetical, and each of them reversed."""
    course = [name for name in ("tp", "ep", "cp", "pp", "dp") if name in sizes]
    fixed = [tuple(course), tuple(sizes), tuple(sorted(sizes))]
    return set(fixed) | {order[::-1] for order in fixed}


def _layout_with(rng, sizes: dict, accept) -> tuple[dict, list]:
    """`sizes` listed in a random order, and a random order of the dimensions that `accept`s and
    that no answer ignoring `order` would use."""
    names = list(sizes)
    rng.shuffle(names)
    sizes = {name: sizes[name] for name in names}
    while True:
        order = [str(name) for name in rng.permutation(names)]
        if tuple(order) not in _orders_to_avoid(sizes) and accept(order):
            return sizes, order


def _separating_layouts(rng) -> list[tuple[dict, list]]:
    """Layouts that separate the right answer from its known near-misses in every grading."""
    def small(low=2, high=4):
        return int(rng.integers(low, high))

    while True:  # all four dimensions larger than 1; CP anywhere but outermost
        four = {"tp": small(), "pp": small(), "dp": small(), "cp": small()}
        if topology.world_size(four) <= 64:
            break
    one = str(rng.choice(["tp", "pp", "dp"]))  # a dimension of size 1, and CP innermost
    with_a_one = {"tp": small(2, 5), "pp": small(2, 5), "dp": small(2, 4), "cp": small(), one: 1}
    ep = small()
    ep_sizes = {"tp": small(1, 3), "pp": small(1, 3), "dp": ep * small(), "ep": ep}
    return [_layout_with(rng, four, lambda order: order[-1] != "cp"),
            _layout_with(rng, with_a_one, lambda order: order[0] == "cp"),
            _layout_with(rng, {"tp": small(), "pp": small(), "dp": small()}, lambda order: True),
            _layout_with(rng, ep_sizes, lambda order: order.index("ep") < order.index("dp")),  # EP inside
            _layout_with(rng, dict(ep_sizes), lambda order: order.index("ep") > order.index("dp"))]  # and outside


def _mesh_on_rank(rank, world_size, shape, names, flatten):
    """init_device_mesh with the learner's arguments; this rank's group along each named
    dimension (and along the flattened dimensions `flatten`, as "dp"), read from torch."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
    groups = {name: sorted(dist.get_process_group_ranks(mesh.get_group(name))) for name in names}
    if flatten:
        groups["dp"] = sorted(dist.get_process_group_ranks(mesh[tuple(flatten)]._flatten("dp").get_group()))
    return groups


REVERSED_ORDER_HINT = (" Your answer is the one for the order reversed: `order` lists the dimensions innermost first "
                       "(its first dimension varies fastest: with TP first, ranks 0, 1, ... differ only in TP)")


@exercise("topology.rank_layout", points=3)
class RankLayout(Check):
    """Verifies: for random layouts of 2 to 64 ranks in random orders, every rank's coordinates, every group of every
    dimension ("expert_dp" and the whole "dp" with EP), and init_device_mesh's arguments; the
    arguments are then given to init_device_mesh on an 8- to 12-rank gloo world with EP, whose
    process groups (read back from torch) must be the layout's. Every grading draws the layouts
    that tell the known near-misses apart (`_separating_layouts`): a "cp" dimension larger than 1,
    inside other dimensions (an answer that ignores a dimension it does not know, or puts it
    outermost), orders that are neither the course's nor the one `sizes` lists (an answer that
    ignores `order`), a dimension of size 1, and EP laid out both inside and outside DP's other
    factor (the two readings of the "dp" coordinate).
    Fakes: dtp.topology.mesh trips; a table cannot match random layouts; patching DeviceMesh in the
    sandbox gains nothing, since the arguments are compared with the oracle's directly.
    """

    reads = ("rank_coordinates", "parallel_groups", "device_mesh_arguments")
    references = LAYOUT_REFERENCES
    timeout_s = 40
    runs_world = True
    preimport = ()  # its ranks use no optimizer and no module that imports torch._dynamo (measured)

    def prepare(self, rng):
        layouts = _separating_layouts(rng) + [_random_layout(rng, with_ep=False), _random_layout(rng, with_ep=True)]
        while True:  # the world: EP, and world size 8 or 12
            sizes, order = _random_layout(rng, with_ep=True)
            if topology.world_size(sizes) in (8, 12):
                return {"layouts": layouts, "world": (sizes, order)}

    def collect(self, student, inputs):
        answers = []
        for sizes, order in inputs["layouts"] + [inputs["world"]]:
            n = topology.world_size(sizes)
            coordinates = [student.rank_coordinates(rank, dict(sizes), list(order)) for rank in range(n)]
            answers.append({"coordinates": coordinates,
                            "groups": student.parallel_groups(dict(sizes), list(order)),
                            "mesh": student.device_mesh_arguments(dict(sizes), list(order))})
        sizes, order = inputs["world"]
        shape, names = _mesh_answer(answers[-1]["mesh"], "device_mesh_arguments")
        flatten = [name for name in names if name in ("ep", "expert_dp")]
        if len(flatten) != 2 or math.prod(shape) != topology.world_size(sizes):
            return {"answers": answers, "mesh_groups": None}  # the judge explains what is wrong with the arguments
        worlds = run_worlds(_mesh_on_rank, [(topology.world_size(sizes), (shape, names, flatten))])
        return {"answers": answers, "mesh_groups": worlds}

    def judge(self, inputs, data) -> str:
        layouts = inputs["layouts"] + [inputs["world"]]
        for (sizes, order), answer in zip(layouts, data["answers"]):
            _judge_coordinates(sizes, order, answer["coordinates"])
            _judge_groups(sizes, order, answer["groups"])
            _judge_mesh_arguments(sizes, order, answer["mesh"])
        done, failure = completed_worlds(data["mesh_groups"])
        raise_world_failure(failure)
        sizes, order = inputs["world"]
        expected = topology.parallel_groups(sizes, order)
        for rank, groups in enumerate(done[0]):
            for name, ranks in groups.items():
                mine = next(group for group in expected[name] if rank in group)
                expect(list(ranks) == mine, f"init_device_mesh with your arguments for "
                                            f"{_describe_layout(sizes, order)} gives rank {rank} the {name} group "
                                            f"{list(ranks)}, not {mine}")
        return ("coordinates, groups and init_device_mesh arguments are right for random layouts and orders (cp, "
                "dimensions of size 1, and EP carved out of DP, inside and outside its other factor), and "
                "init_device_mesh with your arguments builds the layout's groups on gloo")


def _mesh_answer(answer, what: str) -> tuple[list[int], list[str]]:
    expect(isinstance(answer, (tuple, list)) and len(answer) == 2, f"{what} should return (mesh_shape, mesh_dim_names)")
    shape, names = _as_ints(answer[0]), list(answer[1]) if isinstance(answer[1], (list, tuple)) else None
    expect(shape is not None and names is not None and all(isinstance(n, str) for n in names),
           f"{what} should return a tuple of ints and a tuple of names")
    return shape, names


def _without(sizes: dict, name: str) -> dict | None:
    """The layout with dimension `name` treated as size 1 (as an answer that ignores it lays the
    ranks out), or None where that is no layout (DP under EP)."""
    reduced = {**sizes, name: 1}
    try:
        topology.factors(reduced, list(sizes))
    except ValueError:
        return None
    return reduced


def _ignored_dimension(sizes: dict, matches) -> str | None:
    """The dimension (larger than 1) whose omission gives the answer: `matches(reduced_sizes)`."""
    for name, size in sizes.items():
        reduced = _without(sizes, name) if name != "ep" and size > 1 else None
        if reduced is not None and matches(reduced):
            return name
    return None


def _ignored_hint(name: str) -> str:
    return (f" That is the layout with {name!r} left out: every dimension of `sizes` ({name!r} too, whatever its "
            "name) multiplies into the world and is laid out where `order` puts it")


def _judge_coordinates(sizes, order, coordinates) -> None:
    n = topology.world_size(sizes)
    what = _describe_layout(sizes, order)
    expect(isinstance(coordinates, list) and len(coordinates) == n, f"rank_coordinates: one dict per rank ({n})")
    for rank, answer in enumerate(coordinates):
        expected = topology.rank_coordinates(rank, sizes, order)
        expect(isinstance(answer, dict), f"rank_coordinates({rank}, {what}) should return a dict")
        if "ep" in sizes and "expert_dp" not in answer and \
                {k: answer.get(k) for k in sizes} == _ep_multiplied_coordinates(rank, sizes, order):
            raise CheckFailed(f"rank_coordinates({rank}, {what}) = {answer}: that lays EP out as a dimension of "
                              "its own, "
                              f"as if the world had tp·pp·dp·ep ranks. EP is carved out of DP: the world has "
                              f"{n} ranks, and DP's {sizes['dp']} ranks are factored into ep = {sizes['ep']} times "
                              f"expert_dp = {sizes['dp'] // sizes['ep']}")
        keys = set(answer)
        if keys != set(expected):
            missing, extra = sorted(set(expected) - keys), sorted(keys - set(expected))
            unknown = [name for name in missing if name not in ("tp", "pp", "dp", "ep", "expert_dp")]
            raise CheckFailed(f"rank_coordinates({rank}, {what}) has keys {sorted(keys)}: "
                              + (f"missing {missing}" if missing else "") + (f" unexpected {extra}" if extra else "")
                              + ("; with EP, give \"dp\" (the position in the whole DP group), \"ep\" and "
                                 "\"expert_dp\"" if "ep" in sizes else "")
                              + (f"; every dimension of `sizes` has a coordinate, {unknown[0]!r} too" if unknown else ""))
        if {k: answer[k] for k in expected} != expected:
            wrong = [k for k in expected if answer[k] != expected[k]]
            hint = REVERSED_ORDER_HINT if "ep" not in sizes and \
                answer == topology.rank_coordinates(rank, sizes, list(reversed(order))) else ""
            ignored = _ignored_dimension(sizes, lambda reduced: all(  # every rank the smaller layout has
                coordinates[r] == topology.rank_coordinates(r, reduced, order) for r in range(topology.world_size(reduced))))
            if ignored:
                hint = _ignored_hint(ignored)
            if "ep" in sizes and "dp" in wrong and all(answer[k] == expected[k] for k in expected if k != "dp"):
                hint = (" Only \"dp\" is wrong: it is the rank's position in its whole DP group (ranks sorted), made "
                        "of its \"ep\" and \"expert_dp\" coordinates in the order they are laid out")
            raise CheckFailed(f"rank_coordinates({rank}, {what}) = {answer}, expected {expected}.{hint}")


def _ep_multiplied_coordinates(rank: int, sizes: dict, order) -> dict:
    """The mixed-radix digits of `rank` with EP as a dimension of its own (the known mistake)."""
    digits = {}
    for name in order:
        rank, digits[name] = divmod(rank, sizes[name])
    return digits


def _judge_groups(sizes, order, groups) -> None:
    what = _describe_layout(sizes, order)
    expected = topology.parallel_groups(sizes, order)
    expect(isinstance(groups, dict) and set(groups) == set(expected),
           f"parallel_groups({what}) should return a dict with keys {sorted(expected)}, not "
           f"{sorted(groups) if isinstance(groups, dict) else type(groups).__name__}"
           + (" (with EP: \"dp\", \"ep\" and \"expert_dp\")" if "ep" in sizes else "")
           + (f"; every dimension of `sizes` has its groups, {sorted(set(sizes) - set(groups))[0]!r} too"
              if isinstance(groups, dict) and set(sizes) - set(groups) else ""))
    n = topology.world_size(sizes)
    for name, right in expected.items():
        answer = _normalised_groups(groups[name], f"parallel_groups({what})[{name!r}]")
        if answer == right:
            continue
        if any(rank >= n for group in answer for rank in group):
            raise CheckFailed(f"parallel_groups({what})[{name!r}] holds rank {max(max(g) for g in answer)}, but the "
                              f"world has {n} ranks: EP is carved out of DP, so tp·pp·dp GPUs in all, not "
                              "tp·pp·dp·ep")
        if sorted(sorted(group) for group in answer) == right:
            raise CheckFailed(f"parallel_groups({what})[{name!r}] has the right groups in another form: sort each "
                              "group's ranks, and the groups by their first rank")
        hint = ""
        ignored = _ignored_dimension(sizes, lambda reduced: answer == topology.parallel_groups(reduced, order)[name])
        if ignored:
            hint = _ignored_hint(ignored)
        elif "ep" not in sizes and answer == topology.parallel_groups(sizes, list(reversed(order)))[name]:
            hint = REVERSED_ORDER_HINT
        elif "ep" in sizes and name == "dp" and answer == expected.get("expert_dp"):
            hint = (" That is the expert_dp group: the whole DP group holds the ranks that differ in either of DP's "
                    "two factors, ep and expert_dp")
        raise CheckFailed(f"parallel_groups({what})[{name!r}]: {_first_difference(answer, right)}.{hint}")


def _first_difference(answer: list, right: list) -> str:
    """The first group that differs, not the whole lists: a world of 54 ranks has groups enough to
    push the diagnosis past the one-line feedback's length."""
    for index, (got, wanted) in enumerate(zip(answer, right)):
        if got != wanted:
            return f"group {index} of {len(answer)} is {got}, expected {wanted}"
    return f"{len(answer)} groups, expected {len(right)}"


def _judge_mesh_arguments(sizes, order, answer) -> None:
    what = _describe_layout(sizes, order)
    shape, names = _mesh_answer(answer, f"device_mesh_arguments({what})")
    right_shape, right_names = topology.device_mesh_arguments(sizes, order)
    if (tuple(shape), tuple(names)) == (right_shape, right_names):
        return
    if tuple(reversed(shape)) == right_shape and tuple(reversed(names)) == right_names:
        raise CheckFailed(f"device_mesh_arguments({what}) = {tuple(shape)}, {tuple(names)}: init_device_mesh takes "
                          "the dimensions outermost first (its last dimension varies fastest), the order reversed")
    left_out = [name for name in right_names if name not in names]
    if left_out and [n for n in right_names if n in names] == list(names):
        raise CheckFailed(f"device_mesh_arguments({what}) = {tuple(shape)}, {tuple(names)}, expected {right_shape}, "
                          f"{right_names}: {left_out[0]!r} is missing; every dimension of `sizes` is a dimension of "
                          "the mesh")
    raise CheckFailed(f"device_mesh_arguments({what}) = {tuple(shape)}, {tuple(names)}, expected {right_shape}, "
                      f"{right_names}" + (" (with EP the mesh has \"ep\" of size e and \"expert_dp\" of size dp/e)"
                                          if "ep" in sizes else ""))



# --- 2. which link each dimension rides -----------------------------------------------------------

@exercise("topology.links", points=2)
class Links(Check):
    """Verifies: "intra-node" or "inter-node" for every group name of random layouts (EP
    included) on nodes of 2, 4 or 8 GPUs, among them layouts whose groups straddle a node
    boundary (TP = 3 on nodes of 4) and the source notes' 1024-GPU layout.
    Fakes: dtp.topology.mesh.dimension_links trips; random layouts.
    """

    reads = ("dimension_links",)
    references = LINK_REFERENCES + LAYOUT_REFERENCES
    timeout_s = 15

    def prepare(self, rng):
        cases = [({"tp": 8, "pp": 8, "dp": 16, "ep": 8}, ["tp", "ep", "pp", "dp"], 8),
                 ({"tp": 3, "pp": 2, "dp": 2}, ["tp", "pp", "dp"], 4)]
        for with_ep in (False, False, True, True):
            sizes, order = _random_layout(rng, with_ep)
            cases.append((sizes, order, int(rng.choice([2, 4, 8]))))
        return cases

    def collect(self, student, cases):
        return [student.dimension_links(dict(sizes), list(order), g) for sizes, order, g in cases]

    def judge(self, cases, answers) -> str:
        for (sizes, order, g), answer in zip(cases, answers):
            what = f"dimension_links({sizes}, {tuple(order)}, gpus_per_node={g})"
            expected = topology.dimension_links(sizes, order, g)
            expect(isinstance(answer, dict) and set(answer) == set(expected),
                   f"{what} should give a link for each group name {sorted(expected)}")
            for name, link in expected.items():
                if answer[name] == link:
                    continue
                groups = topology.parallel_groups(sizes, order)[name]
                straddling = next((grp for grp in groups if topology.nodes_spanned(grp, g) > 1), None)
                reason = (f"its group {straddling} spans nodes {sorted({r // g for r in straddling})}" if straddling
                          else f"each of its groups (e.g. {groups[0]}) lies inside one node of {g} consecutive ranks")
                raise CheckFailed(f"{what}[{name!r}] is {answer[name]!r}, expected {link!r}: {reason}")
        return "every dimension's link is right on random layouts and node sizes, straddling groups included"

