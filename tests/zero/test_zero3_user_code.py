"""ZeRO3 as everyday training code sees it (issue 37): the wrapped model's parameters by name with
their full shapes, `torch.nn.utils.clip_grad_norm_`, weight decay chosen by name or by shape,
gradient norms logged per layer, an EMA of the weights, modules left replicated, and normalisation
layers kept in fp32 under bf16; all on real gloo worlds against one process training the same GPT
(tests/zero/test_zero_sharded.py's), and without giving up what ZeRO-3 is for (a rank holds pieces)."""
import pytest
import torch
from torch import nn

from dtp.common.traffic import CommunicationLog
from dtp.common.world import run_world
from dtp.zero.measure import held_bytes
from dtp.zero.sharded import NORMALIZATION_LAYERS, MixedPrecision, PieceTensor, ZeRO3
from test_zero_sharded import ADAMW, assert_same_weights, gpt_loss, rows, tiny_gpt, token_batches

# The clipping threshold: below the gradient norms of this GPT (about 3.5), so every step clips.
MAX_NORM = 0.5
EMA_WEIGHT = 0.25
# Averaged gradients are summed in another order than one process's: a few float32 ulps (measured
# below 2e-7 relative on the norms).
NORM_TOLERANCE = 1e-6


def by_name_groups(named):
    """nanoGPT's rule, by shape: matrices decay, vectors (biases, LayerNorm weights) do not; and
    the token embedding at a lower learning rate, by name."""
    named = list(named)
    decay = [p for name, p in named if p.dim() >= 2 and name != "token_embedding.weight"]
    no_decay = [p for name, p in named if p.dim() < 2]
    embedding = [p for name, p in named if name == "token_embedding.weight"]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}, {"params": embedding, "lr": ADAMW[1]["lr"] / 2}]


def single_process_run(steps, clip, groups=False):
    """One process: weights, the norm clip_grad_norm_ returned and each parameter's gradient norm
    per step, and an EMA of the weights."""
    model = tiny_gpt()
    params = by_name_groups(model.named_parameters()) if groups else model.parameters()
    optimizer = ADAMW[0](params, **ADAMW[1])
    ema = {name: p.detach().clone() for name, p in model.named_parameters()}
    norms, logged = [], []
    for tokens in token_batches(steps):
        gpt_loss(model, tokens).backward()
        logged.append({name: float(p.grad.norm()) for name, p in model.named_parameters() if p.grad is not None})
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        for name, p in model.named_parameters():
            ema[name].lerp_(p.detach(), EMA_WEIGHT)
    return {name: p.detach().clone() for name, p in model.state_dict().items()}, norms, logged, ema


