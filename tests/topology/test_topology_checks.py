"""Every check of the topology chapter rejects plausible wrong answers with feedback that names the
mistake, and accepts correct answers written differently from the course's."""
import functools

import nbformat
import pytest

from conftest import assert_fails, changed, graded, solution_cell, solution_path


def variant(name: str, old: str, new: str) -> str:
    return changed(solution_cell("topology", name), (old, new))


# --- exercise 1: coordinates, groups, mesh arguments ---

LAYOUT = "rank_coordinates"
EP_MULTIPLIED = variant(LAYOUT, '''        if name == "dp" and "ep" in sizes:
            dimensions.append(("expert_dp", sizes["dp"] // sizes["ep"]))
        else:
            dimensions.append((name, sizes[name]))''', '''        dimensions.append((name, sizes[name]))  # EP as a fourth dimension of its own''').replace(
    '''    world = math.prod(size for name, size in sizes.items() if name != "ep")''',
    '''    world = math.prod(sizes.values())''').replace('''    if "ep" in sizes:
        varying["dp"] = ["ep", "expert_dp"]''', '''    if "ep" in sizes:
        varying["expert_dp"] = ["dp"]''').replace('''    if "ep" in sizes:
        inner, outer''', '''    if False:
        inner, outer''')


@pytest.mark.parametrize("source, feedback", [
    (variant(LAYOUT, "for name, size in laid_out(sizes, order):\n        rest, coordinates",
             "for name, size in reversed(laid_out(sizes, order)):\n        rest, coordinates"), "order reversed"),
    (variant(LAYOUT, "outermost_first = list(reversed(laid_out(sizes, order)))", "outermost_first = laid_out(sizes, order)"),
     "outermost first"),
    (variant(LAYOUT, 'coordinates["dp"] = coordinates[inner] + dict(laid_out(sizes, order))[inner] * coordinates[outer]',
             'coordinates["dp"] = coordinates["expert_dp"]'), 'Only "dp" is wrong'),
    (variant(LAYOUT, "        groups[name] = [[first + member for member in members]",
             "        groups[name] = [[first + member for member in reversed(members)]"), "in another form"),
    (EP_MULTIPLIED, "EP is carved out of DP"),
    (variant(LAYOUT, '        varying["dp"] = ["ep", "expert_dp"]', '        varying["dp"] = ["expert_dp"]'),
     "That is the expert_dp group"),
], ids=["order-read-outermost-first", "mesh-not-reversed", "dp-coordinate-is-expert-dp", "unsorted-groups",
        "ep-multiplied-into-the-world", "dp-group-is-expert-dp"])
def test_rank_layout_rejects(tmp_notebook, source, feedback):
    assert_fails(graded(tmp_notebook, "topology.rank_layout", {LAYOUT: source}), feedback)


LAYOUT_WITH_NUMPY = '''
def laid_out(sizes, order):
    rest = sizes["dp"] // sizes.get("ep", 1)
    return [("expert_dp", rest) if name == "dp" and "ep" in sizes else (name, sizes[name]) for name in order]


def rank_coordinates(rank, sizes, order):
    # numpy's unravel_index on the mesh's shape (outermost first), read back innermost first
    shape, names = device_mesh_arguments(sizes, order)
    digits = dict(zip(names, (int(d) for d in np.unravel_index(rank, shape))))
    if "ep" in sizes:
        position = [name for name in names if name in ("ep", "expert_dp")]  # outer one first
        digits["dp"] = int(np.ravel_multi_index([digits[n] for n in position], [dict(zip(names, shape))[n] for n in position]))
    return digits


def parallel_groups(sizes, order):
    shape, names = device_mesh_arguments(sizes, order)
    grid = np.arange(int(np.prod(shape))).reshape(shape)
    along = {name: [name] for name in names}
    if "ep" in sizes:
        along["dp"] = ["ep", "expert_dp"]
    result = {}
    for name, dims in along.items():
        axes = [names.index(d) for d in dims]
        moved = np.moveaxis(grid, axes, list(range(grid.ndim - len(axes), grid.ndim)))
        groups = np.sort(moved.reshape(-1, int(np.prod([shape[a] for a in axes]))), axis=1)
        result[name] = sorted(groups.tolist())
    return result


def device_mesh_arguments(sizes, order):
    dims = laid_out(sizes, order)[::-1]
    return tuple(s for _, s in dims), tuple(n for n, _ in dims)
'''

