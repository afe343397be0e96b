"""Every formula of dtp.costs (the numbers the book prints) against a count, a step-by-step
simulation, or a measurement."""
import numpy as np
import pytest
import torch

from conftest import solution_path
from dtp import costs
from dtp.measure import fit_alpha_beta
from dtp.traffic import TrafficCounter
from dtp.world import run_world
from grader.student import StudentCode


@pytest.fixture(scope="module")
def course():
    return StudentCode.from_notebook(str(solution_path("dp")))


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_bytes_formula_matches_the_simulated_ring(course, n):
    size_elements = n * 1000
    _, sent = course.ring_all_reduce_numpy([np.ones(size_elements) for _ in range(n)])
    assert sent == [costs.ring_all_reduce_bytes_per_rank(n, size_elements * 8)] * n


def _count_ring_bytes(rank, world_size, ring, elements):
    with TrafficCounter() as traffic:
        ring(torch.ones(elements))
    return traffic.bytes_sent


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


def test_bus_bandwidth_is_the_rate_each_link_carried():
    n, size, seconds = 16, 4e9, 0.05
    bytes_per_link = costs.ring_all_reduce_bytes_per_rank(n, size)
    assert costs.bus_bandwidth(size, seconds, n) == pytest.approx(bytes_per_link / seconds)
    assert costs.algorithm_bandwidth(size, seconds) == pytest.approx(size / seconds)


def test_fit_recovers_alpha_and_beta_from_model_times():
    n, alpha, beta = 4, 30e-6, 2e9
    sizes = [2**k for k in range(10, 25)]
    times = [costs.ring_all_reduce_time(n, s, alpha, beta) for s in sizes]
    fitted_alpha, fitted_beta = fit_alpha_beta(n, sizes, times)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-3) and fitted_beta == pytest.approx(beta, rel=1e-6)


@pytest.mark.parametrize("cap", [1, 100, 1000, 5000, 10**9])
def test_bucket_sizes_follow_the_greedy_rule(cap):
    rng = np.random.default_rng(cap)
    parameters = [int(b) for b in rng.integers(4, 3000, size=12)]
    buckets = costs.ddp_bucket_sizes(parameters, cap)
    assert sum(buckets) == sum(parameters)
    walk = list(reversed(parameters))
    position = 0
    for bucket in buckets:  # each bucket is a run of the reversed sizes, as long as the cap allows
        run = [walk[position]]
        while position + len(run) < len(walk) and sum(run) + walk[position + len(run)] <= cap:
            run.append(walk[position + len(run)])
        assert bucket == sum(run)
        position += len(run)
    assert costs.ddp_bucket_count(parameters, cap) == len(buckets)
    assert costs.ddp_bucket_count(parameters, 1) == len(parameters)
    assert costs.ddp_bucket_count(parameters, 10**9) == 1


def test_latency_and_bandwidth_terms_cross_at_n_alpha_beta():
    n, alpha, beta = 64, 5e-6, 100e9
    crossover = n * alpha * beta
    latency = 2 * (n - 1) * alpha
    assert costs.ring_all_reduce_time(n, crossover, alpha, beta) == pytest.approx(2 * latency)
    assert costs.ring_all_reduce_time(n, crossover / 10, alpha, beta) < 1.2 * latency  # latency-bound below
