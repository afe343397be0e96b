"""dtp.zero.sharded in mixed precision, its traffic and memory against dtp.zero.formulas's formulas, its
checkpoints and its errors. Models, batches and the single-process references come from
tests/zero/test_zero_sharded.py."""

import pytest
import torch
from torch import nn

from dtp.zero import formulas as zero
from dtp.zero.sharded import MixedPrecision, ShardedOptimizer, ZeRO3
from dtp.common.traffic import CommunicationLog
from dtp.common.world import run_world
from dtp.zero.measure import held_bytes
from test_zero_sharded import (ADAMW, _nothing, _zero3_rank, assert_same_weights, gpt_loss,
                               rows, single_process, tiny_gpt, token_batches)

# Mixed precision is compared by how far the weights' *update* is from fp32 training's, per tensor
# (|w - w_fp32| / |w_fp32 - w_0|): the fp32 masters hold the weights exactly, only the update sees
# 16-bit gradients. bf16 keeps 8 significant bits (a rounding of up to 2^-9 ≈ 0.2% per operation,
# compounded through about thirty operations of forward and backward): a few percent of the update,
# measured 3 to 7% over 3 steps; fp16's 11 bits give eight times less, measured under 1%. Training
# the 16-bit weights themselves (no fp32 masters) loses most of each update and exceeds the bound.
UPDATE_TOLERANCE = {torch.bfloat16: 0.10, torch.float16: 0.02}


def relative_update_error(weights, reference, initial):
    return max(float((weights[k].float() - reference[k]).norm() / (reference[k] - initial[k]).norm())
               for k in reference if (reference[k] - initial[k]).norm() > 0)


