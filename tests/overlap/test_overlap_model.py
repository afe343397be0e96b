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
        alpha = rng.choice([0.0, rng.uniform(0, 1)])
        launch = rng.choice([0.0, rng.uniform(0, 0.2)])
        assert overlap.ddp_exposed(comm, backward, buckets, alpha, launch=launch) == pytest.approx(
            overlap.ddp_exposed_serial(comm, backward, buckets, alpha, launch=launch))


def test_ddp_limits():
    assert overlap.ddp_exposed(4.0, 100.0, 1) == 4.0  # one bucket: all after backward
    assert overlap.ddp_exposed(4.0, 100.0, 4) == 1.0  # plenty of backward: only the last bucket
    assert overlap.ddp_exposed(10.0, 4.0, 2) == 8.0  # communication outlasts backward
    assert overlap.ddp_exposed(4.0, 100.0, 4, alpha=0.5) == 1.5  # the last bucket and its latency


def test_with_a_latency_per_collective_more_buckets_stop_helping():
    """alpha per bucket: the exposure first falls (the last bucket shrinks) then rises (b·alpha in
    the chain), so the best bucket count is finite; without alpha it never stops falling."""
    c, b_time, alpha = 14.0, 20.0, 0.5
    curve = [overlap.ddp_exposed(c, b_time, b, alpha) for b in range(1, 65)]
    best = overlap.ddp_best_buckets(c, b_time, alpha)
    assert 1 < best < 64 and curve[best - 1] == min(curve)
    assert curve[-1] > curve[best - 1] and curve[0] > curve[best - 1]
    assert overlap.ddp_best_buckets(c, b_time, 0.0, most=64) == 64


def test_contention_slows_the_overlapped_compute_only_while_the_collective_runs():
    # a collective shorter than the compute: the compute loses c·e/(1+e); longer: c - f as before
    assert overlap.exposed(2.0, 10.0, 0.25) == pytest.approx(2.0 * 0.25 / 1.25)
    assert overlap.exposed(20.0, 10.0, 0.25) == pytest.approx(10.0)
    for c, f, e in itertools.product([0.5, 2.0, 9.0, 30.0], [1.0, 10.0], [0.0, 0.18, 1.0]):
        program = [("issue", 0, c), ("compute", f), ("wait", 0)]
        assert overlap.exposed(c, f, e) == pytest.approx(overlap.program_exposed(program, e))
    # the compute takes f(1+e) when a collective spans all of it (the issue's definition)
    assert overlap.schedule_time([("issue", 0, 50.0), ("compute", 10.0)], 0.5) == 50.0
    assert overlap.schedule_time([("issue", 0, 15.0), ("compute", 10.0)], 0.5) == pytest.approx(15.0)


def test_with_gradient_accumulation_only_the_last_micro_batchs_backward_hides_the_reduction():
    """no_sync: buckets become ready only during the last micro-batch's backward, so B is one
    micro-batch's backward; the page's example exposes more than m·B would suggest."""
    c, b, m, buckets, alpha = 120.0, 100.0, 8, 25, 0.1
    last = overlap.ddp_exposed(c, b, buckets, alpha)
    assert last == pytest.approx(buckets * alpha + c - b * (buckets - 1) / buckets)  # the chain sticks out
    whole = overlap.ddp_exposed(c, m * b, buckets, alpha)
    assert whole == pytest.approx(alpha + c / buckets) and whole < last


def test_issuing_costs_the_rank_its_launch_time_per_collective_and_is_never_hidden():
    # one bucket after backward: its launch and its all-reduce
    assert overlap.ddp_exposed(4.0, 100.0, 1, 0.5, launch=0.1) == pytest.approx(4.6)
    # plenty of backward: the last bucket, and every bucket's launch on the backward's path
    assert overlap.ddp_exposed(4.0, 100.0, 8, 0.5, launch=0.1) == pytest.approx(0.5 + 0.5 + 8 * 0.1)
    assert overlap.program_exposed([("compute", 5.0), ("issue", 0, 1.0), ("compute", 5.0), ("wait", 0)],
                                   launch=0.2) == pytest.approx(0.2)


