"""The overlap chapter's graded runs: one rank of a gloo world running the learner's code with
everything it issues, waits on and computes recorded in ONE ordered list per rank.

A Timeline (dtp.common.timeline) records the collectives and point-to-point messages (with
`async_op=True` they return a handle, whose `wait()` is recorded as {"op": "wait", "of": index})
and, inside its `matrix_products()`, every matrix product as {"op": "compute"}. The grader judges
the order (was the next unit's all-gather issued before this unit's product and waited on after
it?), never how long anything took. ZeRO-3 also counts the gathered units alive after every
operation (dtp.zero.measure.FullTensorTracker), which is the memory price of prefetching.
"""
from __future__ import annotations

import torch
from torch import nn

from dtp.common.models import tiny_mlp
from dtp.common.timeline import MatrixProducts, Timeline
from dtp.zero.measure import FullTensorTracker, clear_gradients
from dtp.zero.runs import ADAM, batches, gathered_units, marked_step, rank_rows

KEEP = ("op", "bytes", "peer", "of", "label", "rows", "gathers")
PREFETCH_STEPS = 2
GATHERED_UNITS_LIMIT = 2  # the unit computing and the next one, prefetched
ComputeRecorder = MatrixProducts  # the name dtp.overlap.measure records FSDP2's products with


def plain_events(events: list) -> list[dict]:
    return [{key: event[key] for key in KEEP if key in event} for event in events]


# --- ZeRO-3 with prefetch -----------------------------------------------------------------------

def zero3_prefetch_rank(rank, world_size, make, sizes, seed, batch_seed, steps: int = PREFETCH_STEPS) -> dict:
    """One rank training `make(tiny_mlp(sizes, seed))` with torch Adam on its rows of each batch.
    Per step: the loss, the module's parameters after the step (its pieces), the ordered events
    (marks "forward", "backward", "step"; collectives, waits, products), and the most gathered
    units alive at once in forward and in backward."""
    module = make(tiny_mlp(sizes, seed))
    optimizer = torch.optim.Adam(module.parameters(), **ADAM)
    outcome = {"losses": [], "pieces": [], "events": [], "gathered units": []}
    for inputs, targets in batches(sizes, batch_seed, world_size, steps):
        tracker = FullTensorTracker(unit_limit=GATHERED_UNITS_LIMIT)
        with Timeline() as log, tracker, log.matrix_products(tracker):
            loss = marked_step(log, tracker, lambda: nn.functional.mse_loss(module(inputs[rank_rows(rank)]),
                                                                            targets[rank_rows(rank)]))
        optimizer.step()
        clear_gradients([], optimizer=optimizer)
        outcome["losses"].append(float(loss.detach()))
        outcome["pieces"].append([p.detach().clone().numpy() for p in module.parameters()])
        outcome["events"].append(log.kept(KEEP))
        outcome["gathered units"].append(gathered_units(tracker))
    return outcome


# --- collective matmul --------------------------------------------------------------------------

def collective_matmul_rank(rank, world_size, function, rows, hidden, columns, seed) -> dict:
    """Rank r holds rows r·s/t.. of the sequence-parallel input X (s x h) and the column piece
    W_r (h x f/t) of a column-parallel weight; `function(x_piece, w_piece)` returns X @ W_r
    (s x f/t), computed by passing X's pieces around the ring."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows * world_size, hidden, generator=generator)
    w = torch.randn(hidden, columns * world_size, generator=generator)
    x_piece = x[rank * rows:(rank + 1) * rows].clone()
    w_piece = w[:, rank * columns:(rank + 1) * columns].clone()
    with Timeline() as log, log.matrix_products():
        out = function(x_piece, w_piece)
    return {"out": out.detach().clone() if isinstance(out, torch.Tensor) else out,
            "events": log.kept(KEEP)}


def collective_matmul_oracle(world_size, rows, hidden, columns, seed) -> list:
    """X @ W_r for every rank r: what the plain all-gather then GEMM gives."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows * world_size, hidden, generator=generator)
    w = torch.randn(hidden, columns * world_size, generator=generator)
    return [(x @ w[:, r * columns:(r + 1) * columns]).numpy() for r in range(world_size)]


# --- DDP-style bucket overlap -------------------------------------------------------------------

def bucket_overlap_rank(rank, world_size, make, sizes, seed, batch_seed, bucket_layers) -> dict:
    """One backward of `tiny_mlp(sizes, seed)` on this rank's rows, with the learner's
    `make(model, buckets)` registering its hooks; `buckets` lists parameter lists in backward
    order, `bucket_layers[b]` layers in bucket b (the last layer first). After backward the harness marks "backward done" and calls `finish()`, which must
    leave the averaged gradients in .grad."""
    model = tiny_mlp(sizes, seed)
    parameters = list(model.parameters())
    layers = [parameters[i:i + 2] for i in range(0, len(parameters), 2)][::-1]  # backward order
    buckets, start = [], 0
    for count in bucket_layers:
        buckets.append([p for layer in layers[start:start + count] for p in layer])
        start += count
    inputs, targets = batches(sizes, batch_seed, world_size, 1)[0]
    ddp = make(model, buckets)
    loss = nn.functional.mse_loss(model(inputs[rank_rows(rank)]), targets[rank_rows(rank)])
    with Timeline() as log, log.matrix_products():
        log.mark("backward")
        loss.backward()
        log.mark("backward done")
        ddp.finish()
        log.mark("finished")
    return {"grads": [p.grad.detach().clone() if p.grad is not None else None for p in parameters],
            "events": log.kept(KEEP)}


def full_batch_gradients(sizes, seed, batch_seed, world_size) -> list:
    model = tiny_mlp(sizes, seed)
    inputs, targets = batches(sizes, batch_seed, world_size, 1)[0]
    nn.functional.mse_loss(model(inputs), targets).backward()
    return [p.grad.numpy() for p in model.parameters()]

