"""The chapter's ZeRO (dtp.zero.sharded) beside PyTorch's own, on a CPU device mesh: FSDP2's
`fully_shard` against `ZeRO3`, and `ZeroRedundancyOptimizer` (under DDP) against
`ShardedOptimizer(stage=1)`. The same small GPT (tied embeddings, a frozen position embedding),
AdamW with weight decay, the same batches; each run reports the loss of every step averaged over
the ranks (`compare_with_torch`), and what everyday training code sees of each wrapper
(`compare_interfaces`, in dtp.zero.compare_interfaces). The book runs both at build time;
tests/zero/test_zero_compare.py asserts them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dtp.common.gpt import GPT, GPTConfig
from dtp.common.world import run_world
from dtp.zero.sharded import NORMALIZATION_LAYERS, MixedPrecision, ShardedOptimizer, ZeRO3

CONFIG = GPTConfig(vocab_size=37, n_positions=16, n_layers=3, hidden=16, n_heads=2, dropout=0.0)
ROWS, SEQ = 12, 12  # rows of a global batch: 12 splits over 2, 3 and 4 ranks
# eps well above float32 rounding: the attention's key bias has a zero gradient (softmax ignores
# a shift of the scores), so what it gets is rounding noise, which a tiny eps would blow up to lr.
ADAMW = {"lr": 3e-3, "weight_decay": 0.1, "eps": 1e-4}
RUNS = ("ZeRO-3 (dtp.zero.sharded)", "FSDP2 fully_shard", "ZeRO-1 (dtp.zero.sharded)", "ZeroRedundancyOptimizer")


def comparison_model() -> GPT:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.position_embedding.weight.requires_grad_(False)  # a frozen parameter
    return model


def comparison_batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, CONFIG.vocab_size, (ROWS, SEQ + 1), generator=generator) for _ in range(steps)]


def comparison_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.float().reshape(-1, CONFIG.vocab_size), tokens[:, 1:].reshape(-1))


def zero3(model: GPT, mixed: bool = False, norms_fp32: bool = False, replicated=()) -> ZeRO3:
    """ZeRO3 with each block a unit; bf16 compute and fp32 reduction if `mixed`, the LayerNorms
    kept in fp32 if `norms_fp32`."""
    policy = MixedPrecision(torch.bfloat16, torch.float32, NORMALIZATION_LAYERS if norms_fp32 else ()) if mixed else None
    return ZeRO3(model, units=list(model.blocks), mixed_precision=policy, replicated=replicated)


def fsdp2(model: GPT, world_size: int, mixed: bool = False, norms_fp32: bool = False, ignored=None) -> GPT:
    """FSDP2 applied the same way; with `norms_fp32`, each LayerNorm gets its own `fully_shard`
    with an fp32 policy whose outputs are cast to bf16 (FSDP2's per-module mixed precision)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed \
        else MixedPrecisionPolicy()
    if mixed and norms_fp32:
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch.bfloat16)
        left_alone = {id(p) for p in ignored or ()}
        for module in model.modules():
            if isinstance(module, NORMALIZATION_LAYERS) and id(module.weight) not in left_alone:
                fully_shard(module, mesh=mesh, mp_policy=fp32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)


def _wrapped(run: str, model: GPT, world_size: int, mixed: bool, norms_fp32: bool = False):
    """The model to call and the optimizer to step for one of RUNS."""
    if run == RUNS[0]:
        module = zero3(model, mixed, norms_fp32)
        return module, torch.optim.AdamW(module.parameters(), **ADAMW)
    if run == RUNS[1]:
        module = fsdp2(model, world_size, mixed, norms_fp32)
        return module, torch.optim.AdamW(module.parameters(), **ADAMW)
    if run == RUNS[2]:
        return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=1, **ADAMW)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(model)
    return ddp, ZeroRedundancyOptimizer([p for p in model.parameters() if p.requires_grad],
                                        optimizer_class=torch.optim.AdamW, **ADAMW)


def _run_rank(rank: int, world_size: int, run: str, steps: int, mixed: bool, norms_fp32: bool) -> list[float]:
    model, optimizer = _wrapped(run, comparison_model(), world_size, mixed, norms_fp32)
    share = ROWS // world_size
    losses = []
    for tokens in comparison_batches(steps):
        loss = comparison_loss(model, tokens[rank * share:(rank + 1) * share])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        averaged = loss.detach().clone()
        dist.all_reduce(averaged)
        losses.append(averaged.item() / world_size)
    return losses


def single_process_losses(steps: int) -> list[float]:
    model = comparison_model()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for tokens in comparison_batches(steps):
        loss = comparison_loss(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def compare_with_torch(world_size: int = 2, steps: int = 5, mixed: bool = False,
                       norms_fp32: bool = False) -> dict[str, list[float]]:
    """Each run's losses per step (averaged over the ranks), and one process's for reference.
    With `mixed`, the ZeRO-3 runs compute in bf16 and reduce in fp32 (ZeRO-1 and
    ZeroRedundancyOptimizer, which has no mixed precision of its own, stay fp32); with
    `norms_fp32` too, their LayerNorms keep fp32 (only the ZeRO-3 runs are made then)."""
    losses = {"one process (AdamW)": single_process_losses(steps)}
    for run in RUNS[:2] if norms_fp32 else RUNS:
        losses[run] = run_world(_run_rank, world_size, (run, steps, mixed and run in RUNS[:2], norms_fp32),
                                timeout_s=120)[0]
    return losses
