"""Exercise 4: a real 1F1B pipeline on gloo, against single-process training of the same model
on the full batch, with the messages each rank sent and the order its stage computed in."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from dtp.common.traffic import CommunicationLog
from dtp.pp import schedules as pipeline

from ...compare import CheckFailed, expect, expect_answer, expect_close
from ...registry import Check, exercise
from ..common import completed_worlds, events_as_data, raise_world_failure, run_worlds

# --- 4. a real 1F1B pipeline on gloo ----------------------------------------------------------

WIDTHS = dict(d_in=6, width=8, d_out=3)


def _pipeline_batch(seed: int, m: int, micro_batch: int):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(m * micro_batch, WIDTHS["d_in"], generator=generator),
            torch.randn(m * micro_batch, WIDTHS["d_out"], generator=generator))


def _pipeline_rank(rank, world_size, step, seed, m, micro_batch):
    stage = pipeline.pipeline_stages(world_size, seed, **WIDTHS)[rank]
    order: list[str] = []  # what the stage computed, in order: "F" per forward, "B" per backward

    def forward_hook(module, inputs, output):
        order.append("F")
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: order.append("B"))

    stage.register_forward_hook(forward_hook)
    batch, targets = _pipeline_batch(seed, m, micro_batch)
    with CommunicationLog(payloads=True) as log:
        loss = step(stage, batch, targets, m, (micro_batch, WIDTHS["width"]))
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        loss = loss.item()
    grads = {name: (parameter.grad.clone() if parameter.grad is not None else None)
             for name, parameter in stage.named_parameters()}
    return {"loss": loss, "grads": grads, "order": order, "events": events_as_data(log, payloads=True)}


def single_process_reference(p: int, seed: int, m: int, micro_batch: int) -> dict:
    """The oracle: the whole model on the full batch in one process (mean-squared error over the
    batch); plus, per micro-batch, the activation at every stage boundary and the gradient of the
    step's loss with respect to it (its micro-batch's loss divided by m)."""
    stages = pipeline.pipeline_stages(p, seed, **WIDTHS)
    batch, targets = _pipeline_batch(seed, m, micro_batch)
    loss = nn.functional.mse_loss(nn.Sequential(*stages)(batch), targets)
    loss.backward()
    grads = [{name: parameter.grad.numpy().copy() for name, parameter in stage.named_parameters()} for stage in stages]
    activations = [[None] * m for _ in range(p - 1)]  # boundary s (after stage s) -> micro-batch -> tensor
    gradients = [[None] * m for _ in range(p - 1)]
    for k, (x, y) in enumerate(zip(batch.tensor_split(m), targets.tensor_split(m))):
        boundary = []
        for s, stage in enumerate(stages):
            x = stage(x)
            if s < p - 1:
                x.retain_grad()
                boundary.append(x)
        (nn.functional.mse_loss(x, y) / m).backward()
        for s, tensor in enumerate(boundary):
            activations[s][k], gradients[s][k] = tensor.detach().numpy(), tensor.grad.numpy()
    return {"loss": loss.item(), "grads": grads, "activations": activations, "gradients": gradients}


def _which(payload, candidates) -> int | None:
    for index, candidate in enumerate(candidates):
        if payload.shape == candidate.shape and np.allclose(payload, candidate, rtol=1e-4, atol=1e-6):
            return index
    return None


def _judge_messages(events: list, rank: int, p: int, m: int, micro_batch: int, reference: dict, world: str) -> None:
    other = sorted({e["op"] for e in events} - {"send", "recv", "wait"})
    expect(not other, f"{world}: rank {rank} called {', '.join(other)}; pipeline stages talk to their neighbours with "
                      "point-to-point send/recv (isend/irecv) only")
    sends = [e for e in events if e["op"] == "send"]
    for event in sends:
        expect(event["peer"] in (rank - 1, rank + 1),
               f"{world}: rank {rank} sent to rank {event['peer']}; a stage sends activations to rank {rank + 1} and "
               f"gradients to rank {rank - 1} only")
    size = micro_batch * WIDTHS["width"] * 4
    for direction, peer, what, table in (("forward", rank + 1, "activation", reference["activations"]),
                                         ("backward", rank - 1, "gradient", reference["gradients"])):
        if not 0 <= peer < p:
            continue
        sent = [e for e in sends if e["peer"] == peer]
        expect(len(sent) == m, f"{world}: rank {rank} sent {len(sent)} messages to rank {peer} for m = {m} micro-batches; "
                               f"each micro-batch's {what} crosses every stage boundary in its own message, one per "
                               f"micro-batch in each direction")
        boundary = rank if direction == "forward" else rank - 1
        seen = set()
        for number, event in enumerate(sent, 1):
            payload = np.concatenate([np.ravel(t) for t in event["payload"]]) if event["payload"] else np.zeros(0)
            expect(event["bytes"] == size, f"{world}: rank {rank}'s message {number} to rank {peer} has {event['bytes']} "
                                           f"bytes; one micro-batch's {what} is {micro_batch} × {WIDTHS['width']} float32, "
                                           f"{size} bytes")
            candidates = [np.ravel(t) for t in table[boundary]]
            index = _which(payload, candidates)
            if index is None and what == "gradient" and _which(payload / m, candidates) is not None:
                raise CheckFailed(f"{world}: rank {rank} sent gradients m = {m} times too large: the step's loss is the "
                                  "mean over the whole batch, so divide each micro-batch's loss by m")
            if index is None:
                hint = (" Did rank {r} run backward on the wrong micro-batch's output? 1F1B's backwards come in the "
                        "order of the forwards: keep each micro-batch's tensors in a first-in, first-out queue"
                        if what == "gradient" else " Is the stage's input the right micro-batch?").format(r=rank)
                raise CheckFailed(f"{world}: rank {rank}'s {what} message {number} to rank {peer} is not the {what} of "
                                  f"any micro-batch at that stage boundary.{hint}")
            expect(index not in seen, f"{world}: rank {rank} sent the {what} of micro-batch {index} twice")
            seen.add(index)


def _judge_order(order: list, rank: int, p: int, m: int, world: str) -> None:
    forwards, backwards = order.count("F"), order.count("B")
    expect(forwards == m and backwards == m,
           f"{world}: rank {rank}'s stage ran {forwards} forward and {backwards} backward passes; a pipeline step runs "
           f"each of the m = {m} micro-batches through it once each way (call the stage on one micro-batch at a time)")
    held = peak = 0
    for kind in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    bound = min(p - rank, m)
    expect(peak <= bound, f"{world}: rank {rank} held {peak} micro-batches' activations at once; under 1F1B stage s holds "
                          f"at most min(p - s, m) = {bound}: after p - s - 1 warm-up forwards, alternate one forward "
                          "and one backward")
    expect(peak == bound, f"{world}: rank {rank} never had more than {peak} micro-batches in flight, where 1F1B has "
                          f"{bound}: with fewer warm-up forwards (p - s - 1 on stage s) the stages wait for each other "
                          "and the pipeline does not fill")


@exercise("pp.pipeline_1f1b", points=4)
class Pipeline1F1B(Check):
    """Verifies: on 2, 3 and 4 gloo processes with random m (below and above p) and micro-batch
    sizes, the last rank's loss and every stage's gradients equal single-process training on the
    full batch; only send/recv between neighbours, m messages each way across every boundary,
    each carrying one micro-batch's activation (or gradient, with the 1/m of the mean loss) as
    the single-process computation has it; each stage ran m forwards and m backwards with exactly
    1F1B's min(p - s, m) micro-batches in flight at its peak.
    Fakes: GPipe's order (peak m), a stage that waits for each backward before the next forward
    (peak 1), collectives or data sent whole, a backward on the wrong micro-batch (its gradient
    message matches no micro-batch); nothing else reaches a stage's parameters.
    """

    reads = ("one_f_one_b_step",)
    timeout_s = 60
    runs_world = True
    preimport = ()  # its ranks use no optimizer and no module that imports torch._dynamo (measured)

    def prepare(self, rng):
        worlds = []
        for p, low, high in ((2, 1, 6), (3, 2, 7), (4, 3, 9)):
            worlds.append((p, int(rng.integers(1 << 20)), int(rng.integers(low, high + 1)), int(rng.integers(1, 4))))
        return worlds

    def collect(self, student, worlds):
        return run_worlds(_pipeline_rank, [(p, (student.one_f_one_b_step, seed, m, micro_batch))
                                           for p, seed, m, micro_batch in worlds])

    def judge(self, worlds, outcomes) -> str:
        done, failure = completed_worlds(outcomes)
        runs = [(p, m, micro_batch, f"p = {p} processes, m = {m} micro-batches of {micro_batch}",
                 single_process_reference(p, seed, m, micro_batch), per_rank)
                for (p, seed, m, micro_batch), per_rank in zip(worlds, done)]
        # Each property over every world before the next, so that the feedback names the most
        # telling mistake: what was sent (and for which micro-batch), the order, then the results.
        for p, m, micro_batch, world, reference, per_rank in runs:
            for rank, outcome in enumerate(per_rank):
                _judge_messages(outcome["events"], rank, p, m, micro_batch, reference, world)
        for p, m, micro_batch, world, reference, per_rank in runs:
            for rank, outcome in enumerate(per_rank):
                _judge_order(outcome["order"], rank, p, m, world)
        for p, m, micro_batch, world, reference, per_rank in runs:
            loss = per_rank[-1]["loss"]
            expect(loss is not None, f"{world}: the last rank returned None; it should return the step's loss, the mean "
                                     "over the full batch")
            expect_answer(loss, reference["loss"], f"{world}: the loss the last rank returned", rel=1e-4, slips={
                f"that is the sum of the micro-batches' mean losses; divide each by m = {m}": reference["loss"] * m})
            for rank, outcome in enumerate(per_rank):
                grads = outcome["grads"]
                for name, expected in reference["grads"][rank].items():
                    expect(grads.get(name) is not None, f"{world}: rank {rank}'s parameter {name} has no gradient")
                    expect_close(grads[name], expected, f"{world}: rank {rank}'s gradient of {name}", rtol=1e-4, atol=1e-6)
        raise_world_failure(failure)
        return ("loss and every gradient equal single-process training on the full batch for p = 2, 3 and 4; one message "
                "per micro-batch each way across each boundary, and exactly 1F1B's activations in flight")
