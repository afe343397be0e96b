"""Exercises 4 and 5 of the pipeline chapter: the real 1F1B pipeline on gloo and its measured
bubble; the checks reject plausible wrong pipelines and measurements with feedback that names the
mistake, and accept correct ones written differently from the course's."""
import pytest

from conftest import assert_fails, graded
from dtp.pp import schedules as pipeline
from grader.checks import pp
from grader.compare import CheckFailed
from one_f_one_b_steps import step


# --- exercise 4: the real pipeline ---

STEP_WHOLE_BATCH = '''
def one_f_one_b_step(stage, batch, targets, n_micro_batches, boundary_shape):
    # No micro-batches: the whole batch goes through each stage in one message.
    rank, p = dist.get_rank(), dist.get_world_size()
    shape = (batch.shape[0], boundary_shape[1])
    x = batch if rank == 0 else torch.empty(shape)
    if rank:
        dist.recv(x, rank - 1)
        x.requires_grad_()
    y = stage(x)
    if rank == p - 1:
        loss = nn.functional.mse_loss(y, targets)
        loss.backward()
    else:
        dist.send(y.detach(), rank + 1)
        gradient = torch.empty(shape)
        dist.recv(gradient, rank + 1)
        y.backward(gradient)
    if rank:
        dist.send(x.grad, rank - 1)
    return loss.item() if rank == p - 1 else None
'''


@pytest.mark.parametrize("source, feedback", [
    (step(WARM_UP="m"), "under 1F1B stage s holds at most"),  # GPipe: every forward first
    (step(WARM_UP="0"), "never had more than 1 micro-batches in flight"),  # each micro-batch through and back alone
    (step(POP="pop"), "not the gradient of any micro-batch"),  # newest first: the wrong micro-batch's backward
    (step(SCALE=""), "times too large"),
    (step(END="dist.all_reduce(torch.zeros(1))"), "called all_reduce"),
    (step(RESULT="None"), "the last rank returned None"),
    (STEP_WHOLE_BATCH, "messages to rank"),
], ids=["gpipe-order", "no-pipelining", "lifo-queue", "loss-not-divided-by-m", "collective", "no-loss",
        "whole-batch"])
def test_pipeline_rejects(tmp_notebook, source, feedback):
    assert_fails(graded(tmp_notebook, "pp.pipeline_1f1b", {"one_f_one_b_step": source}), feedback)


STEP_BATCHED_P2P = '''
def one_f_one_b_step(stage, batch, targets, n_micro_batches, boundary_shape):
    # Receives posted ahead with batch_isend_irecv; a list as the queue; the loss as a tensor.
    rank, p, m = dist.get_rank(), dist.get_world_size(), n_micro_batches
    first, last = rank == 0, rank == p - 1
    inputs, labels = batch.tensor_split(m), targets.tensor_split(m)
    held, pending, total = [], [], torch.zeros(())

    def exchange(ops):
        if ops:
            pending.extend(dist.batch_isend_irecv(ops))

    def forward(k):
        nonlocal total
        if first:
            x = inputs[k]
        else:
            x = torch.empty(boundary_shape)
            for request in dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, rank - 1)]):
                request.wait()
            x.requires_grad_()
        y = stage(x)
        if last:
            y = nn.functional.mse_loss(y, labels[k]) / m
            total = total + y.detach()
        else:
            exchange([dist.P2POp(dist.isend, y.detach().clone(), rank + 1)])
        held.append((x, y))

    def backward():
        x, y = held.pop(0)
        if last:
            y.backward()
        else:
            gradient = torch.empty(boundary_shape)
            for request in dist.batch_isend_irecv([dist.P2POp(dist.irecv, gradient, rank + 1)]):
                request.wait()
            y.backward(gradient)
        if not first:
            exchange([dist.P2POp(dist.isend, x.grad.clone(), rank - 1)])

    warm_up = min(p - rank - 1, m)
    for k in range(m):
        forward(k)
        if k >= warm_up:
            backward()
    while held:
        backward()
    for request in pending:
        request.wait()
    return total if last else None
'''


def test_pipeline_accepts_batched_p2p_and_a_tensor_loss(tmp_notebook):
    result = graded(tmp_notebook, "pp.pipeline_1f1b", {"one_f_one_b_step": STEP_BATCHED_P2P})
    assert result.status == "passed", result


# --- exercise 5: the measured bubble (the judge on rank sequences made to order; tests/pp/test_pp_load.py runs it) ---

