"""The exposure model of the overlap chapter (dtp.overlap.model): each closed form against a direct
simulation of the same step, and its limits."""
import itertools

import numpy as np
import pytest

from dtp.overlap import model as overlap


def test_exposed_is_what_compute_does_not_hide():
    assert overlap.exposed(3.0, 1.0) == 2.0
    assert overlap.exposed(1.0, 3.0) == 0.0
    assert overlap.exposed_over_phases([(3, 1), (1, 3), (2, 2)]) == 2.0


@pytest.mark.parametrize("buckets", [1, 2, 3, 5, 8])
def test_ddp_closed_form_equals_the_simulated_bucket_engine(buckets):
    rng = np.random.default_rng(buckets)
    for _ in range(200):
        comm, backward = rng.uniform(0.01, 10, size=2)
        assert overlap.ddp_exposed(comm, backward, buckets) == pytest.approx(
            overlap.ddp_exposed_serial(comm, backward, buckets))


def test_ddp_limits():
    assert overlap.ddp_exposed(4.0, 100.0, 1) == 4.0  # one bucket: all after backward
    assert overlap.ddp_exposed(4.0, 100.0, 4) == 1.0  # plenty of backward: only the last bucket
    assert overlap.ddp_exposed(10.0, 4.0, 2) == 8.0  # communication outlasts backward


def fsdp_forward_simulated(units, gather, compute):
    """Gather engine and compute engine; gather k+1 is issued when compute k starts."""
    gather_end, compute_end = gather, 0.0
    for k in range(units):
        start = max(compute_end, gather_end)  # unit k's compute waits for its gather
        if k + 1 < units:
            gather_end = max(start, gather_end) + gather  # issued now, after the engine is free
        compute_end = start + compute
    return compute_end - units * compute


def test_fsdp_forward_closed_form_equals_a_simulation():
    for units, gather, compute in itertools.product([1, 2, 5], [0.5, 1.0, 3.0], [0.25, 1.0, 4.0]):
        assert overlap.fsdp_forward_exposed(units, gather, compute) == pytest.approx(
            fsdp_forward_simulated(units, gather, compute))
        assert overlap.fsdp_forward_exposed(units, gather, compute, prefetch=False) == units * gather


def test_fsdp_backward_phases():
    # compute hides everything but the first gather and the last reduce-scatter
    assert overlap.fsdp_backward_exposed(4, 1.0, 1.0, 5.0) == 2.0
    # g + r = 3 > b = 2 in the two middle phases: 1 each
    assert overlap.fsdp_backward_exposed(4, 1.5, 1.5, 2.0) == pytest.approx(3.0 + 2 * 1.0)
    assert overlap.fsdp_backward_exposed(3, 1.0, 2.0, 0.5, prefetch=False) == 9.0
    assert overlap.fsdp_gathered_units_alive(1, 8) == 2 and overlap.fsdp_gathered_units_alive(7, 4) == 4


def test_collective_matmul_hides_all_but_what_the_gemm_cannot_cover():
    assert overlap.collective_matmul_exposed(3.0, 8.0, 1) == 3.0
    assert overlap.collective_matmul_exposed(3.0, 8.0, 4) == 0.0  # 1 per step under 2 per chunk
    assert overlap.collective_matmul_exposed(6.0, 4.0, 4) == pytest.approx(3 * (2.0 - 1.0))


def test_tp_forward_all_reduces_stay_exposed():
    assert overlap.tp_layer_exposed(1.0, 10.0) == 2.0
    assert overlap.tp_layer_exposed(3.0, 1.0) == 6.0 + 4.0


def test_pp_messages_cost_nothing_when_free_and_more_with_more_micro_batches():
    assert overlap.pp_exposed(4, 8, 0.0) == 0.0
    assert overlap.pp_exposed(4, 8, 0.5) > 2 * 3 * 0.5 - 1e-9  # at least the fill and drain path
    assert overlap.pp_exposed(4, 16, 0.5) > overlap.pp_exposed(4, 8, 0.5)


def test_ep_two_micro_batches():
    assert overlap.ep_exposed(2.0, 5.0) == 0.0
    assert overlap.ep_exposed(2.0, 5.0, overlapped=False) == 4.0
    assert overlap.ep_exposed(5.0, 2.0) == 6.0


def test_fsdp2_issue_order_on_the_pinned_torch_is_what_the_page_says():
    """The page states, from this run at build time: FSDP2 on CPU prefetches nothing in forward by
    default, everything in backward, and in forward too with set_modules_to_forward_prefetch."""
    from dtp.overlap import measure as overlap_measure

    default = overlap_measure.fsdp2_events(forward_prefetch=False)
    explicit = overlap_measure.fsdp2_events(forward_prefetch=True)
    assert overlap_measure.gathers_issued_ahead(default, "forward", "backward") == (0, 3)
    assert overlap_measure.gathers_issued_ahead(default, "backward", "end") == (3, 3)
    assert overlap_measure.gathers_issued_ahead(explicit, "forward", "backward") == (3, 3)


def test_the_issued_ahead_count_tells_prefetch_from_blocking_gathers():
    """On the course's own ZeRO-3 with prefetch, every gather after the first is issued ahead."""
    from dtp.overlap import measure as overlap_measure
    from dtp.overlap.runs import zero3_prefetch_rank
    from dtp.common.world import run_world
    from grader.student import StudentCode

    from conftest import solution_path

    course = StudentCode.from_notebook(str(solution_path("overlap")), {"PrefetchZeRO3Module"})
    events = run_world(zero3_prefetch_rank, 2, (course.PrefetchZeRO3Module, (8, 12, 10, 4), 0, 0, 1))[0]["events"][0]
    assert overlap_measure.gathers_issued_ahead(events, "forward", "backward") == (2, 2)
    assert overlap_measure.gathers_issued_ahead(events, "backward", "step") == (2, 2)
