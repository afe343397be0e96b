"""dtp.pp.torch_pipelining: the schedules the pinned torch.distributed.pipelining ships, read from its
own per-rank planners and run on gloo, against dtp.pp.schedules's generators and simulator (issue 21,
item 16)."""
import pytest
import torch
from torch import nn

from dtp.pp import schedules as pipeline, torch_pipelining as pipeline_torch

HALF = {"F": 0.5, "B": 0.5, "W": 0.5}  # a chunk is half a stage


def test_the_pinned_torch_ships_the_schedules_the_page_lists():
    assert {"ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble",
            "ScheduleDualPipeV"} <= set(pipeline_torch.torch_schedule_names())


@pytest.mark.parametrize("p, m", [(4, 8), (2, 4), (3, 6), (4, 16)])
def test_torchs_interleaved_plan_is_the_course_generator(p, m):
    assert pipeline_torch.torch_schedule_order("ScheduleInterleaved1F1B", p, m) == pipeline.interleaved_schedule(p, m, 2)


@pytest.mark.parametrize("p, m", [(4, 8), (2, 4), (3, 6), (4, 16)])
def test_zbv_runs_every_op_once_in_a_v_and_nearly_without_bubble(p, m):
    schedule = pipeline_torch.torch_schedule_order("ScheduleZBVZeroBubble", p, m)
    for ops in schedule:
        assert sorted(ops) == sorted(pipeline.Op(kind, k, c) for kind in "FBW" for k in range(m) for c in (0, 1))
    timeline = pipeline.simulate(schedule, HALF, placement="V")
    # the turn (virtual stages p-1 and p) stays on the last rank: 2p - 2 messages each way per micro-batch
    assert pipeline.message_count(schedule, "V") == 2 * m * (2 * p - 2)
    zb_h1 = pipeline.simulate(pipeline.zb_h1_schedule(p, m), {kind: 1.0 for kind in "FBW"})
    assert timeline.makespan < zb_h1.makespan
    assert timeline.bubble_fraction < pipeline.bubble_fraction(p, m) / 3
    # chunk activation sets, each half a stage's: as many stage activations as 1F1B's first stage, on every rank
    assert max(timeline.peak_in_flight) == 2 * p


def test_v_placement_sends_forward_down_and_back_up():
    deps = pipeline.dependencies(pipeline.Op("F", 0, 1), 3, 4, 2, "V")  # virtual stage 4 after 3, same rank
    assert deps == [("F", 0, 0, 3)]
    assert pipeline.dependencies(pipeline.Op("F", 0, 1), 2, 4, 2, "V") == [("F", 0, 1, 3)]
    assert pipeline.dependencies(pipeline.Op("B", 0, 1), 0, 4, 2, "V") == [("F", 0, 1, 0)]  # the loss's stage


def test_dualpipev_plan_is_refused_rather_than_simulated_wrongly():
    with pytest.raises(ValueError, match="mixes whole and split backwards"):
        pipeline_torch.torch_schedule_order("ScheduleDualPipeV", 4, 8)


def test_zbv_on_gloo_runs_its_plan_and_matches_one_process():
    p, m = 2, 4
    result = pipeline_torch.run_torch_schedule("ZBVZeroBubble", p, m, timeout_s=90)
    assert result["status"] == "ok", result
    plan = pipeline_torch.torch_schedule_order("ScheduleZBVZeroBubble", p, m)
    for rank, ops in enumerate(plan):
        # virtual stage 0 has no input gradient: torch runs its whole backward at I, and its W is empty
        expected = [tuple(op) for op in ops if not (op.kind == "W" and pipeline.virtual_stage(op.chunk, rank, p, "V") == 0)]
        assert result["ranks"][rank]["order"] == expected
    whole = pipeline.pipeline_stages(2 * p, 0)
    generator = torch.Generator().manual_seed(0)
    batch, targets = torch.randn(2 * m, 6, generator=generator), torch.randn(2 * m, 3, generator=generator)
    nn.functional.mse_loss(nn.Sequential(*whole)(batch), targets).backward()
    grads = {key: value for rank in result["ranks"] for key, value in rank["grads"].items()}
    assert len(grads) == sum(len(list(stage.parameters())) for stage in whole)
    for index, stage in enumerate(whole):
        for name, parameter in stage.named_parameters():
            torch.testing.assert_close(grads[f"{index}.{name}"], parameter.grad, atol=1e-6, rtol=1e-5)
