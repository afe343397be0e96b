"""The chapter's ZeRO (dtp.zero.sharded) beside PyTorch's own, on a CPU device mesh: FSDP2's
`fully_shard` against `ZeRO3`, and `ZeroRedundancyOptimizer` (under DDP) against
`ShardedOptimizer(stage=1)`. The same small GPT (tied embeddings, a frozen position embedding),
AdamW with weight decay, the same batches; each run reports the loss of every step averaged over
the ranks. The book runs `compare_with_torch` at build time; tests/zero/test_zero_compare.py asserts it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dtp.common.gpt import GPT, GPTConfig
from dtp.common.world import run_world
from dtp.zero.sharded import MixedPrecision, ShardedOptimizer, ZeRO3

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


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.float().reshape(-1, CONFIG.vocab_size), tokens[:, 1:].reshape(-1))


def _wrapped(run: str, model: GPT, world_size: int, mixed: bool):
    """The model to call and the optimizer to step for one of RUNS."""
    if run == RUNS[0]:
        policy = MixedPrecision(torch.bfloat16, torch.float32) if mixed else None
        module = ZeRO3(model, units=list(model.blocks), mixed_precision=policy)
        return module, torch.optim.AdamW(module.parameters(), **ADAMW)
    if run == RUNS[1]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh("cpu", (world_size,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed \
            else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), **ADAMW)
    if run == RUNS[2]:
        return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=1, **ADAMW)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(model)
    return ddp, ZeroRedundancyOptimizer([p for p in model.parameters() if p.requires_grad],
                                        optimizer_class=torch.optim.AdamW, **ADAMW)


def _run_rank(rank: int, world_size: int, run: str, steps: int, mixed: bool) -> list[float]:
    model, optimizer = _wrapped(run, comparison_model(), world_size, mixed)
    share = ROWS // world_size
    losses = []
    for tokens in comparison_batches(steps):
        loss = _loss(model, tokens[rank * share:(rank + 1) * share])
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
        loss = _loss(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def compare_with_torch(world_size: int = 2, steps: int = 5, mixed: bool = False) -> dict[str, list[float]]:
    """Each run's losses per step (averaged over the ranks), and one process's for reference.
    With `mixed`, the ZeRO-3 runs compute in bf16 and reduce in fp32 (ZeRO-1 and
    ZeroRedundancyOptimizer, which has no mixed precision of its own, stay fp32)."""
    losses = {"one process (AdamW)": single_process_losses(steps)}
    for run in RUNS:
        losses[run] = run_world(_run_rank, world_size, (run, steps, mixed and run in RUNS[:2]), timeout_s=120)[0]
    return losses
