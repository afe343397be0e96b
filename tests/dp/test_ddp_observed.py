"""What the data-parallel chapter says torch's DDP does, checked on the pinned torch by running it."""
import pytest
import torch
import torch.distributed as dist

from conftest import solution_path
from dtp.common.models import tiny_mlp
from dtp.common.traffic import CommunicationLog
from dtp.common.world import run_world
from dtp.dp import costs
from dtp.dp.ddp_observed import data_parallel_variant, observe_ddp_buckets
from grader.student import StudentCode

DEFAULT_CAP_MODEL = (1024,) * 9  # 8 layers of 4 MiB: more than DDP's default 25 MiB cap


@pytest.fixture(scope="module")
def default_cap():
    return observe_ddp_buckets(DEFAULT_CAP_MODEL, None, iterations=3)


def test_the_first_iteration_reduces_everything_in_one_bucket(default_cap):
    assert default_cap["launched"][0] == [(0, sum(default_cap["parameter_bytes"]))]


def test_later_iterations_use_rebuilt_buckets_with_a_small_first_one(default_cap):
    """Rebuilt after the first iteration in gradient-ready order: a first bucket capped at
    1 MiB, then 25 MiB caps, each bucket closing once it reaches its cap (so it exceeds it)."""
    expected = costs.ddp_bucket_sizes(default_cap["parameter_bytes"], default_cap["cap_bytes"],
                                      dist._DEFAULT_FIRST_BUCKET_BYTES)
    for launched in default_cap["launched"][1:]:
        assert [size for _, size in launched] == expected
    assert default_cap["cap_bytes"] == 25 * 2**20 and dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20
    assert expected[0] > 2**20 and expected[1] > 25 * 2**20


def test_buckets_are_reduced_strictly_in_order(default_cap):
    for launched in default_cap["launched"]:
        assert [index for index, _ in launched] == list(range(len(launched)))


def test_a_cap_given_explicitly_applies_to_the_first_bucket_too():
    observed = observe_ddp_buckets((24, 48, 40, 32, 16, 8), 6000 / 2**20, iterations=2)
    assert [size for _, size in observed["launched"][1]] == costs.ddp_bucket_sizes(observed["parameter_bytes"], 6000)


def _all_reduces_during_and_after_backward(rank, world_size, variant, wrap, widths):
    """(all-reduces issued before backward returned, those issued after), in the second step."""
    model = tiny_mlp(widths, seed=0)
    trained, synced = data_parallel_variant(variant, wrap, model, 1 << 20)
    inputs = torch.randn(16, widths[0])
    for _ in range(2):
        model.zero_grad()
        loss = trained(inputs).square().mean()
        with CommunicationLog() as log:
            loss.backward()
            during = sum(event["op"] == "all_reduce" for event in log.events)
            synced()
        after = sum(event["op"] == "all_reduce" for event in log.events) - during
    return during, after


def test_bucketed_overlap_starts_communication_during_backward():
    """The book's overlap figure (timed there, never here): the bucketed DDP issues its
    all-reduces while backward runs, leaving at most one bucket's for after; averaging after
    backward issues every one after it. Judged by the order of the calls, not by a clock."""
    course = StudentCode.from_notebook(str(solution_path("dp")))
    widths = (512,) * 9
    bucketed = run_world(_all_reduces_during_and_after_backward, 2, ("bucketed", course.BucketedDDP, widths))
    after = run_world(_all_reduces_during_and_after_backward, 2, ("after_backward", course.average_gradients, widths))
    for during, later in bucketed:
        assert during >= 2 and later <= 1
    for during, later in after:
        assert during == 0 and later >= 1
