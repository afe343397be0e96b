"""Exercise 5: the bubble of the learner's real pipeline, on a logical clock.

Each rank runs the learner's exercise-4 step on a stage that computes nothing (the identity, with
each row's micro-batch number in column 0) and appends every forward and backward it runs to the
same Timeline (dtp.common.timeline) that records the rank's sends, receives and waits: one
ordered sequence per rank, no durations. The judge replays these sequences on a logical clock (a
forward takes T_F, a backward T_B, issuing a message nothing) and measures the idle share of the
replayed timeline. The verdict depends only on what the ranks did and in which order, never on
how busy the machine was; a correct 1F1B step idles exactly (p-1)/(m+p-1).

Wall-clock measurements of the same step (dtp.pp.schedules.measure_sleeping_pipeline) stay on the
page and in the benchmark.
"""
from __future__ import annotations

import numpy as np

from dtp.common import timeline
from dtp.pp import schedules as pipeline

from ...compare import CheckFailed, RanksFailed, expect, expect_answer
from ...registry import Check, exercise
from ..common import completed_worlds, raise_world_failure, run_worlds
from .real_pipeline import _judge_order

T_F, T_B = 1.0, 2.0  # logical durations: a backward costs two forwards (two matrix products to one)
WIDTH, MICRO_BATCH = 4, 1
COMPUTE = ("F", "B")
KEEP = ("op", "peer", "tag", "of", "micro_batch")


def recording_rank(rank, world_size, step, m):
    log = timeline.Timeline()
    stage = pipeline.SleepingStage(WIDTH, 0.0, 0.0, timeline=log)  # no sleeps: order only
    batch, targets = pipeline.tagged_batch(m, MICRO_BATCH, WIDTH)
    with log:
        step(stage, batch, targets, m, (MICRO_BATCH, WIDTH))
    return log.kept(KEEP)


# --- the rank's sequence: what it may contain -------------------------------------------------

def _check_sequence(events: list, rank: int, p: int, m: int, world: str) -> None:
    """Point-to-point messages to neighbours only, one per micro-batch each way, and each op
    after the messages it computes on (a forward after the wait for its input, a backward after
    the wait for its output's gradient) and each message after the op that computed it."""
    other = sorted({e["op"] for e in events} - {"send", "recv", "wait", *COMPUTE})
    expect(not other, f"{world}: rank {rank} called {', '.join(other)}; pipeline stages talk to their neighbours with "
                      "point-to-point send/recv (isend/irecv) only")
    for event in events:
        if event["op"] in ("send", "recv"):
            expect(event.get("peer") in (rank - 1, rank + 1),
                   f"{world}: rank {rank} {'sent to' if event['op'] == 'send' else 'received from'} "
                   + ("any rank; name the neighbour it comes from" if event.get("peer") is None else
                      f"rank {event['peer']}; a stage talks to ranks {rank - 1} and {rank + 1} only"))
    for op, peer, what in (("send", rank + 1, "activations"), ("send", rank - 1, "gradients"),
                           ("recv", rank - 1, "activations"), ("recv", rank + 1, "gradients")):
        if 0 <= peer < p:
            count = sum(e["op"] == op and e["peer"] == peer for e in events)
            expect(count == m, f"{world}: rank {rank} {'sent' if op == 'send' else 'received'} {count} messages "
                               f"{'to' if op == 'send' else 'from'} rank {peer} for m = {m} micro-batches; each "
                               f"micro-batch's {what[:-1]} crosses the boundary in its own message")
    waited = {"prev": 0, "next": 0}
    done = {"F": 0, "B": 0}
    sent = {rank - 1: 0, rank + 1: 0}
    for index, event in enumerate(events):
        op = event["op"]
        if op == "wait":
            awaited = events[event["of"]] if isinstance(event.get("of"), int) and 0 <= event["of"] < index else {}
            if awaited.get("op") == "recv":
                waited["prev" if awaited["peer"] == rank - 1 else "next"] += 1
        elif op in COMPUTE:
            done[op] += 1
            needs, side = ("prev", rank > 0) if op == "F" else ("next", rank < p - 1)
            if side and waited[needs] < done[op]:
                what = (f"its forward of micro-batch {done[op] - 1} before it had waited for the activation from rank "
                        f"{rank - 1}" if op == "F" else f"its backward {done[op]} before it had waited for the "
                        f"gradient from rank {rank + 1}")
                raise CheckFailed(f"{world}: rank {rank} ran {what}: it computed on a buffer whose message had not "
                                  "arrived. Wait on a receive's handle (or use dist.recv) before using its tensor")
        elif op == "send":
            sent[event["peer"]] += 1
            kind = "F" if event["peer"] == rank + 1 else "B"
            expect(sent[event["peer"]] <= done[kind],
                   f"{world}: rank {rank} sent message {sent[event['peer']]} to rank {event['peer']} before computing "
                   f"it: a stage sends a micro-batch's {'output' if kind == 'F' else 'input gradient'} after its "
                   f"{'forward' if kind == 'F' else 'backward'}")