LAYOUT_BY_BRUTE_FORCE = '''
import functools


def laid_out(sizes, order):
    return [("expert_dp", sizes["dp"] // sizes["ep"]) if name == "dp" and "ep" in sizes else (name, sizes[name])
            for name in order]


def rank_coordinates(rank, sizes, order):
    stride, coordinates = 1, {}
    for name, size in laid_out(sizes, order):
        coordinates[name] = (rank // stride) % size
        stride *= size
    if "ep" in sizes:  # the position among the sorted ranks of its DP group (groups found once per layout)
        dp_groups = _groups_of(tuple(sizes.items()), tuple(order))["dp"]
        coordinates["dp"] = next(group for group in dp_groups if rank in group).index(rank)
    return coordinates


@functools.lru_cache(maxsize=None)
def _groups_of(size_items, order):
    return parallel_groups(dict(size_items), list(order))


def _digits(rank, sizes, order):
    stride, digits = 1, {}
    for name, size in laid_out(sizes, order):
        digits[name] = (rank // stride) % size
        stride *= size
    return digits


def parallel_groups(sizes, order):
    world = 1
    for name, size in laid_out(sizes, order):
        world *= size
    names = [name for name, _ in laid_out(sizes, order)]
    varying = {name: (name,) for name in names}
    if "ep" in sizes:
        varying["dp"] = ("ep", "expert_dp")
    digits = [_digits(rank, sizes, order) for rank in range(world)]
    groups = {}
    for name, along in varying.items():  # every pair of ranks compared: brute force, but each rank's digits once
        found = set()
        for rank in range(world):
            found.add(tuple(other for other in range(world)
                            if all(digits[other][n] == digits[rank][n] for n in names if n not in along)))
        groups[name] = sorted(list(group) for group in found)
    return groups


def device_mesh_arguments(sizes, order):
    dims = list(reversed(laid_out(sizes, order)))
    return tuple(size for _, size in dims), tuple(name for name, _ in dims)
'''


@pytest.mark.parametrize("source", [
    LAYOUT_WITH_NUMPY,
    # Quadratic in the world size: on the drawn layouts (64 ranks at most) it takes milliseconds.
    # It once timed out because every exercise's sandbox also ran the notebook's answer to another
    # exercise (the planner's interview ratio, which calls it on worlds of thousands of ranks); each
    # sandbox now runs only the set-up its own exercise reads (grader/notebook.py, NotebookCode).
    LAYOUT_BY_BRUTE_FORCE,
], ids=["numpy-unravel", "brute-force"])
def test_rank_layout_accepts_other_correct_layouts(tmp_notebook, source):
    result = graded(tmp_notebook, "topology.rank_layout", {LAYOUT: source})
    assert result.status == "passed", result


# --- exercise 2: links ---

LINKS_BY_SIZE = '''
def dimension_links(sizes, order, gpus_per_node):
    # a group fits in a node if it is no larger than a node (ignores where it starts)
    return {name: "intra-node" if max(r for r in groups[0]) - groups[0][0] < gpus_per_node else "inter-node"
            for name, groups in parallel_groups(sizes, order).items()}
'''

LINKS_TP_ALWAYS_INSIDE = variant("dimension_links", '''        links[name] = "intra-node" if inside else "inter-node"''',
                                 '''        links[name] = "intra-node" if inside or name == "tp" else "inter-node"''')


@pytest.mark.parametrize("source, feedback", [
    (LINKS_BY_SIZE, "spans nodes"),
    (LINKS_TP_ALWAYS_INSIDE, "spans nodes"),
    (variant("dimension_links", "group[0] // gpus_per_node == group[-1] // gpus_per_node",
             "group[0] % gpus_per_node <= group[-1] % gpus_per_node"), "expected"),
], ids=["span-not-position", "tp-always-inside", "modulo-instead-of-division"])
def test_links_reject(tmp_notebook, source, feedback):
    assert_fails(graded(tmp_notebook, "topology.links", {"dimension_links": source}), feedback)


