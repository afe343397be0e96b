"""Exercise 4: the expert-parallel MoE layer on gloo, fixed capacity and dropless. Judged from
what every rank computed (outputs and gradients against the single-process layer) and what it
sent (every collective, and the rows of every all-to-all)."""
from __future__ import annotations

import numpy as np
import torch

from dtp.common.traffic import CommunicationLog
from dtp.ep import moe

from ...compare import CheckFailed, expect
from ...registry import exercise
from ..references import refuses_library
from ..common import WorldsCheck, events_as_data, run_worlds
from .layer import explain_layer_output, layer_slips, partly_dropped
from .shared import MOE, TORCH_DIFFERENTIABLE_ALL_TO_ALL

COUNT_EXCHANGE_BYTES_PER_EXPERT = 8  # an int64 count per expert: the only other traffic allowed


def _ep_on_rank(rank, world_size, layer, cases):
    outcomes = []
    for case in cases:
        experts = slice(rank * case["local"], (rank + 1) * case["local"])
        x = torch.tensor(case["x"][rank], requires_grad=True)
        router = torch.tensor(case["router"], requires_grad=True)
        w_in = torch.tensor(case["w_in"][experts], requires_grad=True)
        w_out = torch.tensor(case["w_out"][experts], requires_grad=True)
        with CommunicationLog() as log, moe.AllToAllLog(payloads=True) as all_to_alls:
            output = layer(x, router, w_in, w_out, case["k"], case["capacity"], case["renormalize"])
            log.mark("forward done")
            differentiable = isinstance(output, torch.Tensor) and output.requires_grad
            if differentiable:
                try:
                    (output * torch.tensor(case["upstream"][rank])).sum().backward()
                except RuntimeError as error:  # raised by the learner's backward (in autograd's engine)
                    raise CheckFailed(f"rank {rank}'s backward pass raised {str(error).splitlines()[0][:200]}: the "
                                      "backward of an all-to-all is the reverse all-to-all, rows_to and rows_from "
                                      "swapped, returning one gradient row per row forward sent") from None
            log.mark("backward done")
        outcomes.append({"output": output, "differentiable": differentiable, "events": events_as_data(log),
                         "all_to_alls": all_to_alls.calls,
                         "gradients": {name: t.grad for name, t in
                                       (("x", x), ("router", router), ("w_in", w_in), ("w_out", w_out))}})
    return outcomes


def _ep_case(rng, world_size: int, local: int, k: int, renormalize: bool, tokens: list[int], capacity_factor):
    experts = world_size * local
    d, f = int(rng.integers(4, 8)), int(rng.integers(3, 7))
    router = rng.standard_normal((d, experts)) + 1.5 * rng.standard_normal(experts)  # popular experts: drops
    x = [rng.standard_normal((t, d)) for t in tokens]
    capacity = None if capacity_factor is None else moe.expert_capacity(max(tokens), experts, k, capacity_factor)
    case = {"x": x, "router": router, "w_in": rng.standard_normal((experts, d, f)) / np.sqrt(d),
            "w_out": rng.standard_normal((experts, f, d)), "upstream": [rng.standard_normal((t, d)) for t in tokens],
            "k": k, "renormalize": renormalize, "capacity": capacity, "local": local}
    if not _separates_near_misses(case, world_size):
        return _ep_case(rng, world_size, local, k, renormalize, tokens, capacity_factor)
    return case


def _separates_near_misses(case, world_size: int) -> bool:
    """With a capacity: some rank's tokens are dropped in part (so renormalising after dropping,
    or not dropping, shows) and every known slip of the layer gives some rank a wrong output.
    Dropless: some pair of ranks sends each other different numbers of rows, so a backward
    all-to-all that does not swap the split sizes fails."""
    layers = [(case["x"][r], case["router"], case["w_in"], case["w_out"], case["k"], case["capacity"],
               case["renormalize"]) for r in range(world_size)]
    if case["capacity"] is None:
        sent = np.array([np.bincount(moe.expert_owner(_routing(case, r)[0].reshape(-1), case["router"].shape[1],
                                                      world_size), minlength=world_size) for r in range(world_size)])
        return not np.array_equal(sent, sent.T)
    if not any(partly_dropped(layer) for layer in layers):
        return False
    slips = [layer_slips(*layer) for layer in layers]
    expected = [moe.moe_layer(*layer) for layer in layers]
    def variants(rank, name) -> list:  # a slip may give one of several values (by probability or by weight)
        return slips[rank][name] if isinstance(slips[rank][name], list) else [slips[rank][name]]

    return all(any(not np.allclose(variants(r, name)[v], expected[r], rtol=1e-7, atol=1e-9) for r in range(world_size))
               for name in slips[0] for v in range(len(variants(0, name))))  # each gives some rank a wrong output


