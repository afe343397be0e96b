"""The page's measuring harness (dtp.overlap.timing, dtp.overlap.measure): what it runs is the
model's own program, its collectives run one after another, its fit recovers alpha and beta, and
the memory it reports is the (1 + d) units the model says. Nothing here asserts a time."""
import inspect
import os

import numpy as np
import pytest
import torch

from dtp.common.world import run_world
from dtp.overlap import measure, model, timing


def test_the_fit_recovers_alpha_and_beta_and_never_a_negative_alpha():
    numel = [1000, 4000, 16000]
    alpha, beta = 2e-4, 3e-9
    fit = timing.alpha_beta_from_times(numel, [alpha + beta * 4 * n for n in numel])
    assert fit["alpha"] == pytest.approx(alpha) and fit["beta"] == pytest.approx(beta)
    # a negative intercept is noise: the line through 0 instead
    fit = timing.alpha_beta_from_times(numel, [-1e-4 + beta * 4 * n for n in numel])
    assert fit["alpha"] == 0.0 and fit["beta"] > 0


def test_the_fit_lets_no_one_size_set_alpha():
    """One size's time off by a tenth, as a round's jitter leaves it: fitted on relative residuals,
    alpha (which a row of 32 small buckets multiplies by 32) stays within a third of the truth;
    an unweighted line, which the largest size pulls, would put it at 0."""
    numel = [2**18 * 2**k for k in range(6)]  # DDP's bucket sizes, 1 to 32 MB per rank
    alpha, beta = 3e-4, 0.8e-9
    times = [alpha + beta * 4 * n for n in numel]
    times[-1] *= 1.1
    assert timing.alpha_beta_from_times(numel, times)["alpha"] == pytest.approx(alpha, rel=1 / 3)
    unweighted_intercept = np.polyfit(np.array(numel) * 4.0, times, 1)[1]
    assert unweighted_intercept < 0


def test_the_measured_programs_are_the_models_with_sizes_for_times():
    program = measure.on_gloo(model.ddp_program(2**20, 0.02, 4), "all_reduce")
    assert [step[0] for step in program] == ["compute", "issue"] * 4 + ["wait"] * 4
    assert {step[3] for step in program if step[0] == "issue"} == {2**18}
    assert timing.compute_only(program) == [("compute", 0.005)] * 4
    late = model.after_backward_program(program)
    assert [step[0] for step in late] == ["compute"] * 4 + ["issue"] * 4 + ["wait"] * 4
    ring = measure.on_gloo(model.collective_matmul_program(3 * 1000, 0.04, 4), "exchange")
    assert [step[0] for step in ring] == ["issue", "compute", "wait"] * 3 + ["compute"]
    with pytest.raises(ValueError, match="unknown collective"):
        timing.buffers([("issue", "x", "broadcast", 10)])


def _order_on_one_link(rank, world_size):
    link = timing.one_link()
    big, small = torch.ones(2**21), torch.ones(4)
    first, second = link.allreduce([big]), link.allreduce([small])
    second.wait()
    in_order = first.is_completed()  # one worker thread: the first issued finished before the second
    first.wait()
    return in_order


def test_the_one_link_group_runs_collectives_in_the_order_issued():
    assert all(run_world(_order_on_one_link, 2))


def _program_order(rank, world_size):
    link = timing.one_link()
    programs = {name: [("issue", "x", "all_reduce", 4), ("compute", 0.0005 * k), ("wait", "x")]
                for k, name in enumerate("abcd")}
    names = {id(program): name for name, program in programs.items()}
    ran, policies, original = [], set(), timing.run_program

    def recording(program, link, tensors):
        ran.append(names.get(id(program)))  # None: a program's computation alone
        policies.add(os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK)
        original(program, link, tensors)

    timing.run_program = recording
    try:
        medians, middles = timing.exposed_summary(programs, link, rounds=6)
    finally:
        timing.run_program = original
    after = os.sched_getscheduler(0)
    return [name for name in ran if name], medians, middles, (policies, after)


