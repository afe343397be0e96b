"""ShardedOptimizer (ZeRO-1/2) as a torch.optim.Optimizer (issue 37): driven by a torch LR
scheduler, stepped with a closure, its state_dict in torch's own format with whole tensors (a
single-process AdamW's loads into it and back), parameter groups added later, and gradient
clipping by the global norm; on gloo worlds against one process training the same GPT."""
import pytest
import torch

from dtp.common.world import run_world
from dtp.zero.sharded import MixedPrecision, ShardedOptimizer
from test_zero_sharded import ADAMW, assert_same_weights, gpt_loss, rows, tiny_gpt, token_batches

STEP_SIZE, GAMMA = 2, 0.1  # StepLR: the learning rate divided by ten every two steps
MAX_NORM = 0.5  # below this GPT's gradient norms (about 3.5): every step clips


def weights(model):
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def one_process(steps, scheduler=False, clip=False, state=None, first_step=0, start=None):
    """AdamW on the whole batch: the weights, the learning rates used, the clipped norms, the losses
    and the optimizer's state_dict; `state`/`start`: resume from that state_dict and those weights."""
    model = tiny_gpt()
    if start is not None:
        model.load_state_dict(start)
    optimizer = ADAMW[0](model.parameters(), **ADAMW[1])
    if state is not None:
        optimizer.load_state_dict(state)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, STEP_SIZE, GAMMA) if scheduler else None
    lrs, norms, losses = [], [], []
    for tokens in token_batches(steps)[first_step:]:
        loss = gpt_loss(model, tokens)
        loss.backward()
        losses.append(loss.item())
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        optimizer.zero_grad()
        if schedule is not None:
            schedule.step()
    return {"weights": weights(model), "lrs": lrs, "norms": norms, "losses": losses, "state": optimizer.state_dict()}


def _scheduled_rank(rank, world_size, stage, steps, clip=False, closure=False):
    model = tiny_gpt()
    optimizer = ShardedOptimizer(model.parameters(), ADAMW[0], stage=stage, **ADAMW[1])
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, STEP_SIZE, GAMMA)
    lrs, norms, losses = [], [], []
    for tokens in token_batches(steps):
        mine = rows(tokens, rank, world_size)

        def step_closure():
            optimizer.zero_grad()
            loss = gpt_loss(model, mine)
            loss.backward()
            return loss
        if closure:
            loss = optimizer.step(step_closure)
        else:
            loss = step_closure()
            if clip:
                norms.append(float(optimizer.clip_grad_norm_(MAX_NORM)))
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
        losses.append(loss.item())
        schedule.step()
    return {"weights": weights(model), "lrs": lrs, "norms": norms, "losses": losses,
            "is optimizer": isinstance(optimizer, torch.optim.Optimizer)}


@pytest.mark.parametrize("stage, world_size", [(1, 2), (2, 3)])
def test_step_lr_drives_the_sharded_optimizer(stage, world_size):
    """StepLR changes the groups' lr and the inner optimizer steps with it: 5 steps equal one
    process's AdamW under the same schedule (not the unscheduled run)."""
    expected = one_process(5, scheduler=True)
    assert expected["lrs"] == pytest.approx([1e-2, 1e-2, 1e-3, 1e-3, 1e-4])
    for outcome in run_world(_scheduled_rank, world_size, (stage, 5)):
        assert outcome["is optimizer"] and outcome["lrs"] == pytest.approx(expected["lrs"])
        assert_same_weights(outcome["weights"], expected["weights"])
    unscheduled = one_process(5)["weights"]["blocks.0.mlp.up.weight"]
    assert (unscheduled - expected["weights"]["blocks.0.mlp.up.weight"]).abs().max() > 1e-3


def test_step_runs_a_closure_and_returns_its_loss():
    expected = one_process(4, scheduler=True)
    per_rank = run_world(_scheduled_rank, 2, (2, 4, False, True))
    averaged = [sum(losses) / 2 for losses in zip(*(outcome["losses"] for outcome in per_rank))]
    assert averaged == pytest.approx(expected["losses"], rel=1e-6)
    assert_same_weights(per_rank[0]["weights"], expected["weights"])


@pytest.mark.parametrize("stage", [1, 2])
def test_clip_grad_norm_by_the_global_norm_of_averaged_gradients(stage):
    """ShardedOptimizer.clip_grad_norm_: the norm one process's clip_grad_norm_ returns, and the
    same clipped training (torch's own on the model would see each rank's own gradient, stage 1,
    or none, stage 2)."""
    expected = one_process(3, scheduler=True, clip=True)
    assert min(expected["norms"]) > MAX_NORM
    for outcome in run_world(_scheduled_rank, 3, (stage, 3, True)):
        assert outcome["norms"] == pytest.approx(expected["norms"], rel=1e-6)
        assert_same_weights(outcome["weights"], expected["weights"])