def _routing(case, rank: int):
    indices, weights = moe.top_k_routing(case["x"][rank] @ case["router"], case["k"], case["renormalize"])
    return indices, weights, moe.assign_slots(indices, case["router"].shape[1], case["capacity"])


def _single_process(case) -> dict:
    """The oracle: each rank's tokens through the single-process layer (capacity per rank), one
    router copy per rank (its gradient is the rank's own), the experts shared."""
    w_in, w_out = torch.tensor(case["w_in"], requires_grad=True), torch.tensor(case["w_out"], requires_grad=True)
    per_rank = []
    for rank, tokens in enumerate(case["x"]):
        x, router = torch.tensor(tokens, requires_grad=True), torch.tensor(case["router"], requires_grad=True)
        output = moe.moe_layer_torch(x, router, w_in, w_out, case["k"], case["capacity"], case["renormalize"])
        (output * torch.tensor(case["upstream"][rank])).sum().backward()
        per_rank.append((x, router, output))
    result = {"x": [x.grad.numpy() for x, _, _ in per_rank], "router": [r.grad.numpy() for _, r, _ in per_rank]}
    local = case["local"]
    result["w_in"] = [w_in.grad[r * local:(r + 1) * local].numpy() for r in range(len(case["x"]))]
    result["w_out"] = [w_out.grad[r * local:(r + 1) * local].numpy() for r in range(len(case["x"]))]
    return result


def _describe(case, world_size: int) -> str:
    capacity = "dropless" if case["capacity"] is None else f"capacity {case['capacity']}"
    return (f"world {world_size}, {case['local']} experts per rank, top-{case['k']}, {capacity}, tokens per rank "
            f"{[len(x) for x in case['x']]}")


def _judge_outputs(case, outcomes, what: str) -> None:
    for rank, outcome in enumerate(outcomes):
        output = outcome["output"]
        layer = (case["x"][rank], case["router"], case["w_in"], case["w_out"], case["k"], case["capacity"],
                 case["renormalize"])
        explain_layer_output(output, layer, f"{what}: rank {rank}'s output")


def _split_phases(outcome) -> tuple[list[dict], list[dict]]:
    """(forward, backward) collectives of one rank, each all-to-all joined with its split sizes."""
    calls = iter(outcome["all_to_alls"])
    forward, backward, phase = [], [], None
    phase = forward
    for event in outcome["events"]:
        if event["op"] == "mark":
            phase = backward if event["label"] == "forward done" else None
            continue
        if event["op"] == "wait" or phase is None:
            continue
        phase.append({**event, **(next(calls, {}) if event["op"] == "all_to_all" else {})})
    return forward, backward


def _token_exchanges(collectives: list[dict]) -> list[dict]:
    """The all-to-alls of token rows (floating point); integer ones exchange counts."""
    return [c for c in collectives if c["op"] == "all_to_all" and "float" in c.get("dtype", "")]


def _judge_collectives(case, outcomes, world_size: int, what: str) -> None:
    experts = case["router"].shape[1]
    for rank, outcome in enumerate(outcomes):
        forward, backward = _split_phases(outcome)
        for collective in forward + backward:
            if collective["op"] != "all_to_all" and collective["bytes"] > COUNT_EXCHANGE_BYTES_PER_EXPERT * experts:
                raise CheckFailed(f"{what}: rank {rank} called {collective['op']} with {collective['bytes']} bytes; "
                                  "tokens and results travel by all_to_all_single only (dispatch and combine)")
        dispatch_and_combine = _token_exchanges(forward)
        expect(len(dispatch_and_combine) == 2,
               f"{what}: rank {rank} ran {len(dispatch_and_combine)} all-to-alls of floating-point rows in the forward "
               "pass; a forward pass runs two: the dispatch and the combine (dropless, the counts go first, as an "
               "integer tensor)")
        expect(outcome["differentiable"], f"{what}: rank {rank}'s output does not require grad: autograd cannot go "
                                          "back through dist.all_to_all_single; wrap it in a torch.autograd.Function")
        reverse = _token_exchanges(backward)
        expect(len(reverse) == 2,
               f"{what}: rank {rank} ran {len(reverse)} all-to-alls in the backward pass; the backward of an "
               "all-to-all is the reverse all-to-all (input and output split sizes swapped), so backward runs two: "
               "write them in your autograd Function's backward")


