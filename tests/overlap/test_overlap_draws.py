"""Every named slip of the overlap checks is refused, and named, on every one of 100 draws. The
functions of numbers are judged with the slip's value; the gloo exercises' judges are handed what a
rank that commits the slip records (its ordered events, its output), built here for each draw's
world, so that 100 draws need no gloo world (the sandboxed tests in test_overlap_checks.py run
each slip for real)."""
import numpy as np
import pytest

from conftest import assert_every_slip_refused, numbers_slips_refused, refused_with
from dtp.zero.formulas import FP32_ITEMSIZE as FP32_BYTES
from dtp.zero.formulas import shard_numel
from grader.checks.overlap.buckets import BucketJudge, products_by_layer
from grader.checks.overlap.collective_matmul import FP32, RingJudge
from grader.checks.overlap.zero3 import PrefetchJudge
from grader.registry import find_exercise

DRAWS = range(100)


def prepared(exercise_id: str, seed: int):
    return find_exercise(exercise_id).check.prepare(np.random.default_rng(seed))


def world_slips_refused(exercise_id: str, make_judge, per_rank_of, slips: dict) -> dict:
    """slip -> on how many draws the check's judge of some world refused, naming it (`slips`: slip ->
    its feedback), what every rank committing the slip records (`per_rank_of(judge, slip)`); the
    right ranks (slip None) pass."""
    counts = dict.fromkeys(slips, 0)
    for seed in DRAWS:
        judges = [make_judge(world) for world in prepared(exercise_id, seed)]
        for slip in [None, *slips]:
            refusals = []
            for judge in judges:
                judge.per_rank = per_rank_of(judge, slip)
                if slip is None:
                    judge.judge()
                else:
                    refusals.append(refused_with(judge.judge, slips[slip]))
            if slip is not None:
                counts[slip] += any(refusals)
    return counts


@pytest.mark.parametrize("exercise_id", ["overlap.exposure_model", "overlap.interview"])
def test_every_formula_slip_is_refused_on_every_draw(exercise_id):
    assert_every_slip_refused(exercise_id, numbers_slips_refused(exercise_id, len(DRAWS)))


# --- DDP buckets: the events of one rank's backward, as bucket_overlap_rank records them ---

def bucket_events(judge: BucketJudge, slip: str | None) -> list[dict]:
    """Backward's products layer by layer (the last layer first), each bucket's all-reduce as soon
    as its last layer's products ran, the waits after backward; or as `slip` changes that."""
    products = products_by_layer(sum(judge.bucket_layers))
    events, issued, layer = [{"op": "mark", "label": "backward"}], [], 0
    for bucket, count in enumerate(judge.bucket_layers):
        for _ in range(sum(products[layer:layer + count])):
            events.append({"op": "compute"})
        layer += count
        if slip not in ("after backward", "at the end of backward", "one for all"):
            issued.append(len(events))
            events.append({"op": "all_reduce", "bytes": judge.bucket_bytes[bucket]})
            if slip == "waits in the hook":
                events.append({"op": "wait", "of": issued[-1]})
    if slip == "at the end of backward":
        for size in judge.bucket_bytes:
            issued.append(len(events))
            events.append({"op": "all_reduce", "bytes": size})
    events.append({"op": "mark", "label": "backward done"})
    if slip in ("after backward", "one for all"):
        for size in judge.bucket_bytes if slip == "after backward" else [sum(judge.bucket_bytes)]:
            issued.append(len(events))
            events.append({"op": "all_reduce", "bytes": size})
    if slip != "waits in the hook":
        events += [{"op": "wait", "of": index} for index in issued]
    return events + [{"op": "mark", "label": "finished"}]


BUCKET_SLIPS = {"waits in the hook": "waited on bucket 0's all-reduce during backward",
                "after backward": "of its all-reduces after backward",
                "at the end of backward": "the bucket was ready after",
                "one for all": "one all-reduce per bucket"}


def test_every_bucket_slip_is_refused_on_every_draw():
    def right_judge(world):
        judge = BucketJudge(*world, [])
        judge.grads = judge.reference  # full_batch_gradients: the average over ranks, every rank's right answer
        return judge

    assert_every_slip_refused("overlap.bucket_overlap", world_slips_refused(
        "overlap.bucket_overlap", right_judge,
        lambda judge, slip: [{"events": bucket_events(judge, slip), "grads": judge.grads}] * judge.n, BUCKET_SLIPS))


# --- collective matmul: each rank's sends, receives, waits and products ---

def ring_events(judge: RingJudge, rank: int, slip: str | None) -> list[dict]:
    t, chunk = judge.t, judge.rows * judge.hidden * FP32
    if slip == "all-gather":
        return [{"op": "all_gather", "bytes": chunk}, {"op": "wait", "of": 0}] + \
            [{"op": "compute", "rows": judge.rows} for _ in range(t)]
    events = []
    for step in range(t):
        if step < t - 1:
            start = len(events)
            events += [{"op": "send", "peer": (rank + 1) % t, "bytes": chunk},
                       {"op": "recv", "peer": (rank - 1) % t, "bytes": chunk}]
            waits = [{"op": "wait", "of": start}, {"op": "wait", "of": start + 1}]
            product = {"op": "compute", "rows": judge.rows}
            events += waits + [product] if slip == "waits before the product" else [product] + waits
        elif slip != "one product of everything":
            events.append({"op": "compute", "rows": judge.rows})
    if slip == "one product of everything":
        events = [e for e in events if e["op"] != "compute"] + [{"op": "compute", "rows": judge.rows * t}]
    return events


