"""The measured-bubble check's verdict does not depend on how busy the machine is: it replays
what each rank did (its forwards, backwards, sends, receives and waits, in order) on a logical
clock. The course's step passes while CPU-bound processes keep every core busy, and steps that
wait needlessly are refused with the same diagnosis every time."""
import os
import time

import pytest

from conftest import grade, notebook_variant, solution_path, spinning_processes
from dtp.common.world import run_world
from one_f_one_b_steps import step


@pytest.fixture
def busy_machine():
    """A spinning process per core (at least 2): the load that made wall-clock verdicts fail."""
    with spinning_processes(max(2, os.cpu_count() or 2)):
        yield


def test_the_measured_bubble_check_passes_while_every_core_is_busy(busy_machine):
    result = grade(solution_path("pp"), "pp.measured_bubble")["pp.measured_bubble"]
    assert result.status == "passed", result


# Exercise 4's solution (tests/pp/one_f_one_b_steps.py) with one change each: a stage that waits for a message before an op that
# does not compute on it. Both run to the end and compute the right gradients (pp.pipeline_1f1b
# passes them); only their timelines are longer than 1F1B's.
@pytest.mark.parametrize("changes, feedback", [
    # The gradient for the steady state's backward received (blocking) before the forward that precedes it.
    (dict(STEADY="gradient = receive_gradient()\n        forward(k)\n        backward(gradient)"),
     "on its receive of gradient message 1 from rank 1, before its next forward, which does not need it"),
    # Every gradient of the cool-down received before its first backward: the stage idles until the next
    # stage has finished its whole step.
    (dict(COOL_DOWN="for gradient in [receive_gradient() for _ in range(warm_up)]:\n        backward(gradient)"),
     "before its next backward, which does not need it"),
], ids=["gradient-before-forward", "cool-down-gradients-received-first"])
def test_a_step_that_waits_needlessly_is_refused_on_a_busy_machine_too(tmp_path, busy_machine, changes, feedback):
    notebook = notebook_variant(tmp_path, "pp", {"one_f_one_b_step": step(**changes)})
    for _ in range(2):  # the same verdict and diagnosis each time
        result = grade(notebook, "pp.measured_bubble", "pp.pipeline_1f1b")
        assert result["pp.pipeline_1f1b"].status == "passed", result  # the step itself is right
        assert result["pp.measured_bubble"].status == "failed", result
        assert "replayed on the grader's clock" in result["pp.measured_bubble"].feedback
        assert feedback in result["pp.measured_bubble"].feedback, result["pp.measured_bubble"].feedback


def _send_then_late_receive(rank, world_size, nbytes):
    """Rank 0 sends and waits on the send's handle, then says so through the store; rank 1 looks
    at the store after a pause, before posting its receive. Order, not time, is what is returned:
    whether rank 0's wait had ended before rank 1 posted the receive."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    buffer = torch.zeros(nbytes // 4)
    if rank == 0:
        dist.isend(buffer, 1).wait()
        store.set("send_completed", "1")
        return None
    time.sleep(0.5)  # room for a send that completes on its own to say so (a slow machine only adds room)
    completed_before_receive = store.check(["send_completed"])
    dist.recv(buffer, 0)
    return completed_before_receive


@pytest.mark.parametrize("nbytes", [32, 1 << 20])
def test_a_gloo_send_completes_only_once_its_receive_is_posted(nbytes):
    """What the logical clock models (dtp.common.timeline.replay): waiting on
    a gloo send's handle lasts until the receiver posts its recv, however small the message."""
    _, completed_before_receive = run_world(_send_then_late_receive, 2, (nbytes,))
    assert completed_before_receive is False