LINKS_WITH_SETS = '''
def dimension_links(sizes, order, gpus_per_node):
    links = {}
    for name, groups in parallel_groups(sizes, order).items():
        nodes = [{rank // gpus_per_node for rank in group} for group in groups]
        links[name] = "inter-node" if any(len(n) > 1 for n in nodes) else "intra-node"
    return links
'''


LINKS_WITH_NUMPY = """
def dimension_links(sizes, order, gpus_per_node):
    return {name: "intra-node" if np.ptp(np.array(groups) // gpus_per_node, axis=1).max() == 0 else "inter-node"
            for name, groups in parallel_groups(sizes, order).items()}
"""


@pytest.mark.parametrize("source", [LINKS_WITH_SETS, LINKS_WITH_NUMPY], ids=["sets-of-nodes", "numpy-ptp"])
def test_links_accept_other_correct_answers(tmp_notebook, source):
    assert graded(tmp_notebook, "topology.links", {"dimension_links": source}).status == "passed"


# --- exercise 3: the planner ---

PLANNER = "plan_layouts"


@pytest.mark.parametrize("old, new, feedback", [
    ('parts["activations"] += held * per_token * s * b / tp\n        totals.append(sum(parts.values()))',
     'parts["activations"] += held * per_token * s * b / tp\n        parts["activations"] = 0.0\n'
     '        totals.append(sum(parts.values()))', ("Without the activations it would fit", "leaves out the activations")),
    ('"bubble": (pp - 1) / (v * m + pp - 1)', '"bubble": (pp - 1) / (v * m)', "(p-1)/(v·m+p-1)"),
    ('total = in_micro_batches * (1 + (pp - 1) / (v * m))', 'total = in_micro_batches * (1 + (pp - 1) / m)',
     "step_time_s"),
    ('+ (["dp", "pp"] if training.pp_outermost else ["pp", "dp"]))\n                links',
     '+ ["pp", "dp"])\n                links', "node_bytes"),
    ("return sorted(rows, key=lambda row: row[\"step_time_s\"])",
     "return sorted(rows, key=lambda row: -row[\"step_time_s\"])", "best (fastest) first"),
    ("for stage in (0, 1, 2, 3):", "for stage in ((0, 1, 2, 3) if pp == 1 else (0, 1)):", "leaves out"),
    ("links = dict(links or dimension_links(sizes, order, cluster.gpus_per_node))",
     "links = dict(dimension_links(sizes, order[::-1], cluster.gpus_per_node))", "node_bytes"),
    ('sent = zero.accumulation_bytes_sent_per_gpu(n, d, m, stage, bool(every), w, w)',
     'sent = zero.accumulation_bytes_sent_per_gpu(n, d, m, stage, False, w, w)', "once per step"),
    ('capacity = moe.expert_capacity(b * s // tp, model.experts',
     'capacity = moe.expert_capacity(b * s, model.experts', "dispatch the whole micro-batch"),
    ('if stage >= 2 and not every:  # a full gradient buffer', 'if False:  # a full gradient buffer',
     ("memory_bytes", "does not fit")),
    ('"pp": min(2, pp - 1) * m * training.chunks * message / tp,', '"pp": 2 * m * training.chunks * message / tp,',
     "expected"),
    ('seconds.get("expert_dp", 0.0) - 2 / 3 * seconds["compute"] / m)',
     'seconds.get("expert_dp", 0.0) - seconds["compute"])', "more computation than can hide it"),
], ids=["activations-ignored", "bubble-over-ideal", "interleaving-ignored-in-the-step", "pp-outermost-ignored",
        "slowest-first", "zero-2-and-3-without-pp-only",
        "tp-outermost-links", "dp-once-per-step-with-sharded-gradients", "ep-dispatches-the-whole-micro-batch",
        "unsharded-accumulation-without-its-memory", "pp-edge-stages", "dp-hidden-under-the-whole-step"])
def test_planner_rejects(tmp_notebook, old, new, feedback):
    source = variant(PLANNER, old, new)
    assert_fails(graded(tmp_notebook, "topology.planner", {PLANNER: source}), feedback)


