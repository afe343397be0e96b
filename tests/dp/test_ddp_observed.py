"""What the data-parallel chapter says torch's DDP does, checked on the pinned torch by running it."""
import torch.distributed as dist
import pytest

from conftest import solution_path
from dtp.dp import costs
from dtp.dp.ddp_observed import exposed_communication, observe_ddp_buckets
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


def test_bucketed_overlap_exposes_less_communication_than_averaging_after_backward():
    """The book's overlap figure, as a ratio measured in one run: launching buckets during
    backward leaves less communication after backward than all-reducing once it is done."""
    course = StudentCode.from_notebook(str(solution_path("dp")))
    widths = (512,) * 9
    after = exposed_communication("after_backward", course.average_gradients, widths)
    bucketed = exposed_communication("bucketed", course.BucketedDDP, widths)
    assert bucketed["exposed_s"] < after["exposed_s"]