def sixteen_bit_weights_trained(steps, dtype):
    """The wrong recipe: AdamW stepping 16-bit weights, no fp32 master copy."""
    model = tiny_gpt().to(dtype)
    optimizer = ADAMW[0](model.parameters(), **ADAMW[1])
    for tokens in token_batches(steps):
        gpt_loss(model, tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduce_dtype", [None, torch.float32])
def test_mixed_precision_zero3_is_within_the_update_tolerance(dtype, reduce_dtype):
    expected, _ = single_process(3)
    initial = tiny_gpt().state_dict()
    outcome = run_world(_zero3_rank, 2, (3, False, 1, False, MixedPrecision(dtype, reduce_dtype)))[0]
    assert relative_update_error(outcome["weights"], expected, initial) < UPDATE_TOLERANCE[dtype]
    assert relative_update_error(sixteen_bit_weights_trained(3, dtype), expected, initial) > UPDATE_TOLERANCE[dtype]


def _mixed_sharded_rank(rank, world_size, stage, dtype, reduce_dtype):
    model = tiny_gpt()
    zero_optimizer = ShardedOptimizer(model.parameters(), ADAMW[0], stage=stage,
                                      mixed_precision=MixedPrecision(dtype, reduce_dtype), **ADAMW[1])
    for tokens in token_batches(3):
        gpt_loss(model, rows(tokens, rank, world_size)).backward()
        held = held_bytes(model.parameters(), model=model, zero=zero_optimizer)
        zero_optimizer.step()
        zero_optimizer.zero_grad()
    dtypes = {p.dtype for p in model.parameters()} | {p.dtype for p in zero_optimizer.pieces}
    weights = zero_optimizer.full_state_dict()["weights"]
    return {n: w for n, w in zip([n for n, _ in model.named_parameters()], weights)}, dtypes, held


@pytest.mark.parametrize("stage", [1, 2])
def test_mixed_precision_sharded_optimizer_keeps_fp32_masters(stage):
    n = 3
    weights, dtypes, held = run_world(_mixed_sharded_rank, n, (stage, torch.bfloat16, torch.float32))[0]
    assert dtypes == {torch.bfloat16, torch.float32}  # 16-bit model, fp32 pieces
    # After backward: the 16-bit model (2Ψ) and the fp32 masters (4C); gradients 16-bit and whole
    # (stage 1) or fp32 pieces (stage 2, reduced in fp32); AdamW's two fp32 moments (8C).
    psi = sum(p.numel() for p in tiny_gpt().parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in tiny_gpt().parameters() if not p.requires_grad)
    pieces = sum(-(-p.numel() // n) for p in tiny_gpt().parameters())
    trained_pieces = sum(-(-p.numel() // n) for p in tiny_gpt().parameters() if p.requires_grad)
    assert {k: held[k] for k in ("weights", "gradients", "optimizer states")} == {
        "weights": 2 * (psi + frozen) + 4 * pieces, "gradients": 2 * psi if stage == 1 else 4 * trained_pieces,
        "optimizer states": 8 * trained_pieces}
    expected, _ = single_process(3)
    initial = tiny_gpt().state_dict()
    expected = {k: expected[k] for k in weights}
    assert relative_update_error(weights, expected, initial) < UPDATE_TOLERANCE[torch.bfloat16]


# --- traffic and memory against dtp.zero.formulas's formulas ---

def _recorded_step(rank, world_size, micro_batches, reduce_once, forward, syncing, step):
    """One optimizer step over this rank's rows of `micro_batches` micro-batches, recorded (with
    `syncing.no_sync()` on all but the last when `reduce_once`), and the bytes its all-gathers and
    reduce-scatters sent around a ring."""
    tokens = token_batches(1, micro_batches)[0]
    with CommunicationLog() as log:
        for micro in range(micro_batches):
            with syncing.no_sync() if reduce_once and micro < micro_batches - 1 else _nothing():
                (gpt_loss(forward, rows(tokens, rank, world_size, micro, micro_batches)) / micro_batches).backward()
        step()
    sent = {op: sum(zero.ring_bytes_sent(op, e["bytes"], world_size) for e in log.of(op))
            for op in ("all_gather", "reduce_scatter")}
    return log, sent


def _zero3_step_traffic(rank, world_size, micro_batches, reduce_once, dtype, reduce_dtype):
    model = tiny_gpt()
    zero3 = ZeRO3(model, units=list(model.blocks), mixed_precision=MixedPrecision(dtype, reduce_dtype))
    optimizer = ADAMW[0](zero3.parameters(), **ADAMW[1])
    log, sent = _recorded_step(rank, world_size, micro_batches, reduce_once, zero3, zero3, optimizer.step)
    return sent, {op: len(log.of(op)) for op in sent}, {e["op"] for e in log.events}


@pytest.mark.parametrize("n, micro_batches, reduce_once", [(3, 3, False), (3, 3, True), (2, 2, True), (4, 2, False)])
def test_zero3_sends_what_accumulation_bytes_sent_says(n, micro_batches, reduce_once):
    """bf16 weights gathered, fp32 gradients reduced; Ψ counted with each parameter's padding."""
    sent, counts, events = run_world(_zero3_step_traffic, n, (micro_batches, reduce_once, torch.bfloat16, torch.float32))[0]
    model = tiny_gpt()
    padded_all = sum(zero.padded_numel(p.numel(), n) for p in model.parameters())
    padded_trained = sum(zero.padded_numel(p.numel(), n) for p in model.parameters() if p.requires_grad)
    weights = zero.accumulation_bytes_sent_per_gpu(padded_all, n, micro_batches, 3, not reduce_once, 2, 4)["weights"]
    gradients = zero.accumulation_bytes_sent_per_gpu(padded_trained, n, micro_batches, 3, not reduce_once, 2, 4)["gradients"]
    assert sent == {"all_gather": pytest.approx(weights), "reduce_scatter": pytest.approx(gradients)}
    units = 1 + len(model.blocks)
    assert counts == {"all_gather": 2 * micro_batches * units, "reduce_scatter": (1 if reduce_once else micro_batches) * units}
    assert events <= {"all_gather", "reduce_scatter", "wait"}  # nothing else is sent


def test_the_formulas_at_their_limits():
    psi, n = 1e9, 8
    assert sum(zero.mixed_precision_bytes_per_gpu(psi, n, 0).values()) == zero.model_state_bytes_per_gpu(psi, n, 0)
    for stage in zero.STAGES:
        assert sum(zero.mixed_precision_bytes_per_gpu(psi, n, stage).values()) == \
            pytest.approx(zero.model_state_bytes_per_gpu(psi, n, stage))
    fp32_gradients = sum(zero.mixed_precision_bytes_per_gpu(psi, 1, 0, gradient_bytes=4).values())
    assert fp32_gradients == 18 * psi
    zero1 = sum(zero.mixed_precision_bytes_per_gpu(psi, 10**9, 1, gradient_bytes=4).values())
    assert fp32_gradients / zero1 == pytest.approx(3.0, rel=1e-6)  # not 4
    every = zero.accumulation_bytes_sent_per_gpu(psi, n, 4, 2, True)
    once = zero.accumulation_bytes_sent_per_gpu(psi, n, 4, 2, False)
    assert every["gradients"] == 4 * once["gradients"] and every["weights"] == once["weights"]
    assert zero.accumulation_gradient_bytes_held(psi, n, 3, True) == 2 * psi / n
    assert zero.accumulation_gradient_bytes_held(psi, n, 3, False) == 2 * psi + 2 * psi / n
    assert zero.zero3_transient_bytes(1e8) == 6e8


# --- checkpoints and errors ---

def _sharded_save(rank, world_size, steps):
    model = tiny_gpt()
    zero_optimizer = ShardedOptimizer(model.parameters(), ADAMW[0], stage=2, **ADAMW[1])
    for tokens in token_batches(steps):
        gpt_loss(model, rows(tokens, rank, world_size)).backward()
        zero_optimizer.step()
        zero_optimizer.zero_grad()
    return zero_optimizer.full_state_dict()


def _sharded_resume(rank, world_size, saved, first_step, steps):
    model = tiny_gpt()
    zero_optimizer = ShardedOptimizer(model.parameters(), ADAMW[0], stage=2, **ADAMW[1])
    zero_optimizer.load_full_state_dict(saved)
    for tokens in token_batches(steps)[first_step:]:
        gpt_loss(model, rows(tokens, rank, world_size)).backward()
        zero_optimizer.step()
        zero_optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def test_sharded_optimizer_checkpoint_saved_on_2_resumes_on_4():
    saved = run_world(_sharded_save, 2, (2,))[0]
    expected, _ = single_process(4)
    assert_same_weights(run_world(_sharded_resume, 4, (saved, 2, 4))[3], expected)


def _errors(rank, world_size):
    messages = []
    model = tiny_gpt()
    outside = nn.Linear(3, 3)
    for attempt in (lambda: ZeRO3(model, units=[outside]),
                    lambda: ZeRO3(model, units=[model.blocks[0], model.blocks[0]]),
                    lambda: ShardedOptimizer(model.parameters(), "adam"),
                    lambda: ShardedOptimizer([], torch.optim.AdamW)):
        try:
            attempt()
            messages.append(None)
        except (ValueError, TypeError) as error:
            messages.append(str(error))
    return messages


def test_unsupported_cases_raise_one_line_errors():
    messages = run_world(_errors, 2)[0]
    assert all(m and "\n" not in m for m in messages), messages
    assert "not a submodule" in messages[0] and "twice" in messages[1]


def _zero3_held(rank, world_size):
    model = tiny_gpt()
    zero3 = ZeRO3(model, units=list(model.blocks), mixed_precision=MixedPrecision(torch.bfloat16, torch.float32))
    optimizer = ADAMW[0](zero3.parameters(), **ADAMW[1])
    for tokens in token_batches(2):
        gpt_loss(zero3, rows(tokens, rank, world_size)).backward()
        held = held_bytes(zero3.parameters(), zero=zero3, optimizer=optimizer)
        optimizer.step()
        optimizer.zero_grad()
    return held


def test_mixed_precision_zero3_holds_only_fp32_pieces_between_units():
    """FSDP2's way: the 16-bit weights exist only gathered, so a rank holds 4 + 4 + 8 bytes per
    element of its pieces (fp32 masters, fp32-reduced gradients, AdamW's moments), no 2Ψ/Nd copy."""
    n = 3
    held = run_world(_zero3_held, n)[0]
    pieces = sum(-(-p.numel() // n) for p in tiny_gpt().parameters())
    trained = sum(-(-p.numel() // n) for p in tiny_gpt().parameters() if p.requires_grad)
    assert {k: held[k] for k in ("weights", "gradients", "optimizer states", "other")} == {
        "weights": 4 * pieces, "gradients": 4 * trained, "optimizer states": 8 * trained, "other": 0}, held["other paths"]
    assert sum(zero.mixed_precision_bytes_per_gpu(n * pieces, n, 3, param_bytes=0, gradient_bytes=4).values()) == \
        pytest.approx(16 * pieces)


# --- the page's corrections (book/zero.md asserts the same numbers as it is built) ---

def test_the_70b_examples_activations_fit_16_gib_only_with_full_recomputation():
    from dtp.memory import formulas as memory
    layers, hidden, heads, seq = 80, 8192, 64, 4096
    selective = memory.activation_bytes(layers, seq, 1, hidden, heads, recompute="selective")
    assert round(selective / 2**30) == 85
    full = memory.activation_bytes(layers, seq, 1, hidden, heads, recompute="full") \
        + memory.activation_bytes_per_layer(seq, 1, hidden, heads)
    assert full < 16 * 2**30 < selective


def test_zero3_has_a_floor_that_no_nd_lowers():
    layer = 12 * 8192**2
    floor = zero.zero3_transient_bytes(layer)
    assert floor == pytest.approx(4.8e9, rel=0.01)
    assert zero.model_state_bytes_per_gpu(70e9, 10**6, 3) < floor  # model states vanish, the floor stays


def test_fsdp2_overlaps_forward_all_gathers_by_default_on_the_pinned_torch():
    """The page quotes this docstring (issue 22: it said FSDP2 does not prefetch in forward unless told)."""
    from torch.distributed.fsdp import FSDPModule
    doc = " ".join(FSDPModule.set_modules_to_forward_prefetch.__doc__.split())
    assert "gives the same all-gather overlap behavior as the default overlap behavior" in doc


def _sharded_step_traffic(rank, world_size, stage, micro_batches, reduce_once):
    model = tiny_gpt()
    zero_optimizer = ShardedOptimizer(model.parameters(), ADAMW[0], stage=stage,
                                      mixed_precision=MixedPrecision(torch.bfloat16, torch.float32), **ADAMW[1])
    log, sent = _recorded_step(rank, world_size, micro_batches, reduce_once, model, zero_optimizer,
                               zero_optimizer.step)
    return sent, [e["bytes"] for e in log.of("all_reduce")]


@pytest.mark.parametrize("stage, reduce_once", [(1, False), (2, False), (2, True)])
def test_sharded_optimizer_sends_what_accumulation_bytes_sent_says(stage, reduce_once):
    """bf16 weights all-gathered, fp32 gradients reduce-scattered, 3 micro-batches on 3 ranks;
    stage 1 adds one all-reduce of a flag per parameter (which got a gradient somewhere)."""
    n, micro_batches = 3, 3
    sent, flags = run_world(_sharded_step_traffic, n, (stage, micro_batches, reduce_once))[0]
    trained = [p for p in tiny_gpt().parameters() if p.requires_grad]
    padded = sum(zero.padded_numel(p.numel(), n) for p in trained)
    formula = zero.accumulation_bytes_sent_per_gpu(padded, n, micro_batches, stage, not reduce_once, 2, 4)
    assert sent == {"all_gather": pytest.approx(formula["weights"]), "reduce_scatter": pytest.approx(formula["gradients"])}
    assert flags == ([4 * len(list(tiny_gpt().parameters()))] if stage == 1 else [])