@pytest.mark.parametrize("buckets", [1, 2, 3, 5, 8, 64])
def test_ddp_closed_form_with_contention_equals_the_simulated_bucket_engine(buckets):
    """Both regimes: all-reduces that end before the next bucket is ready, and back-to-back ones."""
    rng = np.random.default_rng(100 + buckets)
    for _ in range(200):
        comm, backward = rng.uniform(0.01, 10, size=2)
        alpha, contention = rng.choice([0.0, rng.uniform(0, 1)]), rng.uniform(0.0, 0.5)
        assert overlap.ddp_exposed(comm, backward, buckets, alpha, contention) == pytest.approx(
            overlap.ddp_exposed_serial(comm, backward, buckets, alpha, contention))


def test_ddp_with_contention_is_simulated_and_costs_more():
    plain = overlap.ddp_exposed(10.0, 40.0, 4, 0.2)
    contended = overlap.ddp_exposed(10.0, 40.0, 4, 0.2, overlap.GPU_CONTENTION)
    assert contended > plain
    # three all-reduces under backward, each slowing it by its length · e/(1+e); the last exposed
    e, piece = overlap.GPU_CONTENTION, 0.2 + 10.0 / 4
    assert contended == pytest.approx(piece + 3 * piece * e / (1 + e))


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
        for alpha, e, launch in ((0.0, 0.0, 0.0), (0.3, 0.0, 0.0), (0.3, 0.18, 0.0), (0.3, 0.0, 0.05)):
            closed = overlap.fsdp_forward_exposed(units, gather, compute, True, alpha, e, launch)
            assert closed == pytest.approx(overlap.fsdp_forward_exposed_units(
                [gather + alpha] * units, [compute] * units, 1, e, launch))
            assert overlap.fsdp_forward_exposed(units, gather, compute, False, alpha, launch=launch) == pytest.approx(
                overlap.fsdp_forward_exposed_units([gather + alpha] * units, [compute] * units, 0, launch=launch))


def test_with_equal_units_deeper_prefetch_changes_nothing_and_with_a_big_gather_it_helps():
    for gather, compute in itertools.product([0.5, 1.0, 3.0], [0.25, 1.0, 4.0]):
        depth_1 = overlap.fsdp_forward_exposed_units([gather] * 6, [compute] * 6, 1)
        assert overlap.fsdp_forward_exposed_units([gather] * 6, [compute] * 6, 2) == pytest.approx(depth_1)
    # a gather five times the others behind a compute that hides one: one unit earlier, two hide it
    gathers, computes = [1.0, 1.0, 1.0, 5.0, 1.0, 1.0], [3.0] * 6
    depth_1 = overlap.fsdp_forward_exposed_units(gathers, computes, 1)
    depth_2 = overlap.fsdp_forward_exposed_units(gathers, computes, 2)
    assert depth_1 == pytest.approx(1.0 + (5.0 - 3.0)) and depth_2 == pytest.approx(1.0)


def test_fsdp_backward_phases():
    # compute hides everything but the first gather and the last reduce-scatter
    assert overlap.fsdp_backward_exposed(4, 1.0, 1.0, 5.0) == 2.0
    # g + r = 3 > b = 2 in the two middle phases: 1 each
    assert overlap.fsdp_backward_exposed(4, 1.5, 1.5, 2.0) == pytest.approx(3.0 + 2 * 1.0)
    assert overlap.fsdp_backward_exposed(3, 1.0, 2.0, 0.5, prefetch=False) == 9.0
    assert overlap.fsdp_gathered_units_alive(1, 8) == 2 and overlap.fsdp_gathered_units_alive(7, 4) == 4
    # FSDP2's root is not resharded after forward: backward starts without a gather
    assert overlap.fsdp_backward_exposed(4, 1.0, 1.0, 5.0, first_gather=False) == 1.0
    assert overlap.fsdp_backward_exposed(4, 1.0, 1.0, 5.0, alpha=0.5) == 3.0


def fsdp_backward_program(units, g, r, b):
    """Backward as a program: unit L-1's gather waited on; per unit k, the gather of k-1 issued,
    k computed, k's reduce-scatter issued after; the previous unit's reduce-scatter (issued before
    this compute) runs under it too."""
    program = [("issue", ("g", units - 1), g), ("wait", ("g", units - 1))]
    for k in reversed(range(units)):
        if k > 0:
            program.append(("issue", ("g", k - 1), g))
        program.append(("compute", b))
        program.append(("issue", ("r", k), r))
        if k > 0:
            program.append(("wait", ("g", k - 1)))
    return program + [("wait", ("r", k)) for k in range(units)]


