"""Exercise 10: expert parallelism beside tensor parallelism with sequence parallelism, on a gloo
world of 4 (TP 2 × EP 2): each TP rank dispatches only its own s/t tokens."""
from __future__ import annotations

import numpy as np
import torch

from dtp.common.traffic import CommunicationLog
from dtp.ep import moe  # noqa: F401  imported before the sandbox is confined
from dtp.ep import tp_ep as moe_tp_ep

from ...compare import CheckFailed, expect, expect_answer
from ...registry import Check, exercise
from ..references import refuses_library
from ..common import completed_worlds, events_as_data, raise_world_failure, run_worlds
from .shared import MOE

TP, EP = 2, 2


def _tp_ep_on_rank(rank, world_size, layer, case):
    """In the sandbox, one rank: the grader makes the groups (rank = ep_rank·t + tp_rank), calls the
    learner's layer on the whole sequence, and records every collective."""
    import torch.distributed as dist

    tp_groups = [dist.new_group(list(range(j * TP, (j + 1) * TP))) for j in range(EP)]
    ep_groups = [dist.new_group([j * TP + i for j in range(EP)]) for i in range(TP)]
    del tp_groups  # created on every rank (torch requires it), not needed by the MoE layer
    local = case["w_in"].shape[0] // EP
    mine = slice((rank // TP) * local, (rank // TP + 1) * local)
    with CommunicationLog() as log:
        output = layer(torch.tensor(case["x"]), torch.tensor(case["router"]), torch.tensor(case["w_in"][mine]),
                       torch.tensor(case["w_out"][mine]), case["k"], case["capacity"], ep_groups[rank % TP],
                       rank % TP, TP)
    return {"output": output.detach() if isinstance(output, torch.Tensor) else output, "events": events_as_data(log)}


@exercise("ep.tp_ep", points=3)
@refuses_library("dtp.ep.tp_ep", MOE)
class TensorAndExpertParallel(Check):
    """Verifies: on a gloo world of 4 (TP 2 × EP 2), each rank's output is the single-process
    layer (fixed capacity, renormalised top-k) on its own s/t tokens of the sequence, and its
    token rows move only in all-to-alls of its EP group, sending the bytes of
    `tp_ep_dispatch_bytes` with sequence parallelism; `tp_ep_dispatch_bytes` itself is right for
    random sequences, TP and EP sizes, experts, k and capacity factors, with and without sequence
    parallelism.
    Fakes: dtp.ep.tp_ep and dtp.ep.moe's layers and router trip; an output computed without the
    all-to-all (every rank holding only its own experts) cannot equal the layer; dispatching the
    whole sequence from every TP rank fails on the output's rows, and keeping only the rank's own
    rows of it on their values (every grading's layer drops other tokens when twice the tokens meet
    the same capacity), each named.
    """

    reads = ("tp_ep_moe", "tp_ep_dispatch_bytes")
    runs_world = True
    preimport = ()  # its ranks use no optimizer and no module that imports torch._dynamo (measured)
    timeout_s = 60

    def prepare(self, rng):
        while True:  # until dispatching the whole sequence (the same capacity, twice the tokens) drops differently
            experts, k = int(rng.choice([4, 6, 8])), int(rng.integers(1, 3))
            seq, hidden, width = TP * int(rng.integers(5, 12)), int(rng.integers(4, 9)), int(rng.integers(3, 7))
            factor = float(rng.choice([1.0, 1.25, 2.0]))
            case = {"x": rng.standard_normal((seq, hidden)),
                    "router": rng.standard_normal((hidden, experts)) + rng.standard_normal(experts),
                    "w_in": rng.standard_normal((experts, hidden, width)) / np.sqrt(hidden),
                    "w_out": rng.standard_normal((experts, width, hidden)), "k": k, "factor": factor,
                    "capacity": moe.expert_capacity(seq // TP, experts, k, factor)}
            if any(not np.allclose(whole, right, **LAYER_TOLERANCE)
                   for whole, right in zip(whole_sequence_outputs(case), layer_outputs(case))):
                break
        formulas = [(int(rng.integers(64, 8192)) * t, t, e, e * int(rng.integers(1, 9)), int(rng.integers(1, 5)),
                     float(rng.choice([1.0, 1.25, 1.5])), int(rng.integers(64, 8192)), int(rng.choice([2, 4])), sp)
                    for t, e, sp in ((2, 2, True), (4, 8, True), (8, 4, False), (int(rng.choice([2, 4])), 2, True))]
        return {"case": case, "formulas": formulas}

    def collect(self, student, inputs):
        bytes_ = [student.tp_ep_dispatch_bytes(*args[:-1], sequence_parallel=args[-1]) for args in inputs["formulas"]]
        return {"worlds": run_worlds(_tp_ep_on_rank, [(TP * EP, (student.tp_ep_moe, inputs["case"]))]),
                "bytes": bytes_}

    def judge(self, inputs, data) -> str:
        expect(isinstance(data, dict) and len(data.get("bytes", [])) == len(inputs["formulas"]),
               "the grader's calls did not all return")
        for args, answer in zip(inputs["formulas"], data["bytes"]):
            _judge_formula(args, answer)
        completed, failure = completed_worlds(data["worlds"])
        raise_world_failure(failure)
        case = inputs["case"]
        for rank, outcome in enumerate(completed[0]):
            _judge_rank(case, rank, outcome)
        return ("each TP rank of a TP 2 × EP 2 world routed only its s/t tokens, exchanged them in its EP group, "
                "and got the single-process layer's output; the dispatch bytes equal the formula")


def _judge_formula(args, answer) -> None:
    seq, tp, ep, experts, k, factor, hidden, width, sp = args
    what = (f"tp_ep_dispatch_bytes(seq_tokens={seq}, tp={tp}, ep={ep}, num_experts={experts}, k={k}, "
            f"capacity_factor={factor}, hidden={hidden}, bytes_per_element={width}, sequence_parallel={sp})")
    expect_answer(answer, moe_tp_ep.tp_ep_dispatch_bytes(*args[:-1], sequence_parallel=sp), what, rel=1e-12,
                  slips=formula_slips(args))


def formula_slips(args) -> dict:
    """feedback -> the bytes that mistake gives, for tp_ep_dispatch_bytes(*args)."""
    seq, tp, ep, experts, k, factor, hidden, width, sp = args
    expected = moe_tp_ep.tp_ep_dispatch_bytes(*args[:-1], sequence_parallel=sp)
    capacity = moe.expert_capacity(seq // tp if sp else seq, experts, k, factor)
    return {("with sequence parallelism a TP rank routes only its s/t tokens, so its capacity is computed on s/t"
             if sp else "without sequence parallelism every TP rank holds (and routes) all s tokens"):
                moe_tp_ep.tp_ep_dispatch_bytes(*args[:-1], sequence_parallel=not sp),
            "the rows for the rank's own experts stay on it: (e-1)·(E/e)·C rows leave, not E·C":
                experts * capacity * hidden * width,
            "bytes_per_element is missing": expected / width}


LAYER_TOLERANCE = dict(rtol=1e-7, atol=1e-9)
WHOLE_SEQUENCE = ("every TP rank dispatched the whole sequence and kept its own rows of the output: with sequence "
                  "parallelism a TP rank holds and dispatches only its own s/t tokens (x_sequence.chunk(tp)[tp_rank]); "
                  "the whole sequence, twice the tokens into the same capacity, drops other tokens (and sends each one "
                  "to its experts t times)")


def _shares(case) -> list[np.ndarray]:
    seq, hidden = case["x"].shape
    return list(case["x"].reshape(TP, seq // TP, hidden))


def layer_outputs(case) -> list[np.ndarray]:
    """Each TP rank's right output: the single-process layer on its s/t tokens."""
    return [moe.moe_layer(share, case["router"], case["w_in"], case["w_out"], case["k"], case["capacity"], True)
            for share in _shares(case)]


def whole_sequence_outputs(case) -> list[np.ndarray]:
    """Each TP rank's rows of the layer on the whole sequence, with the capacity of s/t tokens."""
    whole = moe.moe_layer(case["x"], case["router"], case["w_in"], case["w_out"], case["k"], case["capacity"], True)
    return list(whole.reshape(TP, -1, whole.shape[1]))


def _judge_rank(case, rank: int, outcome) -> None:
    seq, hidden = case["x"].shape
    share = _shares(case)[rank % TP]
    what = f"rank {rank} (tp_rank {rank % TP}, ep_rank {rank // TP}) of a TP {TP} × EP {EP} world, sequence of {seq}"
    output = outcome["output"]
    expect(isinstance(output, (np.ndarray, torch.Tensor)), f"{what}: tp_ep_moe should return a tensor")
    output = np.asarray(output)
    if output.shape == (seq, hidden):
        raise CheckFailed(f"{what}: the output has all {seq} tokens: every TP rank dispatched the whole sequence, so "
                          f"each token went to its experts {TP} times. With sequence parallelism a TP rank holds and "
                          f"dispatches only its own s/t = {seq // TP} tokens (x_sequence.chunk(tp)[tp_rank])")
    expect(output.shape == share.shape, f"{what}: the output should have shape {share.shape}, not {output.shape}")
    expected = layer_outputs(case)[rank % TP]
    if not np.allclose(output, expected, **LAYER_TOLERANCE):
        if np.allclose(output, whole_sequence_outputs(case)[rank % TP], **LAYER_TOLERANCE):
            raise CheckFailed(f"{what}: {WHOLE_SEQUENCE}")
        raise CheckFailed(f"{what}: the output differs from the single-process layer on this rank's "
                          f"{seq // TP} tokens by up to {np.abs(output - expected).max():.3g} (capacity "
                          f"{case['capacity']} per rank, renormalised top-{case['k']})")
    exchanges = [e for e in outcome["events"] if e["op"].startswith("all_to_all")]
    expect(exchanges, f"{what}: the output is right but no all-to-all was recorded: the tokens must reach the EP "
                      "rank that owns their experts through all_to_all_single in the EP group")
    ep_ranks = tuple(sorted(rank % TP + TP * j for j in range(EP)))
    wrong_group = [e for e in exchanges if e.get("group") is not None and tuple(sorted(e["group"])) != ep_ranks]
    expect(not wrong_group, f"{what}: an all-to-all ran in group {wrong_group[0].get('group') if wrong_group else ''}; "
                            f"the tokens go to the experts in the EP group {list(ep_ranks)}")
    experts, k = case["router"].shape[1], case["k"]
    expected_bytes = moe_tp_ep.tp_ep_dispatch_bytes(seq, TP, EP, experts, k, case["factor"], hidden, 8)
    sent = exchanges[0]["bytes"] * (EP - 1) // EP
    expect(sent == expected_bytes, f"{what}: the dispatch sent {sent} bytes to the other EP rank; with capacity "
                                   f"{case['capacity']} it is (e-1)·(E/e)·C·h·8 = {expected_bytes}")
