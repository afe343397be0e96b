"""dtp.zero.sharded's ZeRO-1/2 (ShardedOptimizer) and ZeRO-3 (ZeRO3) on real gloo worlds against
single-process training of the same model: a small GPT with tied embeddings and a frozen parameter,
AdamW with weight decay, SGD with momentum, parameter groups, unused parameters, mixed precision,
gradient accumulation both ways, and a checkpoint saved on 2 ranks resumed on 3 or 4."""
import pytest
import torch
from torch import nn

from dtp.common.gpt import GPT, GPTConfig
from dtp.zero.sharded import ShardedOptimizer, ZeRO3
from dtp.common.world import run_world

CONFIG = GPTConfig(vocab_size=29, n_positions=8, n_layers=2, hidden=12, n_heads=2, dropout=0.0)
ROWS, SEQ = 12, 6  # rows of a global (micro-)batch, whatever the world size: 12 splits over 2, 3 and 4
# eps well above float32 rounding: the key bias gets a zero gradient (softmax ignores a shift of the
# scores), which summed in another order is rounding noise that a tiny eps would blow up to lr.
ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-4})
SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
# fp32 sums in another order than one process: a few float32 ulps per step, grown by Adam's division.
FP32_TOLERANCE = 2e-5


class TinyGPT(GPT):
    """The course's GPT (tied embeddings) with a buffer and a keyword argument in forward."""

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("logit_scale", torch.tensor(0.5))

    def forward(self, tokens, *, temperature=1.0):
        return super().forward(tokens) * self.logit_scale / temperature


def tiny_gpt(frozen: bool = True) -> GPT:
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    if frozen:
        model.position_embedding.weight.requires_grad_(False)
    return model


def token_batches(steps: int, micro_batches: int = 1):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, CONFIG.vocab_size, (micro_batches * ROWS, SEQ + 1), generator=generator)
            for _ in range(steps)]


def gpt_loss(model, tokens):
    logits = model(tokens=tokens[:, :-1], temperature=0.8)
    return nn.functional.cross_entropy(logits.float().reshape(-1, CONFIG.vocab_size), tokens[:, 1:].reshape(-1))


def rows(tokens, rank, world_size, micro=0, micro_batches=1):
    """Rank's rows of micro-batch `micro`: the global batch is cut into micro-batches first."""
    per_micro = tokens.shape[0] // micro_batches
    block = tokens[micro * per_micro:(micro + 1) * per_micro]
    share = per_micro // world_size
    return block[rank * share:(rank + 1) * share]


def parameter_groups(parameters_by_name):
    """No weight decay on biases and LayerNorm weights, as GPT recipes do, by name (by shape in
    tests/zero/test_zero3_user_code.py: ZeRO-3's parameters keep their full shapes)."""
    parameters_by_name = list(parameters_by_name)
    no_decay = [p for name, p in parameters_by_name if "bias" in name or "norm" in name]
    decay = [p for name, p in parameters_by_name if not ("bias" in name or "norm" in name)]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def single_process(steps, world_size=1, optimizer=ADAMW, groups=False, micro_batches=1):
    """The weights after `steps` steps of one process on the whole batch, and its losses."""
    model = tiny_gpt()
    optimizer_class, options = optimizer
    params = parameter_groups(model.named_parameters()) if groups else model.parameters()
    opt = optimizer_class(params, **options)
    losses = []
    for step, tokens in enumerate(token_batches(steps, micro_batches)):
        for micro in range(micro_batches):
            block = rows(tokens, 0, 1, micro, micro_batches)
            loss = gpt_loss(model, block)
            (loss / micro_batches).backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {name: p.detach().clone() for name, p in model.state_dict().items()}, losses


# --- ZeRO-1 and ZeRO-2 ---

def _sharded_optimizer_rank(rank, world_size, stage, steps, optimizer, groups, micro_batches, reduce_once,
                            unused_on=None):
    model = tiny_gpt()
    optimizer_class, options = optimizer
    params = parameter_groups(model.named_parameters()) if groups else model.parameters()
    zero = ShardedOptimizer(params, optimizer_class, stage=stage, **options)
    for step, tokens in enumerate(token_batches(steps, micro_batches)):
        for micro in range(micro_batches):
            block = rows(tokens, rank, world_size, micro, micro_batches)
            last = micro == micro_batches - 1
            with zero.no_sync() if reduce_once and not last else _nothing():
                (gpt_loss(model, block) / micro_batches).backward()
        if unused_on is not None and rank in unused_on:  # as if this rank's batch missed the final norm
            model.final_norm.weight.grad = None
        zero.step()
        zero.zero_grad()
    pieces = sum(piece.numel() for piece in zero.pieces)
    return {name: p.detach().clone() for name, p in model.state_dict().items()}, pieces


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def assert_same_weights(got, expected, tolerance=FP32_TOLERANCE):
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name].float(), expected[name].float(), atol=tolerance, rtol=tolerance,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("stage, world_size, optimizer, groups", [
    (1, 2, ADAMW, False), (2, 3, ADAMW, False), (1, 3, SGD, False), (2, 2, SGD, False),
    (1, 4, ADAMW, True), (2, 2, ADAMW, True)])