def _state_dict_rank(rank, world_size, stage, steps, loaded=None, start=None, first_step=0, mixed=None):
    model = tiny_gpt()
    if start is not None:
        model.load_state_dict(start, strict=False)  # the model's weights first, then the optimizer's state
    optimizer = ShardedOptimizer(model.parameters(), ADAMW[0], stage=stage, mixed_precision=mixed, **ADAMW[1])
    if loaded is not None:
        optimizer.load_state_dict(loaded)
    for tokens in token_batches(steps)[first_step:]:
        gpt_loss(model, rows(tokens, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"state": optimizer.state_dict(), "weights": weights(model)}


def assert_same_optimizer_state(got, expected):
    assert [{k: v for k, v in g.items()} for g in got["param_groups"]] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        assert got["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            torch.testing.assert_close(got["state"][index][key], value, atol=1e-5, rtol=1e-4,
                                       msg=lambda m: f"state[{index}][{key!r}]: {m}")


def test_state_dict_is_torchs_format_and_loads_both_ways():
    """After 2 steps on 2 ranks, state_dict() is what a single-process AdamW's is (indices, groups,
    whole moments, step counts; the frozen parameter has no state); that state loads into a plain
    AdamW which finishes as one process does, and one process's state loads into 3 ranks."""
    two_steps = one_process(2)
    saved = run_world(_state_dict_rank, 2, (2, 2))[0]
    assert_same_optimizer_state(saved["state"], two_steps["state"])
    expected = one_process(4)
    resumed_alone = one_process(4, state=saved["state"], first_step=2, start=saved["weights"])
    assert_same_weights(resumed_alone["weights"], expected["weights"])
    resumed_sharded = run_world(_state_dict_rank, 3, (1, 4, two_steps["state"], two_steps["weights"], 2))[2]
    assert_same_weights(resumed_sharded["weights"], expected["weights"])
    assert_same_optimizer_state(resumed_sharded["state"], expected["state"])


def test_mixed_precision_state_dict_carries_the_fp32_masters():
    """The 16-bit model holds its weights rounded: state_dict adds the fp32 masters, and a run
    resumed from them ends where the uninterrupted run ends; resumed from the 16-bit model's
    weights (the masters left out) it does not."""
    mixed = MixedPrecision(torch.bfloat16, torch.float32)
    uninterrupted = run_world(_state_dict_rank, 2, (2, 4, None, None, 0, mixed))[0]["state"]["master_weights"]
    saved = run_world(_state_dict_rank, 2, (2, 2, None, None, 0, mixed))[0]["state"]
    masters = saved["master_weights"]
    assert [m.dtype for m in masters] == [torch.float32] * len(list(tiny_gpt().parameters()))
    resumed = run_world(_state_dict_rank, 2, (2, 4, saved, None, 2, mixed))[0]["state"]["master_weights"]
    for got, want in zip(resumed, uninterrupted):
        torch.testing.assert_close(got, want)
    rounded_start = {name: m.to(torch.bfloat16).float() for name, m in zip(dict(tiny_gpt().named_parameters()), masters)}
    without = {k: v for k, v in saved.items() if k != "master_weights"}
    rounded = run_world(_state_dict_rank, 2, (2, 4, without, rounded_start, 2, mixed))[0]["state"]["master_weights"]
    assert max(float((got - want).abs().max()) for got, want in zip(rounded, uninterrupted)) > 1e-5


def _added_group_rank(rank, world_size):
    model = tiny_gpt()
    blocks = [p for name, p in model.named_parameters() if name.startswith("blocks.")]
    rest = [p for name, p in model.named_parameters() if not name.startswith("blocks.")]
    optimizer = ShardedOptimizer(blocks, ADAMW[0], stage=2, **ADAMW[1])
    optimizer.add_param_group({"params": rest, "lr": ADAMW[1]["lr"] / 2})
    for tokens in token_batches(3):
        gpt_loss(model, rows(tokens, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return weights(model), [g["lr"] for g in optimizer.param_groups]


def test_a_parameter_group_added_later_is_sharded_and_stepped():
    weights_got, lrs = run_world(_added_group_rank, 2)[0]
    model = tiny_gpt()
    blocks = [p for name, p in model.named_parameters() if name.startswith("blocks.")]
    rest = [p for name, p in model.named_parameters() if not name.startswith("blocks.")]
    optimizer = ADAMW[0]([{"params": blocks}, {"params": rest, "lr": ADAMW[1]["lr"] / 2}], **ADAMW[1])
    for tokens in token_batches(3):
        gpt_loss(model, tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert lrs == [ADAMW[1]["lr"], ADAMW[1]["lr"] / 2]
    assert_same_weights(weights_got, weights(model))