def test_each_round_runs_every_program_once_in_an_order_shuffled_alike_on_every_rank():
    """Shuffled so that what one program leaves behind does not always fall on the same next one;
    alike on every rank, or the ranks' collectives would pair up wrongly. The timed programs run
    at a real-time priority exactly where the machine allows it, and only they."""
    (order, medians, middles, (policies, after)), (other_rank_order, *_) = run_world(_program_order, 2)
    assert policies == {os.SCHED_FIFO if timing.realtime_allowed() else os.SCHED_OTHER}
    assert after == os.SCHED_OTHER
    assert order == other_rank_order
    warm_up, rounds = order[:4], [order[4 + 4 * k: 8 + 4 * k] for k in range(6)]
    assert warm_up == list("abcd") and all(sorted(r) == list("abcd") for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1
    assert all(middles[name][0] <= medians[name] <= middles[name][1] for name in "abcd")


def _placement_of_every_thread(rank, world_size):
    timing.own_core(rank)
    link = timing.one_link()  # a new gloo device: its worker threads and its event loop start now
    link.allreduce([torch.ones(4)]).wait()
    placement = {}
    for thread in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{thread}/comm") as name:
            placement[thread] = (name.read().strip(), os.sched_getaffinity(int(thread)),
                                 os.sched_getscheduler(int(thread)))
    return placement


def test_each_measuring_rank_computes_on_a_core_of_its_own_with_gloo_s_event_loops_beside_it():
    """The rank's threads on its core, gloo's TCP event loops (one per device: the default
    group's and the link's) on the next: on the worker's own core an event loop kept it waiting
    (an all-reduce of 1 MB took about 3 ms instead of under 1). No thread keeps a real-time
    priority outside the timed rounds."""
    cores = sorted(os.sched_getaffinity(0))
    for rank, placement in enumerate(run_world(_placement_of_every_thread, 2)):
        own, beside = {cores[rank % len(cores)]}, {cores[(rank + 1) % len(cores)]}
        loops = [core for name, core, _ in placement.values() if name == timing.EVENT_LOOP_THREAD]
        others = [core for name, core, _ in placement.values() if name != timing.EVENT_LOOP_THREAD]
        assert len(loops) == 2 and all(core == beside for core in loops), placement
        assert len(others) > 1 and all(core == own for core in others), placement
        assert {policy for _, _, policy in placement.values()} == {os.SCHED_OTHER}, placement


def _peaks(rank, world_size, depth, keep):
    return measure._gathered_peak([2**12] * 4, depth, 0.002, keep_handles=keep)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_prefetch_depth_d_keeps_one_plus_d_units_gathered(depth):
    unit_bytes = 2 * 2**12 * 4  # two ranks' pieces of float32
    assert run_world(_peaks, 2, (depth, False))[0] == (1 + depth) * unit_bytes == \
        model.fsdp_gathered_units_alive(depth, 4) * unit_bytes


def test_a_kept_handle_keeps_the_previous_unit_gathered():
    """A finished Work holds its output: keeping the handle past the buffer costs one unit."""
    assert run_world(_peaks, 2, (0, True))[0] == 2 * (2 * 2**12 * 4)


@pytest.mark.parametrize("alpha_ms", [0.1, 0.5, 1.0, 2.5])
@pytest.mark.parametrize("allreduce_ms", [10.0, 25.0, 40.0])
def test_the_ddp_measurement_sizes_backward_where_no_row_multiplies_an_all_reduce_error(alpha_ms, allreduce_ms):
    """measure_ddp's backward is a fraction of the first-estimated all-reduce chosen so that an
    error in the all-reduces passes to every row's exposure about once, for any alpha and C this
    machine or another gives; a backward that nearly covers the chain would multiply it."""
    defaults = inspect.signature(measure.measure_ddp).parameters
    counts, ratio = defaults["bucket_counts"].default, defaults["backward_over_allreduce"].default
    alpha, c, launch = alpha_ms * 1e-3, allreduce_ms * 1e-3, 80e-6

    def gains(backward):
        return [model.error_gain(model.ddp_program(c, backward, b, alpha), launch=launch) for b in counts]

    assert max(gains(ratio * (alpha + c))) < 2
    covering = max(max(gains(factor * (alpha + c))) for factor in measure.COVERING_BACKWARDS)
    assert covering > 4  # the page's contrast is real: some backward in that range is ill-conditioned


def test_the_zero3_measurement_keeps_the_uneven_rows_off_the_models_edges():
    """measure_zero3_forward's big unit sticks out at depth 1 by more than a gather and hides at
    depth 2 even were it a tenth slower, while the computation is off the fitted gather by up to
    15 % either way and alpha is anywhere from a tenth to a quarter of a gather (this machine fits
    14-22 %): a row near either edge swings with every round's gather time. In gathers of an
    ordinary unit."""
    defaults = {name: p.default for name, p in inspect.signature(measure.measure_zero3_forward).parameters.items()}
    units, big_unit = defaults["units"], defaults["big_unit"]

    def sticks_out_only_at_depth_1(big_factor, compute, short):
        first_gather_only = 1.0
        for alpha_share in (0.10, 0.175, 0.25):
            big = alpha_share + (1 - alpha_share) * big_factor  # alpha does not grow with the bytes
            gathers = [big if i == big_unit else 1.0 for i in range(units)]
            slower = [big * 1.1 if i == big_unit else 1.0 for i in range(units)]
            for error in (0.85, 0.9, 1.0, 1.1, 1.15):
                computes = [(short if i == big_unit - 1 else compute) * error for i in range(units)]
                if model.fsdp_forward_exposed_units(slower, computes, 2) != pytest.approx(first_gather_only):
                    return False
                if model.fsdp_forward_exposed_units(gathers, computes, 1) < first_gather_only + 1.0:
                    return False
        return True

    assert sticks_out_only_at_depth_1(defaults["big_factor"], defaults["compute_over_gather"],
                                      defaults["short_over_gather"])
    assert not sticks_out_only_at_depth_1(2.5, 2.0, 2.0)  # equal computes: a built page measured 0.61 of the model
    assert not sticks_out_only_at_depth_1(3.0, 1.5, 1.5)  # and the sizes before: on depth 2's edge