def test_fsdp_backward_closed_form_equals_the_program():
    for units, g, r, b in itertools.product([2, 3, 6], [0.5, 2.0], [0.5, 2.0], [0.5, 1.5, 5.0]):
        # the link runs r of unit k+1 and g of unit k-1 one after the other under b of unit k
        assert overlap.fsdp_backward_exposed(units, g, r, b) == pytest.approx(
            overlap.program_exposed(fsdp_backward_program(units, g, r, b)))


def gemm_reduce_scatter_program(reduce_scatter, piece, chunks, alpha):
    """GEMM then reduce-scatter, decomposed: piece 0's partial sum computed with nothing in
    flight, then each partial sum sent on while the next piece computes."""
    program = [("compute", piece)]
    for step in range(chunks - 1):
        program += [("issue", step, reduce_scatter / (chunks - 1) + alpha), ("compute", piece), ("wait", step)]
    return program


def test_collective_matmul_hides_all_but_what_the_gemm_cannot_cover():
    assert overlap.collective_matmul_exposed(3.0, 8.0, 1) == 3.0
    assert overlap.collective_matmul_exposed(3.0, 8.0, 4) == 0.0  # 1 per step under 2 per chunk
    assert overlap.collective_matmul_exposed(6.0, 4.0, 4) == pytest.approx(3 * (2.0 - 1.0))
    for a, g, t, alpha, e in itertools.product([2.0, 6.0], [4.0, 12.0], [2, 3, 4, 8], [0.0, 0.4], [0.0, 0.18]):
        closed = overlap.collective_matmul_exposed(a, g, t, alpha, e)
        assert closed == pytest.approx(overlap.program_exposed(overlap.collective_matmul_program(a, g, t, alpha), e))
        # GEMM then reduce-scatter, mirrored: the same exposure
        assert closed == pytest.approx(overlap.program_exposed(gemm_reduce_scatter_program(a, g / t, t, alpha), e))


def test_collective_matmul_benefit_peaks_at_a_finite_number_of_pieces():
    """Each piece runs a little less efficiently than the whole GEMM (and each transfer has its
    latency): splitting further eventually costs more than it hides."""
    curve = {t: overlap.collective_matmul_exposed(6.0, 10.0, t, alpha=0.1, piece_overhead=0.2) for t in range(1, 33)}
    best = min(curve, key=curve.get)
    assert 1 < best < 32 and curve[32] > curve[best] and curve[1] > curve[best]


def test_pp_messages_cost_nothing_when_free_and_more_with_more_micro_batches():
    assert overlap.pp_exposed(4, 8, 0.0) == 0.0
    assert overlap.pp_exposed(4, 8, 0.5) > 2 * 3 * 0.5 - 1e-9  # at least the fill and drain path
    assert overlap.pp_exposed(4, 16, 0.5) > overlap.pp_exposed(4, 8, 0.5)


def test_ep_two_micro_batches():
    assert overlap.ep_exposed(2.0, 5.0) == 0.0
    assert overlap.ep_exposed(2.0, 5.0, overlapped=False) == 4.0
    assert overlap.ep_exposed(5.0, 2.0) == 6.0
    assert overlap.ep_exposed(2.0, 5.0, overlapped=False, alpha=0.25) == 5.0  # two all-to-alls per micro-batch


def test_fsdp2_issue_order_on_the_pinned_torch_is_what_the_page_says():
    """The page states, from this run at build time: FSDP2 on CPU prefetches nothing in forward by
    default, everything in backward, and in forward too with set_modules_to_forward_prefetch."""
    from dtp.overlap import torch_facts

    default = torch_facts.fsdp2_events(forward_prefetch=False)
    explicit = torch_facts.fsdp2_events(forward_prefetch=True)
    assert torch_facts.gathers_issued_ahead(default, "forward", "backward") == (0, 3)
    assert torch_facts.gathers_issued_ahead(default, "backward", "end") == (3, 3)
    assert torch_facts.gathers_issued_ahead(explicit, "forward", "backward") == (3, 3)


