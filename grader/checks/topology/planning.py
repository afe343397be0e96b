"""Exercise 3 of the topology chapter: a planner that lists the layouts of a model that fit on a
cluster, with their memory, traffic per link class, bubble and step time."""
from __future__ import annotations

import functools

import numpy as np

from dtp.ep import moe
from dtp.topology import mesh as topology
from dtp.topology import planner
from dtp.zero import formulas as zero

from ...compare import CheckFailed, expect, expect_answer
from ...registry import Check, exercise
from .layout import LINK_REFERENCES

PLANNER_REFERENCES = tuple(f"dtp.topology.planner.{name}" for name in (
    "plan", "evaluate", "candidate_layouts", "step_time", "traffic_per_gpu", "memory_per_gpu",
    "peak_memory_per_gpu", "moe_extra_activation_bytes_per_layer", "bytes_by_link", "model_flops_utilization",
    "dp_bytes_per_gpu", "expert_tokens_per_gpu", "folded_group_link"))


# The oracle's plan of a case, computed once per case (prepare picks cases by it, judge compares with it).
_plan = functools.lru_cache(maxsize=16)(planner.plan)

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
                                    flops_utilization=float(rng.uniform(0.3, 0.6)),
                                    chunks=int(rng.choice([1, 2])), pp_outermost=bool(rng.integers(2)))
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


def _links_differ_when_read_in(model, cluster, training, wrong_order) -> bool:
    """Whether some fitting layout sends bytes on a dimension whose link class differs when the
    layout's ranks are read in `wrong_order(layout)`: cases where none does cannot catch that slip."""
    candidates = {_layout_key(layout): layout for layout in planner.candidate_layouts(model, cluster, training)}
    for row in _plan(model, cluster, training):
        layout = candidates[_key(row)]
        misread = topology.dimension_links(layout.sizes(model), wrong_order(layout), cluster.gpus_per_node)
        if any(entry["bytes"] and entry["link"] != misread[name] for name, entry in row["traffic"].items()):
            return True
    return False


def _links_tell_the_order(model, cluster, training) -> bool:
    """The order read the wrong way round (TP outermost) changes some fitting layout's links."""
    return _links_differ_when_read_in(model, cluster, training,
                                      lambda layout: tuple(layout.order(model, training.pp_outermost))[::-1])


