"""dtp.pp.schedules, the one source of the chapter's schedules, timelines and closed forms: the
generators against their defining properties, the simulator against the grader's independent
event simulation, every closed form the book prints against simulated steps, and the real
pipeline's messages against the count the book states."""
import json

import numpy as np
import pytest
import torch

from conftest import solution_path
from dtp.pp import schedules as pipeline, torch_pipelining as pipeline_torch
from dtp.common.traffic import CommunicationLog
from dtp.common.world import run_world
from grader.checks.pp import event_simulation, random_valid_schedule
from grader.student import StudentCode


def random_case(rng, name):
    p = int(rng.integers(1, 9)) if name != "ZB-H1" else int(rng.integers(2, 9))
    v = int(rng.integers(2, 5)) if name == "interleaved 1F1B" else 1
    m = p * int(rng.integers(1, 5)) if v > 1 else int(rng.integers(1, 25))
    if name == "ZB-H1":  # the closed form's conditions: m >= p, t_W <= min(t_F, t_B)
        m = max(m, p)
        t_w = float(rng.uniform(0.1, 1.0))
        times = {"F": float(rng.uniform(t_w, 3)), "B": float(rng.uniform(t_w, 3)), "W": t_w}
    else:
        times = {kind: float(rng.uniform(0.1, 3)) for kind in "FBW"}
    return p, m, v, times


@pytest.mark.parametrize("name", list(pipeline.SCHEDULES))
def test_closed_forms_match_simulated_steps(name):
    rng = np.random.default_rng(4)
    for _ in range(150):
        p, m, v, times = random_case(rng, name)
        timeline = pipeline.simulate(pipeline.make_schedule(name, p, m, v), times)
        assert timeline.makespan == pytest.approx(pipeline.makespan(name, p, m, times, v), rel=1e-12)
        assert timeline.peak_in_flight == [pipeline.peak_in_flight(name, p, m, s, v) for s in range(p)]
        if name != "ZB-H1":
            assert timeline.bubble_fraction == pytest.approx(pipeline.bubble_fraction(p, m, v), rel=1e-12, abs=1e-15)
            assert timeline.bubble_over_ideal == pytest.approx(pipeline.bubble_over_ideal(p, m, v), rel=1e-12, abs=1e-15)


def test_zb_h1_has_a_third_of_the_1f1b_bubble_with_equal_op_times():
    for p, m in ((4, 8), (8, 64), (3, 3)):
        one_f_one_b = pipeline.simulate(pipeline.one_f_one_b_schedule(p, m), pipeline.UNIT_TIMES)
        zero_bubble = pipeline.simulate(pipeline.zb_h1_schedule(p, m), pipeline.UNIT_TIMES)
        idle = [p * t.makespan - 3 * m * p for t in (one_f_one_b, zero_bubble)]
        assert idle[1] * 3 == pytest.approx(idle[0])
        assert max(zero_bubble.peak_in_flight) == max(one_f_one_b.peak_in_flight) == min(p, m)


def test_zb_h1_closed_form_states_its_conditions():
    with pytest.raises(ValueError, match="m >= p"):
        pipeline.makespan("ZB-H1", 4, 3, pipeline.UNIT_TIMES)
    slow_weights = {"F": 1.0, "B": 1.0, "W": 2.0}  # t_W > t_F: the W cannot hide in the cool-down any more
    simulated = pipeline.simulate(pipeline.zb_h1_schedule(4, 8), slow_weights).makespan
    assert simulated > 8 * 4 + 3 * (1 + 1 - 2)
    with pytest.raises(ValueError):
        pipeline.makespan("ZB-H1", 4, 8, slow_weights)


