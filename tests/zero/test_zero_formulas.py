"""The ZeRO chapter's formulas (dtp.zero.formulas) against the paper's worked example, against each other,
and against measurements of the course's own ZeRO runs on gloo (dtp.zero.measure): bytes held
from the tensors that exist, bytes sent from the collectives recorded, and what gloo itself wrote."""
import math
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from conftest import solution_path
from dtp.memory import formulas as memory
from dtp.zero import formulas as zero, measure as zero_measure, runs as zero_runs
from dtp.common.models import tiny_mlp
from dtp.common.world import run_world
from dtp.common.traffic import CommunicationLog
from dtp.zero.measure import FullTensorTracker, held_bytes
from grader.student import StudentCode


# --- per GPU, any size ---

def test_the_papers_figure_1_example():
    """Rajbhandari et al. 2020, figure 1: Ψ = 7.5B, Nd = 64, K = 12: 120, 31.4, 16.6 and 1.9 GB."""
    per_gpu = [zero.model_state_bytes_per_gpu(7.5e9, 64, stage) / 1e9 for stage in zero.STAGES]
    assert [round(value, 1) for value in per_gpu] == [120.0, 31.4, 16.6, 1.9]


def test_stage_formulas_by_component():
    psi, n = 1e9, 8
    assert zero.model_state_breakdown_per_gpu(psi, n, 1) == {"weights": 2 * psi, "gradients": 2 * psi,
                                                             "optimizer states": 12 * psi / n}
    assert zero.model_state_bytes_per_gpu(psi, n, 2) == pytest.approx(2 * psi + 14 * psi / n)
    assert zero.model_state_bytes_per_gpu(psi, n, 3) == pytest.approx(16 * psi / n)
    assert zero.model_state_bytes_per_gpu(psi, n, 0) == memory.model_state_memory(psi, "mixed_adam")


@pytest.mark.parametrize("stage, limit", [(1, 4.0), (2, 8.0), (3, math.inf)])
def test_the_source_notes_4x_and_8x_are_limits(stage, limit):
    assert zero.saving_factor_limit(stage) == limit
    factors = [zero.memory_saving_factor(n, stage) for n in (8, 64, 1024, 10**6)]
    assert factors == sorted(factors) and all(f < limit for f in factors)
    if stage < 3:
        assert factors[-1] == pytest.approx(limit, rel=1e-4)
    assert zero.memory_saving_factor(8, 1) == pytest.approx(16 / 5.5)


def test_every_stage_is_plain_data_parallelism_on_one_gpu():
    for recipe in memory.RECIPES:
        assert {zero.model_state_bytes_per_gpu(3e9, 1, stage, recipe) for stage in zero.STAGES} == \
            {memory.model_state_memory(3e9, recipe)}


@pytest.mark.parametrize("n", [2, 3, 8, 64])
def test_communication_volume(n):
    psi = 1e9
    ring = 2 * (n - 1) / n * psi * 2  # bf16 all-reduce of the gradients
    for stage in (0, 1, 2):
        assert zero.communication_bytes_per_gpu(psi, n, stage) == pytest.approx(ring)
    assert zero.communication_bytes_per_gpu(psi, n, 3) == pytest.approx(1.5 * ring)


def test_hybrid_sharding_is_zero3_inside_a_group_and_data_parallelism_across():
    psi = 1e9
    assert zero.hybrid_sharding_bytes_per_gpu(psi, 8) == zero.model_state_bytes_per_gpu(psi, 8, 3)
    one_group = zero.hybrid_sharding_elements_per_gpu(psi, 8, 1)
    assert one_group == {"within a group": zero.communication_elements_per_gpu(psi, 8, 3), "across groups": 0}
    no_sharding = zero.hybrid_sharding_elements_per_gpu(psi, 1, 16)
    assert no_sharding == {"within a group": 0, "across groups": zero.communication_elements_per_gpu(psi, 16, 0)}
    assert zero.hybrid_sharding_elements_per_gpu(psi, 8, 4)["across groups"] == pytest.approx(2 * 3 / 4 * psi / 8)


def test_fewest_gpus_to_fit_the_70b_model():
    h100 = memory.GPU_MEMORY_MIB["H100 80GB"] * 2**20
    assert [zero.fewest_gpus_to_fit(70e9, h100, stage) for stage in (0, 1, 2)] == [None, None, None]
    for reserved in (0, 16 * 2**30):
        fewest = zero.fewest_gpus_to_fit(70e9, h100, 3, reserved_bytes=reserved)
        room = h100 - reserved
        assert zero.model_state_bytes_per_gpu(70e9, fewest, 3) <= room < zero.model_state_bytes_per_gpu(70e9, fewest - 1, 3)
    assert zero.fewest_gpus_to_fit(1e9, h100, 0) == 1
    assert zero.fewest_gpus_to_fit(6e9, h100, 1) == 2  # 24 GB of bf16 weights and gradients, 72 GB/Nd of Adam


