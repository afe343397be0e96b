"""Exercise 9: node-limited routing (DeepSeek-V3): every token's experts on at most M nodes, and
the bytes its dispatch sends across nodes."""
from __future__ import annotations

import numpy as np

from dtp.ep import moe  # noqa: F401  imported before the sandbox is confined
from dtp.ep import routing as moe_routing

from ...compare import CheckFailed, expect, expect_answer
from ...registry import Check, exercise
from ..references import refuses_library
from .shared import MOE, integer_array, known_mistake, pair


@exercise("ep.node_limited", points=3)
@refuses_library("dtp.ep.routing", MOE)
class NodeLimited(Check):
    """Verifies: `node_limited_router` keeps, for every token, the M nodes whose k/M most probable
    experts sum highest and routes top-k among their experts (best first, gate weights the
    probabilities, renormalised and not), on draws where plain top-k spans more than M nodes and
    where scoring a node by its single best expert or by all its experts, or a limit applied after
    the top-k, would change some token's experts (each named);
    every token's experts lie on at most M nodes. `cross_node_bytes` counts one crossing per token
    and destination node other than its own, on those routings from random source nodes, and
    `max_cross_node_bytes` is the bound T·M·h·w.
    Fakes: dtp.ep.routing's functions and dtp.ep.moe's router trip; fresh logits defeat a table.
    """

    reads = ("node_limited_router", "cross_node_bytes", "max_cross_node_bytes")
    timeout_s = 15

    def prepare(self, rng):
        cases = []
        for max_nodes, per_node_k, renormalize in ((1, 2, False), (2, 1, True), (2, 2, True), (3, 2, False)):
            nodes, k = int(rng.integers(max_nodes + 2, 9)), max_nodes * per_node_k
            per_node = int(rng.integers(max(per_node_k, 2), 7))
            for _ in range(50):  # until the near-misses differ from the rule on some token
                logits = rng.standard_normal((int(rng.integers(10, 40)), nodes * per_node)) * float(rng.choice([1.0, 2.5]))
                if _separates(logits, k, per_node, max_nodes):
                    break
            cases.append({"logits": logits, "k": k, "experts_per_node": per_node, "max_nodes": max_nodes,
                          "renormalize": renormalize, "source_node": int(rng.integers(nodes)),
                          "hidden": int(rng.integers(8, 4096)), "bytes_per_element": int(rng.choice([2, 4])),
                          # a routing that respects the limit, for the bytes (drawn here: collect may not call dtp)
                          "limited_indices": moe_routing.node_limited_routing(logits, k, per_node, max_nodes, False)[0]})
        return cases

    def collect(self, student, cases):
        answers = []
        for case in cases:
            routed = student.node_limited_router(case["logits"].copy(), case["k"], case["experts_per_node"],
                                                 case["max_nodes"], case["renormalize"])
            crossing = student.cross_node_bytes(case["limited_indices"].copy(), case["experts_per_node"], case["source_node"], case["hidden"],
                                                case["bytes_per_element"])
            bound = student.max_cross_node_bytes(case["logits"].shape[0], case["k"], case["max_nodes"], case["hidden"],
                                                 case["bytes_per_element"])
            answers.append({"routed": routed, "crossing": crossing, "bound": bound})
        return answers

    def judge(self, cases, answers) -> str:
        expect(len(answers) == len(cases), "the grader's calls did not all return")
        for case, answer in zip(cases, answers):
            _judge_routing(case, answer["routed"])
            _judge_bytes(case, answer["crossing"], answer["bound"])
        return ("every token's k experts come from its M best nodes (scored by their k/M best experts), gate weights "
                "unchanged, and the cross-node dispatch bytes and their bound T·M·h·w are right")


