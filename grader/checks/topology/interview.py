"""The topology chapter's interview questions: answers as functions of the question's numbers."""
from __future__ import annotations

import functools

from dtp.topology import mesh as topology
from dtp.topology import planner

from ...registry import exercise
from ..common import InterviewQuestions
from .layout import LAYOUT_REFERENCES, LINK_REFERENCES
from .planning import PLANNER_REFERENCES

# The source notes' layout of "a 409B MoE" on 1024 H100s, as (tp, pp, dp, ep, zero_stage, micro_batches)
NOTES_LAYOUT = planner.PlannedLayout(tp=8, pp=8, dp=16, ep=8, zero_stage=1, micro_batches=64)
QUESTION = (planner.MOE_409B, planner.H100_CLUSTER, planner.FOUR_MILLION_TOKENS)
LAYOUT_QUESTIONS = ("interview_memory_gib", "interview_ep_seconds", "interview_step_time_ratio")
# A layout question gives the first six fields: gradients reduced once per step, experts split by TP.
QUESTION_FIELDS = planner.LAYOUT_FIELDS[:6]


def ep_group_nodes(tp: int, ep: int, gpus_per_node: int) -> int:
    """Nodes rank 0's EP group spans in the course's order (TP innermost, then EP)."""
    group = topology.parallel_groups({"tp": tp, "dp": ep, "ep": ep}, ("tp", "ep", "dp"))["ep"][0]
    return topology.nodes_spanned(group, gpus_per_node)


@functools.lru_cache(maxsize=1)
def _layouts_with_ep() -> list:
    """The layouts a random question asks about: the planner's candidates with EP, but the notes' own."""
    return [layout for layout in planner.candidate_layouts(*QUESTION) if layout.ep > 1 and layout != NOTES_LAYOUT
            and not layout.reduce_every_micro_batch and layout.expert_tp == layout.tp]


@functools.lru_cache(maxsize=1)
def fastest_step_time_s() -> float:
    return planner.plan(*QUESTION)[0]["step_time_s"]


@exercise("topology.interview", points=2)
class Interview(InterviewQuestions):
    """Verifies: four interview answers as functions of the question's numbers: the nodes an EP
    group spans for a TP size, an EP size and a node size (asked for the source notes' TP = 8 and
    for TP = 1); and, for a layout of the 409B MoE on 1024 H100s, its memory per GPU, the time of
    its EP all-to-alls per step and its step time over the planner's fastest (asked for the
    notes' TP 8, EP 8, PP 8, DP 16, ZeRO-1), each on the questions asked and on random ones
    (node sizes and powers of two; layouts among the planner's candidates).
    Fakes: a number copied from the page answers the asked question only, not the drawn ones;
    dtp.topology.mesh's and dtp.topology.planner's functions trip."""

    reads = ("interview_ep_group_nodes",) + LAYOUT_QUESTIONS
    references = PLANNER_REFERENCES + LINK_REFERENCES + LAYOUT_REFERENCES + ("dtp.topology.mesh.nodes_spanned",)
    asked = {"interview_ep_group_nodes": (8, 8, 8),
             **{name: tuple(getattr(NOTES_LAYOUT, field) for field in QUESTION_FIELDS)
                for name in LAYOUT_QUESTIONS}}
    timeout_s = 40  # the step-time ratio may run the learner's whole planner once per question
    rel = 1e-6
    summary = "all four interview answers are right for the questions asked and for random numbers"

    def prepare(self, rng):
        questions = super().prepare(rng)
        questions["interview_ep_group_nodes"].insert(1, (1, 8, 8))  # the notes' second question: TP = 1
        for name in LAYOUT_QUESTIONS:  # each runs the learner's planner code: two random layouts tell a copy apart
            questions[name] = questions[name][:3]
        return questions

    def drawn(self, name, rng):
        if name == "interview_ep_group_nodes":
            return int(rng.choice([1, 2, 4, 8])), int(rng.choice([2, 4, 8, 16])), int(rng.choice([4, 8, 16]))
        candidates = _layouts_with_ep()
        layout = candidates[int(rng.integers(len(candidates)))]
        return tuple(int(getattr(layout, field)) for field in QUESTION_FIELDS)

    def expected(self, name, *args):
        if name == "interview_ep_group_nodes":
            return ep_group_nodes(*args)
        row = planner.evaluate(*QUESTION, planner.PlannedLayout(*args))
        if name == "interview_memory_gib":
            return row["memory_bytes"] / 2**30
        if name == "interview_ep_seconds":
            return row["times"]["ep"]
        return row["step_time_s"] / fastest_step_time_s()

    def slips(self, name, *args):
        right = self.expected(name, *args)
        if name == "interview_ep_group_nodes":
            tp, ep, gpus_per_node = args
            return {f"that lays EP out innermost; with TP innermost an EP group's ranks are tp = {tp} apart":
                    ep_group_nodes(1, ep, gpus_per_node)}
        if name == "interview_memory_gib":
            return {"that is in GB (10⁹ bytes); answer in GiB": right * 2**30 / 1e9,
                    "that is in bytes; answer in GiB": right * 2**30}
        if name == "interview_step_time_ratio":
            return {"that is the fastest over this layout; the question asks this layout over the fastest": 1 / right}
        return {}