def _match_rows(chunk: np.ndarray, wanted: np.ndarray, rtol: float) -> int:
    """How many of the `wanted` rows appear in `chunk` (each chunk row used once)."""
    available = list(range(len(chunk)))
    found = 0
    for row in wanted:
        for position in available:
            if np.allclose(chunk[position], row, rtol=rtol, atol=1e-12):
                available.remove(position)
                found += 1
                break
    return found


def _judge_dataflow(case, outcomes, world_size: int, what: str) -> None:
    """Dispatch: rank r's piece for rank q holds the token of every kept assignment of r to an
    expert of q (and, with capacity, exactly E/n·C rows). Combine: rank q's piece for rank r holds
    the expert output of each of those assignments."""
    local, capacity = case["local"], case["capacity"]
    for source in range(world_size):
        indices, _, slots = _routing(case, source)
        dispatch = _token_exchanges(_split_phases(outcomes[source])[0])[0]
        kept_token, kept_choice = np.nonzero(slots >= 0)
        owners = moe.expert_owner(indices[kept_token, kept_choice], case["router"].shape[1], world_size)
        for destination in range(world_size):
            mine = owners == destination
            tokens, chosen = kept_token[mine], indices[kept_token[mine], kept_choice[mine]]
            rows = np.asarray(dispatch["payload"][destination]).reshape(-1, case["x"][source].shape[1]) \
                if destination < len(dispatch["payload"]) else np.zeros((0, case["x"][source].shape[1]))
            expected_rows = local * capacity if capacity is not None else len(tokens)
            expect(len(rows) == expected_rows,
                   f"{what}: rank {source} sent rank {destination} {len(rows)} rows in the dispatch; "
                   + (f"with capacity {capacity} every rank sends each rank its E/n·C = {expected_rows} slots"
                      if capacity is not None else
                      f"dropless, it sends one row per assignment to that rank's experts: {expected_rows}"))
            found = _match_rows(rows, case["x"][source][tokens], rtol=1e-12)
            expect(found == len(tokens),
                   f"{what}: of the {len(tokens)} tokens rank {source} routes to rank {destination}'s experts, only "
                   f"{found} were in its dispatch to that rank: send each kept assignment's token row, unchanged")
            combine = _token_exchanges(_split_phases(outcomes[destination])[0])[1]
            results = [moe.expert_mlp(case["x"][source][t], case["w_in"][e], case["w_out"][e])
                       for t, e in zip(tokens, chosen)]
            returned = np.asarray(combine["payload"][source]).reshape(-1, case["x"][source].shape[1]) \
                if source < len(combine["payload"]) else np.zeros((0, case["x"][source].shape[1]))
            found = _match_rows(returned, results, rtol=1e-9)
            expect(found == len(tokens),
                   f"{what}: rank {destination}'s combine to rank {source} held {found} of the {len(tokens)} expert "
                   "outputs that rank's tokens needed: the expert's rank computes them and sends them back unweighted "
                   "in the combine all-to-all")


def _judge_bytes(case, outcomes, world_size: int, what: str) -> None:
    d, experts = case["router"].shape
    if case["capacity"] is None:
        expected = moe.dropless_all_to_all_bytes([_routing(case, r)[0] for r in range(world_size)], experts, d, 8)
    else:
        expected = [moe.capacity_all_to_all_bytes(world_size, experts, case["capacity"], d, 8)] * world_size
    for rank, outcome in enumerate(outcomes):
        forward, backward = _split_phases(outcome)
        sent = sum(sum(c["bytes_to"]) - c["bytes_to"][rank] for c in _token_exchanges(forward + backward))
        expect(sent == expected[rank],
               f"{what}: rank {rank} sent {sent} bytes of token rows to other ranks over forward and backward; the "
               f"formula gives {expected[rank]}" + (" (dropless sends only real rows: no padding)"
                                                    if case["capacity"] is None else ""))


def _judge_gradients(case, outcomes, oracle, what: str) -> None:
    for rank, outcome in enumerate(outcomes):
        for name, label in (("x", "x"), ("router", "the router weight"), ("w_in", "w_in"), ("w_out", "w_out")):
            gradient = outcome["gradients"][name]
            expect(gradient is not None, f"{what}: rank {rank}'s {label} received no gradient: the output must depend "
                                         "on it through autograd (gates from the router's softmax, experts through "
                                         "the differentiable all-to-alls)")
            if not np.allclose(gradient, oracle[name][rank], rtol=1e-7, atol=1e-10):
                raise CheckFailed(
                    f"{what}: the outputs are right but rank {rank}'s gradient of {label} is not "
                    f"(max error {np.abs(gradient - oracle[name][rank]).max():.3g}): each backward all-to-all must "
                    "send every row's gradient back to the rank that sent the row (input and output split sizes "
                    "swapped)" + (", and the router's gradient comes through the gate weights" if name == "router"
                                  else ""))