# --- layouts ---

def test_units_from_pieces():
    sizes = [240, 30, 510, 17, 68, 4]  # tiny_mlp((8, 30, 17, 4))
    assert zero.units_from_pieces([60, 8, 128, 5, 17, 1], sizes, 4) == sizes
    assert zero.units_from_pieces([218], sizes, 4) == [869]
    assert zero.units_from_pieces([68, 132, 18], sizes, 4) == [270, 527, 72]
    assert zero.units_from_pieces([60, 8], sizes, 4) is None  # not every parameter gathered
    assert zero.units_from_pieces([219], sizes, 4) is None  # one element too many


def test_units_in_order_tell_apart_splits_with_the_same_pieces():
    sizes = [192, 24, 576, 24, 552, 23, 92, 4]  # 4 layers: 216, 600, 575 and 96 elements on 3 ranks
    assert zero.units_from_pieces([72, 200, 192, 32], sizes, 3, ordered=True) == [216, 600, 575, 96]
    assert zero.units_from_pieces([72, 200, 192, 32], sizes, 3) == [216, 576, 599, 96]  # same pieces, other split


def test_unshard_drops_the_padding():
    full = np.arange(10.0)
    pieces = [[full[4 * r:4 * r + 4]] for r in range(3)]
    pieces[2][0] = np.concatenate([pieces[2][0], [0.0, 0.0]])
    assert np.array_equal(zero.unshard(pieces, [10])[0], full)


def test_exact_formulas_reduce_to_the_textbook_ones_when_n_divides():
    units, n = [64, 32, 96], 4
    psi = sum(units)
    assert zero.held_bytes_per_rank(units, n, 3) == {k: 4 * v for k, v in
                                                     {"weights": psi / n, "gradients": psi / n,
                                                      "optimizer states": 2 * psi / n}.items()}
    assert zero.held_bytes_per_rank(units, n, 1, padded=False) == zero.held_bytes_per_rank(units, n, 1)
    assert zero.sent_bytes_per_rank(units, n, 2) == pytest.approx(zero.sent_bytes_per_rank(units, n, 0))
    assert zero.sent_bytes_per_rank(units, n, 3) == pytest.approx(1.5 * zero.sent_bytes_per_rank(units, n, 0))


# --- measuring tools ---

def test_held_bytes_counts_each_storage_once_and_leaves_out_scalars():
    model = torch.nn.Linear(6, 5)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    optimizer.step()

    class Wrapper:
        pass

    wrapper = Wrapper()
    wrapper.optimizer, wrapper.view, wrapper.extra = optimizer, model.weight.detach()[:2], torch.zeros(7)
    held = held_bytes(model.parameters(), model=model, zero=wrapper)
    assert held["weights"] == held["gradients"] == 4 * 35 and held["optimizer states"] == 8 * 35
    assert held["other"] == 28 and held["other paths"] == ["zero.extra (28 bytes)"]


def _followed_copies(rank, world_size):
    tracker = FullTensorTracker()
    with tracker:
        gathered = torch.zeros(8 * world_size)
        dist.all_gather_single(gathered, torch.ones(8))
        copy = torch.cat([gathered[:4], gathered[4:]]).clone()
        computed = gathered * 2  # computed from it, not a copy of it
        destination = torch.empty(8 * world_size)
        destination.copy_(gathered)
        alive = tracker.full_bytes_alive()
        del gathered, copy, computed, destination
        torch.zeros(1)  # one more operation, sampled after the deletions
    return alive, tracker.full_bytes_alive(), tracker.peaks["start"]


def test_the_tracker_follows_gathered_weights_through_copies():
    alive, left, peak = run_world(_followed_copies, 1)[0]
    assert alive == peak == 3 * 32 and left == 0


# --- measured on gloo ---

SIZES = (8, 23, 19, 4)  # 699 parameters, 3 layers: no world size of 2 to 4 divides a unit


@pytest.fixture(scope="module")
def course():
    return StudentCode.from_notebook(str(solution_path("zero")), {"ZeRO1Adam", "ZeRO2Adam", "ZeRO3Module"})