def test_gpipe_and_1f1b_take_the_least_time_any_schedule_can():
    """The last stage cannot start before (p-1)·t_F, has m(t_F+t_B) of work, and the last
    backward still has p-1 stages to cross: (m+p-1)(t_F+t_B) is a lower bound, met by both."""
    rng = np.random.default_rng(5)
    for _ in range(50):
        p, m = int(rng.integers(2, 7)), int(rng.integers(1, 9))
        times = {"F": float(rng.uniform(0.1, 2)), "B": float(rng.uniform(0.1, 2)), "W": 0.0}
        bound = (p - 1) * times["F"] + m * (times["F"] + times["B"]) + (p - 1) * times["B"]
        orders = [random_valid_schedule(rng, p, m, 1, False) for _ in range(3)]
        assert all(pipeline.simulate(order, times).makespan >= bound - 1e-9 for order in orders)
        for name in ("GPipe", "1F1B"):
            assert pipeline.simulate(pipeline.make_schedule(name, p, m), times).makespan == pytest.approx(bound)


def test_dtp_simulator_and_the_graders_event_simulation_agree_exactly():
    rng = np.random.default_rng(6)
    for _ in range(300):
        p, m, v, split = int(rng.integers(1, 6)), int(rng.integers(1, 7)), int(rng.integers(1, 3)), bool(rng.integers(2))
        schedule = random_valid_schedule(rng, p, m, v, split)
        times, p2p = {k: float(rng.uniform(0.1, 2)) for k in "FBW"}, float(rng.choice([0.0, rng.uniform(0, 0.5)]))
        ours, theirs = pipeline.simulate(schedule, times, p2p), event_simulation(schedule, times, p2p)
        assert ours.start == theirs["start"] and ours.end == theirs["end"]
        assert ours.peak_in_flight == theirs["peak_in_flight"]
        assert ours.bubble_fraction == pytest.approx(theirs["bubble_fraction"], abs=1e-12)


def test_p2p_time_delays_gpipe_by_one_message_per_boundary_each_way():
    for p, m, c in ((4, 8, 0.1), (2, 5, 0.2), (8, 16, 0.05)):
        timeline = pipeline.simulate(pipeline.gpipe_schedule(p, m), pipeline.UNIT_TIMES, c)
        assert timeline.makespan == pytest.approx((m + p - 1) * 3 + 2 * (p - 1) * c)
        one_f_one_b = pipeline.simulate(pipeline.one_f_one_b_schedule(p, m), pipeline.UNIT_TIMES, c)
        assert one_f_one_b.makespan > timeline.makespan  # the book: 1F1B's steady state waits on round trips


def test_a_deadlocking_order_is_an_error():
    schedule = [[pipeline.Op("F", 0), pipeline.Op("B", 0), pipeline.Op("F", 1), pipeline.Op("B", 1)],
                pipeline.gpipe_schedule(2, 2)[1]]
    with pytest.raises(ValueError, match="deadlocks"):
        pipeline.simulate(schedule, pipeline.UNIT_TIMES)
    with pytest.raises(ValueError, match="multiple of p"):
        pipeline.interleaved_schedule(4, 6, 2)


@pytest.mark.parametrize("name", list(pipeline.SCHEDULES))
def test_activations_over_time_peak_where_the_order_says(name):
    timeline = pipeline.simulate_named(name, 4, 8, 2)
    for stage in range(4):
        times, counts = pipeline.in_flight_over_time(timeline, stage)
        assert max(counts) == timeline.peak_in_flight[stage] and counts[-1] == 0
        assert times == sorted(times)


def test_timeline_json_is_what_the_simulator_computes():
    data = json.loads(pipeline.timeline_json("interleaved 1F1B", 4, 8, 2, p2p_time=0.25))
    timeline = pipeline.simulate_named("interleaved 1F1B", 4, 8, 2, p2p_time=0.25)
    assert data["makespan"] == timeline.makespan and data["peak_in_flight"] == timeline.peak_in_flight
    assert len(data["ops"]) == sum(len(ops) for ops in timeline.schedule) == 4 * 8 * 2 * 2
    first = data["ops"][0]
    assert set(first) == {"stage", "kind", "micro_batch", "chunk", "start", "end"}
    assert first["end"] - first["start"] == pytest.approx(0.5)  # a chunk's forward: t_F / v
    assert data["bubble_fraction"] == timeline.bubble_fraction


