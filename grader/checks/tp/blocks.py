"""Exercises 4 and 5: the tensor-parallel block and its sequence-parallel variant."""
from __future__ import annotations

import copy

import numpy as np
import torch

from dtp.common.traffic import CommunicationLog
from dtp.tp import tensor_parallel as tp

from ...compare import CheckFailed, expect
from ...registry import exercise
from ..common import WorldsCheck, events_as_data, run_worlds
from .shared import (
    DTENSOR_TP,
    DenseParameters,
    close,
    describe_collectives,
    expect_collectives,
    held_parameters,
    judge_gradients,
    leaf,
    locate_shards,
    run_backward,
)

# --- 4 and 5. the tensor-parallel and sequence-parallel block ------------------------------------------

BLOCK_SPLIT = {"attention.qkv.weight", "attention.qkv.bias", "attention.proj.weight", "mlp.up.weight",
               "mlp.up.bias", "mlp.down.weight"}


def _block_case(rng, n: int, sequence_parallel: bool) -> tuple:
    heads = int(rng.choice([4, 8]))
    head_size = int(rng.integers(2, 5))
    # Sequence parallelism: batch > 1 always, where a gathered buffer reshaped with `view` instead of
    # concatenated along the sequence puts one sequence's positions into another.
    batch = int(rng.integers(2, 4)) if sequence_parallel else int(rng.integers(1, 3))
    seq = n * int(rng.integers(1, 4)) if sequence_parallel else int(rng.integers(2, 7))
    hidden = heads * head_size
    return (n, {"hidden": hidden, "heads": heads, "seed": int(rng.integers(1 << 20)),
                "x": rng.standard_normal((batch, seq, hidden)).astype(np.float32),
                "dy": rng.standard_normal((batch, seq, hidden)).astype(np.float32)})


def _block_on_rank(rank, world_size, block_class, sync, case, sequence_parallel):
    block = tp.random_block(case["hidden"], case["heads"], case["seed"])
    parallel = block_class(block)
    x, dy = case["x"], case["dy"]
    if sequence_parallel:
        x, dy = (np.ascontiguousarray(np.array_split(a, world_size, axis=1)[rank]) for a in (x, dy))
    x = leaf(x)
    with CommunicationLog() as log:
        log.mark("forward")
        with tp.SavedForBackward(parallel) as saved:  # what the rank keeps until its backward
            out = parallel(x)
        log.mark("backward")
        run_backward(out, torch.from_numpy(dy), type(parallel).__name__)
        log.mark("sync")
        if sync is not None:
            sync(parallel)
        log.mark("done")
    return {"out": out, "x_grad": x.grad, "parameters": held_parameters(parallel), "events": events_as_data(log),
            "kept": saved.tensors if sequence_parallel else []}


