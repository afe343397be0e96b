"""Exercise 4 of the overlap chapter: DDP's gradient buckets all-reduced during backward.

Each rank runs one backward through the learner's hooks (`dtp.overlap.runs.bucket_overlap_rank`)
and records, in one ordered list, its matrix products, all-reduces and the waits on them. A
bucket is ready once backward has run the products of its layers; its all-reduce must be issued
before the products of the next layer, and waited on only after backward."""
from __future__ import annotations

from dtp.common.models import tiny_mlp
from dtp.overlap.runs import bucket_overlap_rank, full_batch_gradients

from ...compare import CheckFailed, expect, expect_close
from ...registry import exercise
from ..references import refuses_library
from ..common import WorldsCheck, run_worlds
from .order import between_marks, unexpected_ops, wait_of

FP32 = 4


def products_by_layer(layers: int) -> list[int]:
    """Matrix products backward runs per Linear, in backward order: the input gradient and the
    weight gradient, except for the first layer, whose input needs no gradient."""
    return [2] * (layers - 1) + [1]


class BucketJudge:
    def __init__(self, n, sizes, seed, batch_seed, bucket_layers, per_rank):
        self.n, self.sizes, self.bucket_layers, self.per_rank = n, sizes, bucket_layers, per_rank
        self.reference = full_batch_gradients(sizes, seed, batch_seed, n)
        self.where = f"with {n} processes and buckets of {list(bucket_layers)} layers (last layer first)"
        parameters = [p.numel() for p in tiny_mlp(sizes).parameters()]
        layer_bytes = [FP32 * (w + b) for w, b in zip(parameters[::2], parameters[1::2])][::-1]
        products = products_by_layer(len(layer_bytes))
        self.bucket_bytes, self.ready_after, start = [], [], 0
        for count in bucket_layers:
            self.bucket_bytes.append(sum(layer_bytes[start:start + count]))
            self.ready_after.append(sum(products[:start + count]))
            start += count

    def judge(self) -> None:
        for rank, outcome in enumerate(self.per_rank):
            self.order(rank, outcome["events"])
        for rank, outcome in enumerate(self.per_rank):
            for index, (grad, wanted) in enumerate(zip(outcome["grads"], self.reference)):
                expect(grad is not None, f"{self.where}: rank {rank}'s parameter {index} has no gradient after finish()")
                expect_close(grad, wanted, f"{self.where}: rank {rank}'s gradient of parameter {index} after finish() "
                                           "(the average over ranks)", rtol=1e-4, atol=1e-6)

    def order(self, rank, events) -> None:
        where = f"{self.where}: rank {rank}"
        other = unexpected_ops(events, {"all_reduce"})
        expect(not other, f"{where} called {', '.join(other)}; DDP averages gradients with one all-reduce per bucket")
        backward = between_marks(events, "backward", "backward done")
        issued = [i for i, e in enumerate(events) if e["op"] == "all_reduce"]
        during = [i for i in issued if i in backward]
        expect(len(issued) == len(self.bucket_bytes) and [events[i]["bytes"] for i in issued] == self.bucket_bytes,
               f"{where} all-reduced {[events[i]['bytes'] for i in issued]} bytes; one all-reduce per bucket, in "
               f"backward's order, gives {self.bucket_bytes} (each bucket's gradients flattened into one tensor)")
        expect(len(during) == len(issued), f"{where} issued {len(issued) - len(during)} of its all-reduces after "
                                           "backward; issue each bucket's all-reduce from a gradient hook as soon as "
                                           "the bucket's last gradient is there, so it runs under the rest of backward")
        for bucket, (index, ready) in enumerate(zip(issued, self.ready_after)):
            products = sum(events[i]["op"] == "compute" for i in range(backward.start, index))
            if products > ready:
                raise CheckFailed(
                    f"{where} issued bucket {bucket}'s all-reduce after {products} of backward's matrix products; the "
                    f"bucket was ready after {ready}. Issue it from the hook that sees the bucket's last gradient, not "
                    "later: every product run before it is compute it could have hidden under")
            waited = wait_of(events, index)
            expect(waited is not None, f"{where} never waited on bucket {bucket}'s all-reduce: wait in finish()")
            if waited in backward:
                raise CheckFailed(
                    f"{where} waited on bucket {bucket}'s all-reduce during backward; the rest of backward could not "
                    "run while it waited. Wait on every handle only in finish(), after backward")


@exercise("overlap.bucket_overlap", points=3)
@refuses_library("dtp.overlap.runs")
class BucketOverlap(WorldsCheck):
    """Verifies: on 2 and 3 gloo ranks with random buckets of layers (the last layer first), one
    backward leaves the average over ranks of every gradient after finish(); each bucket's
    gradients go in one all-reduce, in backward's order, issued during backward before any
    matrix product of a later layer (as soon as the bucket is ready) and waited on only after
    backward.
    Fakes: torch's DDP trips (its all-reduces run in C++, unseen); all-reducing everything after
    backward, or waiting right after issuing, shows in the recorded order."""

    reads = ("OverlappingDDP",)
    preimport = ()  # its ranks use no optimizer and no module that imports torch._dynamo (measured)
    references = ("torch.nn.parallel.DistributedDataParallel",)
    timeout_s = 40
    summary = ("gradients averaged on 2 and 3 ranks; each bucket all-reduced from a hook as soon as it was ready, "
               "under the rest of backward, and waited on only after backward")

    def prepare(self, rng):
        worlds = []
        for n in (2, 3):
            sizes = (8, *[int(rng.integers(9, 25)) for _ in range(3)], 4)
            layers, split = len(sizes) - 1, []
            while sum(split) < layers:
                split.append(int(rng.integers(1, layers - sum(split) + 1)))
            if len(split) == 1:  # at least two buckets, so that one runs under backward
                split = [1, layers - 1]
            worlds.append((n, sizes, int(rng.integers(1 << 20)), int(rng.integers(1 << 20)), tuple(split)))
        return worlds

    def collect(self, student, worlds):
        return run_worlds(bucket_overlap_rank, [(n, (student.OverlappingDDP, sizes, seed, batch_seed, split))
                                                 for n, sizes, seed, batch_seed, split in worlds])

    def judge_world(self, world, per_rank) -> None:
        BucketJudge(*world, per_rank).judge()