def _after_top_k(logits, k, per_node, max_nodes) -> np.ndarray:
    """The slip: top-k over all experts first, keep the M nodes with the most chosen probability,
    then fill k from those nodes."""
    probabilities = moe.softmax(logits)
    chosen, _ = moe.top_k_routing(logits, k, False)
    tokens, experts = probabilities.shape
    scores = np.zeros((tokens, experts // per_node))
    np.add.at(scores, (np.arange(tokens)[:, None], chosen // per_node), np.take_along_axis(probabilities, chosen, 1))
    nodes = np.argsort(-scores, axis=1, kind="stable")[:, :max_nodes]
    allowed = np.zeros_like(scores, dtype=bool)
    np.put_along_axis(allowed, nodes, True, axis=1)
    masked = np.where(np.repeat(allowed, per_node, axis=1), probabilities, -np.inf)
    return np.argsort(-masked, axis=1, kind="stable")[:, :k]


def _by_node_score(logits, k, per_node, max_nodes, best: int | None) -> np.ndarray:
    """The slip: nodes scored by the sum of their `best` most probable experts (1: DeepSeek-V2's
    device-limited rule; None: all of them) instead of their k/M best."""
    probabilities = moe.softmax(logits)
    tokens, experts = probabilities.shape
    by_node = np.sort(probabilities.reshape(tokens, experts // per_node, per_node), axis=2)
    score = by_node[:, :, -best:].sum(axis=2) if best else by_node.sum(axis=2)
    nodes = np.argsort(-score, axis=1, kind="stable")[:, :max_nodes]
    allowed = np.zeros_like(score, dtype=bool)
    np.put_along_axis(allowed, nodes, True, axis=1)
    masked = np.where(np.repeat(allowed, per_node, axis=1), probabilities, -np.inf)
    return np.argsort(-masked, axis=1, kind="stable")[:, :k]


def routing_slips(logits, k, per_node, max_nodes) -> dict:
    """feedback -> the expert indices that mistake chooses: each differs from the rule on some
    token of every case `_separates` accepts, where it can differ at all."""
    slips = {"the node limit is ignored: that is plain top-k, whose experts span more than max_nodes nodes":
                 moe.top_k_routing(logits, k, False)[0],
             "the limit is applied after the top-k: choose the M nodes first (each scored by the sum of its k/M most "
             "probable experts), then the top-k among their experts": _after_top_k(logits, k, per_node, max_nodes)}
    if k // max_nodes > 1:  # with one expert per node from each, its best expert is its score
        slips["the nodes are scored by their single best expert; DeepSeek-V3 scores a node by the sum of its k/M "
              "most probable experts"] = _by_node_score(logits, k, per_node, max_nodes, 1)
    if k // max_nodes < per_node:  # a node's k/M best are not all its experts
        slips["the nodes are scored by the sum of all their experts' probabilities; DeepSeek-V3 sums only each node's "
              "k/M most probable experts (a node of many middling experts must not outscore one with a few strong "
              "ones)"] = _by_node_score(logits, k, per_node, max_nodes, None)
    return slips


def _separates(logits, k, per_node, max_nodes) -> bool:
    right, _ = moe_routing.node_limited_routing(logits, k, per_node, max_nodes, False)
    return all(not np.array_equal(right, wrong) for wrong in routing_slips(logits, k, per_node, max_nodes).values())


def _judge_routing(case, answer) -> None:
    logits, k, per_node, max_nodes = case["logits"], case["k"], case["experts_per_node"], case["max_nodes"]
    what = (f"node_limited_router(logits of shape {logits.shape}, k={k}, experts_per_node={per_node}, "
            f"max_nodes={max_nodes}, renormalize={case['renormalize']})")
    indices, weights = pair(answer, "expert_indices, gate_weights", what)
    indices = integer_array(indices, (logits.shape[0], k), "expert_indices", what)
    expected, expected_weights = moe_routing.node_limited_routing(logits, k, per_node, max_nodes, case["renormalize"])
    if not np.array_equal(indices, expected):
        slip = known_mistake(indices, routing_slips(logits, k, per_node, max_nodes), rtol=0, atol=0)
        if slip:
            raise CheckFailed(f"{what}: {slip}")
        spans = [len(set((row // per_node).tolist())) for row in indices]
        token = int(np.argmax(np.any(indices != expected, axis=1)))
        raise CheckFailed(f"{what}: " + (f"token {int(np.argmax(spans))}'s experts lie on {max(spans)} nodes, more than "
                                         f"max_nodes = {max_nodes}" if max(spans) > max_nodes else
                                         f"token {token} went to experts {indices[token].tolist()}, expected "
                                         f"{expected[token].tolist()}"))
    expect(isinstance(weights, np.ndarray) and weights.shape == expected_weights.shape,
           f"{what}: gate_weights should be an array of shape {expected_weights.shape}")
    if not np.allclose(weights, expected_weights, rtol=1e-9, atol=1e-12):
        raise CheckFailed(f"{what}: the experts are right; the gate weights should be their softmax probabilities "
                          f"over all experts{', divided by their sum' if case['renormalize'] else ''} (the limit "
                          "changes which experts, not how their probabilities are computed)")


def _judge_bytes(case, crossing, bound) -> None:
    k, per_node, max_nodes = case["k"], case["experts_per_node"], case["max_nodes"]
    hidden, width, source = case["hidden"], case["bytes_per_element"], case["source_node"]
    tokens, indices = case["logits"].shape[0], case["limited_indices"]
    what = (f"cross_node_bytes({tokens} tokens' expert_indices, experts_per_node={per_node}, source_node={source}, "
            f"hidden={hidden}, bytes_per_element={width})")
    expect_answer(crossing, moe_routing.cross_node_dispatch_bytes(indices, per_node, source, hidden, width), what,
                  rel=1e-12, slips=crossing_slips(case))
    what = (f"max_cross_node_bytes(tokens={tokens}, k={k}, max_nodes={max_nodes}, hidden={hidden}, "
            f"bytes_per_element={width})")
    expect_answer(bound, tokens * max_nodes * hidden * width, what, rel=1e-12, slips=bound_slips(case))


def crossing_slips(case) -> dict:
    per_node, source, hidden, width = case["experts_per_node"], case["source_node"], case["hidden"], case["bytes_per_element"]
    indices = case["limited_indices"]
    nodes, row = indices // per_node, hidden * width
    return {"that sends one copy per expert; a token crosses to each other node once (and is copied to its experts "
            "there)": int(np.sum(nodes != source)) * row,
            "a token's own node is reached without crossing: count only the other nodes":
                sum(len(set(r.tolist())) for r in nodes) * row,
            "bytes_per_element is missing": moe_routing.cross_node_dispatch_bytes(indices, per_node, source, hidden, 1)}


def bound_slips(case) -> dict:
    tokens, k, max_nodes = case["logits"].shape[0], case["k"], case["max_nodes"]
    row = case["hidden"] * case["bytes_per_element"]
    return {"that is one copy per expert, the bound without the limit (and without sending once per node); with it a "
            "token reaches at most M nodes": tokens * k * row,
            "the token's own node need not be among its M nodes, so all M may be crossings": tokens * (max_nodes - 1) * row}
