"""Checks of the topology chapter (notebook 07_topology).

Oracles, computed in the grader: `dtp.topology` (coordinates, groups, mesh arguments and links;
tests/test_topology_layout.py checks them against init_device_mesh on gloo worlds),
`dtp.topology_planner` (built from the memory, ZeRO, tensor, pipeline and expert chapters'
closed forms; tests/test_topology_planner.py checks its counts against torch models and its
traffic against gloo runs) and single-process training. Mechanisms, from what the learner's code
did in a gloo world: the groups its mesh arguments gave init_device_mesh, and every collective it
issued with the ranks of the group it ran on.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dtp import topology
from dtp import topology_planner as planner
from dtp.traffic import CommunicationLog

from ..compare import CheckFailed, expect, expect_answer, expect_close
from ..registry import Check, exercise
from .common import FixedAnswers, completed_worlds, events_as_data, raise_world_failure, run_worlds

LAYOUT_REFERENCES = ("dtp.topology.rank_coordinates", "dtp.topology.parallel_groups",
                     "dtp.topology.device_mesh_arguments", "dtp.topology.coordinates_to_rank",
                     "dtp.topology.factors", "dtp.topology.mesh_groups_on_rank")
LINK_REFERENCES = ("dtp.topology.dimension_links",)
PLANNER_REFERENCES = tuple(f"dtp.topology_planner.{name}" for name in (
    "plan", "evaluate", "candidate_layouts", "step_time", "traffic_per_gpu", "memory_per_gpu",
    "peak_memory_per_gpu", "moe_extra_activation_bytes_per_layer", "bytes_by_link", "model_flops_utilization"))
TRAINING_REFERENCES = ("dtp.topology_training.train_3d_rank", "dtp.topology_training.ParallelMLP",
                       "dtp.topology_training.ParallelAttention", "dtp.topology_training.ParallelBlock")


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
    """Verifies: for random layouts of 2 to 64 ranks in random orders (with EP carved out of DP,
    and sometimes a fourth dimension "cp"), every rank's coordinates, every group of every
    dimension ("expert_dp" and the whole "dp" with EP), and init_device_mesh's arguments; the
    arguments are then given to init_device_mesh on an 8- to 12-rank gloo world with EP, whose
    process groups (read back from torch) must be the layout's.
    Fakes: dtp.topology trips; a table cannot match random layouts; patching DeviceMesh in the
    sandbox gains nothing, since the arguments are compared with the oracle's directly.
    """

    reads = ("rank_coordinates", "parallel_groups", "device_mesh_arguments")
    references = LAYOUT_REFERENCES
    timeout_s = 40
    runs_world = True

    def prepare(self, rng):
        layouts = [_random_layout(rng, with_ep=False) for _ in range(4)] + \
                  [_random_layout(rng, with_ep=True) for _ in range(3)]
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
        return ("coordinates, groups and init_device_mesh arguments are right for random layouts and orders (EP "
                "carved out of DP included), and init_device_mesh with your arguments builds the layout's groups "
                "on gloo")


def _mesh_answer(answer, what: str) -> tuple[list[int], list[str]]:
    expect(isinstance(answer, (tuple, list)) and len(answer) == 2, f"{what} should return (mesh_shape, mesh_dim_names)")
    shape, names = _as_ints(answer[0]), list(answer[1]) if isinstance(answer[1], (list, tuple)) else None
    expect(shape is not None and names is not None and all(isinstance(n, str) for n in names),
           f"{what} should return a tuple of ints and a tuple of names")
    return shape, names


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
            raise CheckFailed(f"rank_coordinates({rank}, {what}) has keys {sorted(keys)}: "
                              + (f"missing {missing}" if missing else "") + (f" unexpected {extra}" if extra else "")
                              + ("; with EP, give \"dp\" (the position in the whole DP group), \"ep\" and "
                                 "\"expert_dp\"" if "ep" in sizes else ""))
        if {k: answer[k] for k in expected} != expected:
            wrong = [k for k in expected if answer[k] != expected[k]]
            hint = REVERSED_ORDER_HINT if "ep" not in sizes and \
                answer == topology.rank_coordinates(rank, sizes, list(reversed(order))) else ""
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
           + (" (with EP: \"dp\", \"ep\" and \"expert_dp\")" if "ep" in sizes else ""))
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
        if "ep" not in sizes and answer == topology.parallel_groups(sizes, list(reversed(order)))[name]:
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
    raise CheckFailed(f"device_mesh_arguments({what}) = {tuple(shape)}, {tuple(names)}, expected {right_shape}, "
                      f"{right_names}" + (" (with EP the mesh has \"ep\" of size e and \"expert_dp\" of size dp/e)"
                                          if "ep" in sizes else ""))


# --- 2. which link each dimension rides -----------------------------------------------------------

@exercise("topology.links", points=2)
class Links(Check):
    """Verifies: "intra-node" or "inter-node" for every group name of random layouts (EP
    included) on nodes of 2, 4 or 8 GPUs, among them layouts whose groups straddle a node
    boundary (TP = 3 on nodes of 4) and the source notes' 1024-GPU layout.
    Fakes: dtp.topology.dimension_links trips; random layouts.
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