PLANNER_EP_MULTIPLIED = solution_cell("topology", PLANNER) + '''

_right_plan = plan_layouts


def plan_layouts(model, cluster, training):
    # EP as a factor of its own: for each ep > 1, dp = GPUs / (tp·pp·ep)
    rows = _right_plan(model, cluster, training)
    extra = []
    for row in rows:
        for ep in divisors(min(row["dp"], model.experts))[1:]:
            if row["dp"] % ep == 0:
                extra.append(dict(row, dp=row["dp"] // ep, ep=ep))
    return sorted(rows + extra, key=lambda row: row["step_time_s"])
'''


def test_planner_rejects_ep_multiplied_into_the_world(tmp_notebook):
    assert_fails(graded(tmp_notebook, "topology.planner", {PLANNER: PLANNER_EP_MULTIPLIED}), "EP is carved out of DP")


PLANNER_WITH_PRODUCT_AND_TIE_BREAK = solution_cell("topology", PLANNER) + '''

import itertools as _itertools


def plan_layouts(model, cluster, training):
    # Enumerates with itertools.product, keeps extra keys, breaks ties by the smallest memory.
    rows = []
    for tp, pp, stage, every in _itertools.product(divisors(cluster.gpus_per_node), divisors(model.layers), range(4),
                                                   (0, 1)):
        if model.heads % tp or model.seq % tp or cluster.gpus % (tp * pp) or (every and stage < 2):
            continue
        dp = cluster.gpus // (tp * pp)
        if training.global_batch % (dp * training.micro_batch):
            continue
        m = training.global_batch // (dp * training.micro_batch)
        for ep in [e for e in range(1, dp + 1) if dp % e == 0 and model.experts % e == 0] if model.experts > 1 else [1]:
            folds = model.experts > 1 and tp > 1 and model.experts % (tp * ep) == 0
            for expert_tp in ({tp, 1} if folds else {tp}):
                if m >= pp:
                    row = layout_row(model, cluster, training, (tp, pp, dp, ep, stage, m, every, expert_tp))
                    if row["memory_bytes"] <= cluster.memory_bytes:
                        rows.append(dict(row, fits=True))
    return sorted(rows, key=lambda row: (row["step_time_s"], row["memory_bytes"]))
'''


PLANNER_WITH_THE_CALCULATOR_S_PEAK = variant(PLANNER, """    totals = []
    for where in ("first", "last"):""", """    # a dense model reducing as the calculator assumes: its peak as it is; else each stage adjusted, as the course does
    adjusted = is_moe or (stage >= 2 and not every)
    totals = [] if adjusted else [sum(calculator.peak_memory_per_gpu(model.config, training.recipe, dense_layout)[1].values())]
    for where in (("first", "last") if adjusted else ()):""")


@pytest.mark.parametrize("source", [PLANNER_WITH_PRODUCT_AND_TIE_BREAK, PLANNER_WITH_THE_CALCULATOR_S_PEAK],
                         ids=["product-and-tie-break", "calculator-peak"])
def test_planner_accepts_other_correct_planners(tmp_notebook, source):
    result = graded(tmp_notebook, "topology.planner", {PLANNER: source})
    assert result.status == "passed", result


# --- exercise 4: DP × TP training ---

TRAINING = "train_dp_tp"


@pytest.mark.parametrize("old, new, feedback", [
    ('sizes, order = {"tp": tp, "dp": dp}, ["tp", "dp"]', 'sizes, order = {"tp": tp, "dp": dp}, ["dp", "tp"]',
     "would be its group with TP outermost"),
    ("            parameter.grad /= dp\n", "", "divide the all-reduced gradients by dp"),
    ("        total = grad.contiguous().clone()\n        dist.all_reduce(total, group=ctx.group)\n        return total, None",
     "        return grad, None", "f's backward"),
    ('dist.all_reduce(parameter.grad, group=mine["dp"])', "dist.all_reduce(parameter.grad)",
     "neither its TP group"),
    ('return ReduceFromGroup.apply(F.linear(x, parameters["4.weight"]), mine["tp"]) + parameters["4.bias"]',
     'return ReduceFromGroup.apply(F.linear(x, parameters["4.weight"], parameters["4.bias"]), mine["tp"])',
     "losses at step 1 (before any update"),
], ids=["tp-outermost", "dp-gradients-summed", "f-without-all-reduce", "gradients-over-the-world",
        "row-bias-added-t-times"])