def _zero3_user_rank(rank, world_size, steps, clip, groups=False, replicated=False):
    model = tiny_gpt()
    keep_whole = [model.final_norm, *(block.norm1 for block in model.blocks)] if replicated else []
    zero = ZeRO3(model, units=list(model.blocks), replicated=keep_whole)
    visible = [(name, tuple(p.shape), type(p).__name__) for name, p in zero.module.named_parameters()]
    params = by_name_groups(zero.module.named_parameters()) if groups else zero.parameters()
    optimizer = ADAMW[0](params, **ADAMW[1])
    ema = {name: p.detach().clone() for name, p in zero.module.named_parameters()}
    norms, local_only, logged, held = [], [], [], None
    for tokens in token_batches(steps):
        gpt_loss(zero, rows(tokens, rank, world_size)).backward()
        logged.append({name: float(p.grad.norm()) for name, p in zero.module.named_parameters() if p.grad is not None})
        # The slip the wrapper must not make: each rank's own pieces only, no all-reduce.
        local_only.append(float(torch.linalg.vector_norm(torch.stack(
            [p.grad.to_local().norm() if isinstance(p.grad, PieceTensor) else p.grad.norm()
             for p in zero.parameters() if p.grad is not None]))))
        held = held_bytes(zero.parameters(), zero=zero, optimizer=optimizer)
        if clip == "torch":
            norms.append(float(torch.nn.utils.clip_grad_norm_(zero.parameters(), MAX_NORM)))
        elif clip == "torch by name":
            norms.append(float(torch.nn.utils.clip_grad_norm_([p for _, p in zero.module.named_parameters()], MAX_NORM)))
        elif clip == "wrapper":
            norms.append(float(zero.clip_grad_norm_(MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        for name, p in zero.module.named_parameters():
            ema[name].lerp_(p.detach(), EMA_WEIGHT)
    replicated_grads = None
    if replicated:
        gpt_loss(zero, rows(token_batches(1)[0], rank, world_size)).backward()
        replicated_grads = {name: p.grad.clone() for name, p in zero.module.named_parameters()
                            if not isinstance(p, PieceTensor)}
    return {"weights": zero.full_state_dict()["model"], "visible": visible, "norms": norms, "local only": local_only,
            "logged": logged, "held": held, "replicated grads": replicated_grads,
            "ema": {name: (e.full_tensor() if isinstance(e, PieceTensor) else e) for name, e in ema.items()}}


@pytest.mark.parametrize("world_size, clip", [(2, "torch"), (4, "torch by name"), (4, "wrapper")])
def test_clip_grad_norm_on_zero3_matches_the_unsharded_model(world_size, clip):
    """torch's clip_grad_norm_ over the wrapper's parameters or over the model's named_parameters(),
    and ZeRO3.clip_grad_norm_: the same total norm as one process, on every rank, and the same
    clipped updates (AdamW, 3 steps); a norm of each rank's own pieces would be far from it."""
    per_rank = run_world(_zero3_user_rank, world_size, (3, clip))
    expected, norms, _, _ = single_process_run(3, clip=True)
    assert min(norms) > MAX_NORM  # every step clipped
    for outcome in per_rank:
        assert outcome["norms"] == pytest.approx(norms, rel=NORM_TOLERANCE)
        assert_same_weights(outcome["weights"], expected)
        assert all(local < 0.9 * total for local, total in zip(outcome["local only"], norms))
    unclipped, _, _, _ = single_process_run(3, clip=False)
    assert (unclipped["blocks.0.mlp.up.weight"] - expected["blocks.0.mlp.up.weight"]).abs().max() > 1e-3


def test_parameters_keep_names_and_shapes_while_a_rank_holds_pieces():
    """named_parameters() lists what the unwrapped model lists (tied embedding once, the frozen one
    too), with full shapes; a rank holds 4 bytes per element of its pieces for the weights, as many
    for the gradients, 8 for AdamW's moments, and nothing else (no full weight kept alive)."""
    n = 3
    outcome = run_world(_zero3_user_rank, n, (1, None))[0]
    model = tiny_gpt()
    assert outcome["visible"] == [(name, tuple(p.shape), "PieceTensor") for name, p in model.named_parameters()]
    pieces = sum(-(-p.numel() // n) for p in model.parameters())
    trained = sum(-(-p.numel() // n) for p in model.parameters() if p.requires_grad)
    held = outcome["held"]
    assert {k: held[k] for k in ("weights", "gradients", "other")} == {"weights": 4 * pieces, "gradients": 4 * trained,
                                                                      "other": 0}, held["other paths"]


def test_weight_decay_by_shape_and_name_gradient_logging_and_ema():
    """Groups chosen by p.dim() and by name train as on one process; the gradient norm logged per
    parameter is the averaged gradient's (global), and an EMA of the weights kept as PieceTensors
    (lerp_ on the pieces) equals one process's EMA."""
    per_rank = run_world(_zero3_user_rank, 2, (3, None, True))
    expected, _, logged, ema = single_process_run(3, clip=False, groups=True)
    for outcome in per_rank:
        assert_same_weights(outcome["weights"], expected)
        assert outcome["logged"][0].keys() == logged[0].keys()
        for got, want in zip(outcome["logged"], logged):
            assert got == pytest.approx(want, rel=NORM_TOLERANCE)
        assert_same_weights(outcome["ema"], ema)


def test_replicated_modules_keep_whole_weights_and_averaged_gradients():
    """The final norm and each block's first norm left whole on every rank: plain parameters,
    gradients averaged (the same on every rank), training as one process, clipping included."""
    per_rank = run_world(_zero3_user_rank, 3, (3, "wrapper", False, True))
    expected, norms, _, _ = single_process_run(3, clip=True)
    whole = {"final_norm.weight", "final_norm.bias", "blocks.0.norm1.weight", "blocks.0.norm1.bias",
             "blocks.1.norm1.weight", "blocks.1.norm1.bias"}
    for outcome in per_rank:
        assert_same_weights(outcome["weights"], expected)
        assert outcome["norms"] == pytest.approx(norms, rel=NORM_TOLERANCE)
        assert {name for name, _, kind in outcome["visible"] if kind == "Parameter"} == whole
        assert outcome["replicated grads"].keys() == whole
        for name in whole:
            assert torch.equal(outcome["replicated grads"][name], per_rank[0]["replicated grads"][name])


def _mixed_dtypes_rank(rank, world_size, keep_norms):
    model = tiny_gpt()
    policy = MixedPrecision(torch.bfloat16, torch.float32, NORMALIZATION_LAYERS if keep_norms else ())
    zero = ZeRO3(model, units=list(model.blocks), mixed_precision=policy)
    seen = {}

    def record(name):
        def hook(module, args, output):
            seen[name] = (module.weight.dtype, args[0].dtype, output.dtype)
        return hook
    for name, module in model.named_modules():
        if isinstance(module, (nn.LayerNorm, nn.Linear)):
            module.register_forward_hook(record(name))
    tokens = token_batches(1)[0]
    with CommunicationLog() as log:
        gpt_loss(zero, rows(tokens, rank, world_size)).backward()
    grads = {p.grad.dtype for p in zero.parameters() if p.grad is not None}
    return seen, grads, {op: len(log.of(op)) for op in ("all_gather", "reduce_scatter")}


def test_normalisation_layers_stay_fp32_under_bf16():
    """With full_precision=NORMALIZATION_LAYERS: every LayerNorm runs on fp32 weights and inputs and
    hands bf16 on; Linear layers compute in bf16; the fp32 gradients of the pieces; one more
    all-gather and reduce-scatter per unit (each unit holds norms). Without it, everything is bf16."""
    units = 1 + tiny_gpt().config.n_layers
    seen, grads, counts = run_world(_mixed_dtypes_rank, 2, (True,))[0]
    norms = {name: dtypes for name, dtypes in seen.items() if "norm" in name}
    linears = {name: dtypes for name, dtypes in seen.items() if "norm" not in name}
    assert len(norms) == 2 * units - 1 and len(linears) == 4 * (units - 1) + 1  # and the output layer
    assert set(norms.values()) == {(torch.float32, torch.float32, torch.bfloat16)}
    assert set(linears.values()) == {(torch.bfloat16, torch.bfloat16, torch.bfloat16)}
    assert grads == {torch.float32}
    assert counts == {"all_gather": 2 * 2 * units, "reduce_scatter": 2 * units}
    seen, _, counts = run_world(_mixed_dtypes_rank, 2, (False,))[0]
    assert {dtypes for dtypes in seen.values()} == {(torch.bfloat16, torch.bfloat16, torch.bfloat16)}
    assert counts == {"all_gather": 2 * units, "reduce_scatter": units}


def _misuse_rank(rank, world_size):
    messages = []
    model = tiny_gpt()
    for attempt in (lambda: ZeRO3(tiny_gpt(), replicated=[model.final_norm]),
                    lambda: ZeRO3(model, replicated=[model]),
                    lambda: ZeRO3(model, units=[model.blocks[0].mlp], replicated=[model.blocks[0]]),
                    lambda: ZeRO3(model, replicated=[model.token_embedding])):  # tied with the output layer
        try:
            attempt()
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    model = tiny_gpt()
    zero = ZeRO3(model, units=list(model.blocks))
    for attempt in (lambda: zero.module.token_embedding.weight[0], lambda: zero.module.final_norm.weight.sum(dim=0)):
        try:
            attempt()
            messages.append(None)
        except RuntimeError as error:
            messages.append(str(error))
    return messages


def test_misuse_gets_one_line_errors():
    messages = run_world(_misuse_rank, 2)[0]
    assert all(m and "\n" not in m for m in messages), messages
    assert "not a submodule" in messages[0] and "DDP" in messages[1] and "lies in the replicated" in messages[2]
    assert "inside a replicated module and outside it" in messages[3]
    assert "full_tensor" in messages[4] and "some dimensions" in messages[5]


ORDERS = (1, 2, 3, float("inf"), float("-inf"), 0)


def reduction_input():
    full = torch.randn(7, 5, generator=torch.Generator().manual_seed(3)) - 0.3  # 35 elements: padded on 2, 3, 4 ranks
    full[0, 0] = 0.0  # one zero for the 0-norm to leave out
    return full


def _reductions_rank(rank, world_size):
    from dtp.zero.pieces import piece_of
    full = reduction_input()
    sharded = PieceTensor(piece_of(full, rank, world_size), full.shape)
    got = {f"norm {order}": float(torch.linalg.vector_norm(sharded, order)) for order in ORDERS}
    got.update(sum=float(sharded.sum()), mean=float(sharded.mean()), max=float(sharded.max()), min=float(sharded.min()),
               norm=float(sharded.norm()), doubled=sharded.mul(2).add_(full).full_tensor())
    return got


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_piece_tensor_reductions_are_those_of_the_whole_tensor(world_size):
    """Norms of every order, sum, mean, max and min of a PieceTensor equal torch's on the whole
    tensor (the zero padding of the last pieces left out: min would be 0, the -inf norm 0, the
    0-norm would count it); elementwise arithmetic with a plain full tensor stays elementwise."""
    full = reduction_input()
    expected = {f"norm {order}": float(torch.linalg.vector_norm(full, order)) for order in ORDERS}
    expected.update(sum=float(full.sum()), mean=float(full.mean()), max=float(full.max()), min=float(full.min()),
                    norm=float(full.norm()))
    for got in run_world(_reductions_rank, world_size):
        assert torch.equal(got.pop("doubled"), 3 * full)
        assert got == pytest.approx(expected, rel=1e-6)