def rank_sequences(schedule, early=()) -> list:
    """What each rank of exercise 4's solution records for a schedule of F and B: a blocking
    receive (recv + wait) right before each op that needs a message, an isend right after each op
    whose result another stage needs, and a wait on every send at the end. For (rank, i) in
    `early`, op i's receive comes before op i - 1 instead (a wait its previous op does not need)."""
    p = len(schedule)
    sequences = []
    for rank, ops in enumerate(schedule):
        events, sends = [], []

        def receive(kind):
            peer = rank - 1 if kind == "F" else rank + 1
            if 0 <= peer < p:
                events.extend([{"op": "recv", "peer": peer, "tag": 0}, {"op": "wait", "of": len(events)}])

        for index, (kind, micro_batch, _) in enumerate(ops):
            if (rank, index + 1) in early:
                receive(ops[index + 1][0])
            if (rank, index) not in early:
                receive(kind)
            events.append({"op": kind, "micro_batch": micro_batch})
            peer = rank + 1 if kind == "F" else rank - 1
            if 0 <= peer < p:
                sends.append(len(events))
                events.append({"op": "send", "peer": peer, "tag": 0})
        sequences.append(events + [{"op": "wait", "of": index} for index in sends])
    return sequences


BUBBLE_WORLDS = [(2, 5), (3, 2), (4, 9)]
SYNTHETIC = [[(0.0, 3.0), (5.0, 8.0)], [(2.0, 10.0)]]


def replayed_idle(sequences) -> float:
    return pipeline.idle_fraction([[(s, e) for s, e, _ in rank] for rank in pp.measured_bubble.replay(sequences)["intervals"]])


def judge_bubble(runs, measured=None, synthetic=None):
    """The measured-bubble judge on one run per world; `measured` gives the learner's answer."""
    inputs = {"worlds": [(len(run), sum(e["op"] == "F" for e in run[0])) for run in runs], "synthetic": SYNTHETIC}
    answers = [(measured or replayed_idle)(run) for run in runs]
    return pp.measured_bubble.MeasuredBubble().judge(inputs, {
        "runs": runs, "measured": answers, "synthetic": pipeline.idle_fraction(SYNTHETIC) if synthetic is None else synthetic})


def course_runs(schedule=pipeline.one_f_one_b_schedule):
    return [rank_sequences(schedule(p, m)) for p, m in BUBBLE_WORLDS]


def test_replay_of_1f1b_idles_exactly_the_bubble_fraction():
    for p in range(1, 6):
        for m in range(1, 10):
            assert replayed_idle(rank_sequences(pipeline.one_f_one_b_schedule(p, m))) == pytest.approx(
                pipeline.bubble_fraction(p, m), rel=1e-12, abs=1e-12)


def test_measured_bubble_judge_accepts_the_course_step():
    assert "idles exactly (p-1)/(m+p-1)" in judge_bubble(course_runs())


def test_measured_bubble_judge_rejects_a_gpipe_order():
    with pytest.raises(CheckFailed, match="under 1F1B stage s holds at most"):
        judge_bubble(course_runs(pipeline.gpipe_schedule))


def test_measured_bubble_rejects_a_gpipe_order_step(tmp_notebook):
    assert_fails(graded(tmp_notebook, "pp.measured_bubble", {"one_f_one_b_step": step(WARM_UP="m")}),
                 "under 1F1B stage s holds at most")


def test_measured_bubble_judge_rejects_a_gradient_received_before_the_forward():
    runs = course_runs()
    # p = 4, rank 1 (two warm-up forwards): F0 F1 F2 B0 F3 B1 ...; B1's gradient received before F3
    runs[2] = rank_sequences(pipeline.one_f_one_b_schedule(4, 9), early={(1, 5)})
    with pytest.raises(CheckFailed, match="your pipeline idles .*; 1F1B's bubble is .*Rank 1 sat idle .* gradient "
                                          "message 2 from rank 2, before its next forward, which does not need it"):
        judge_bubble(runs)


def test_measured_bubble_judge_rejects_an_op_run_before_its_message_was_waited_on():
    runs = course_runs()
    runs[0][1] = [e for e in runs[0][1] if not (e["op"] == "wait" and runs[0][1][e["of"]]["op"] == "recv")]
    with pytest.raises(CheckFailed, match="before it had waited for the activation"):
        judge_bubble(runs)


def test_measured_bubble_judge_rejects_a_wrong_measurement():
    def idle_over_busy(run):
        bubble = replayed_idle(run)
        return bubble / (1 - bubble)
    with pytest.raises(CheckFailed, match="idle time over busy time"):
        judge_bubble(course_runs(), measured=idle_over_busy)
    with pytest.raises(CheckFailed, match="random intervals"):
        judge_bubble(course_runs(), synthetic=0.25)


def test_measured_bubble_without_exercise_4_is_missing_and_names_it(tmp_notebook):
    stub = ("def one_f_one_b_step(stage, batch, targets, n_micro_batches, boundary_shape):\n"
            "    raise NotImplementedError('write your solution here')\n")
    result = graded(tmp_notebook, "pp.measured_bubble", {"one_f_one_b_step": stub})
    assert result.status == "missing", result
    assert "one_f_one_b_step from exercise 4" in result.feedback