def test_dp_tp_training_rejects(tmp_notebook, old, new, feedback):
    assert_fails(graded(tmp_notebook, "topology.dp_tp_training", {TRAINING: variant(TRAINING, old, new)}), feedback)


TRAINING_WITH_TORCH_DDP = variant(TRAINING, """    optimizer = torch.optim.SGD(parameters.values(), lr=lr)""", """    class Local(nn.Module):
        def __init__(self):
            super().__init__()
            self.held = nn.ParameterList(parameters.values())

        def forward(self, x):
            return forward(x)

    ddp = nn.parallel.DistributedDataParallel(Local(), process_group=mine["dp"])
    optimizer = torch.optim.SGD(parameters.values(), lr=lr)""").replace("""        loss = F.mse_loss(forward(x), y)
        loss.backward()
        for parameter in parameters.values():
            dist.all_reduce(parameter.grad, group=mine["dp"])
            parameter.grad /= dp
""", """        loss = F.mse_loss(ddp(x), y)
        loss.backward()
""")


def test_dp_tp_training_explains_that_torch_ddp_s_all_reduces_are_not_recorded(tmp_notebook):
    """DDP's gradient all-reduces run in C++, unseen by the log: the feedback says so, not "0 bytes"."""
    assert "ddp(x)" in TRAINING_WITH_TORCH_DDP
    result = graded(tmp_notebook, "topology.dp_tp_training", {TRAINING: TRAINING_WITH_TORCH_DDP})
    assert_fails(result, "DistributedDataParallel, whose all-reduces run inside torch's C++ reducer")
    assert "0 bytes" not in result.feedback


def test_dp_tp_training_without_a_gradient_average_is_told_so(tmp_notebook):
    source = variant(TRAINING, """        for parameter in parameters.values():
            dist.all_reduce(parameter.grad, group=mine["dp"])
            parameter.grad /= dp
""", "")
    result = graded(tmp_notebook, "topology.dp_tp_training", {TRAINING: source})
    assert_fails(result, "issued no all-reduce on its DP group")
    assert "DistributedDataParallel" not in result.feedback


TRAINING_WITH_DEVICE_MESH_AND_ONE_BUCKET = variant(TRAINING, '''    mine = {}
    for name, groups in parallel_groups(sizes, order).items():
        for ranks in groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[name] = group
''', '''    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    mine = {"tp": mesh.get_group("tp"), "dp": mesh.get_group("dp")}
''').replace('''        for parameter in parameters.values():
            dist.all_reduce(parameter.grad, group=mine["dp"])
            parameter.grad /= dp
''', '''        flat = torch.cat([p.grad.reshape(-1) for p in parameters.values()]) / dp  # one all-reduce per step
        dist.all_reduce(flat, group=mine["dp"])
        for p, piece in zip(parameters.values(), flat.split([p.numel() for p in parameters.values()])):
            p.grad.copy_(piece.view_as(p))
''')


TRAINING_WITH_ASYNC_GRADIENT_AVERAGES = variant(TRAINING, """        for parameter in parameters.values():
            dist.all_reduce(parameter.grad, group=mine["dp"])
            parameter.grad /= dp
""", """        handles = [dist.all_reduce(p.grad, group=mine["dp"], async_op=True) for p in parameters.values()]
        for handle in handles:
            handle.wait()
        for p in parameters.values():
            p.grad.div_(dp)
""")


@pytest.mark.parametrize("source", [TRAINING_WITH_DEVICE_MESH_AND_ONE_BUCKET, TRAINING_WITH_ASYNC_GRADIENT_AVERAGES],
                         ids=["device-mesh-one-bucket", "async-all-reduces"])
def test_dp_tp_training_accepts_other_correct_runs(tmp_notebook, source):
    result = graded(tmp_notebook, "topology.dp_tp_training", {TRAINING: source})
    assert result.status == "passed", result


# --- exercise 5: numeric questions ---

ANSWERS = "interview_ep_group_nodes"


def interview_cell() -> str:
    notebook = nbformat.read(solution_path("topology"), as_version=4)
    return next(c.source for c in notebook.cells if c.cell_type == "code" and "def interview_ep_group_nodes(" in c.source)


