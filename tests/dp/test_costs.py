"""Every formula of dtp.dp.costs (the numbers the book prints) against a count, a step-by-step
simulation, or a measurement."""
import numpy as np
import pytest
import torch

from conftest import solution_path
from dtp.dp import costs
from dtp.common.measure import fit_alpha_beta
from dtp.common.models import tiny_mlp
from dtp.dp.simulated import SimulatedNetwork
from dtp.common.traffic import CommunicationLog
from dtp.common.world import run_world
from grader.student import StudentCode


@pytest.fixture(scope="module")
def course():
    return StudentCode.from_notebook(str(solution_path("dp")))


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_bytes_formula_matches_the_simulated_ring(course, n):
    size_elements = n * 1000
    network = SimulatedNetwork(n)
    course.ring_all_reduce_numpy([np.ones(size_elements) for _ in range(n)], network)
    assert network.bytes_sent == [costs.ring_all_reduce_bytes_per_rank(n, size_elements * 8)] * n


def _count_ring_bytes(rank, world_size, ring, elements):
    with CommunicationLog() as log:
        ring(torch.ones(elements))
    return log.bytes_sent


@pytest.mark.parametrize("n", [2, 4])
def test_ring_bytes_formula_matches_bytes_sent_on_gloo(course, n):
    elements = n * 4096
    sent = run_world(_count_ring_bytes, n, (course.ring_all_reduce, elements))
    assert sent == [costs.ring_all_reduce_bytes_per_rank(n, elements * 4)] * n


@pytest.mark.parametrize("n", [1, 2, 5, 64])
def test_ring_time_is_the_sum_of_its_steps(n):
    size, alpha, beta = 3e8, 7e-6, 2.5e10
    steps = [alpha + (size / n) / beta for _ in range(2 * (n - 1))]  # one chunk of S/n per step
    assert costs.ring_all_reduce_time(n, size, alpha, beta) == pytest.approx(sum(steps))


def test_bus_bandwidth_applies_nccl_tests_fixed_factor():
    """For a ring all-reduce the factor equals the bytes each rank sends over S; nccl-tests
    applies the same factor whatever algorithm ran."""
    n, size, seconds = 16, 4e9, 0.05
    assert costs.bus_bandwidth(size, seconds, n) == pytest.approx(costs.ring_all_reduce_bytes_per_rank(n, size) / seconds)
    assert costs.algorithm_bandwidth(size, seconds) == pytest.approx(size / seconds)
    assert costs.bus_bandwidth(size, seconds, n, "all_gather") == pytest.approx(size / seconds * 15 / 16)
    assert costs.bus_bandwidth(size, seconds, 2) == costs.algorithm_bandwidth(size, seconds)


def test_fit_recovers_alpha_and_beta_from_model_times():
    n, alpha, beta = 4, 30e-6, 2e9
    sizes = [2**k for k in range(10, 25)]
    times = [costs.ring_all_reduce_time(n, s, alpha, beta) for s in sizes]
    fit = fit_alpha_beta(n, sizes, times)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-6) and fit.bandwidth == pytest.approx(beta, rel=1e-6)
    assert np.abs(fit.relative_residuals).max() < 1e-9


def test_the_fit_weights_small_messages_as_much_as_large_ones():
    """5 % noise on the largest time would swing a plain fit's intercept far off; relative
    least squares keeps alpha within a few percent."""
    n, alpha, beta = 2, 30e-6, 2e9
    sizes = np.array([2.0**k for k in range(10, 25)])
    times = np.array([costs.ring_all_reduce_time(n, s, alpha, beta) for s in sizes])
    times[-1] *= 1.05
    assert fit_alpha_beta(n, sizes, times).alpha_s == pytest.approx(alpha, rel=0.05)


@pytest.mark.parametrize("cap", [1, 100, 1000, 5000, 10**9])
def test_bucket_sizes_follow_torchs_own_assignment(cap):
    """torch's DDP assigns buckets with dist._compute_bucket_assignment_by_size, given the
    parameters in the order their gradients become ready; our closed form must agree."""
    rng = np.random.default_rng(cap)
    parameters = [torch.empty(int(n)) for n in rng.integers(1, 750, size=12)]
    sizes = [p.numel() * 4 for p in parameters]
    assignment, _ = torch.distributed._compute_bucket_assignment_by_size(list(reversed(parameters)), [cap])
    torch_buckets = [sum(sizes[len(sizes) - 1 - i] for i in bucket) for bucket in assignment]
    assert costs.ddp_bucket_sizes(sizes, cap) == torch_buckets
    assert costs.ddp_bucket_count(sizes, 1) == len(sizes) and costs.ddp_bucket_count(sizes, 10**9) == 1


def _ddp_rebuilt_buckets(rank, world_size, widths, cap_bytes):
    model = tiny_mlp(widths, seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap_bytes / 2**20)
    for _ in range(2):  # buckets are rebuilt in gradient-ready order after the first iteration
        ddp(torch.randn(3, widths[0])).sum().backward()
    ddp(torch.randn(3, widths[0]))  # logging data is refreshed in forward
    rebuilt = ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"]
    return [int(b) for b in rebuilt.split(", ")], [p.numel() * 4 for p in model.parameters()]


def test_bucket_sizes_equal_what_torch_ddp_builds():
    widths, cap = (24, 48, 40, 32, 16, 8), 6000
    rebuilt, sizes = run_world(_ddp_rebuilt_buckets, 2, (widths, cap))[0]
    assert rebuilt == costs.ddp_bucket_sizes(sizes, cap)
    assert any(bucket > cap for bucket in rebuilt)  # a bucket closes once it reaches the cap, so it can exceed it


def test_latency_and_bandwidth_terms_cross_at_n_alpha_beta():
    n, alpha, beta = 64, 5e-6, 100e9
    crossover = n * alpha * beta
    latency = 2 * (n - 1) * alpha
    assert costs.ring_all_reduce_time(n, crossover, alpha, beta) == pytest.approx(2 * latency)
    assert costs.ring_all_reduce_time(n, crossover / 10, alpha, beta) < 1.2 * latency  # latency-bound below


def test_tree_model_trades_latency_steps_for_bytes():
    alpha, beta = 5e-6, 100e9
    assert costs.tree_all_reduce_time(1024, 0, alpha, beta) == pytest.approx(2 * 10 * alpha)  # 2·log2(n) steps
    assert costs.ring_all_reduce_time(1024, 0, alpha, beta) == pytest.approx(2 * 1023 * alpha)
    big = 1e12  # bandwidth-bound: the tree's 2S against the ring's 2(n-1)/n·S
    assert costs.tree_all_reduce_time(4, big, alpha, beta) / costs.ring_all_reduce_time(4, big, alpha, beta) == \
        pytest.approx(4 / 3, rel=1e-6)
