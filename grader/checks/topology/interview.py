"""The topology chapter's interview questions."""
from __future__ import annotations

import functools

from dtp import topology
from dtp import topology_planner as planner

from ...compare import expect_answer
from ...registry import exercise
from ..common import FixedAnswers

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