def test_idle_fraction_of_hand_made_intervals():
    # two stages over [0, 10]: busy 6 and 8, idle 6 of 20
    assert pipeline.idle_fraction([[(0, 3), (5, 8)], [(2, 10)]]) == pytest.approx(0.3)


@pytest.fixture(scope="module")
def course():
    return StudentCode.from_notebook(str(solution_path("pp")))


def _messages(rank, world_size, step, m):
    stage = pipeline.pipeline_stages(world_size, 0)[rank]
    batch, targets = torch.randn(2 * m, 6), torch.randn(2 * m, 3)
    with CommunicationLog() as log:
        step(stage, batch, targets, m, (2, 8))
    return [(event["peer"], event["bytes"]) for event in log.of("send")]


@pytest.mark.parametrize("p, m", [(2, 5), (4, 3)])
def test_each_micro_batch_crosses_each_boundary_once_each_way(course, p, m):
    sent = run_world(_messages, p, (course.one_f_one_b_step, m))
    assert sum(len(messages) for messages in sent) == pipeline.boundary_messages_per_step(p, m)
    for rank, messages in enumerate(sent):
        neighbours = [rank - 1] * (rank > 0) + [rank + 1] * (rank < p - 1)
        assert sorted(messages) == sorted((peer, 2 * 8 * 4) for peer in neighbours for _ in range(m))


def test_boundary_bytes_of_the_interview_question():
    assert pipeline.boundary_bytes_per_step(64, 1, 4096, 8192, 2) == 8 * 2**30


def test_megatrons_longer_interleaved_warm_up_pays_only_when_messages_take_time():
    """The book: with (p-s-1) instead of 2(p-s-1) warm-up forwards the step is as short when
    messages are free, longer when they are not, and the stages hold no more chunk activations."""
    rng = np.random.default_rng(7)
    for p, m, v in ((4, 8, 2), (2, 4, 3), (3, 6, 2), (4, 4, 4)):
        times = {"F": float(rng.uniform(0.5, 2)), "B": float(rng.uniform(0.5, 2)), "W": 0.0}
        short, megatron = (pipeline.interleaved_schedule(p, m, v, warm_up_factor=f) for f in (1, 2))
        free = [pipeline.simulate(s, times).makespan for s in (short, megatron)]
        assert free[0] == pytest.approx(free[1]) == pytest.approx(pipeline.makespan("interleaved 1F1B", p, m, times, v))
        chatty = [pipeline.simulate(s, times, 0.1).makespan for s in (short, megatron)]
        assert chatty[0] > chatty[1]
        assert max(pipeline.simulate(short, times).peak_in_flight) <= max(pipeline.simulate(megatron, times).peak_in_flight)


@pytest.mark.parametrize("p, m, v", [(4, 8, 2), (2, 4, 3), (8, 16, 4), (3, 3, 2)])
def test_interleaving_multiplies_the_messages_by_pv_minus_1_over_p_minus_1_not_v(p, m, v):
    """Issue 21, item 9: counted from the simulated schedule's cross-stage dependencies."""
    interleaved, plain = (pipeline.message_count(s) for s in (pipeline.interleaved_schedule(p, m, v),
                                                            pipeline.one_f_one_b_schedule(p, m)))
    assert interleaved == pipeline.boundary_messages_per_step(p, m, v) == 2 * m * (p * v - 1)
    assert plain == pipeline.boundary_messages_per_step(p, m)
    assert interleaved / plain == pytest.approx((p * v - 1) / (p - 1)) != v