class ExpertParallelCheck(WorldsCheck):
    reads = ("expert_parallel_moe",)
    preimport = ()  # its ranks use no optimizer and no module that imports torch._dynamo (measured)
    references = TORCH_DIFFERENTIABLE_ALL_TO_ALL
    timeout_s = 40
    dropless = False

    def worlds(self, rng) -> list[tuple[int, list]]:
        raise NotImplementedError

    def prepare(self, rng):
        return self.worlds(rng)

    def collect(self, student, worlds):
        return run_worlds(_ep_on_rank, [(n, (student.expert_parallel_moe, cases)) for n, cases in worlds])

    def judge_world(self, world, per_rank) -> None:
        n, cases = world
        for index, case in enumerate(cases):
            what = _describe(case, n)
            ranks = [per_rank[rank][index] for rank in range(n)]
            oracle = _single_process(case)
            _judge_outputs(case, ranks, what)
            _judge_collectives(case, ranks, n, what)
            _judge_dataflow(case, ranks, n, what)
            _judge_bytes(case, ranks, n, what)
            _judge_gradients(case, ranks, oracle, what)


@exercise("ep.expert_parallel_capacity", points=3)
@refuses_library(MOE)
class ExpertParallelCapacity(ExpertParallelCheck):
    """Verifies: on 2 and 4 gloo ranks with 3 and 2 experts per rank, top-1 and top-2, with a
    capacity that drops tokens: every rank's output and the gradients of its tokens, its router
    copy and its experts equal the single-process layer's (capacity per rank); the forward runs two
    all-to-alls of token rows and the backward two; each rank's dispatch to each rank is its E/n·C
    slots holding the right token rows, each combine holds the expert outputs its tokens need; the
    bytes sent to other ranks equal 4(n-1)/n·E·C·h·w. Each case is drawn so that some token loses
    part of its choices and every known slip of the layer gives some rank a wrong output.
    Fakes: torch's differentiable all-to-alls trip; all_gather, broadcast or point-to-point
    traffic beyond the count exchange is refused; results computed another way (the store, a file)
    fail on the rows each all-to-all carried.
    """

    summary = ("outputs and gradients (x, router, experts) equal the single-process layer on 2 and 4 ranks with "
               "dropped tokens; 2 all-to-alls forward and 2 backward, each carrying the right rows, 4(n-1)/n·E·C·h·w "
               "bytes per rank")

    def worlds(self, rng):
        worlds = []
        for n, local in ((2, 3), (4, 2)):
            tokens = [int(rng.integers(6, 16))] * n
            cases = [_ep_case(rng, n, local, 2, True, tokens, float(rng.choice([0.5, 0.75]))),
                     _ep_case(rng, n, local, 1, False, tokens, 1.0)]
            worlds.append((n, cases))
        return worlds


@exercise("ep.expert_parallel_dropless", points=3)
@refuses_library(MOE)
class ExpertParallelDropless(ExpertParallelCheck):
    """Verifies: dropless routing on 2 and 4 gloo ranks with 2 and 3 experts per rank, top-1 and
    top-2, ranks holding different numbers of tokens (one of them a single token, so that some
    splits are empty): outputs and all gradients equal the single-process layer's; two
    all-to-alls of token rows forward and two backward (plus at most a small integer count
    exchange); each dispatch piece is exactly the rows routed to that rank, each combine piece the
    expert outputs they need; bytes equal 2(out + in)·h·w, so no padding. In each case some pair
    of ranks sends each other different numbers of rows, so a backward that does not swap the
    split sizes fails.
    Fakes: as for the fixed-capacity layer; padding to equal splits fails on the bytes.
    """

    summary = ("dropless outputs and gradients equal the single-process layer on 2 and 4 ranks with uneven (and "
               "empty) splits; 2 all-to-alls forward and 2 backward carrying exactly the routed rows, 2(out+in)·h·w "
               "bytes per rank")

    def worlds(self, rng):
        worlds = []
        for n, local in ((2, 2), (4, 3)):
            tokens = [int(rng.integers(3, 20)) for _ in range(n)]
            tokens[int(rng.integers(n))] = 1
            cases = [_ep_case(rng, n, local, 2, True, tokens, None), _ep_case(rng, n, local, 1, False, tokens, None)]
            worlds.append((n, cases))
        return worlds
