"""Layouts as practised: how layers are split over stages, which interleavings a framework runs
(the review's item: v must divide each stage's layers), the step of unequal stages against a
1F1B timeline, the micro-batches each stage holds, NCCL's latency model and the contention of
overlapped work."""
import dataclasses

import pytest

from dtp.overlap import model as overlap

from dtp.pp import schedules
from dtp.topology import collectives, frameworks, planner, search, stages, validation
from dtp.topology.mesh import INTER_NODE, INTRA_NODE
from dtp.topology.published import BLOOM_176B, megatron_table_1


def test_even_and_balanced_splits():
    assert stages.split_layers(96, 8, False) == (12,) * 8
    # BLOOM's `type:transformer|embedding`: 70 layers and two embeddings as 72 units on 12 stages
    assert stages.split_layers(70, 12, True) == (5,) + (6,) * 10 + (5,)
    # Llama 3: one layer fewer on the first and last of 16 stages
    assert stages.split_layers(126, 16, True) == (7,) + (8,) * 14 + (7,)
    uneven = stages.split_layers(61, 16, True)
    assert sum(uneven) == 61 and max(stages.stage_units(uneven, True)) - min(stages.stage_units(uneven, True)) == 1
    with pytest.raises(ValueError, match="evenly"):
        stages.split_layers(70, 12, False)
    with pytest.raises(ValueError, match="without a layer"):
        stages.split_layers(4, 4, True)
    assert not stages.can_split(70, 12, False) and stages.can_split(70, 12, True)


def test_interleaving_needs_v_to_divide_every_stage_s_layers():
    """The review's item: Megatron runs v chunks per stage only when v divides the stage's layers
    (Narayanan et al. 2021, section 2.2.2): GPT 76.1B's 15 layers per stage take v = 3 or 5, not 2;
    529.6B's 3 take v = 3, not 2. No search offers what the framework refuses, and the validation
    of Table 1 uses the authors' own v (examples/sc21/run_table_1.sh)."""
    megatron = frameworks.practised(planner.Training(1), "megatron-2021")
    assert not stages.interleaving_allowed((15,) * 4, 2, 28, False)
    assert stages.interleaving_allowed((15,) * 4, 3, 28, False)
    assert not stages.interleaving_allowed((15,) * 4, 3, 30, False)  # m not a multiple of p
    assert frameworks.chunk_choices(megatron, (15,) * 4) == (1, 3, 5, 15)
    assert frameworks.chunk_choices(megatron, (3,) * 35) == (1, 3)
    table = {run.name: run for run in megatron_table_1()}
    assert (table["GPT 76.1B"].chunks, table["GPT 529.6B"].chunks, table["GPT 1008B"].chunks) == (3, 3, 1)
    for run in table.values():
        split = (run.model.layers // run.pp,) * run.pp
        assert all(split[0] % v == 0 for _, _, v, *_ in validation.choices(run))
    model = dataclasses.replace(planner.DENSE_70B, layers=60)
    cluster = planner.Cluster(4, 8, 80 * 2**30, 300e9, 25e9, 312e12)
    for tp, cp, pp, layers, balanced, dp, b, m, v in search.configurations(
            model, cluster, dataclasses.replace(megatron, global_batch=64)):
        assert all(units % v == 0 for units in stages.stage_units(layers, balanced))
        assert v == 1 or m % pp == 0


def test_deepspeed_neither_interleaves_nor_runs_zero_2_with_a_pipeline():
    deepspeed = frameworks.practised(planner.Training(1), "deepspeed")
    assert frameworks.chunk_choices(deepspeed, (6,) * 12) == (1,)
    assert frameworks.zero_stages(deepspeed, 12) == (0, 1) and frameworks.zero_stages(deepspeed, 1) == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="unknown framework"):
        frameworks.practised(planner.Training(1), "jax")


def _one_f_one_b_makespan(forward: list[float], backward: list[float], m: int) -> float:
    """A 1F1B step of stages with their own forward and backward times, each op starting when its
    stage is free and its input has arrived (the course's schedule, timed here by hand)."""
    p = len(forward)
    schedule = schedules.one_f_one_b_schedule(p, m)
    end, free, position = {}, [0.0] * p, [0] * p
    while any(position[s] < len(schedule[s]) for s in range(p)):
        for s in range(p):
            while position[s] < len(schedule[s]):
                kind, k, _ = schedule[s][position[s]]
                needs = (("F", k, s - 1) if s else None) if kind == "F" else \
                    (("B", k, s + 1) if s < p - 1 else ("F", k, s))
                if needs and needs not in end:
                    break
                start = max(free[s], end.get(needs, 0.0) if needs else 0.0)
                free[s] = end[(kind, k, s)] = start + (forward[s] if kind == "F" else backward[s])
                position[s] += 1
    return max(end.values())