# --- the logical clock --------------------------------------------------------------------------

def replay(sequences: list) -> dict:
    """dtp.common.timeline.replay with a forward taking T_F and a backward T_B; raises
    CheckFailed naming the messages the ranks wait on if no rank can go on (a deadlock)."""
    try:
        return timeline.replay(sequences, {"F": T_F, "B": T_B})
    except timeline.Deadlock as deadlock:
        raise CheckFailed("the ranks' sends and receives cannot all complete: " + "; ".join(
            f"rank {rank} waits on {_describe_message(sequences[rank], rank, sequences[rank][index]['of'])}"
            for rank, index in sorted(deadlock.stuck.items()))) from None


def _describe_message(events: list, rank: int, index: int) -> str:
    event = events[index]
    number = sum(e["op"] == event["op"] and e["peer"] == event["peer"] for e in events[:index + 1])
    if event["op"] == "recv":
        what = "activation" if event["peer"] == rank - 1 else "gradient"
        return f"its receive of {what} message {number} from rank {event['peer']}"
    return f"its send of message {number} to rank {event['peer']}, which completes only once rank {event['peer']} posts the matching receive (gloo)"


def _needless_wait(sequences: list, delays: list) -> str | None:
    """The earliest wait that idled a rank for a message its next op does not compute on: not
    the input of its next forward (the next activation from rank - 1) or of its next backward
    (the next gradient from rank + 1)."""
    for rank, began, ended, awaited, index in sorted(delays, key=lambda delay: delay[1]):
        events = sequences[rank]
        following = next((i for i in range(index + 1, len(events)) if events[i]["op"] in COMPUTE), None)
        if following is None:
            continue  # the step's end: nothing idles after it
        kind = events[following]["op"]
        number = sum(e["op"] == kind for e in events[:following + 1])  # the next op is the number-th of its kind
        message = events[awaited]
        ordinal = sum(e["op"] == message["op"] and e["peer"] == message["peer"] for e in events[:awaited + 1])
        needed_from = rank - 1 if kind == "F" else rank + 1
        if message["op"] == "recv" and message["peer"] == needed_from and ordinal <= number:
            continue
        op = "forward" if kind == "F" else "backward"
        return (f"rank {rank} sat idle from {began:g} to {ended:g} on {_describe_message(events, rank, awaited)}, before "
                f"its next {op}, which does not need it")
    return None


def replayed_bubble(sequences: list) -> float:
    return pipeline_idle_share([[(start, end) for start, end, _ in rank] for rank in replay(sequences)["intervals"]])


def pipeline_idle_share(busy: list) -> float:
    """The idle share of p × (last end - first start): the grader's own, not dtp's (which the
    sandbox disables while the learner's measured_bubble is graded)."""
    intervals = [interval for stage in busy for interval in stage]
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    return 1 - sum(end - start for start, end in intervals) / (len(busy) * span)