def _runs_on_rank(rank, world_size, makers):
    return [zero_runs.train_zero_rank(rank, world_size, stage, make, SIZES, 5, 11) for stage, make in makers]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_measured_runs_hold_and_send_what_the_formulas_say(course, n):
    makers = [(0, None), (1, course.ZeRO1Adam), (2, course.ZeRO2Adam), (3, course.ZeRO3Module)]
    per_rank = run_world(_runs_on_rank, n, (makers,))
    parameter_sizes = [p.numel() for p in tiny_mlp(SIZES).parameters()]
    layer_sizes = [a + b for a, b in zip(parameter_sizes[::2], parameter_sizes[1::2])]
    reference = zero_runs.single_process_adam(SIZES, 5, zero_runs.batches(SIZES, 11, n), n)
    for rank, runs in enumerate(per_rank):
        for stage, run in enumerate(runs):
            units = layer_sizes if stage == 3 else parameter_sizes
            for step in (1, 2):  # once Adam's state exists
                held = {k: run["held"][step][k] for k in zero.COMPONENTS}
                assert held == zero.held_bytes_per_rank(parameter_sizes, n, stage, units=units), (stage, rank)
                assert run["held"][step]["other"] == 0
            sent = sum(zero.ring_bytes_sent(e["op"], e["bytes"], n) for e in run["events"][-1]
                       if e["op"] in ("all_gather", "reduce_scatter", "all_reduce"))
            # ZeRO-3 gathers a unit again only when backward needs its weights: the first layer's
            # input needs no gradient, so autograd saves none of them and it is not gathered again.
            skipped = (n - 1) * zero.shard_numel(layer_sizes[0], n) * zero.FP32_ITEMSIZE if stage == 3 else 0
            assert sent == pytest.approx(zero.sent_bytes_per_rank(units, n, stage) - skipped)
            assert np.allclose(run["losses"], [losses[rank] for losses in reference["losses"]], rtol=1e-5)
            if stage == 3:
                assert all(record["after backward"] == record["after step"] == 0 for record in run["full weights"])
                assert max(record["forward"] for record in run["full weights"]) < 4 * sum(parameter_sizes)
            if stage == 2:
                assert run["full grads after backward"] == [0] * zero_runs.STEPS


def _gloo_bytes_on_rank(rank, world_size, numel):
    data = torch.randn(numel * world_size)
    counts = {}
    for name, call in (("all_gather", lambda: dist.all_gather_single(torch.empty(numel * world_size), data[:numel])),
                       ("reduce_scatter", lambda: dist.reduce_scatter_single(torch.empty(numel), data)),
                       ("all_reduce", lambda: dist.all_reduce(data))):
        dist.barrier()
        before = zero_measure.bytes_written()
        call()
        counts[name] = zero_measure.bytes_written() - before
    return counts


@pytest.mark.parametrize("n", [2, 4])
def test_gloos_reduce_scatter_sends_what_an_all_reduce_sends(n):
    """What the book says of gloo on the pinned torch: its all-gather and all-reduce send a ring's
    bytes, its reduce-scatter twice a ring's (it all-reduces, then keeps a piece)."""
    numel = 1 << 18
    counts = run_world(_gloo_bytes_on_rank, n, (numel,))[0]
    ring_piece = (n - 1) * numel * 4
    assert counts["all_gather"] == pytest.approx(ring_piece, rel=0.01)
    assert counts["reduce_scatter"] == pytest.approx(2 * ring_piece, rel=0.01)
    assert counts["all_reduce"] == pytest.approx(2 * ring_piece, rel=0.01)


def _released_after_gather(rank, world_size):
    with CommunicationLog():
        full = torch.empty(4 * world_size)
        dist.all_gather_single(full, torch.ones(4))
        storage = StorageWeakRef(full.untyped_storage())
        del full
        for _ in range(50):  # gloo's worker thread lets go a moment after the wait returns
            if storage.expired():
                return True
            time.sleep(0.001)
    return False


def test_the_releasing_log_lets_gathered_tensors_go():
    assert all(run_world(_released_after_gather, 2))


def _units_and_stale_gradients(rank, world_size):
    """Gathered units counted alive, and gradients followed past their reduce-scatter, by the
    order of operations alone."""
    counting = FullTensorTracker(unit_limit=2)
    with counting:
        kept = []
        for _ in range(3):  # three units gathered and kept
            gathered = torch.empty(4 * world_size)
            dist.all_gather_single(gathered, torch.ones(4))
            kept.append(gathered[:3].clone())  # a copy of a gathered unit is that unit
            del gathered
        kept.clear()
        for _ in range(3):  # three units gathered one at a time
            gathered = torch.empty(4 * world_size)
            dist.all_gather_single(gathered, torch.ones(4))
            del gathered
            torch.zeros(1)
    parameters = [torch.nn.Parameter(torch.zeros(6)) for _ in range(3)]
    following = FullTensorTracker(parameters, follow_reductions=True)
    with following:
        held = []
        for parameter in parameters:
            parameter.grad = torch.ones(6)
            padded = torch.zeros(6 * world_size)
            padded[:6] = parameter.grad * 0.5  # a scaled, padded copy is the same full gradient
            dist.reduce_scatter_single(torch.empty(6), padded)
            held.append(padded)  # kept after its reduce-scatter
            parameter.grad = None
        torch.zeros(1)
    return counting.unit_peaks["start"], following.stale


def test_the_tracker_counts_gathered_units_and_follows_reduced_gradients():
    units, stale = run_world(_units_and_stale_gradients, 2)[0]
    assert units == 3
    assert stale is not None and stale["parameters"] == [0] and stale["bytes"] == 24