def _links_tell_pp_from_dp(model, cluster, training) -> bool:
    """With PP outermost, reading the order as DP outermost changes some fitting layout's links:
    only such a case catches the order ignored."""
    return training.pp_outermost and _links_differ_when_read_in(model, cluster, training,
                                                                lambda layout: layout.order(model, False))


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
    estimated step time, best first. The draws always include a fitting ZeRO-2/3 layout reducing
    every one of several micro-batches, one with ZeRO-2/3 and PP > 1, and an MoE layout with TP and
    EP, an interleaved (v = 2) case with PP > 1, and both rank orders (DP or PP outermost, the
    latter with a layout whose links differ between the two orders), and a layout whose DP traffic
    outlasts the last micro-batch's backward, so that
    DP traffic counted once per step with sharded gradients, and every TP rank dispatching the
    whole micro-batch, and DP traffic hidden under more compute than the last backward (or none),
    are refused by name.
    Fakes: dtp.topology.planner's planner functions trip; the cases are random.
    """

    reads = ("plan_layouts",)
    references = PLANNER_REFERENCES + LINK_REFERENCES
    timeout_s = 30

    def prepare(self, rng):
        while True:
            cases = [_planner_case(rng, moe) for moe in (False, True, bool(rng.integers(2)))]
            rows = [row for case in cases for row in _plan(*case)]
            # Cases where the corrections matter: a fitting ZeRO-2/3 layout reducing every one of
            # several micro-batches (once per step would be wrong), one with ZeRO and PP > 1, and an
            # MoE layout with TP and EP (dispatching the whole micro-batch would be wrong).
            if (any(_links_tell_the_order(*case) for case in cases)
                    and any(r["reduce_every_micro_batch"] and r["micro_batches"] > 1 and r["dp"] > 1 for r in rows)
                    and any(r["zero_stage"] >= 2 and r["pp"] > 1 for r in rows)
                    and any(r["tp"] > 1 and r["ep"] > 1 and r["expert_tp"] > 1 for r in rows)
                    and any(case[2].chunks > 1 and any(r["pp"] > 1 for r in _plan(*case)) for case in cases)
                    and len({case[2].pp_outermost for case in cases}) == 2
                    and any(_links_tell_pp_from_dp(*case) for case in cases)
                    and any(r["times"]["dp"] + r["times"].get("expert_dp", 0.0) > 0 for r in rows)):
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
    oracle = {_key(row): row for row in _plan(model, cluster, training)}
    listed = [_key(row) for row in rows]
    for key in listed:
        tp, pp, dp, ep = key[:4]
        if key not in candidates:
            every, expert_tp = key[6:8]
            if every and key[4] < 2:
                raise CheckFailed(f"plan_layouts ({what}) lists {_show(key)}: reduce_every_micro_batch = 1 is a "
                                  "choice for ZeRO-2 and 3 only (stage 0 and 1 reduce once per step)")
            if expert_tp != tp and not model.is_moe:
                raise CheckFailed(f"plan_layouts ({what}) lists {_show(key)}: a dense model's expert_tp is its tp")
            if tp * pp * dp != cluster.gpus:
                raise CheckFailed(f"plan_layouts ({what}) lists {_show(key)}, which uses tp·pp·dp = {tp * pp * dp} "
                                  f"GPUs; the cluster has {cluster.gpus}. EP is carved out of DP: tp·pp·dp = GPUs, "
                                  "and ep divides dp")
            raise CheckFailed(f"plan_layouts ({what}) lists {_show(key)}, which is not among the layouts to "
                              "enumerate (tp divides a node's GPUs, the heads and the sequence; pp divides the layers; "
                              "ep divides dp and the experts; ZeRO 0-3 with any pp, stages 2 and 3 both ways of "
                              "accumulating; expert_tp = tp, or 1 when tp > 1 and tp·ep divides the experts; "
                              "m = batch/(dp·b) whole and at least pp)")
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
    if not np.isclose(row["memory_bytes"], right["memory_bytes"], rtol=1e-6):  # slips computed only when wrong
        expect_answer(row["memory_bytes"], right["memory_bytes"], f"{where}: memory_bytes", rel=1e-6, slips={
            "that leaves out the activations": _without_activations(model, training, layout)})
    wrong = not all(np.isclose(row[f], right[f], rtol=1e-6) for f in ("intra_node_bytes", "inter_node_bytes",
                                                                      "step_time_s"))
    slips = _traffic_slips(model, cluster, training, layout, right["traffic"]) if wrong else {}
    for field, link, other in (("intra_node_bytes", topology.INTRA_NODE, "inter_node_bytes"),
                               ("inter_node_bytes", topology.INTER_NODE, "intra_node_bytes")):
        if np.isclose(row[field], right[field], rtol=1e-6):
            continue
        for feedback, traffic in slips.items():
            if np.isclose(row[field], planner.bytes_by_link(traffic)[link], rtol=1e-6):
                raise CheckFailed(f"{where}: {field} is {row[field]:.6g}, expected {right[field]:.6g}: {feedback}")
        on_link = [f"{name} {entry['bytes']:.6g}" for name, entry in right["traffic"].items()
                   if entry["link"] == link and entry["bytes"]]
        hint = (" That is the other link class's total: with TP innermost, TP's groups (and EP's, when t·e GPUs "
                "fit in a node) lie inside a node; compare each dimension's groups with the nodes"
                if np.isclose(row[field], right[other], rtol=1e-6) and right[other] else "")
        raise CheckFailed(f"{where}: {field} is {row[field]:.6g}, expected {right[field]:.6g} = "
                          f"{' + '.join(on_link) or '0'} bytes (per GPU per step).{hint}")
    expect_answer(row["bubble"], right["bubble"], f"{where}: bubble", rel=1e-9, slips={
        "that is (p-1)/m, idle time relative to the busy time; the bubble here is the idle share of the step, "
        "(p-1)/(v·m+p-1)": pipeline_bubble_over_ideal(row, training)})
    parts = ", ".join(f"{name} {seconds:.4g} s" for name, seconds in times.items() if name != "total" and seconds)
    time_slips = {}
    if not np.isclose(row["step_time_s"], right["step_time_s"], rtol=1e-6):
        # the exposure rule's slips first (short texts: where several coincide, each stays readable)
        for feedback, hidden_under in ((OVERLAP_BEYOND_COMPUTE, times["compute"]), (NO_DP_OVERLAP, 0.0)):
            time_slips[feedback] = planner.step_time(model, cluster, training, layout,
                                                     dp_hidden_under=hidden_under)["total"]
    time_slips.update({feedback: planner.step_time(model, cluster, training, layout, traffic)["total"]
                       for feedback, traffic in slips.items()})
    try:
        expect_answer(row["step_time_s"], right["step_time_s"], f"{where}: step_time_s", rel=1e-6, slips=time_slips)
    except CheckFailed as failed:
        raise CheckFailed(f"{failed} (expected parts: {parts})") from None


OVERLAP_BEYOND_COMPUTE = "DP hidden under more computation than can hide it: only the last backward, (2/3)·compute/m"
NO_DP_OVERLAP = "all DP traffic left exposed: it hides under the last backward, (2/3)·compute/m"
ONCE_PER_STEP = ("that counts the data-parallel traffic once per step, but with ZeRO-2/3 gradients kept sharded "
                 "every micro-batch reduce-scatters its gradients (and ZeRO-3 gathers the weights for each "
                 "micro-batch): zero.accumulation_bytes_sent_per_gpu with reduce_every_micro_batch")
# The same slip written with the accumulation formula of unsharded gradients (ZeRO-3's gathers per micro-batch kept).
ONCE_PER_STEP_ACCUMULATED = ONCE_PER_STEP.replace("that counts", "that reduces the gradients as if they were "
                                                  "accumulated unsharded, that is counts")
WHOLE_MICRO_BATCH = ("that has every GPU of a TP group dispatch the whole micro-batch's b·s tokens; with sequence "
                     "parallelism each TP rank dispatches its own b·s/t (capacity from b·s//t tokens)")


def _traffic_slips(model, cluster, training, layout, right) -> dict[str, dict]:
    """The traffic (as planner.traffic_per_gpu gives it) of two plausible mistakes, where they
    differ from the right traffic: DP bytes once per step with sharded gradients, and EP
    dispatching the whole micro-batch on every TP rank."""
    slips = {}
    t, p, e, w = layout.tp, layout.pp, layout.ep, training.bytes_per_value
    if layout.reduce_every_micro_batch and layout.micro_batches > 1:
        counts = planner.parameter_counts(model)
        shares = {"dp": (counts["non_expert"] / (t * p), layout.dp)}
        if model.is_moe:
            shares["expert_dp"] = (counts["experts"] / (t * p * e), layout.dp // e)
        once = {name: dict(entry) for name, entry in right.items()}
        accumulated = {name: dict(entry) for name, entry in right.items()}
        for name, (n, d) in shares.items():
            once[name]["bytes"] = zero.communication_bytes_per_gpu(n, d, layout.zero_stage, w)
            sent = zero.accumulation_bytes_sent_per_gpu(n, d, layout.micro_batches, layout.zero_stage, False, w, w)
            accumulated[name]["bytes"] = sent["gradients"] + sent["weights"]
        slips[ONCE_PER_STEP] = once
        slips[ONCE_PER_STEP_ACCUMULATED] = accumulated
    if model.is_moe and t > 1:
        tokens = training.micro_batch * model.seq
        capacity = {n: moe.expert_capacity(n, model.experts, model.top_k, model.capacity_factor)
                    for n in (tokens // t, tokens)}
        if capacity[tokens] != capacity[tokens // t]:
            wrong = {name: dict(entry) for name, entry in right.items()}
            scale = capacity[tokens] / capacity[tokens // t]
            wrong["ep"]["bytes"] *= scale
            if layout.expert_tp > 1:  # the experts' all-gather and reduce-scatter move the larger buffers too
                passes = 3 if training.recompute == "full" else 2
                per_row = (model.layers // p) * layout.micro_batches * 2 * (t - 1) * model.experts * model.hidden \
                    * w * passes
                wrong["tp"]["bytes"] += per_row * (capacity[tokens] - capacity[tokens // t])
            slips[WHOLE_MICRO_BATCH] = wrong
    return slips


def pipeline_bubble_over_ideal(row, training) -> float:
    return (row["pp"] - 1) / (training.chunks * row["micro_batches"])