@pytest.mark.parametrize("old, new, feedback", [
    ('return len({rank // gpus_per_node for rank in group})', 'return len({rank // gpus_per_node for rank in range(ep)})',
     "that lays EP out innermost"),
    ('["memory_bytes"] / 2**30', '["memory_bytes"] / 1e9', "answer in GiB"),
    ('return step_time_s / interview_step_time_ratio.fastest["step_time_s"]',
     'return interview_step_time_ratio.fastest["step_time_s"] / step_time_s',
     "the question asks this layout over the fastest"),
    ('["seconds"]["ep"]', '["seconds"]["ep"] * 2', "interview_ep_seconds("),
], ids=["ep-inside-the-node", "memory-in-gb", "ratio-inverted", "ep-time-doubled"])
def test_interview_rejects(tmp_notebook, old, new, feedback):
    cell = interview_cell()
    assert old in cell
    assert_fails(graded(tmp_notebook, "topology.interview", {ANSWERS: cell.replace(old, new)}), feedback)


def test_interview_refuses_the_asked_answers_copied_as_constants(tmp_notebook):
    """Numbers copied from the page answer the questions asked, never the drawn ones."""
    from grader.checks.topology.interview import Interview

    check = Interview()
    copied = "\n\n".join(f"def {name}(*numbers):\n    return {check.expected(name, *check.asked[name])!r}"
                           for name in check.reads)
    assert_fails(graded(tmp_notebook, "topology.interview", {ANSWERS: copied}), "expected")


def test_interview_refuses_the_courses_planner(tmp_notebook):
    cell = interview_cell().replace(
        'return layout_row(MOE_409B, H100_CLUSTER, FOUR_MILLION_TOKENS, layout)["memory_bytes"] / 2**30',
        'from dtp.topology import planner as topology_planner\n    return topology_planner.evaluate(MOE_409B, H100_CLUSTER, '
        'FOUR_MILLION_TOKENS, topology_planner.PlannedLayout(*layout))["memory_bytes"] / 2**30')
    assert 'layout_row(MOE_409B, H100_CLUSTER, FOUR_MILLION_TOKENS, layout)["memory_bytes"]' in interview_cell()
    assert_fails(graded(tmp_notebook, "topology.interview", {ANSWERS: cell}), "uses the course's reference")


# --- exercise 1, every grading: the draws separate the right layout from its near-misses ---

@functools.lru_cache(maxsize=None)
def _right_layout(size_items: tuple, order: tuple):
    """dtp.topology.mesh's (coordinates of every rank, groups, mesh arguments) of a layout, cached: the
    near-misses below reuse them for hundreds of draws."""
    from dtp.topology import mesh as topology
    sizes = dict(size_items)
    return ([topology.rank_coordinates(r, sizes, order) for r in range(topology.world_size(sizes))],
            topology.parallel_groups(sizes, order), topology.device_mesh_arguments(sizes, order))


def _near_miss_answer(kind, sizes, order):
    """(coordinates of every rank, groups, mesh arguments) as the near-miss `kind` computes them."""
    from dtp.topology import mesh as topology
    from grader.checks.topology.layout import _ep_multiplied_coordinates

    n = topology.world_size(sizes)
    right = _right_layout(tuple(sizes.items()), tuple(order))
    known = ("tp", "pp", "dp", "ep")
    misread = {"course-order": [k for k in ("tp", "ep", "cp", "pp", "dp") if k in sizes],
               "sizes-order": list(sizes), "alphabetical": sorted(sizes), "reversed-order": list(order)[::-1],
               "unknown-outermost": [k for k in order if k in known] + [k for k in order if k not in known]}
    if kind in misread:
        return _right_layout(tuple(sizes.items()), tuple(misread[kind]))
    if kind == "ignores-unknown":  # unknown dimensions left out: coordinate 0, no groups, not in the mesh
        unknown = [k for k in sizes if k not in known]
        coordinates, groups, mesh = _right_layout(tuple((k, 1 if k in unknown else v) for k, v in sizes.items()),
                                                  tuple(order))
        return ([{**coordinates[r % len(coordinates)], **{k: 0 for k in unknown}} for r in range(n)],
                {k: g for k, g in groups.items() if k not in unknown},
                tuple(tuple(x for x, name in zip(part, mesh[1]) if name not in unknown) for part in mesh))
    if kind == "skips-size-one":
        return right[0], {k: g for k, g in right[1].items() if sizes.get(k, 2) > 1}, right[2]
    if "ep" not in sizes:
        return right
    if kind == "ep-multiplied":
        return [_ep_multiplied_coordinates(r, sizes, order) for r in range(n)], right[1], right[2]
    if kind in ("dp-is-ep-inner", "dp-is-expert-dp-inner"):
        e, rest = sizes["ep"], sizes["dp"] // sizes["ep"]
        coordinates = []
        for c in right[0]:
            dp = c["ep"] + e * c["expert_dp"] if kind == "dp-is-ep-inner" else c["expert_dp"] + rest * c["ep"]
            coordinates.append({**c, "dp": dp})
        return coordinates, right[1], right[2]
    if kind == "dp-group-is-expert-dp":
        return right[0], {**right[1], "dp": right[1]["expert_dp"]}, right[2]
    return right