def test_the_issued_ahead_count_tells_prefetch_from_blocking_gathers():
    """On the course's own ZeRO-3 with prefetch, every gather after the first is issued ahead."""
    from dtp.overlap import torch_facts
    from dtp.overlap.runs import zero3_prefetch_rank
    from dtp.common.world import run_world
    from grader.student import StudentCode

    from conftest import solution_path

    course = StudentCode.from_notebook(str(solution_path("overlap")), {"PrefetchZeRO3Module"})
    events = run_world(zero3_prefetch_rank, 2, (course.PrefetchZeRO3Module, (8, 12, 10, 4), 0, 0, 1))[0]["events"][0]
    assert torch_facts.gathers_issued_ahead(events, "forward", "backward") == (2, 2)
    assert torch_facts.gathers_issued_ahead(events, "backward", "step") == (2, 2)


def test_error_gain_is_one_for_the_last_bucket_and_the_chain_over_the_exposure_when_the_chain_sets_the_end():
    """A relative error in each collective passes through unchanged when one bucket sticks out,
    and is multiplied by b·p / exposed when the all-reduces outlast backward (b·p - B(b-1)/b)."""
    last_bucket = overlap.ddp_program(4.0, 100.0, 4)  # p = 1, the chain ends long before backward
    assert overlap.error_gain(last_bucket) == pytest.approx(1.0)
    chain = overlap.ddp_program(10.0, 4.0, 2)  # p = 5: exposed 2·5 - 4·1/2 = 8, gain 10 / 8
    assert overlap.error_gain(chain) == pytest.approx(10 / 8)
    many = overlap.ddp_program(48.0, 40.0, 16, alpha=0.5)  # p = 3.5: exposed 56 - 37.5 = 18.5
    assert overlap.error_gain(many) == pytest.approx(16 * 3.5 / 18.5)
    assert overlap.error_gain(overlap.ddp_program(1.0, 100.0, 4)) == pytest.approx(1.0)
    hidden = [("issue", 0, 1.0), ("compute", 5.0), ("wait", 0)]
    assert overlap.error_gain(hidden) == float("inf")


def test_error_gain_sees_a_row_that_the_error_pushes_into_the_chain():
    """Four buckets of p = 0.9 under a backward of 4: the chain (3.6) ends just before backward
    would let the last bucket alone stick out, so the model exposes p; 25 % more per all-reduce
    makes the chain outlast backward and the exposure jumps: the gain says so."""
    edge = overlap.ddp_program(3.6, 4.0, 4)
    assert overlap.program_exposed(edge) == pytest.approx(0.9)
    assert overlap.error_gain(edge) > 1.5
    assert overlap.error_gain(edge, relative=1e-6) == pytest.approx(1.0)


def test_with_the_link_busy_variations_of_the_all_reduces_add_up_instead_of_cancelling():
    """The page's reason for the spread of the many-bucket rows: half the all-reduces 20 % late and
    half 20 % early, in random orders (the same mean), expose more on average than equal ones when
    the chain keeps the link busy (a late one delays those queued behind it; an early one gains
    only while a backlog is left to catch up), and the same where there is slack."""
    rng = np.random.default_rng(0)

    def mean_exposed(p, backward, swing, draws=200):
        total = 0.0
        for _ in range(draws):
            signs = rng.permutation([1] * 8 + [-1] * 8)
            program = []
            for k, sign in enumerate(signs):
                program += [("compute", backward / 16), ("issue", k, p * (1 + swing * sign))]
            total += overlap.program_exposed(program + [("wait", k) for k in range(16)])
        return total / draws

    busy = overlap.program_exposed(overlap.ddp_program(16 * 2.4, 40.0, 16))
    assert mean_exposed(2.4, 40.0, 0.0) == pytest.approx(busy)
    assert mean_exposed(2.4, 40.0, 0.2) > 1.15 * busy
    slack = overlap.program_exposed(overlap.ddp_program(16 * 1.0, 40.0, 16))
    assert mean_exposed(1.0, 40.0, 0.2) == pytest.approx(slack, rel=0.05)