def test_a_pipeline_boundary_sends_far_fewer_bytes_per_flop_than_tensor_parallelism():
    """Issue 21, item 10: the ratio's closed form, its independence of the tokens, and the page's
    comparison (one boundary message per stage against four all-reduces per layer)."""
    from dtp.tp import tensor_parallel as tp

    link, flops = tp.gigabits_to_bytes_per_s(tp.INFINIBAND_NDR_GBIT_PER_S), tp.H100_BF16_DENSE_FLOPS
    seq, hidden, layers = 4096, 8192, 10
    ratio = pipeline.boundary_communication_to_compute_ratio(layers, seq, hidden, 2, link, flops)
    expected = 2 * hidden * 2 * flops / (link * layers * ((24 + 48) * hidden**2 + 12 * seq * hidden))
    assert ratio == pytest.approx(expected, rel=1e-12)
    tensor_ratio = tp.communication_to_compute_ratio(seq, hidden, 8, 2, link, flops)
    assert tensor_ratio / ratio == pytest.approx(4 * (8 - 1) * layers, rel=1e-12)  # 8(t-1)/t·S over 1/t of the FLOPs, per layer
    assert ratio < 0.05 < 1 < tensor_ratio


def test_micro_batches_are_tied_to_the_global_batch_and_data_parallelism():
    """Issue 21, item 15: m = B / (b · DP), so at a fixed batch the bubble grows with DP."""
    assert pipeline.micro_batches_per_step(512, 1, 8) == 64
    assert pipeline.micro_batches_per_step(512, 2, 4) == 64
    with pytest.raises(ValueError, match="multiple"):
        pipeline.micro_batches_per_step(100, 1, 8)
    bubbles = [pipeline.bubble_fraction(8, pipeline.micro_batches_per_step(512, 1, dp)) for dp in (1, 4, 16, 64)]
    assert bubbles == sorted(bubbles) and bubbles[-1] > 5 * bubbles[0]


def test_saved_activation_meter_counts_each_tensor_once_and_views_by_their_own_bytes():
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    batch = torch.randn(10, 8)
    metered = pipeline_torch.MeteredStage(layer)
    outputs = [metered(micro) for micro in batch.tensor_split(5)]  # views of one storage
    # each micro-batch: its input and Tanh's output (also the second Linear's input), 2 x 8 float32 each
    assert metered.meter.live == metered.meter.peak == 5 * 2 * (2 * 8 * 4)
    for output in outputs:
        output.sum().backward()
    assert metered.meter.live == 0


@pytest.mark.parametrize("p, m", [(4, 8), (3, 2)])
def test_first_stage_holds_one_micro_batch_of_the_whole_model(course, p, m):
    """Issue 21, item 12 (Korthikanti et al. 2022, section 4.2.3): under 1F1B stage s keeps
    min(p - s, m) micro-batches of its L/p layers, so stage 0 keeps, for m >= p, as much as one
    micro-batch through all L layers; measured on the course's step on gloo."""
    measured = pipeline_torch.measure_saved_activations(course.one_f_one_b_step, p, m)
    one_stage = measured["one_stage_one_micro_batch"]
    assert measured["per_rank"] == [min(p - s, m) * one_stage for s in range(p)]
    if m >= p:
        assert measured["per_rank"][0] == measured["whole_model_one_micro_batch"] == p * one_stage


def test_interleaved_bubble_formula_needs_equal_chunks():
    """Issue 21, item 13: with the p·v chunks unequal (every stage's total still equal) the
    interleaved step is longer than (vm + p - 1) chunk times; equal chunks meet it exactly."""
    p, m, v = 4, 8, 2
    schedule, times = pipeline.interleaved_schedule(p, m, v), {"F": 0.5, "B": 0.5, "W": 0.5}
    equal = pipeline.simulate(schedule, times, chunk_scale=[1.0, 1.0])
    assert equal.bubble_fraction == pytest.approx(pipeline.bubble_fraction(p, m, v))
    for scale in ([0.75, 1.25], [1.25, 0.75]):
        assert pipeline.simulate(schedule, times, chunk_scale=scale).bubble_fraction > pipeline.bubble_fraction(p, m, v) + 0.02
    with pytest.raises(ValueError, match="multiple of p"):
        pipeline.interleaved_schedule(4, 6, 2)
