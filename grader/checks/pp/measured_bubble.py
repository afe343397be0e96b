"""Exercise 5: the bubble of the learner's real pipeline."""
from __future__ import annotations

import numpy as np

from dtp import pipeline

from ...compare import CheckFailed, expect, expect_answer
from ...registry import Check, exercise


# --- 5. the bubble of the real pipeline, measured ---------------------------------------------

SLEEP_P = 4
SLEEP_MS = (4, 8, 16)  # micro-batch counts
FORWARD_S, BACKWARD_S = 0.05, 0.1  # each op sleeps this long; see tests/test_pp_load.py for why
BUBBLE_TOLERANCE = 0.03


def _busy_intervals(log: list) -> list[tuple[float, float]]:
    return [(start, end) for _, _, start, end in log]


def _judge_sleeping_run(logs: list, m: int) -> float:
    """The measured bubble of one run, after checking that its timeline is one a pipeline could
    have: every op once, each at least its sleep long, none overlapping on a stage, and each
    after the op it depends on on the neighbouring stage (times are the grader's own)."""
    p = len(logs)
    world = f"p = {p}, m = {m}"
    when = [{(kind, micro_batch): (start, end) for kind, micro_batch, start, end in log} for log in logs]
    for rank, log in enumerate(logs):
        ran = sorted((kind, micro_batch) for kind, micro_batch, _, _ in log)
        expect(ran == sorted((kind, k) for kind in "FB" for k in range(m)),
               f"{world}: rank {rank}'s stage did not run each micro-batch forward and backward exactly once")
        for kind, micro_batch, start, end in log:
            least = FORWARD_S if kind == "F" else BACKWARD_S
            expect(end - start >= least * 0.999, f"{world}: a {kind} op took {end - start:.4f} s, shorter than its "
                                                 f"{least} s sleep: the timeline is not one the stages produced")
        ordered = sorted(log, key=lambda op: op[2])
        expect(all(a[3] <= b[2] + 1e-6 for a, b in zip(ordered, ordered[1:])),
               f"{world}: rank {rank}'s ops overlap in time")
    for rank in range(p - 1):
        for k in range(m):
            expect(when[rank + 1][("F", k)][0] >= when[rank][("F", k)][1] - 1e-6 and
                   when[rank][("B", k)][0] >= when[rank + 1][("B", k)][1] - 1e-6,
                   f"{world}: micro-batch {k} reached a stage before the stage it comes from had finished it")
    return pipeline.idle_fraction([_busy_intervals(log) for log in logs])


@exercise("pp.measured_bubble", points=2)
class MeasuredBubble(Check):
    """Verifies: the learner's 1F1B step, run on 4 gloo processes whose stages sleep 50 ms per
    forward and 100 ms per backward (timed by grader code), idles within 3 percentage points of
    (p-1)/(m+p-1) for m = 4, 8 and 16 (a run more than 3 points over is repeated, up to 3 runs,
    and the least idle one counts: load from other processes only adds idle time); and
    measured_bubble returns the idle share of every run's intervals and of random intervals.
    Fakes: every run's timeline must be one the stages could produce (every op once, at least its
    sleep long, after what it depends on); a pipeline that serialises its stages idles
    3(m-1)/(4m) or more in every run; dtp.pipeline.idle_fraction trips.
    """

    reads = ("one_f_one_b_step", "measured_bubble")
    references = ("dtp.pipeline.idle_fraction",)
    timeout_s = 60
    runs_world = True

    def prepare(self, rng):
        stages = int(rng.integers(2, 6))
        synthetic = []
        for _ in range(stages):
            edges = np.sort(rng.uniform(0.0, 10.0, 2 * int(rng.integers(1, 5))))
            synthetic.append([(float(a), float(b)) for a, b in zip(edges[::2], edges[1::2])])
        return {"synthetic": synthetic}

    def collect(self, student, inputs):
        from .common import world_options

        runs = []
        for m in SLEEP_MS:
            attempts = pipeline.measure_sleeping_pipeline(student.one_f_one_b_step, SLEEP_P, m, FORWARD_S, BACKWARD_S,
                                                          retry_above=BUBBLE_TOLERANCE, **world_options())
            runs.append([{"logs": logs, "measured": student.measured_bubble([_busy_intervals(log) for log in logs])}
                         for logs in attempts])
        return {"runs": runs, "synthetic": student.measured_bubble([list(stage) for stage in inputs["synthetic"]])}

    def judge(self, inputs, data) -> str:
        expect_answer(data["synthetic"], pipeline.idle_fraction(inputs["synthetic"]),
                      "measured_bubble on the grader's random intervals", rel=1e-9)
        for m, attempts in zip(SLEEP_MS, data["runs"]):
            bubbles = []
            for run in attempts:
                bubble = _judge_sleeping_run(run["logs"], m)
                expect_answer(run["measured"], bubble, f"measured_bubble of the run with m = {m}", rel=1e-9, slips={
                    "that is idle time over busy time; the bubble is the idle share of p × (last end - first start)":
                        bubble / (1 - bubble)})
                bubbles.append(bubble)
            bubble = min(bubbles)  # load on the machine only adds idle time: the least idle run is the pipeline's
            expected = pipeline.bubble_fraction(SLEEP_P, m)
            if abs(bubble - expected) > BUBBLE_TOLERANCE:
                raise CheckFailed(f"with p = {SLEEP_P} and m = {m} your pipeline idled {bubble:.1%} of the time; 1F1B's "
                                  f"bubble is (p-1)/(m+p-1) = {expected:.1%} (tolerance {BUBBLE_TOLERANCE:.0%}). "
                                  + ("A stage waited for messages longer than the schedule makes it: send each "
                                     "activation and gradient as soon as it is computed (isend), and receive only "
                                     "what the next op needs" if bubble > expected else
                                     "Less idle time than the schedule allows: are the stages' sleeps all there?"))
        return ("with 4 sleeping stages your pipeline idles within 3 points of (p-1)/(m+p-1) for m = 4, 8 and 16, and "
                "measured_bubble computes the idle share right")