def test_sharded_optimizer_trains_as_one_process(stage, world_size, optimizer, groups):
    """Tied embeddings (one update, the weight listed once), a frozen position embedding (never
    stepped, not even by weight decay), AdamW with weight decay 0.1, SGD with momentum, groups."""
    per_rank = run_world(_sharded_optimizer_rank, world_size, (stage, 3, optimizer, groups, 1, False))
    expected, _ = single_process(3, world_size, optimizer, groups)
    for weights, _ in per_rank:
        assert_same_weights(weights, expected)
    model = tiny_gpt()
    assert torch.equal(per_rank[0][0]["position_embedding.weight"], model.position_embedding.weight)
    n_params = sum(p.numel() for p in model.parameters())  # the tied matrix once
    assert per_rank[0][1] == sum(-(-p.numel() // world_size) for p in model.parameters()) < n_params


@pytest.mark.parametrize("stage, reduce_once", [(1, False), (2, False), (2, True)])
def test_sharded_optimizer_accumulates_micro_batches(stage, reduce_once):
    per_rank = run_world(_sharded_optimizer_rank, 2, (stage, 2, ADAMW, False, 3, reduce_once))
    expected, _ = single_process(2, 2, ADAMW, micro_batches=3)
    for weights, _ in per_rank:
        assert_same_weights(weights, expected)


def test_stage_1_counts_a_gradient_missing_on_some_ranks_as_zero():
    """A parameter no rank used is not stepped (AdamW would decay it); one used on rank 0 only is
    averaged with zeros from the others, as DDP does."""
    per_rank = run_world(_sharded_optimizer_rank, 3, (1, 1, ADAMW, False, 1, False, (0, 1, 2)))
    assert torch.equal(per_rank[0][0]["final_norm.weight"], tiny_gpt().final_norm.weight)
    per_rank = run_world(_sharded_optimizer_rank, 3, (1, 1, ADAMW, False, 1, False, (1, 2)))
    assert not torch.equal(per_rank[0][0]["final_norm.weight"], tiny_gpt().final_norm.weight)
    assert all(torch.equal(w["final_norm.weight"], per_rank[0][0]["final_norm.weight"]) for w, _ in per_rank)


def _bad_stage(rank, world_size):
    try:
        ShardedOptimizer(tiny_gpt().parameters(), torch.optim.AdamW, stage=3)
    except ValueError as error:
        return str(error)


def test_unsupported_cases_say_so_in_one_line():
    message = run_world(_bad_stage, 1)[0]
    assert "ZeRO3" in message and "\n" not in message


# --- ZeRO-3 ---

def _zero3_rank(rank, world_size, steps, groups=False, micro_batches=1, reduce_once=False, mixed=None,
                saved=None, first_step=0, save=False):
    model = tiny_gpt()
    zero = ZeRO3(model, units=list(model.blocks), mixed_precision=mixed)
    params = parameter_groups(zero.named_pieces()) if groups else zero.parameters()
    optimizer = ADAMW[0](params, **ADAMW[1])
    if saved is not None:
        zero.load_full_state_dict(saved, optimizer)
    peaks, losses = {"forward": 0, "backward": 0}, []
    for step, tokens in enumerate(token_batches(steps, micro_batches)):
        if step < first_step:
            continue
        for micro in range(micro_batches):
            last = micro == micro_batches - 1
            with zero.no_sync() if reduce_once and not last else _nothing():
                zero.peak_gathered_units = 0
                loss = gpt_loss(zero, rows(tokens, rank, world_size, micro, micro_batches))
                peaks["forward"] = max(peaks["forward"], zero.peak_gathered_units)
                zero.peak_gathered_units = 0
                (loss / micro_batches).backward()
                peaks["backward"] = max(peaks["backward"], zero.peak_gathered_units)
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    left_after_step = zero.gathered_units()
    with torch.no_grad():
        evaluation = gpt_loss(zero, rows(token_batches(1)[0], rank, world_size)).item()
    state = zero.full_state_dict(optimizer if save else None)
    return {"weights": state["model"], "losses": losses, "peaks": peaks, "left": (left_after_step, zero.gathered_units()),
            "evaluation": evaluation, "saved": state if save else None,
            "piece elements": sum(p.to_local().numel() for p in zero.parameters())}


@pytest.mark.parametrize("world_size, groups", [(2, False), (3, True), (4, False)])
def test_zero3_trains_as_one_process(world_size, groups):
    """Blocks as units and the root for the rest (tied embeddings, frozen position embedding, a
    buffer), forward called with keyword arguments, AdamW with weight decay, parameter groups built
    from the pieces' names; at most two gathered units (the root and a block) in forward and in
    backward, none after the step or after a no_grad evaluation."""
    per_rank = run_world(_zero3_rank, world_size, (3, groups))
    expected, _ = single_process(3, world_size, ADAMW, groups)
    for outcome in per_rank:
        assert_same_weights(outcome["weights"], expected)
        assert outcome["peaks"] == {"forward": 2, "backward": 2} and outcome["left"] == (0, 0)
    model = tiny_gpt()
    assert per_rank[0]["piece elements"] == sum(-(-p.numel() // world_size) for p in model.parameters())
    model.load_state_dict(expected)
    with torch.no_grad():
        assert per_rank[0]["evaluation"] == pytest.approx(gpt_loss(model, rows(token_batches(1)[0], 0, world_size)).item(),
                                                         rel=1e-5)


@pytest.mark.parametrize("reduce_once", [False, True])
def test_zero3_accumulates_micro_batches_both_ways(reduce_once):
    per_rank = run_world(_zero3_rank, 2, (2, False, 3, reduce_once))
    expected, _ = single_process(2, 2, ADAMW, micro_batches=3)
    for outcome in per_rank:
        assert_same_weights(outcome["weights"], expected)


def test_zero3_checkpoint_saved_on_2_ranks_resumes_on_3_and_4():
    saved = run_world(_zero3_rank, 2, (2, False, 1, False, None, None, 0, True))[0]["saved"]
    expected, _ = single_process(4)
    for world_size in (3, 4):
        per_rank = run_world(_zero3_rank, world_size, (4, False, 1, False, None, saved, 2))
        assert_same_weights(per_rank[0]["weights"], expected)
