"""Routing as practised since DeepSeek-V3: auxiliary-loss-free load balancing (a per-expert bias
that steers the choice of experts, never the gate weights) and node-limited routing (each token's
experts on at most M nodes) with the cross-node bytes it bounds.

Conventions are dtp.ep.moe's: logits (T, E), softmax probabilities, `indices[t, j]` token t's j-th
choice, best first, ties to the lower expert index.

tests/ep/test_ep_routing.py checks every function here against a brute-force loop, and
tests/topology/test_topology_planner.py the expected dispatch copies against `node_limited_routing`.
"""
from __future__ import annotations

import math

import numpy as np

from dtp.ep.moe import softmax

# --- auxiliary-loss-free load balancing (Wang et al. 2024; DeepSeek-V3, section 2.1.2) ----------


def biased_top_k_routing(logits: np.ndarray, bias: np.ndarray, k: int,
                         renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """(indices, weights), each (T, k). The experts are chosen by probability + bias (the k
    largest, best first); the gate weights are the chosen experts' probabilities, without the bias
    (divided by their sum when `renormalize`). The bias only decides who computes a token, so it
    never enters the output's value, and the gradient never reaches it."""
    probabilities = softmax(logits)
    indices = np.argsort(-(probabilities + bias), axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probabilities, indices, axis=-1)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return indices, weights


def update_choice_bias(bias: np.ndarray, indices, rate: float) -> np.ndarray:
    """The bias after one step: b_i + rate·sign(mean load - load_i), the load being the number of
    assignments expert i received in this step's routing (`indices`, T×k). An overloaded expert
    loses `rate`, an underloaded one gains it, one exactly at the mean keeps its bias. The sign,
    not the size of the error: every step moves a bias by the same fixed amount, so that a few
    unusual batches cannot swing the routing."""
    bias = np.asarray(bias, dtype=float)
    loads = np.bincount(np.asarray(indices).reshape(-1), minlength=bias.shape[0])
    return bias + rate * np.sign(loads.mean() - loads)


def load_imbalance(indices, num_experts: int, k: int) -> float:
    """E · max_i f_i, f counted over the T·k assignments: 1 when even, at most E/k (no expert can
    receive more than one of each token's k distinct choices)."""
    counts = np.bincount(np.asarray(indices).reshape(-1), minlength=num_experts)
    return float(num_experts * counts.max() / counts.sum())


# --- node-limited routing (DeepSeek-V3, section 2.1.2: at most M nodes per token) ---------------


def node_limited_routing(logits: np.ndarray, k: int, experts_per_node: int, max_nodes: int,
                         renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """(indices, weights), each (T, k), with every token's experts on at most `max_nodes` nodes
    (node n holds experts n·experts_per_node ... (n+1)·experts_per_node - 1). First the nodes:
    each node scores the sum of its k/M highest probabilities, and the M best nodes are kept; then
    the k most probable experts among the kept nodes' experts. The limit comes before the top-k:
    choosing the top-k first and then cutting nodes would leave a token fewer than k experts."""
    assert k % max_nodes == 0, "DeepSeek-V3's node score sums the k/M best experts of each node"
    probabilities = softmax(logits)
    tokens, experts = probabilities.shape
    per_node = np.sort(probabilities.reshape(tokens, experts // experts_per_node, experts_per_node), axis=-1)
    node_scores = per_node[..., -(k // max_nodes):].sum(axis=-1)
    nodes = np.argsort(-node_scores, axis=-1, kind="stable")[:, :max_nodes]
    allowed = np.zeros_like(node_scores, dtype=bool)
    np.put_along_axis(allowed, nodes, True, axis=-1)
    masked = np.where(np.repeat(allowed, experts_per_node, axis=-1), probabilities, -np.inf)
    indices = np.argsort(-masked, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probabilities, indices, axis=-1)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return indices, weights


def cross_node_dispatch_bytes(indices, experts_per_node: int, source_node: int, hidden: int,
                              bytes_per_element: int) -> int:
    """Bytes the tokens of `source_node` send to other nodes in one dispatch when each token
    crosses to each destination node once (and is copied to its experts there over the node's
    own links, as DeepEP does): Σ_t |nodes(t) minus the source| · h · w. It is at most
    `max_cross_node_dispatch_bytes`: T·min(M, N-1)·h·w with node-limited routing, T·min(k, N-1)·h·w
    without, against T·k·h·w for one copy per expert."""
    nodes = np.asarray(indices) // experts_per_node
    crossings = sum(len(set(row.tolist()) - {source_node}) for row in nodes)
    return int(crossings * hidden * bytes_per_element)


def max_cross_node_copies(k: int, nodes: int, max_nodes: int | None = None) -> int:
    """The most copies of one token a dispatch sends to other nodes when each token goes once to
    each destination node: min(k, M, N - 1) for N nodes in the expert-parallel group. Its k
    experts lie on at most k nodes (at most M with node-limited routing, None: no limit), and its
    own node needs no copy. Some routing reaches it, so it is the bound, not k."""
    limit = nodes if max_nodes is None else max_nodes
    if k < 1 or nodes < 1 or not 1 <= limit <= nodes:
        raise ValueError(f"need k >= 1, nodes >= 1 and 1 <= max_nodes <= nodes; got k={k}, nodes={nodes}, "
                         f"max_nodes={max_nodes}")
    return min(k, limit, nodes - 1)


def max_cross_node_dispatch_bytes(tokens: int, k: int, nodes: int, hidden: int, bytes_per_element: int,
                                  max_nodes: int | None = None) -> int:
    """The most bytes a node's `tokens` send to other nodes in one dispatch (and the combine sends
    back), one copy per destination node: T · min(k, M, N - 1) · h · w."""
    return tokens * max_cross_node_copies(k, nodes, max_nodes) * hidden * bytes_per_element


def node_limited_dispatch_copies(k: int, num_experts: int, nodes: int, gpus_per_node: int,
                                 max_nodes: int) -> dict[str, float]:
    """Expected copies of one token a dispatch sends with node-limited routing as DeepSeek-V3
    runs it (section 3.2.2): over the inter-node links, one copy to each chosen node other than
    the token's own (it lands on the GPU with the token's in-node index); over NVLink, one copy
    from that GPU (or, on the token's own node, from the token's GPU) to each other GPU of the
    node that hosts one of the token's experts. Experts are spread evenly, E/N per node and
    E/(N·G) per GPU, and every node and GPU is equally likely (balanced routing):
    - "nodes": the chosen nodes a token's experts fill, M (the rule keeps the M nodes whose k/M
      best experts score highest, and the top-k among them almost always lands on all M; with
      independent scores, tests measure the mean over `node_limited_routing`);
    - "inter_node": M·(N-1)/N, the token's own node being any of the N with equal chance;
    - "intra_node": M·D·(G-1)/G, with D = G·(1 - C(E/N - E/(N·G), k/M) / C(E/N, k/M)) the
      expected distinct GPUs holding k/M experts drawn among a node's E/N, and (G-1)/G the
      chance that such a GPU is not the one the copy arrived on.
    The same counts hold for the combine, which sends the results back along the same routes."""
    if max_nodes < 1 or k % max_nodes or num_experts % (nodes * gpus_per_node) or max_nodes > nodes:
        raise ValueError(f"need 1 <= max_nodes <= nodes, k divisible by max_nodes and the experts by the GPUs; got "
                         f"k={k}, experts={num_experts}, nodes={nodes}, gpus_per_node={gpus_per_node}, "
                         f"max_nodes={max_nodes}")
    per_node, per_gpu, chosen = num_experts // nodes, num_experts // (nodes * gpus_per_node), k // max_nodes
    gpus_hit = gpus_per_node * (1 - math.comb(per_node - per_gpu, chosen) / math.comb(per_node, chosen))
    return {"nodes": float(max_nodes), "inter_node": max_nodes * (nodes - 1) / nodes,
            "intra_node": max_nodes * gpus_hit * (gpus_per_node - 1) / gpus_per_node}
