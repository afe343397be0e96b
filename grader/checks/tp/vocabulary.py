"""Exercise 6: the vocabulary-parallel embedding and cross-entropy."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from dtp.common.traffic import CommunicationLog
from dtp.tp import tensor_parallel as tp

from ...compare import CheckFailed, expect, expect_close
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
    run_backward,
)

# --- 6. vocabulary-parallel embedding and cross-entropy -------------------------------------------

def _vocabulary_on_rank(rank, world_size, embedding_class, cross_entropy, data):
    dense = nn.Embedding(*data["table"].shape)
    with torch.no_grad():
        dense.weight.copy_(torch.from_numpy(data["table"]))
    embedding = embedding_class(dense)
    start, stop = tp.shard_bounds(data["logits"].shape[1], world_size, rank)
    local_logits = leaf(data["logits"][:, start:stop])
    targets = torch.from_numpy(data["targets"])
    with CommunicationLog() as log:
        log.mark("embedding forward")
        rows = embedding(torch.from_numpy(data["tokens"]))
        log.mark("embedding backward")
        run_backward(rows, torch.from_numpy(data["dy_rows"]), "VocabParallelEmbedding")
        log.mark("loss forward")
        with tp.TensorShapes() as shapes:
            losses = cross_entropy(local_logits, targets, start)
            log.mark("loss backward")
            run_backward(losses, torch.from_numpy(data["loss_weights"]),
                      "vocab_parallel_cross_entropy (one loss per token)")
        log.mark("done")
    return {"rows": rows, "embedding": held_parameters(embedding), "losses": losses, "logits_grad": local_logits.grad,
            "shapes": shapes.shapes, "events": events_as_data(log)}


@exercise("tp.vocab_parallel", points=4)
class VocabParallel(WorldsCheck):
    """Verifies: on 2 and 3 ranks with a vocabulary not divisible by t, VocabParallelEmbedding
    returns the dense embedding's rows with one all-reduce in forward and none in backward, each
    rank holding its rows of the table with the dense gradient; vocab_parallel_cross_entropy
    returns every token's loss and the gradient of the rank's logits equal to torch's
    cross_entropy on the whole logits (logits near 100 included, where exp overflows unless the
    max is subtracted); its forward all-reduces at most 3 numbers per token (no gather, no
    all-to-all), its backward nothing; no tensor any rank creates has the vocabulary's size.
    Fakes: all-gathering the logits or all-reducing a zero-padded copy (bytes and shapes); a
    side channel (the store, files) with numpy is not seen by the shape record, but then no
    torch operation touches the full logits and the three all-reduces must still carry the
    right values for the loss to come out right.
    """

    reads = ("VocabParallelEmbedding", "vocab_parallel_cross_entropy")
    preimport = ()  # its ranks use no optimizer and no module that imports torch._dynamo (measured)
    references = DTENSOR_TP
    timeout_s = 40
    summary = ("embedding and per-token cross-entropy equal the dense ones in value and gradient on 2 and 3 ranks "
               "(uneven vocabulary shards, logits near 100); the loss all-reduces at most 3 numbers per token and no "
               "rank ever creates a tensor of the vocabulary's size")

    def prepare(self, rng):
        worlds = []
        for n, offset in ((2, 0.0), (3, 100.0)):
            tokens, vocab, hidden = int(rng.integers(4, 8)), n * int(rng.integers(6, 10)) + int(rng.integers(1, n)), \
                int(rng.integers(3, 6))
            batch_tokens = rng.integers(0, vocab, size=(2, int(rng.integers(2, 5))))
            worlds.append((n, {"table": rng.standard_normal((vocab, hidden)).astype(np.float32),
                               "tokens": batch_tokens, "dy_rows": rng.standard_normal((*batch_tokens.shape, hidden))
                               .astype(np.float32),
                               "logits": (3 * rng.standard_normal((tokens, vocab)) + offset).astype(np.float32),
                               "targets": rng.integers(0, vocab, size=tokens),
                               "loss_weights": rng.uniform(0.5, 1.5, size=tokens).astype(np.float32)}))
        return worlds

    def collect(self, student, worlds):
        return run_worlds(_vocabulary_on_rank, [(n, (student.VocabParallelEmbedding, student.vocab_parallel_cross_entropy,
                                                     data)) for n, data in worlds])

    def judge_world(self, world, per_rank) -> None:
        n, data = world
        self._judge_embedding(n, data, per_rank)
        self._judge_loss(n, data, per_rank)

    @staticmethod
    def _judge_embedding(n, data, per_rank) -> None:
        table = torch.from_numpy(data["table"]).double().requires_grad_()
        rows = F.embedding(torch.from_numpy(data["tokens"]), table)
        rows.backward(torch.from_numpy(data["dy_rows"]).double())
        for rank, outcome in enumerate(per_rank):
            close(outcome["rows"], rows.detach().numpy(), f"world {n}, rank {rank}: VocabParallelEmbedding's output")
        judge_shards(DenseParameters({"weight": data["table"]}), {"weight": table.grad.numpy()},
                     [o["embedding"] for o in per_rank], {"weight"}, f"VocabParallelEmbedding (world {n})")
        for rank, outcome in enumerate(per_rank):
            what = f"world {n}, rank {rank}: VocabParallelEmbedding's"
            expect_collectives(outcome["events"], "embedding forward", "embedding backward",
                                {"all_reduce": [data["dy_rows"].nbytes]}, f"{what} forward",
                                "each rank looks up the tokens of its own rows (zeros for the others), and one "
                                "all-reduce (g) adds them up")
            expect_collectives(outcome["events"], "embedding backward", "loss forward", {}, f"{what} backward",
                                "the gradient of the rows each rank holds is already on that rank")

    @staticmethod
    def _judge_loss(n, data, per_rank) -> None:
        tokens, vocab = data["logits"].shape
        logits = torch.from_numpy(data["logits"]).double().requires_grad_()
        losses = F.cross_entropy(logits, torch.from_numpy(data["targets"]), reduction="none")
        losses.backward(torch.from_numpy(data["loss_weights"]).double())
        scale = 1e-5 * max(1.0, float(np.abs(data["logits"]).max()))
        dense_losses = losses.detach().numpy()
        for rank, outcome in enumerate(per_rank):  # a known slip on any rank explains the others' errors too
            start, stop = tp.shard_bounds(vocab, n, rank)
            mine = outcome["losses"]
            if not isinstance(mine, np.ndarray) or mine.shape != dense_losses.shape or \
                    np.allclose(mine, dense_losses, atol=scale, rtol=1e-4):
                continue
            if not np.all(np.isfinite(mine)):
                raise CheckFailed(f"world {n}, rank {rank}: the losses contain NaN or inf with logits near "
                                  f"{np.abs(data['logits']).max():.0f}: exp overflows float32 above 88; subtract the "
                                  "maximum logit over the whole vocabulary (all-reduced with ReduceOp.MAX) before "
                                  "exponentiating")
            held = (data["targets"] >= start) & (data["targets"] < stop)
            local = torch.from_numpy(data["logits"][:, start:stop]).double().logsumexp(-1).numpy()
            target = data["logits"][np.arange(tokens), data["targets"]]
            if held.any() and np.allclose(mine[held], (local - target)[held], atol=scale, rtol=1e-4):
                raise CheckFailed(f"world {n}, rank {rank}: the losses use this rank's logits only in the softmax's "
                                  "denominator: the sum of exponentials runs over the whole vocabulary, so all-reduce "
                                  "the local sums (after subtracting the all-reduced maximum)")
        for rank, outcome in enumerate(per_rank):
            what = f"world {n}, rank {rank}"
            start, stop = tp.shard_bounds(vocab, n, rank)
            mine = outcome["losses"]
            expect_close(mine, losses.detach().numpy().astype(np.float32), f"{what}: the per-token losses",
                         rtol=1e-4, atol=scale)
            expect_close(outcome["logits_grad"], logits.grad.numpy()[:, start:stop].astype(np.float32),
                         f"{what}: the gradient of this rank's logits (softmax minus one-hot, times each token's "
                         "upstream gradient)", rtol=1e-4, atol=1e-5)
            shapes = [tuple(s) for s in outcome["shapes"]]
            expect(any(int(np.prod(s)) == tokens * (stop - start) for s in shapes),
                   f"{what}: the grader saw no operation on this rank's logits while the loss was computed")
            whole = [s for s in shapes if vocab in s or int(np.prod(s)) >= tokens * vocab]
            expect(not whole, f"{what}: a tensor of shape {whole[0] if whole else ''} was created while computing the "
                              f"loss; it has the size of the whole vocabulary ({vocab}): no rank may hold the full "
                              "logits. Combine per-token numbers (max, sum of exponentials, target logit) instead")
            forward = tp.events_between(outcome["events"], "loss forward", "loss backward")
            others = sorted({e["op"] for e in forward} - {"all_reduce"})
            expect(not others, f"{what}: the loss's forward issued {', '.join(others)}; it needs only all-reduces of "
                               "per-token numbers")
            sent = sum(e["bytes"] for e in forward)
            expect(0 < sent <= 3 * tokens * 8,
                   f"{what}: the loss's forward all-reduced {sent:,} bytes; the maximum, the sum of exponentials and the "
                   f"target logit are 3 numbers per token, {3 * tokens * 4:,} bytes in float32 for {tokens} tokens")
            expect_collectives(outcome["events"], "loss backward", "done", {}, f"{what}: the loss's backward",
                                "each rank's gradient, softmax minus one-hot on its own logits, needs no communication")