@pytest.mark.parametrize("times", [[1, 1, 1, 1], [1, 1.5, 1, 1], [1, 1, 1, 2], [2, 1, 1, 1]])
def test_the_costliest_stage_decides_the_step(times):
    """m·max(τ) + (Σ τ - max(τ)): equal to the timeline for equal stages, and within a stage's time
    of it when one stage is slower (first, middle or last)."""
    forward = [t / 3 for t in times]
    backward = [2 * t / 3 for t in times]
    m = 12
    parts = stages.pipeline_seconds(times, m)
    timeline = _one_f_one_b_makespan(forward, backward, m)
    if len(set(times)) == 1:
        assert parts["steady"] + parts["fill_drain"] == pytest.approx(timeline)
    assert abs(parts["steady"] + parts["fill_drain"] - timeline) <= max(times) * (1 + 1e-9)
    assert timeline >= m * max(times)


def test_equal_interleaved_stages_take_m_plus_p_minus_1_over_v():
    p, m, v = 4, 8, 2
    timeline = schedules.simulate(schedules.interleaved_schedule(p, m, v), {"F": 1 / v, "B": 2 / v, "W": 0.0})
    parts = stages.pipeline_seconds([3.0] * p, m, v)
    assert parts["steady"] + parts["fill_drain"] == pytest.approx(timeline.makespan)


def test_micro_batches_in_flight():
    """1F1B keeps min(m, p - i) micro-batches on stage i; Megatron's interleaved schedule keeps its
    warm-up chunks plus one, (p - i - 1)·2 + (v - 1)·p + 1, each of L_i/v layers."""
    split = (10,) * 8
    assert stages.in_flight_layers(split, 0, 64, 1) == 80 and stages.in_flight_layers(split, 7, 64, 1) == 10
    assert stages.in_flight_layers(split, 0, 4, 1) == 40
    assert stages.in_flight_layers(split, 0, 64, 2) == 10 / 2 * (14 + 8 + 1)
    assert schedules.max_in_flight(schedules.interleaved_schedule(8, 64, 2)[0]) == 14 + 8 + 1


def test_nccl_s_latency_model():
    """NCCL's tuner (src/graph/tuning.cc): base 8.4 µs, 3.4 µs per NVLink ring step and 14 µs per
    network step (Simple protocol); an all-reduce over 64 ranks on 8 nodes takes 2·63 steps, 2·7
    of them between nodes; a reduce-scatter half that."""
    cluster = planner.A100_CLUSTER
    assert collectives.ring_steps("all_reduce", 64, 8) == (112, 14)
    assert collectives.collective_latency_s(cluster, "all_reduce", 64, 8) == pytest.approx(
        8.4e-6 + 112 * 3.4e-6 + 14 * 14e-6)
    assert collectives.collective_latency_s(cluster, "reduce_scatter", 64, 64) == pytest.approx(8.4e-6 + 63 * 14e-6)
    assert collectives.collective_latency_s(cluster, "send", 2, 1) == pytest.approx(8.4e-6 + 3.4e-6)
    assert collectives.collective_latency_s(cluster, "all_gather", 1, 1) == 0.0
    assert cluster.alpha(INTRA_NODE) == 3.4e-6 and cluster.alpha(INTER_NODE) == 14e-6
    assert collectives.nodes_of_group(16, 64, 8) == 16 and collectives.nodes_of_group(8, 1, 8) == 1
    # the DP ring's latency grows with the nodes it spans: 2·(k-1) network steps
    small, large = (collectives.collective_latency_s(cluster, "all_reduce", n, n) for n in (8, 192))
    assert large - small == pytest.approx(2 * (191 - 7) * 14e-6)


def test_contention_slows_what_communication_hides_under():
    """ε = 20/112 (DeepSeek-V3's 20 of 132 SMs), the overlap chapter's estimate: computation beside a
    collective it hides runs at 1/(1+ε), so a hidden second costs ε/(1+ε) of a second; a collective
    that outlasts the slowed computation costs only its own excess."""
    assert collectives.DEFAULT_CONTENTION == overlap.GPU_CONTENTION == pytest.approx(20 / 112)
    assert overlap.exposed(2.0, 10.0, 0.2) == pytest.approx(2.0 * 0.2 / 1.2)
    assert overlap.exposed(10.0, 2.0, 0.2) == pytest.approx(8.0)
    model, layout = planner.DENSE_70B, planner.PlannedLayout(8, 8, 16, 1, 1, 64)
    training = frameworks.practised(planner.FOUR_MILLION_TOKENS, "megatron-core")
    free = dataclasses.replace(planner.A100_CLUSTER, contention=0.0)
    assert planner.step_time(model, planner.A100_CLUSTER, training, layout)["tp"] > \
        planner.step_time(model, free, training, layout)["tp"]


def test_bloom_s_published_layout_enters_and_fits():
    """The issue's case: 70 layers on 12 stages (BLOOM's split, the two embeddings counted as layers)
    on 384 A100 80GB, TP 4, DP 8, micro-batch 2, batch 2048, ZeRO-1, full recomputation."""
    from dtp.topology import published

    run = published.bloom()[0]
    result = validation.predict(run)
    assert result["row"]["fits"] and result["row"]["stage_layers"] == (5,) + (6,) * 10 + (5,)
    assert result["row"]["micro_batch"] == 2 and result["row"]["recompute"] == "full"
    assert planner.parameter_counts(BLOOM_176B)["total"] == pytest.approx(176.2e9, rel=2e-3)