# --- 3. the planner ---------------------------------------------------------------------------------

ROW_FIELDS = planner.LAYOUT_FIELDS + ("memory_bytes", "intra_node_bytes", "inter_node_bytes", "bubble", "step_time_s")


def _planner_case(rng, moe: bool):
    """A random model, cluster and batch whose candidate layouts partly fit: the memory is set
    between the candidates' needs, so that some fit only if activations are forgotten."""
    while True:
        heads = int(rng.choice([8, 16, 32]))
        hidden = heads * int(rng.choice([64, 128]))
        layers = int(rng.choice([4, 6, 8, 12]))
        seq = int(rng.choice([1024, 2048, 4096]))
        experts = int(rng.choice([4, 8, 16])) if moe else 1
        model = planner.ModelShape(layers, hidden, heads, int(rng.choice([32000, 50257])), seq, experts=experts,
                                   top_k=int(rng.integers(1, 3)) if moe else 1,
                                   expert_hidden=int(rng.choice([0, 2 * hidden])) if moe else 0,
                                   capacity_factor=float(rng.choice([1.0, 1.25])) if moe else 1.0)
        gpus_per_node = int(rng.choice([4, 8]))
        nodes = int(rng.choice([1, 2, 4]))
        batch = gpus_per_node * nodes * int(rng.choice([1, 2, 4]))
        training = planner.Training(global_batch=batch, micro_batch=int(rng.choice([1, 2])),
                                    recompute=str(rng.choice(["none", "selective", "full"])),
                                    flops_utilization=float(rng.uniform(0.3, 0.6)))
        base = planner.Cluster(nodes, gpus_per_node, 1.0, float(rng.uniform(100e9, 450e9)),
                               float(rng.uniform(10e9, 50e9)), float(rng.uniform(100e12, 1000e12)))
        candidates = planner.candidate_layouts(model, base, training)
        if len(candidates) < 4:
            continue
        needs = []
        for layout in candidates:
            _, breakdown = planner.peak_memory_per_gpu(model, training, layout)
            needs.append((sum(breakdown.values()), sum(breakdown.values()) - breakdown["activations"]))
        totals = sorted(total for total, _ in needs)
        memory = float(rng.uniform(totals[len(totals) // 4], totals[3 * len(totals) // 4]))
        if not any(states <= memory < total for total, states in needs) or memory < totals[0]:
            continue
        cluster = planner.Cluster(nodes, gpus_per_node, memory, base.intra_node_bytes_per_s,
                                  base.inter_node_bytes_per_s, base.peak_flops)
        return model, cluster, training


def _links_tell_the_order(model, cluster, training) -> bool:
    """Whether some fitting layout sends bytes on a dimension whose link class differs when the
    order is read the wrong way round (TP outermost): cases where it never does cannot catch it."""
    candidates = {_layout_key(layout): layout for layout in planner.candidate_layouts(model, cluster, training)}
    for row in planner.plan(model, cluster, training):
        layout = candidates[_key(row)]
        misread = topology.dimension_links(layout.sizes(model), tuple(layout.order(model))[::-1], cluster.gpus_per_node)
        if any(entry["bytes"] and entry["link"] != misread[name] for name, entry in row["traffic"].items()):
            return True
    return False


def _layout_key(layout) -> tuple:
    return tuple(getattr(layout, field) for field in planner.LAYOUT_FIELDS)


def _key(row) -> tuple:
    return tuple(int(row[field]) for field in planner.LAYOUT_FIELDS)


def _show(key) -> str:
    return ", ".join(f"{field}={value}" for field, value in zip(planner.LAYOUT_FIELDS, key))


@exercise("topology.planner", points=5)
class Planner(Check):
    """Verifies: on random dense and MoE models, clusters and batches (the GPU memory drawn so
    that some candidate layouts fit and some do not, some only if activations were left out),
    that the listed layouts are exactly the candidates that fit (none listed that does not fit,
    none missing), and for each its memory per GPU, bytes per step on each link class, bubble and
    estimated step time, best first.
    Fakes: dtp.topology_planner's planner functions trip; the cases are random.
    """

    reads = ("plan_layouts",)
    references = PLANNER_REFERENCES + LINK_REFERENCES
    timeout_s = 30

    def prepare(self, rng):
        while True:
            cases = [_planner_case(rng, moe) for moe in (False, True, bool(rng.integers(2)))]
            if any(_links_tell_the_order(*case) for case in cases):
                return cases

    def collect(self, student, cases):
        return [student.plan_layouts(model, cluster, training) for model, cluster, training in cases]

    def judge(self, cases, answers) -> str:
        for (model, cluster, training), rows in zip(cases, answers):
            _judge_plan(model, cluster, training, rows)
        return ("for random dense and MoE models and clusters, exactly the fitting layouts are listed, best first, "
                "with the right memory, bytes per link class, bubble and step time")


def _case_name(model, cluster, training) -> str:
    kind = f"MoE ({model.experts} experts, top-{model.top_k})" if model.is_moe else "dense"
    return (f"{kind} L={model.layers} h={model.hidden} s={model.seq} on {cluster.nodes}×{cluster.gpus_per_node} GPUs "
            f"of {cluster.memory_bytes / 2**30:.1f} GiB, batch {training.global_batch}, micro-batch "
            f"{training.micro_batch}, recompute {training.recompute!r}")


def _judge_plan(model, cluster, training, rows) -> None:
    what = _case_name(model, cluster, training)
    expect(isinstance(rows, list), f"plan_layouts ({what}) should return a list of dicts")
    for row in rows:
        expect(isinstance(row, dict) and all(field in row for field in ROW_FIELDS),
               f"plan_layouts ({what}): every row should be a dict with keys {', '.join(ROW_FIELDS)}")
        expect(all(isinstance(row[f], (int, float)) and not isinstance(row[f], bool) for f in ROW_FIELDS),
               f"plan_layouts ({what}): every field of a row should be a number")
    candidates = {_layout_key(c): c for c in planner.candidate_layouts(model, cluster, training)}
    oracle = {_key(row): row for row in planner.plan(model, cluster, training)}
    listed = [_key(row) for row in rows]
    for key in listed:
        tp, pp, dp, ep = key[:4]
        if key not in candidates:
            if tp * pp * dp != cluster.gpus:
                raise CheckFailed(f"plan_layouts ({what}) lists {_show(key)}, which uses tp·pp·dp = {tp * pp * dp} "
                                  f"GPUs; the cluster has {cluster.gpus}. EP is carved out of DP: tp·pp·dp = GPUs, "
                                  "and ep divides dp")
            raise CheckFailed(f"plan_layouts ({what}) lists {_show(key)}, which is not among the layouts to "
                              "enumerate (tp divides a node's GPUs, the heads and the sequence; pp divides the layers; "
                              "ep divides dp and the experts; ZeRO 0-1 with pp > 1; m = batch/(dp·b) whole and at "
                              "least pp)")
        if key not in oracle:
            stage, breakdown = planner.peak_memory_per_gpu(model, training, candidates[key])
            total, activations = sum(breakdown.values()), breakdown["activations"]
            hint = (" Without the activations it would fit: count them (and the logits on the last stage)"
                    if total - activations - breakdown["logits"] <= cluster.memory_bytes else "")
            raise CheckFailed(f"plan_layouts ({what}) lists {_show(key)}, which does not fit: its {stage} stage needs "
                              f"{total / 2**30:.2f} GiB per GPU ({activations / 2**30:.2f} GiB of activations), more "
                              f"than {cluster.memory_bytes / 2**30:.2f} GiB.{hint}")
    expect(len(set(listed)) == len(listed), f"plan_layouts ({what}) lists a layout twice")
    missing = [key for key in oracle if key not in set(listed)]
    if missing:
        key = missing[0]
        raise CheckFailed(f"plan_layouts ({what}) leaves out {_show(key)}, which fits: it needs "
                          f"{oracle[key]['memory_bytes'] / 2**30:.2f} GiB per GPU of "
                          f"{cluster.memory_bytes / 2**30:.2f}")
    for row in rows:
        _judge_row(model, cluster, training, row, oracle[_key(row)], what, candidates[_key(row)])
    times = [oracle[key]["step_time_s"] for key in listed]
    for index, (a, b) in enumerate(zip(times, times[1:])):
        expect(b >= a * (1 - 1e-9), f"plan_layouts ({what}) lists {_show(listed[index])} ({a:.4g} s) before "
                                    f"{_show(listed[index + 1])} ({b:.4g} s): best (fastest) first")


def _without_activations(model, training, layout) -> float:
    """The peak memory per GPU if activations were left out: the peak stage may change (the last
    stage holds the logits), so the most over both stages, not the peak stage's total less its
    activations."""
    stages = (planner.memory_per_gpu(model, training, layout, stage) for stage in ("first", "last"))
    return max(sum(breakdown.values()) - breakdown["activations"] for breakdown in stages)


def _judge_row(model, cluster, training, row, right, what, layout) -> None:
    where = f"plan_layouts ({what}), layout {_show(_key(row))}"
    times = right["times"]
    expect_answer(row["memory_bytes"], right["memory_bytes"], f"{where}: memory_bytes", rel=1e-6, slips={
        "that leaves out the activations": _without_activations(model, training, layout)})
    for field, link, other in (("intra_node_bytes", topology.INTRA_NODE, "inter_node_bytes"),
                               ("inter_node_bytes", topology.INTER_NODE, "intra_node_bytes")):
        if np.isclose(row[field], right[field], rtol=1e-6):
            continue
        on_link = [f"{name} {entry['bytes']:.6g}" for name, entry in right["traffic"].items()
                   if entry["link"] == link and entry["bytes"]]
        hint = (" That is the other link class's total: with TP innermost, TP's groups (and EP's, when t·e GPUs "
                "fit in a node) lie inside a node; compare each dimension's groups with the nodes"
                if np.isclose(row[field], right[other], rtol=1e-6) and right[other] else "")
        raise CheckFailed(f"{where}: {field} is {row[field]:.6g}, expected {right[field]:.6g} = "
                          f"{' + '.join(on_link) or '0'} bytes (per GPU per step).{hint}")
    expect_answer(row["bubble"], right["bubble"], f"{where}: bubble", rel=1e-9, slips={
        "that is (p-1)/m, idle time relative to the busy time; the bubble here is the idle share of the step, "
        "(p-1)/(m+p-1)": pipeline_bubble_over_ideal(row)})
    parts = ", ".join(f"{name} {seconds:.4g} s" for name, seconds in times.items() if name != "total" and seconds)
    try:
        expect_answer(row["step_time_s"], right["step_time_s"], f"{where}: step_time_s", rel=1e-6)
    except CheckFailed as failed:
        raise CheckFailed(f"{failed} (expected parts: {parts})") from None


def pipeline_bubble_over_ideal(row) -> float:
    return (row["pp"] - 1) / row["micro_batches"]


# --- 4. DP × TP training on gloo -------------------------------------------------------------------

STEPS = 3
LEARNING_RATE = 0.1


def _dense_model(case) -> nn.Sequential:
    d_in, hidden, width, d_out = case["sizes"]
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(case["seed"])
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, width), nn.GELU(),
                          nn.Linear(width, d_out))
    torch.random.set_rng_state(generator_state)
    return model


def _batches(case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in case["batches"]]


def _dp_tp_on_rank(rank, world_size, train, dp, tp, case):
    model = _dense_model(case)
    with CommunicationLog() as log:
        result = train(rank, world_size, dp, tp, model, _batches(case), case["lr"])
    return {"result": result, "events": events_as_data(log)}


def single_process_training(case) -> tuple[list[float], dict[str, np.ndarray]]:
    """The oracle: SGD on the whole batches; (loss per step, final parameters)."""
    model = _dense_model(case)
    losses = []
    for x, y in _batches(case):
        model.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        with torch.no_grad():  # plain SGD, as torch.optim.SGD steps (which would import torch._dynamo here)
            for parameter in model.parameters():
                parameter.add_(parameter.grad, alpha=-case["lr"])
        losses.append(loss.item())
    return losses, {name: p.detach().numpy().copy() for name, p in model.named_parameters()}


def _shard(full: np.ndarray, name: str, tp: int, index: int) -> np.ndarray:
    """This TP rank's piece of a parameter: layer 2 column-parallel (weight rows, bias), layer 4
    row-parallel (weight columns; whole bias), layer 0 replicated."""
    if name.startswith("2."):
        return np.array_split(full, tp, axis=0)[index]
    if name == "4.weight":
        return np.array_split(full, tp, axis=1)[index]
    return full


@exercise("topology.dp_tp_training", points=4)
class DataTensorParallelTraining(Check):
    """Verifies: on gloo worlds of 2 × 2 and 2 × 3 (DP × TP, TP innermost, an MLP whose hidden
    width does not divide by 3), every rank's losses and final parameter pieces equal
    single-process SGD on the whole batches; each rank's TP all-reduces ran on its TP group
    (consecutive ranks), one forward (g) and one backward (f) per step, of its rows' activations;
    its gradient all-reduces ran on its DP group and carried its parameters' bytes each step.
    Fakes: dtp's 3D training code trips; a correct result computed with the wrong groups (TP
    outermost) fails on the recorded groups; all-reducing over the whole world fails on them too.
    """

    reads = ("train_dp_tp",)
    references = TRAINING_REFERENCES + LAYOUT_REFERENCES
    timeout_s = 40
    runs_world = True

    def prepare(self, rng):
        worlds = []
        for dp, tp in ((2, 2), (2, 3)):
            rows = dp * int(rng.integers(2, 4))
            sizes = (int(rng.integers(3, 6)), int(rng.integers(4, 7)), tp * int(rng.integers(2, 4)) + (tp == 3),
                     int(rng.integers(2, 4)))
            batches = [(rng.standard_normal((rows, sizes[0])).astype(np.float32),
                        rng.standard_normal((rows, sizes[3])).astype(np.float32)) for _ in range(STEPS)]
            worlds.append((dp, tp, {"seed": int(rng.integers(1 << 30)), "sizes": sizes, "batches": batches,
                                    "lr": LEARNING_RATE}))
        return worlds

    def collect(self, student, worlds):
        return run_worlds(_dp_tp_on_rank, [(dp * tp, (student.train_dp_tp, dp, tp, case)) for dp, tp, case in worlds])

    def judge(self, worlds, outcomes) -> str:
        done, failure = completed_worlds(outcomes)
        for (dp, tp, case), per_rank in zip(worlds, done):
            _judge_dp_tp(dp, tp, case, per_rank)
        raise_world_failure(failure)
        return (f"{STEPS} SGD steps on 2 × 2 and 2 × 3 (DP × TP) ranks equal single-process training; TP "
                "all-reduces ran on consecutive ranks (g forward, f backward), gradient all-reduces on the DP groups")


def _judge_dp_tp(dp, tp, case, per_rank) -> None:
    what = f"{dp} × {tp} (DP × TP) ranks"
    sizes = {"tp": tp, "dp": dp}
    groups = topology.parallel_groups(sizes, ["tp", "dp"])
    losses, final = single_process_training(case)
    for rank, outcome in enumerate(per_rank):
        _judge_collectives(rank, outcome["events"], groups, case, dp, tp, what)
    by_dp = {}
    for rank, outcome in enumerate(per_rank):
        result = outcome["result"]
        expect(isinstance(result, dict) and "losses" in result and "parameters" in result,
               f"{what}: train_dp_tp should return {{\"losses\": [...], \"parameters\": {{...}}}} on every rank")
        rank_losses = result["losses"]
        expect(isinstance(rank_losses, (list, tuple)) and len(rank_losses) == STEPS,
               f"{what}: rank {rank} should return one loss per step ({STEPS})")
        by_dp.setdefault(topology.rank_coordinates(rank, sizes, ["tp", "dp"])["dp"], []).append(list(rank_losses))
    def judge_losses(steps) -> None:
        for step in steps:
            mean = float(np.mean([losses_[0][step] for losses_ in by_dp.values()]))
            expect_answer(mean, losses[step], f"{what}: the mean over DP ranks of their losses at step {step + 1}"
                          + (" (before any update: the forward pass)" if step == 0 else ""), rel=1e-4)

    judge_losses([0])
    for rank, outcome in enumerate(per_rank):
        parameters = outcome["result"]["parameters"]
        index = topology.rank_coordinates(rank, sizes, ["tp", "dp"])["tp"]
        expect(isinstance(parameters, dict) and set(parameters) == set(final),
               f"{what}: rank {rank}'s parameters should be a dict with keys {sorted(final)}")
        for name, full in final.items():
            expected = _shard(full, name, tp, index)
            try:
                expect_close(parameters[name], expected, f"rank {rank}'s {name} after {STEPS} steps ({what})",
                             rtol=1e-4, atol=1e-5)
            except CheckFailed as failed:
                hint = _training_hint(case, rank, name, parameters[name], tp, index, dp)
                raise CheckFailed(str(failed) + hint) from None
    judge_losses(range(1, STEPS))


def _training_hint(case, rank, name, actual, tp, index, dp) -> str:
    scaled = dict(case, lr=case["lr"] * dp)
    _, summed = single_process_training(scaled)
    if np.shape(actual) == _shard(summed[name], name, tp, index).shape and \
            np.allclose(actual, _shard(summed[name], name, tp, index), rtol=1e-4, atol=1e-5):
        return " It matches training with the DP gradients summed: divide the all-reduced gradients by dp."
    if name.startswith("0."):
        return (" The first layer is replicated: its input gradient comes from every TP rank's columns, so f's "
                "backward must all-reduce it over the TP group.")
    return ""


def _judge_collectives(rank, events, groups, case, dp, tp, what) -> None:
    mine = {name: next(g for g in grp if rank in g) for name, grp in groups.items()}
    rows = len(case["batches"][0][0]) // dp
    d_in, hidden, width, d_out = case["sizes"]
    by_group: dict[tuple, list[int]] = {}
    for event in events:
        if event["op"] in ("mark", "wait"):
            continue
        expect(event["op"] == "all_reduce", f"{what}: rank {rank} called {event['op']}; training with DP and TP needs "
                                            "only all-reduces (TP's f and g, and the DP gradient average)")
        by_group.setdefault(tuple(event.get("group") or ()), []).append(event["bytes"])
    activations = sorted([rows * d_out * 4, rows * hidden * 4] * STEPS)
    if tp > 1:
        tp_like = [list(ranks) for ranks, sizes in by_group.items() if sorted(sizes) == activations]
        if tp_like and tp_like[0] != mine["tp"]:
            raise CheckFailed(f"{what}: rank {rank}'s f and g all-reduced its activations over ranks {tp_like[0]}; "
                              f"with TP innermost its TP group is the consecutive ranks {mine['tp']} (inside one "
                              f"node), and {tp_like[0]} would be its group with TP outermost")
    for ranks in by_group:
        expect(list(ranks) in (mine["tp"], mine["dp"]),
               f"{what}: rank {rank} all-reduced over ranks {list(ranks)}, which is neither its TP group {mine['tp']} "
               f"nor its DP group {mine['dp']} (TP innermost)")
    if tp > 1:
        sent = sorted(by_group.get(tuple(mine["tp"]), []))
        expect(sent == activations,
               f"{what}: rank {rank}'s TP all-reduces carried {sent} bytes over {STEPS} steps; each step has two: "
               f"g's forward sum of the row-parallel output ({rows}×{d_out} floats) and f's backward sum of the "
               f"column-parallel input's gradient ({rows}×{hidden} floats)")
    piece = len(np.array_split(np.arange(width), tp)[rank % tp])  # this rank's share of the hidden width
    parameter_bytes = 4 * ((d_in + 1) * hidden + (hidden + 1) * piece + piece * d_out + d_out)
    sent = sum(by_group.get(tuple(mine["dp"]), []))
    expect(sent == STEPS * parameter_bytes,
           f"{what}: rank {rank}'s DP all-reduces carried {sent} bytes over {STEPS} steps; averaging its gradients "
           f"takes {parameter_bytes} bytes per step (its pieces of every parameter)")


# --- 5. numeric questions -------------------------------------------------------------------------

INTERVIEW_ANSWERS = ("interview_ep_group_nodes", "interview_ep_nodes_with_tp1", "interview_memory_gib",
                     "interview_ep_seconds", "interview_step_time_ratio")
NOTES_LAYOUT = planner.PlannedLayout(tp=8, pp=8, dp=16, ep=8, zero_stage=1, micro_batches=64)


@functools.lru_cache(maxsize=1)
def interview_oracle() -> dict[str, float]:
    """The answers, from the course's planner (the 409B MoE, the H100 cluster, 4M-token batches)."""
    model, cluster, training = planner.MOE_409B, planner.H100_CLUSTER, planner.FOUR_MILLION_TOKENS
    notes = planner.evaluate(model, cluster, training, NOTES_LAYOUT)
    best = planner.plan(model, cluster, training)[0]
    ep_group = topology.parallel_groups(NOTES_LAYOUT.sizes(model), NOTES_LAYOUT.order(model))["ep"][0]
    tp1 = {"tp": 1, "pp": 8, "dp": 128, "ep": 8}
    tp1_group = topology.parallel_groups(tp1, topology.COURSE_ORDER)["ep"][0]
    return {"interview_ep_group_nodes": topology.nodes_spanned(ep_group, 8),
            "interview_ep_nodes_with_tp1": topology.nodes_spanned(tp1_group, 8),
            "interview_memory_gib": notes["memory_bytes"] / 2**30,
            "interview_ep_seconds": notes["times"]["ep"],
            "interview_step_time_ratio": notes["step_time_s"] / best["step_time_s"]}


@exercise("topology.interview", points=2)
class Interview(FixedAnswers):
    """Verifies: five answers about the source notes' 409B MoE layout on 1024 H100s (TP 8, EP 8,
    PP 8, DP 16, ZeRO-1): the nodes an EP group spans with TP = 8 and with TP = 1, the memory per
    GPU, the EP all-to-all time per step and the step time over the planner's best, all from
    dtp.topology and dtp.topology_planner. Fakes: a fixed question, so a copied number passes; it
    is worth two points for that."""

    reads = INTERVIEW_ANSWERS

    def judge(self, inputs, answers) -> str:
        right = interview_oracle()
        nodes, nodes_tp1, memory_gib, ep_seconds, ratio = answers
        expect_answer(nodes, right["interview_ep_group_nodes"], "interview_ep_group_nodes", slips={
            "an EP group cannot share a node that TP = 8 fills: its 8 ranks are 8 apart, one per node": 1})
        expect_answer(nodes_tp1, right["interview_ep_nodes_with_tp1"], "interview_ep_nodes_with_tp1", slips={
            "with TP = 1, EP is the innermost dimension: ranks 0..7, one node": 8})
        expect_answer(memory_gib, right["interview_memory_gib"], "interview_memory_gib", rel=1e-4, slips={
            "that is in GB (10⁹ bytes); answer in GiB": right["interview_memory_gib"] * 2**30 / 1e9,
            "that is in bytes; answer in GiB": right["interview_memory_gib"] * 2**30})
        expect_answer(ep_seconds, right["interview_ep_seconds"], "interview_ep_seconds", rel=1e-4)
        expect_answer(ratio, right["interview_step_time_ratio"], "interview_step_time_ratio", rel=1e-4, slips={
            "that is best over the notes' layout; the question asks the notes' layout over the best":
                1 / right["interview_step_time_ratio"]})
        return "all five answers are right"