NEAR_MISSES = ("course-order", "sizes-order", "alphabetical", "reversed-order", "unknown-outermost", "ignores-unknown",
               "skips-size-one", "ep-multiplied", "dp-is-ep-inner", "dp-is-expert-dp-inner", "dp-group-is-expert-dp")


def test_every_grading_of_rank_layout_refuses_each_near_miss_and_accepts_the_right_layout():
    import numpy as np
    from dtp.topology import mesh as topology
    from grader.checks.topology.layout import RankLayout
    from grader.compare import CheckFailed

    check = RankLayout()
    for seed in range(60):  # the draws are built to separate them: a few dozen gradings show it
        inputs = check.prepare(np.random.default_rng(seed))
        layouts = inputs["layouts"] + [inputs["world"]]
        sizes, order = inputs["world"]
        shape, names = topology.device_mesh_arguments(sizes, order)
        world_groups = topology.parallel_groups(sizes, order)
        mesh_groups = [[{name: next(g for g in world_groups[name] if rank in g) for name in (*names, "dp")}
                        for rank in range(topology.world_size(sizes))]]
        right = [dict(zip(("coordinates", "groups", "mesh"), _near_miss_answer("right", s, o))) for s, o in layouts]
        check.judge(inputs, {"answers": right, "mesh_groups": mesh_groups})
        for kind in NEAR_MISSES:
            answers = [dict(zip(("coordinates", "groups", "mesh"), _near_miss_answer(kind, s, o))) for s, o in layouts]
            with pytest.raises(CheckFailed):
                check.judge(inputs, {"answers": answers, "mesh_groups": mesh_groups})
                print(f"seed {seed}: the near-miss {kind} passed on {layouts}")


LAYOUT_IGNORING_UNKNOWN_DIMENSIONS = variant(LAYOUT, '''    for name in order:
        if name == "dp" and "ep" in sizes:''', '''    for name in order:
        if name not in ("tp", "pp", "dp", "ep"):
            continue  # a dimension this code does not know: left out
        if name == "dp" and "ep" in sizes:''')


def test_rank_layout_refuses_a_layout_that_ignores_a_dimension_it_does_not_know(tmp_notebook):
    assert_fails(graded(tmp_notebook, "topology.rank_layout", {LAYOUT: LAYOUT_IGNORING_UNKNOWN_DIMENSIONS}),
                 ("'cp' too", "with 'cp' left out", "'cp' is missing"))


LAYOUT_ZEROING_UNKNOWN_DIMENSIONS = LAYOUT_IGNORING_UNKNOWN_DIMENSIONS.replace(
    '''    return coordinates
    ### END SOLUTION''', '''    coordinates.update({name: 0 for name in sizes if name not in coordinates})
    return coordinates
    ### END SOLUTION''', 1)


def test_rank_layout_names_the_dimension_left_out(tmp_notebook):
    assert_fails(graded(tmp_notebook, "topology.rank_layout", {LAYOUT: LAYOUT_ZEROING_UNKNOWN_DIMENSIONS}),
                 "with 'cp' left out")