def ring_output(judge: RingJudge, rank: int, slip: str | None) -> np.ndarray:
    """The rank's X @ W_r; with the pieces in the wrong rows, each product written where the piece
    of the ring turning the other way belongs."""
    right = judge.oracle[rank]
    if slip != "wrong rows":
        return right
    pieces = right.reshape(judge.t, judge.rows, -1)
    return pieces[[(2 * rank - j) % judge.t for j in range(judge.t)]].reshape(right.shape) if judge.t > 2 else \
        pieces[::-1].reshape(right.shape)


RING_SLIPS = {"waits before the product": "sat idle", "all-gather": "called all_gather",
              "one product of everything": "at once", "wrong rows": "in the wrong rows"}


def test_every_collective_matmul_slip_is_refused_on_every_draw():
    assert_every_slip_refused("overlap.collective_matmul", world_slips_refused(
        "overlap.collective_matmul", lambda world: RingJudge(*world, []),
        lambda judge, slip: [{"events": ring_events(judge, rank, slip), "out": ring_output(judge, rank, slip)}
                             for rank in range(judge.t)], RING_SLIPS))


# --- ZeRO-3 with prefetch: each step's gathers, waits, products and reduce-scatters ---

def zero3_events(judge: PrefetchJudge, slip: str | None) -> list[dict]:
    """One step of a rank that gathers layer by layer (a unit: a Linear's weight and bias), unit
    i+1's all-gather issued before unit i's product and waited on after it, in forward and again
    in backward (last unit first); or as `slip` changes that."""
    units = [w + b for (w, _), (b, _) in zip(judge.parameters[::2], judge.parameters[1::2])]
    events, numbers = [], {}

    def gather(unit):
        numbers[unit] = sum(e["op"] == "all_gather" for e in events) + 1
        events.append({"op": "all_gather", "bytes": shard_numel(units[unit], judge.n) * FP32_BYTES})
        return len(events) - 1

    def phase(order, blocking, backward):
        pending = gather(order[0])
        events.append({"op": "wait", "of": pending})
        for position, unit in enumerate(order):
            ahead = gather(order[position + 1]) if position + 1 < len(order) else None
            if ahead is not None and blocking:
                events.append({"op": "wait", "of": ahead})
            if slip == "computes before waiting" and ahead is not None and not backward:
                events.append({"op": "compute", "gathers": [numbers[order[position + 1]]]})
            events.append({"op": "compute", "gathers": [numbers[unit]]})
            if backward:
                events.append({"op": "reduce_scatter", "bytes": shard_numel(units[unit], judge.n) * judge.n * FP32_BYTES})
            if ahead is not None and not blocking:
                events.append({"op": "wait", "of": ahead})

    events.append({"op": "mark", "label": "forward"})
    phase(list(range(len(units))), slip == "waits right after issuing", False)
    events.append({"op": "mark", "label": "backward"})
    if slip == "keeps the gathered weights for backward":
        for unit in reversed(range(len(units))):
            events += [{"op": "compute", "gathers": [numbers[unit]]},
                       {"op": "reduce_scatter", "bytes": shard_numel(units[unit], judge.n) * judge.n * FP32_BYTES}]
    else:
        phase(list(reversed(range(len(units)))), slip == "backward without prefetch", True)
    return events + [{"op": "mark", "label": "step"}]


def zero3_outcome(judge: PrefetchJudge, rank: int, slip: str | None) -> dict:
    """What the harness returns for one rank: per step its events, units alive, loss and pieces."""
    sizes = [size for size, _ in judge.parameters]
    units = [sizes[i] + sizes[i + 1] for i in range(0, len(sizes), 2)]
    alive = len(units) if slip == "gathers everything at once" else 2
    outcome = {"events": [], "gathered units": [], "losses": [], "pieces": []}
    for step, state in enumerate(judge.reference["states"]):
        flat = np.concatenate([np.ravel(v) for v in state.values()])
        pieces, start = [], 0
        for unit in units:
            piece = shard_numel(unit, judge.n)
            padded = np.concatenate([flat[start:start + unit], np.zeros(piece * judge.n - unit, dtype=flat.dtype)])
            pieces.append(padded[rank * piece:(rank + 1) * piece])
            start += unit
        outcome["events"].append(zero3_events(judge, slip))
        outcome["gathered units"].append({"forward": alive, "backward": alive})
        outcome["losses"].append(judge.reference["losses"][step][rank])
        outcome["pieces"].append(pieces)
    return outcome


ZERO3_SLIPS = {"waits right after issuing": "nothing overlapped",
               "backward without prefetch": "in backward of step 1 rank 0 waited on all-gather",
               "gathers everything at once": "Prefetch one unit ahead",
               "keeps the gathered weights for backward": "did not all-gather every weight again",
               "computes before waiting": "before waiting on its handle"}


def test_every_zero3_prefetch_slip_is_refused_on_every_draw():
    assert_every_slip_refused("overlap.zero3_prefetch", world_slips_refused(
        "overlap.zero3_prefetch", lambda world: PrefetchJudge(*world, []),
        lambda judge, slip: [zero3_outcome(judge, rank, slip) for rank in range(judge.n)], ZERO3_SLIPS))
