"""Expert parallelism beside tensor parallelism. With sequence parallelism the t ranks of a TP
group each hold s/t of the sequence's tokens after attention's reduce-scatter, so each dispatches
only its own share to the experts: nothing is sent twice (Megatron-Core requires sequence
parallelism when TP and EP are combined). Without it every TP rank holds all s tokens and would
send each of them t times.

Layout of a world of t·e ranks: rank = ep_rank·t + tp_rank; TP groups are consecutive ranks,
EP groups the ranks with the same tp_rank. Experts are whole (no expert tensor parallelism):
EP rank j holds experts j·E/e ... (j+1)·E/e - 1. Fixed capacity, forward only.

tests/ep/test_ep_routing.py runs a world of 4 (TP 2 × EP 2) against the single-process layer.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from dtp.common.traffic import CommunicationLog
from dtp.ep.moe import assign_slots, expert_capacity, moe_layer, top_k_routing


def tp_ep_dispatch_bytes(seq_tokens: int, tp: int, ep: int, num_experts: int, k: int, capacity_factor: float,
                         hidden: int, bytes_per_element: int, sequence_parallel: bool = True) -> int:
    """Bytes one rank sends to other EP ranks in one forward dispatch with fixed capacity: it routes
    its s/t tokens (all s without sequence parallelism) with C = ceil(cf · tokens · k / E) and sends
    the E/e·C rows of each other EP rank's experts: (e-1)·(E/e)·C·h·w."""
    tokens = seq_tokens // tp if sequence_parallel else seq_tokens
    capacity = expert_capacity(tokens, num_experts, k, capacity_factor)
    return (ep - 1) * (num_experts // ep) * capacity * hidden * bytes_per_element


def _groups(world_size: int, tp: int):
    """Every rank creates every group, in the same order (torch requires it); returns this rank's."""
    ep = world_size // tp
    rank = dist.get_rank()
    tp_groups = [dist.new_group(list(range(j * tp, (j + 1) * tp))) for j in range(ep)]
    ep_groups = [dist.new_group([j * tp + i for j in range(ep)]) for i in range(tp)]
    return tp_groups[rank // tp], ep_groups[rank % tp]


def tp_ep_moe_forward(x_sequence: torch.Tensor, router_weight, w_in_local, w_out_local, k: int, capacity: int,
                      ep_group, tp_rank: int, tp: int, sequence_parallel: bool = True) -> torch.Tensor:
    """One rank's MoE forward: route its tokens (its s/t share with sequence parallelism, all s
    without), send each expert's C slots to the EP rank owning it (one all_to_all_single in the
    EP group), run the local experts, send the results back, combine with the gate weights."""
    tokens = x_sequence.chunk(tp)[tp_rank] if sequence_parallel else x_sequence
    num_experts, hidden = router_weight.shape[1], tokens.shape[1]
    ep, local = dist.get_world_size(ep_group), w_in_local.shape[0]
    indices, weights = top_k_routing((tokens @ router_weight).numpy(), k, renormalize=True)
    slots = assign_slots(indices, num_experts, capacity)
    token, choice = np.nonzero(slots >= 0)
    buffers = torch.zeros(num_experts * capacity, hidden, dtype=tokens.dtype)
    rows = torch.from_numpy(indices[token, choice] * capacity + slots[token, choice])
    buffers[rows] = tokens[torch.from_numpy(token)]
    received = torch.empty_like(buffers)  # [source EP rank, my expert, slot]
    dist.all_to_all_single(received, buffers, group=ep_group)
    by_expert = received.view(ep, local, capacity, hidden)
    results = torch.stack([torch.relu(by_expert[:, e] @ w_in_local[e]) @ w_out_local[e] for e in range(local)], dim=1)
    returned = torch.empty_like(buffers)
    dist.all_to_all_single(returned, results.reshape(-1, hidden).contiguous(), group=ep_group)
    output = torch.zeros_like(tokens)
    gates = torch.from_numpy(weights[token, choice]).to(tokens.dtype).unsqueeze(1)
    return output.index_add(0, torch.from_numpy(token), gates * returned[rows])


def _measured_rank(rank, world_size, tp, case, sequence_parallel):
    _, ep_group = _groups(world_size, tp)
    ep, local = world_size // tp, case["w_in"].shape[0] // (world_size // tp)
    mine = slice((rank // tp) * local, (rank // tp + 1) * local)
    with CommunicationLog() as log:
        output = tp_ep_moe_forward(torch.from_numpy(case["x"]), torch.from_numpy(case["router"]),
                                   torch.from_numpy(case["w_in"][mine]), torch.from_numpy(case["w_out"][mine]),
                                   case["k"], case["capacity"], ep_group, rank % tp, tp, sequence_parallel)
    dispatch = next(e for e in log.events if e["op"].startswith("all_to_all"))
    # the rows for this rank's own experts stay: bytes sent to other ranks
    return {"output": output.numpy(), "dispatch_bytes_to_others": dispatch["bytes"] * (ep - 1) // ep}


def measure_tp_ep(seq_tokens: int = 48, hidden: int = 16, expert_hidden: int = 24, num_experts: int = 8, k: int = 2,
                  tp: int = 2, ep: int = 2, seed: int = 0) -> dict:
    """Run TP × EP on a gloo world of t·e, with and without sequence parallelism, with a capacity
    that drops nothing (C = the tokens a rank routes), against the single-process layer."""
    from dtp.common.world import run_world

    rng = np.random.default_rng(seed)
    case = {"x": rng.standard_normal((seq_tokens, hidden)), "router": rng.standard_normal((hidden, num_experts)),
            "w_in": rng.standard_normal((num_experts, hidden, expert_hidden)) / math.sqrt(hidden),
            "w_out": rng.standard_normal((num_experts, expert_hidden, hidden)) / math.sqrt(expert_hidden), "k": k}
    expected = moe_layer(case["x"], case["router"], case["w_in"], case["w_out"], k, None, True)
    runs = {}
    for sequence_parallel in (True, False):
        tokens = seq_tokens // tp if sequence_parallel else seq_tokens
        factor = num_experts / k  # C = tokens: no expert can overflow, so nothing is dropped
        ranks = run_world(_measured_rank, tp * ep,
                          (tp, {**case, "capacity": expert_capacity(tokens, num_experts, k, factor)}, sequence_parallel))
        rebuilt = [np.concatenate([ranks[j * tp + i]["output"] for i in range(tp)]) if sequence_parallel
                   else ranks[j * tp]["output"] for j in range(ep)]
        runs["sp" if sequence_parallel else "no_sp"] = {
            "bytes": [r["dispatch_bytes_to_others"] for r in ranks],
            "formula": tp_ep_dispatch_bytes(seq_tokens, tp, ep, num_experts, k, factor, hidden, 8, sequence_parallel),
            "max_difference": max(float(np.abs(out - expected).max()) for out in rebuilt)}
    return runs
