"""Exercise 3: column- and row-parallel linear layers on gloo."""
from __future__ import annotations

import re

import numpy as np
import torch
from torch import nn

from dtp.common.traffic import CommunicationLog
from dtp.tp import tensor_parallel as tp

from ...compare import CheckFailed
from ...registry import exercise
from ..common import WorldsCheck, events_as_data, run_worlds
from .shared import (
    DTENSOR_TP,
    DenseParameters,
    close,
    expect_collectives,
    held_parameters,
    judge_shards,
    leaf,
    matches,
    run_backward,
    scaled_gradient_causes,
)

# --- 3. column- and row-parallel linear layers -------------------------------------------------------

def _dense_linear(weight: np.ndarray, bias: np.ndarray) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(weight))
        layer.bias.copy_(torch.from_numpy(bias))
    return layer


def _slice(array: np.ndarray, n: int, rank: int, dim: int = -1) -> np.ndarray:
    start, stop = tp.shard_bounds(array.shape[dim], n, rank)
    return np.ascontiguousarray(np.moveaxis(np.moveaxis(array, dim, 0)[start:stop], 0, dim))


def chunk_sizes(size: int, parts: int) -> list[int]:
    """The pieces torch.chunk cuts: ceil(size/parts) each, the last shorter, and fewer than
    `parts` pieces when the rest runs out (9 into 4: 3, 3, 3)."""
    step = -(-size // parts)
    return [min(step, size - start) for start in range(0, size, step)] if size else []


def separates_chunk_from_tensor_split(size: int, parts: int) -> bool:
    """torch.chunk gives `parts` pieces of other sizes than torch.tensor_split's."""
    chunks = chunk_sizes(size, parts)
    return len(chunks) == parts and chunks != [len(range(*tp.shard_bounds(size, parts, r))) for r in range(parts)]


def _split_hint(got: int, size: int, n: int, rank: int) -> str:
    """Why a rank's share of `size` features has `got` of them, when torch.chunk explains it."""
    chunks = chunk_sizes(size, n)
    start, stop = tp.shard_bounds(size, n, rank)
    if got != stop - start and rank < len(chunks) and got == chunks[rank]:
        return (f": that is torch.chunk's piece ({', '.join(map(str, chunks))} for {size} features on {n} ranks); "
                f"torch.tensor_split, as shard_of cuts, makes the first {size} % {n} pieces one longer "
                f"({', '.join(str(len(range(*tp.shard_bounds(size, n, r)))) for r in range(n))})")
    return ""


def _linears_on_rank(rank, world_size, column_class, row_class, data):
    column = column_class(_dense_linear(data["w_column"], data["b_column"]))
    row = row_class(_dense_linear(data["w_row"], data["b_row"]))
    x = leaf(data["x_column"])
    x_shard = leaf(_slice(data["x_row"], world_size, rank))
    width = data["w_column"].shape[0]
    with CommunicationLog() as log:
        log.mark("column forward")
        y = column(x)
        log.mark("column backward")
        if isinstance(y, torch.Tensor) and y.dim() and y.shape[-1] != len(range(*tp.shard_bounds(width, world_size, rank))):
            hint = _split_hint(y.shape[-1], width, world_size, rank)  # a form error: it cannot pass anyway
            if hint:
                raise CheckFailed(f"rank {rank}: ColumnParallelLinear returned {y.shape[-1]} of the {width} output "
                                  f"features{hint}")
        run_backward(y, torch.from_numpy(_slice(data["dy_column"], world_size, rank)),
                     "ColumnParallelLinear (its output holds this rank's out_features, by tensor_split)")
        log.mark("row forward")
        try:
            z = row(x_shard)
        except RuntimeError as error:
            if "shapes cannot be multiplied" not in str(error):
                raise
            shapes = re.search(r"and (\d+)x\d+\)", str(error))  # mat2: the rank's weight, (in_features, out)
            hint = _split_hint(int(shapes.group(1)), width, world_size, rank) if shapes else ""
            raise CheckFailed(f"RowParallelLinear failed on an input shard of shape {tuple(x_shard.shape)}: {error}"
                              + (hint or ". A row-parallel layer multiplies its in_features/t inputs by the matching "
                                 "columns of nn.Linear's weight (dim 1), the rows of W")) from None
        log.mark("row backward")
        run_backward(z, torch.from_numpy(data["dy_row"]), "RowParallelLinear (its output is whole on every rank)")
        log.mark("done")
    return {"y": y, "x_grad": x.grad, "column": held_parameters(column), "z": z, "x_shard_grad": x_shard.grad,
            "row": held_parameters(row), "events": events_as_data(log)}


@exercise("tp.parallel_linear", points=3)
class ParallelLinear(WorldsCheck):
    """Verifies: on 2 and 4 ranks, with feature counts not divisible by t, ColumnParallelLinear
    returns its rank's output features and passes back the full input gradient (one all-reduce,
    in backward only); RowParallelLinear takes its rank's input features and returns the whole
    output with the bias added once (one all-reduce, in forward only); every weight and bias a
    rank holds is a piece of the dense layer (split where it should be, the row layer's bias
    whole on every rank) and its gradient equals the dense gradient there.
    Fakes: a dense layer on every rank (the weights it holds are not split); the bias added on
    every rank, or divided by t (output or bias gradient off); all-gathers in place of the
    all-reduce (the recorded collectives); shards cut by torch.chunk, which agrees with
    tensor_split for some widths t does not divide: every grading's 4-rank width is one where
    they differ.
    """

    reads = ("ColumnParallelLinear", "RowParallelLinear")
    preimport = ()  # its ranks use no optimizer and no module that imports torch._dynamo (measured)
    references = DTENSOR_TP
    timeout_s = 40
    summary = ("on 2 and 4 ranks (features not divisible by t): outputs, input, weight and bias gradients equal the "
               "dense layer's; the row layer adds its bias once; one all-reduce each, in backward (column) and "
               "forward (row)")

    def prepare(self, rng):
        worlds = []
        for n in (2, 4):
            batch, seq = int(rng.integers(1, 3)), int(rng.integers(2, 5))
            # a width t does not divide; on 4 ranks one where torch.chunk cuts other pieces than tensor_split
            # (10: 3, 3, 3, 1 against 3, 3, 2, 2), in every grading (on 2 ranks the two always agree)
            widths = [w for w in range(n * 2 + 1, n * 4) if w % n and (n == 2 or separates_chunk_from_tensor_split(w, n))]
            d_in, width, d_out = int(rng.integers(3, 8)), int(rng.choice(widths)), int(rng.integers(3, 8))
            normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
            worlds.append((n, {"w_column": normal(width, d_in) / np.float32(np.sqrt(d_in)), "b_column": normal(width),
                               "w_row": normal(d_out, width) / np.float32(np.sqrt(width)), "b_row": normal(d_out),
                               "x_column": normal(batch, seq, d_in), "dy_column": normal(batch, seq, width),
                               "x_row": normal(batch, seq, width), "dy_row": normal(batch, seq, d_out)}))
        return worlds

    def collect(self, student, worlds):
        return run_worlds(_linears_on_rank, [(n, (student.ColumnParallelLinear, student.RowParallelLinear, data))
                                             for n, data in worlds])

    def judge_world(self, world, per_rank) -> None:
        n, data = world
        d = {k: v.astype(np.float64) for k, v in data.items()}
        y = d["x_column"] @ d["w_column"].T + d["b_column"]
        z = d["x_row"] @ d["w_row"].T + d["b_row"]
        column_grads = {"weight": np.einsum("bso,bsi->oi", d["dy_column"], d["x_column"]),
                        "bias": d["dy_column"].sum(axis=(0, 1))}
        row_grads = {"weight": np.einsum("bso,bsi->oi", d["dy_row"], d["x_row"]), "bias": d["dy_row"].sum(axis=(0, 1))}
        for rank, outcome in enumerate(per_rank):
            what = f"world {n}, rank {rank}"
            close(outcome["y"], _slice(y, n, rank), f"{what}: ColumnParallelLinear's output")
            partial = _slice(d["dy_column"], n, rank) @ _slice(d["w_column"], n, rank, 0)
            if matches(outcome["x_grad"], partial):
                raise CheckFailed(f"{what}: ColumnParallelLinear passed back only this rank's part of dL/dx; the "
                                  "input is used by every rank's columns, so its gradient is the sum over ranks: "
                                  "apply f (copy_to_tensor_parallel) to the input")
            close(outcome["x_grad"], d["dy_column"] @ d["w_column"], f"{what}: ColumnParallelLinear's input gradient")
            if matches(outcome["z"], z + (n - 1) * d["b_row"]):
                raise CheckFailed(f"{what}: RowParallelLinear's output holds the bias {n} times: every rank added "
                                  "it before the all-reduce; add it once, after the sum")
            close(outcome["z"], z, f"{what}: RowParallelLinear's output")
            close(outcome["x_shard_grad"], _slice(d["dy_row"] @ d["w_row"], n, rank),
                   f"{what}: RowParallelLinear's input-shard gradient")
            bias = [p for p in outcome["row"] if np.shape(p["value"]) == d["b_row"].shape
                    and np.array_equal(p["value"], data["b_row"])]
            if bias and bias[0]["grad"] is None:
                raise CheckFailed(f"{what}: RowParallelLinear's bias got no gradient on this rank; every rank must "
                                  "add the whole bias to the all-reduced output, once, after the sum")
            if bias and not matches(bias[0]["grad"], row_grads["bias"]):
                rows = data["x_row"].shape[0] * data["x_row"].shape[1]
                # a diagnosis only where the gradient is that multiple; both when b·s = t makes them coincide
                causes = scaled_gradient_causes(bias[0]["grad"], row_grads["bias"], n, rows)
                hint = ("it is " + "; or it is ".join(causes)) if causes else \
                    "the bias must be added by every rank, after the sum"
                raise CheckFailed(f"{what}: the gradient of RowParallelLinear's bias differs from the dense layer's "
                                  f"({hint}); add the whole bias once to the all-reduced output, on every rank")
        judge_shards(DenseParameters({"weight": data["w_column"], "bias": data["b_column"]}), column_grads,
                     [o["column"] for o in per_rank], {"weight", "bias"}, f"ColumnParallelLinear (world {n})")
        judge_shards(DenseParameters({"weight": data["w_row"], "bias": data["b_row"]}), row_grads,
                     [o["row"] for o in per_rank], {"weight"}, f"RowParallelLinear (world {n})")
        for rank, outcome in enumerate(per_rank):
            events, what = outcome["events"], f"world {n}, rank {rank}"
            expect_collectives(events, "column forward", "column backward", {},
                                f"{what}: ColumnParallelLinear's forward",
                                "its input is whole on every rank and each rank computes its own columns")
            expect_collectives(events, "column backward", "row forward", {"all_reduce": [data["x_column"].nbytes]},
                                f"{what}: ColumnParallelLinear's backward", "one all-reduce of dL/dx (f)")
            expect_collectives(events, "row forward", "row backward", {"all_reduce": [data["dy_row"].nbytes]},
                                f"{what}: RowParallelLinear's forward",
                                "one all-reduce adds the ranks' partial products (g); a column split of W needs "
                                "all-gathers instead")
            expect_collectives(events, "row backward", "done", {}, f"{what}: RowParallelLinear's backward")