def dense_block_reference(case) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The oracle: the same dtp.common.gpt Block in float64, forward and backward on the whole input."""
    block = tp.random_block(case["hidden"], case["heads"], case["seed"])
    values = {name: p.detach().numpy().copy() for name, p in block.named_parameters()}
    reference = copy.deepcopy(block).double()
    x = torch.from_numpy(case["x"]).double().requires_grad_()
    out = reference(x)
    out.backward(torch.from_numpy(case["dy"]).double())
    grads = {name: p.grad.numpy() for name, p in reference.named_parameters()}
    return out.detach().numpy(), x.grad.numpy(), values, grads


def sequence_wide_activations(case) -> dict[str, np.ndarray]:
    """The dense block's activations that sequence parallelism never keeps whole, in float64, shape
    (b, s, h): the inputs of the two column-parallel layers (what the all-gathers produce) and
    the residual stream and LayerNorm inputs around them."""
    block = copy.deepcopy(tp.random_block(case["hidden"], case["heads"], case["seed"])).double()
    with torch.no_grad():
        x = torch.from_numpy(case["x"]).double()
        qkv_input = block.norm1(x)
        after_attention = x + block.attention(qkv_input)
        mlp_input = block.norm2(after_attention)
    return {"the all-gathered input of the QKV projection (LayerNorm 1's output)": qkv_input.numpy(),
            "the all-gathered input of the MLP's first layer (LayerNorm 2's output)": mlp_input.numpy(),
            "the block's input": x.numpy(), "the residual stream after attention": after_attention.numpy()}


def _judge_kept_inputs(case, n: int, per_rank: list[dict], what_block: str) -> None:
    """No rank keeps, for backward, any of these activations at other ranks' sequence positions:
    that would hold b·s·h values per rank where sequence parallelism keeps b·s/t·h."""
    for rank, outcome in enumerate(per_rank):
        for name, whole in sequence_wide_activations(case).items():
            others = np.concatenate([piece for r, piece in enumerate(np.array_split(whole, n, axis=1)) if r != rank], axis=1)
            rows = others.reshape(-1, case["hidden"])
            atol = 1e-4 * max(1.0, float(np.abs(whole).max()))
            for kept in outcome["kept"]:
                # a whole rank's worth of the other positions: the gathered sequence, not a coincidence
                if tp.rows_found(np.asarray(kept), rows, atol) >= len(rows) // (n - 1):
                    raise CheckFailed(
                        f"{what_block} (world {n}): rank {rank} keeps for backward a tensor of shape "
                        f"{tuple(np.shape(kept))} holding {name} for other ranks' positions of the sequence. Sequence "
                        "parallelism exists so that a rank keeps only its s/t positions: keep the piece, and all-gather "
                        "it again in backward (run the QKV projection and the MLP's first layer under "
                        "torch.utils.checkpoint, or write their backward yourself)")


def _judge_heads(located: list[tuple], n: int, hidden: int, heads: int, what: str) -> None:
    """Each rank's rows of the fused [q; k; v] weight are q, k and v of the same whole heads."""
    head_size = hidden // heads
    for rank in range(n):
        indices = np.concatenate([i.ravel() for r, _, name, i in located if r == rank and name == "attention.qkv.weight"])
        rows = np.unique(indices // hidden)
        by_part = [set((rows[rows // hidden == part] % hidden) // head_size) for part in range(3)]
        whole = all(np.sum((rows // head_size) == head) == head_size for head in np.unique(rows // head_size))
        if not (by_part[0] == by_part[1] == by_part[2]) or not whole:
            names = ", ".join(f"{part} of heads {sorted(int(h) for h in heads_held)}"
                              for part, heads_held in zip("qkv", by_part))
            raise CheckFailed(f"{what}: rank {rank} holds rows of the fused qkv weight giving {names}. Split attention "
                              f"by heads: each rank needs q, k and v of the same {heads // n} whole heads (the weight "
                              "stacks [q; k; v], so a contiguous split of its rows does not do that)")


def _judge_block(case, n, per_rank, sequence_parallel: bool, what_block: str) -> None:
    out, x_grad, values, grads = dense_block_reference(case)
    dense = DenseParameters(values)
    label = f"{what_block} (world {n}, hidden {case['hidden']}, {case['heads']} heads)"
    located = locate_shards(dense, [o["parameters"] for o in per_rank], BLOCK_SPLIT, label)
    _judge_heads(located, n, case["hidden"], case["heads"], label)
    judge_gradients(located, grads, BLOCK_SPLIT, n, label, rows=case["x"].shape[0] * case["x"].shape[1])
    for rank, outcome in enumerate(per_rank):
        want_out, want_grad = out, x_grad
        if sequence_parallel:
            want_out, want_grad = (np.array_split(a, n, axis=1)[rank] for a in (out, x_grad))
        close(outcome["out"], want_out, f"{label}: rank {rank}'s output")
        close(outcome["x_grad"], want_grad, f"{label}: rank {rank}'s input gradient")


@exercise("tp.parallel_block", points=4)
class ParallelBlock(WorldsCheck):
    """Verifies: TensorParallelBlock(block) on 2 and 4 ranks equals the dense dtp.common.gpt Block (same
    random weights, LayerNorms included) in output, input gradient and every parameter gradient;
    each rank holds q, k and v of the same t-th of the heads and 1/t of every matrix; forward
    issues exactly 2 all-reduces of b·s·h floats and backward 2 more (a reduce-scatter plus an
    all-gather counts as one all-reduce). Fakes: the dense block on every rank (weights not
    split); a contiguous split of the fused qkv rows (heads check); gathering activations
    instead of all-reducing them (the recorded collectives).
    """

    reads = ("TensorParallelBlock",)
    preimport = ()  # its ranks use no optimizer and no module that imports torch._dynamo (measured)
    references = DTENSOR_TP
    timeout_s = 50
    summary = ("equal to the dense block in output and every gradient on 2 and 4 ranks, attention split by heads; "
               "2 all-reduces of b·s·h values in forward and 2 in backward")

    def prepare(self, rng):
        return [_block_case(rng, n, False) for n in (2, 4)]

    def collect(self, student, cases):
        return run_worlds(_block_on_rank, [(n, (student.TensorParallelBlock, None, case, False)) for n, case in cases])

    def judge_world(self, world, per_rank) -> None:
        n, case = world
        _judge_block(case, n, per_rank, False, "TensorParallelBlock")
        message = {"all_reduce": [case["x"].nbytes] * 2}
        for rank, outcome in enumerate(per_rank):
            what = f"world {n}, rank {rank}: TensorParallelBlock's"
            expect_collectives(outcome["events"], "forward", "backward", message, f"{what} forward",
                                "g after attention's output projection and after the MLP, each b·s·h values")
            expect_collectives(outcome["events"], "backward", "sync", message, f"{what} backward",
                                "f's all-reduce of dL/dx before the QKV projection and before the MLP")


@exercise("tp.sequence_parallel", points=3)
class SequenceParallel(WorldsCheck):
    """Verifies: SequenceParallelBlock(block), fed its rank's piece of the sequence on 2 and 4
    ranks (batch > 1 every time), returns its piece of the dense block's output and input
    gradient; after all_reduce_replicated_gradients every gradient equals the dense block's;
    forward issues 2 all-gathers of b·s/t·h floats and 2 reduce-scatters of b·s·h and no
    all-reduce; no rank keeps for backward (autograd's saved tensors) the gathered inputs of
    the column-parallel layers, or the LayerNorms' or residual stream's values, at other ranks'
    positions; backward issues 2 reduce-scatters and 4 all-gathers (2 of them gathering the
    kept piece again); the gradient sync all-reduces exactly the replicated parameters
    (LayerNorms and the row-parallel biases).
    Fakes: plain tensor parallelism with a slice at the end (all-reduces recorded); summing every
    gradient (byte count); a gathered buffer reshaped with `view` (wrong for batch > 1); keeping
    the gathered input hidden from autograd's saved tensors (an attribute of ctx) still shows
    in the backward's collectives, which then lack the 2 repeated all-gathers.
    """

    reads = ("SequenceParallelBlock", "all_reduce_replicated_gradients")
    references = DTENSOR_TP
    timeout_s = 50
    summary = ("equal to the dense block (output and input gradient by sequence piece, every parameter gradient after "
               "the sync) on 2 and 4 ranks; all-gathers and reduce-scatters of equal volume replace the all-reduces; "
               "each rank keeps only its piece of the sequence for backward and gathers it again there")

    def prepare(self, rng):
        return [_block_case(rng, n, True) for n in (2, 4)]

    def collect(self, student, cases):
        return run_worlds(_block_on_rank, [(n, (student.SequenceParallelBlock, student.all_reduce_replicated_gradients,
                                                case, True)) for n, case in cases])

    def judge_world(self, world, per_rank) -> None:
        n, case = world
        full, shard, hidden = case["x"].nbytes, case["x"].nbytes // n, case["hidden"]
        replicated_bytes = 6 * hidden * 4
        for rank, outcome in enumerate(per_rank):
            what = f"world {n}, rank {rank}: SequenceParallelBlock's"
            expect_collectives(outcome["events"], "forward", "backward",
                               {"all_gather": [shard] * 2, "reduce_scatter": [full] * 2}, f"{what} forward",
                               "each all-reduce of tensor parallelism becomes an all-gather of the sequence (before "
                               "the column-parallel layer) and a reduce-scatter (after the row-parallel one)",
                               merge=False)
        _judge_kept_inputs(case, n, per_rank, "SequenceParallelBlock")  # before the backward's count: it says why
        for rank, outcome in enumerate(per_rank):
            what = f"world {n}, rank {rank}: SequenceParallelBlock's"
            events = outcome["events"]
            backward = tp.summarize(tp.events_between(events, "backward", "sync"))
            expect(backward.get("reduce_scatter") == [full] * 2 and backward.get("all_gather") == [shard] * 4
                   and set(backward) == {"reduce_scatter", "all_gather"},
                   f"{what} backward issued {describe_collectives(backward)}; it should issue 2 reduce_scatter "
                   f"({full:,} bytes each: the all-gathers' backward) and 4 all_gather ({shard:,} bytes each: 2 for "
                   "the reduce-scatters' backward, and 2 that gather the sequence again for the column-parallel "
                   "layers' weight gradients, since a rank keeps only its piece)")
            sync = tp.summarize(tp.events_between(events, "sync", "done"))
            expect(set(sync) <= {"all_reduce"} and sum(sync.get("all_reduce", [])) == replicated_bytes,
                   f"{what} all_reduce_replicated_gradients issued {describe_collectives(sync)}; it should all-reduce the "
                   f"gradients of the replicated parameters only (two LayerNorms and two row-parallel biases, "
                   f"6h = {6 * hidden} floats, {replicated_bytes} bytes), which each rank computed from its own "
                   "piece of the sequence")
        _judge_block(case, n, per_rank, True, "SequenceParallelBlock")