@exercise("pp.measured_bubble", points=2)
class MeasuredBubble(Check):
    """Verifies: the learner's 1F1B step (exercise 4), run on 2, 3 and 4 gloo processes with
    random m (below and above p), sends one message per micro-batch each way between neighbours
    only, computes each op after waiting for the message it computes on, keeps 1F1B's
    min(p - s, m) micro-batches in flight on stage s (the order pp.pipeline_1f1b requires), and,
    replayed on a logical clock (forward 1, backward 2, messages free, a receive waits for its
    send, a gloo send for its receive), idles exactly (p-1)/(m+p-1) of the step; measured_bubble
    returns the idle share of the replayed intervals and of random intervals.
    The verdict never depends on wall-clock time: the replay uses only the order of each rank's
    ops, sends, receives and waits.
    Fakes: a GPipe order (peak m) fails the order; a stage that waits for a message its next op
    does not need (a gradient before a forward, a send before computing on) idles more in the
    replay; ops run before their message was waited on are refused; dtp.pp.schedules.idle_fraction
    trips.
    """

    reads = ("one_f_one_b_step", "measured_bubble")
    references = ("dtp.pp.schedules.idle_fraction",)
    timeout_s = 60
    runs_world = True
    preimport = ()  # its ranks use no optimizer and no module that imports torch._dynamo (measured)

    def prepare(self, rng):
        worlds = [(2, int(rng.integers(2, 7))), (3, int(rng.integers(1, 3))), (4, int(rng.integers(5, 13)))]
        stages = int(rng.integers(2, 6))
        synthetic = []
        for _ in range(stages):
            edges = np.sort(rng.uniform(0.0, 10.0, 2 * int(rng.integers(1, 5))))
            synthetic.append([(float(a), float(b)) for a, b in zip(edges[::2], edges[1::2])])
        return {"worlds": worlds, "synthetic": synthetic}

    def collect(self, student, inputs):
        outcomes = run_worlds(recording_rank, [(p, (student.one_f_one_b_step, m)) for p, m in inputs["worlds"]])
        failure = completed_worlds(outcomes)[1]
        if failure is not None and failure["status"] == "missing":
            return {"runs": outcomes, "measured": [], "synthetic": None}  # the judge names exercise 4
        measured = []
        for outcome in completed_worlds(outcomes)[0]:
            try:  # the learner's measure of the replayed run; the judge replays again, on its own
                busy = [[(start, end) for start, end, _ in rank] for rank in replay(outcome)["intervals"]]
            except Exception:  # noqa: BLE001 - a sequence the judge refuses, with its reason
                busy = None
            measured.append(None if busy is None else student.measured_bubble(busy))
        return {"runs": outcomes, "measured": measured,
                "synthetic": student.measured_bubble([list(stage) for stage in inputs["synthetic"]])}

    def judge(self, inputs, data) -> str:
        done, failure = completed_worlds(data["runs"])
        if failure is not None and failure["status"] == "missing":
            raise RanksFailed("missing", "exercise 5 runs your one_f_one_b_step from exercise 4, which is not "
                                         "implemented yet (a rank hit its `raise NotImplementedError`): finish exercise "
                                         "4 first")
        expect_answer(data["synthetic"], pipeline_idle_share(inputs["synthetic"]),
                      "measured_bubble on the grader's random intervals", rel=1e-9)
        runs = [(p, m, f"p = {p} processes, m = {m} micro-batches", sequences)
                for (p, m), sequences in zip(inputs["worlds"], done)]
        for p, m, world, sequences in runs:
            for rank, events in enumerate(sequences):
                _check_sequence(events, rank, p, m, world)
        for p, m, world, sequences in runs:
            for rank, events in enumerate(sequences):
                _judge_order([e["op"] for e in events if e["op"] in COMPUTE], rank, p, m, world)
        for (p, m, world, sequences), measured in zip(runs, data["measured"]):
            try:
                replayed = replay(sequences)
            except CheckFailed as deadlock:
                raise CheckFailed(f"{world}: {deadlock}") from None
            busy = [[(start, end) for start, end, _ in rank] for rank in replayed["intervals"]]
            bubble, expected = pipeline_idle_share(busy), pipeline.bubble_fraction(p, m)
            expect_answer(measured, bubble, f"measured_bubble of the replayed run with {world}", rel=1e-9, slips={
                "that is idle time over busy time; the bubble is the idle share of p × (last end - first start)":
                    bubble / (1 - bubble)})
            if not np.isclose(bubble, expected, rtol=1e-9, atol=1e-12):
                why = _needless_wait(sequences, replayed["delays"])
                raise CheckFailed(
                    f"{world}: replayed on the grader's clock (forward 1, backward 2, messages free), your pipeline "
                    f"idles {bubble:.1%} of the step; 1F1B's bubble is (p-1)/(m+p-1) = {expected:.1%}. "
                    + (f"{why[0].upper()}{why[1:]}: wait for each message right before the op that computes on it, "
                       "and send with isend, waiting for the handles at the end" if why else
                       "A stage waited for messages longer than the schedule makes it: receive only what the next "
                       "op needs, and send each activation and gradient as soon as it is computed (isend)"))
        raise_world_failure(failure)
        return ("replayed on a logical clock, your 1F1B step idles exactly (p-1)/(m+p-1) for p = 2, 3 and 4 with 1F1B's "
                "micro-batches in flight, and measured_bubble computes the idle share right")
