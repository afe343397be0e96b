"""A real DP × PP × TP training run of a tiny GPT on gloo, written once: the chapter's page runs
it on 8 processes (2 × 2 × 2) and tests/topology/test_topology_training.py checks it against
single-process training.

Each rank builds the same `dtp.common.gpt.GPT` from a seed and keeps its part:
- PP: stage `pp` holds blocks [pp·L/p, (pp+1)·L/p); the first stage also the embeddings, the
  last the final LayerNorm and the output layer. Stages exchange activations (forward) and
  their gradients (backward) with send/recv, in the order of dtp.pp.schedules's 1F1B schedule.
- TP (Megatron-style, as in the tensor-parallelism chapter): attention split by heads (QKV
  column-parallel, the output projection row-parallel), the MLP column- then row-parallel, with
  the operators f (identity forward, all-reduce backward) and g (all-reduce forward, identity
  backward) on the TP group. LayerNorms, embeddings and the output layer are replicated: every
  rank of a TP group sees the same inputs, so their gradients agree without communication.
- DP: each DP rank takes its rows of the batch; after the last micro-batch the gradients are
  averaged over the DP group with one all-reduce of a flat buffer.
Groups come from dtp.topology.mesh.parallel_groups with the course's order (TP innermost).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from dtp.common.gpt import GPT, GPTConfig
from dtp.common.traffic import CommunicationLog
from dtp.pp import schedules as pipeline
from dtp.topology.mesh import parallel_groups, rank_coordinates

TINY_GPT = GPTConfig(vocab_size=256, n_positions=16, n_layers=2, hidden=32, n_heads=4, tied_embeddings=False,
                     dropout=0.0)
ORDER = ("tp", "pp", "dp")


class _CopyToGroup(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient over the TP group backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """g: all-reduce over the TP group forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _piece(tensor: torch.Tensor, parts: int, index: int, dim: int) -> nn.Parameter:
    return nn.Parameter(tensor.detach().tensor_split(parts, dim)[index].clone())


class ParallelAttention(nn.Module):
    """A dtp.common.gpt CausalSelfAttention's heads `index`·a/t ... on one rank of a TP group of t."""

    def __init__(self, attention, group, t: int, index: int):
        super().__init__()
        self.group, self.heads = group, attention.n_heads // t
        hidden = attention.qkv.in_features
        # qkv's rows are [Q; K; V]; regroup them per rank so that one split gives Q, K and V of the same heads.
        weight = attention.qkv.weight.detach().view(3, t, hidden // t, hidden).transpose(0, 1) \
            .reshape(3 * hidden, hidden)
        bias = attention.qkv.bias.detach().view(3, t, hidden // t).transpose(0, 1).reshape(-1)
        self.qkv_weight, self.qkv_bias = _piece(weight, t, index, 0), _piece(bias, t, index, 0)
        self.proj_weight = _piece(attention.proj.weight, t, index, 1)  # row-parallel: input features split
        self.proj_bias = nn.Parameter(attention.proj.bias.detach().clone())

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = F.linear(_CopyToGroup.apply(x, self.group), self.qkv_weight, self.qkv_bias).chunk(3, dim=-1)
        q, k, v = (z.view(batch, seq, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        probabilities = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        context = (probabilities @ v).transpose(1, 2).reshape(batch, seq, -1)
        return _ReduceFromGroup.apply(F.linear(context, self.proj_weight), self.group) + self.proj_bias


class ParallelMLP(nn.Module):
    def __init__(self, mlp, group, t: int, index: int):
        super().__init__()
        self.group = group
        self.up_weight, self.up_bias = _piece(mlp.up.weight, t, index, 0), _piece(mlp.up.bias, t, index, 0)
        self.down_weight = _piece(mlp.down.weight, t, index, 1)
        self.down_bias = nn.Parameter(mlp.down.bias.detach().clone())

    def forward(self, x):
        hidden = F.gelu(F.linear(_CopyToGroup.apply(x, self.group), self.up_weight, self.up_bias))
        return _ReduceFromGroup.apply(F.linear(hidden, self.down_weight), self.group) + self.down_bias


class ParallelBlock(nn.Module):
    def __init__(self, block, group, t: int, index: int):
        super().__init__()
        self.norm1, self.norm2 = block.norm1, block.norm2  # replicated
        self.attention = ParallelAttention(block.attention, group, t, index)
        self.mlp = ParallelMLP(block.mlp, group, t, index)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Stage(nn.Module):
    """Pipeline stage `stage` of `p` of a GPT, its blocks tensor-parallel over `group`."""

    def __init__(self, model: GPT, stage: int, p: int, group, t: int, index: int):
        super().__init__()
        self.first, self.last = stage == 0, stage == p - 1
        per_stage = len(model.blocks) // p
        if self.first:
            self.token_embedding, self.position_embedding = model.token_embedding, model.position_embedding
        self.blocks = nn.ModuleList(ParallelBlock(block, group, t, index)
                                    for block in model.blocks[stage * per_stage:(stage + 1) * per_stage])
        if self.last:
            self.final_norm, self.lm_head = model.final_norm, model.lm_head

    def forward(self, x):
        if self.first:
            x = self.token_embedding(x) + self.position_embedding(torch.arange(x.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x)) if self.last else x


def _own_groups(sizes: dict[str, int], rank: int) -> dict:
    """Every rank creates every group of every dimension, in the same order (torch requires it),
    and keeps those it belongs to."""
    own = {}
    for name, groups in parallel_groups(sizes, ORDER).items():
        for ranks in groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                own[name] = (group, ranks)
    return own


def _one_f_one_b(stage_module, stage, p, tokens, targets, m, groups, boundary) -> float:
    """One step's forwards and backwards of this stage in 1F1B order; returns the summed loss
    (each micro-batch's mean cross-entropy / m) on the last stage, 0 elsewhere."""
    pp_group, pp_ranks = groups["pp"]
    previous, following = (pp_ranks[stage - 1] if stage else None), (pp_ranks[stage + 1] if stage < p - 1 else None)
    inputs, labels = tokens.tensor_split(m), targets.tensor_split(m)
    held, sending, loss = {}, [], 0.0
    for kind, k, _ in pipeline.one_f_one_b_schedule(p, m)[stage]:
        if kind == pipeline.FORWARD:
            if stage == 0:
                x = inputs[k]
            else:
                x = torch.empty((len(inputs[k]), *boundary))
                dist.recv(x, previous, group=pp_group)
                x.requires_grad_()
            y = stage_module(x)
            if stage == p - 1:
                y = F.cross_entropy(y.flatten(0, 1), labels[k].flatten()) / m
                loss += y.item()
            else:
                sending.append(dist.isend(y.detach().contiguous(), following, group=pp_group))
            held[k] = (x, y)
        else:
            x, y = held.pop(k)
            if stage == p - 1:
                y.backward()
            else:
                gradient = torch.empty_like(y)
                dist.recv(gradient, following, group=pp_group)
                y.backward(gradient)
            if stage:
                sending.append(dist.isend(x.grad.contiguous(), previous, group=pp_group))
    for request in sending:
        request.wait()
    return loss


def train_3d_rank(rank, world_size, sizes, config, seed, batches, lr, micro_batches):
    """One rank of a DP × PP × TP run ({"dp", "pp", "tp"} sizes, TP innermost) of
    `GPT(config)` initialised from `seed`, trained with Adam (lr) on `batches`, a list of
    (tokens, targets), each (B, s) with B divisible by dp·micro_batches. Returns this rank's
    coordinates, its loss per step (the summed micro-batch losses on the last stage, its DP
    rank's share of the batch; None elsewhere), and what it sent, by group:
    {"ranks": group ranks, "op": ..., "bytes": [...]} per operation."""
    coordinates = rank_coordinates(rank, sizes, ORDER)
    groups = _own_groups(sizes, rank)
    torch.manual_seed(seed)
    model = GPT(config)
    t, p, dp = sizes["tp"], sizes["pp"], sizes["dp"]
    stage = Stage(model, coordinates["pp"], p, groups["tp"][0], t, coordinates["tp"])
    optimizer = torch.optim.Adam(stage.parameters(), lr=lr)
    parameters = list(stage.parameters())
    losses = []
    with CommunicationLog() as log:
        for tokens, targets in batches:
            tokens, targets = (x.tensor_split(dp)[coordinates["dp"]] for x in (tokens, targets))
            optimizer.zero_grad()
            loss = _one_f_one_b(stage, coordinates["pp"], p, tokens, targets, micro_batches, groups,
                                (tokens.shape[1], config.hidden))
            flat = torch.cat([q.grad.reshape(-1) for q in parameters])
            dist.all_reduce(flat, group=groups["dp"][0])
            flat /= dp
            for q, piece in zip(parameters, flat.split([q.numel() for q in parameters])):
                q.grad.copy_(piece.view_as(q))
            optimizer.step()
            losses.append(loss if coordinates["pp"] == p - 1 else None)
    sent = {}
    for event in log.events:
        if event["op"] in ("all_reduce", "send") and event.get("group"):
            entry = sent.setdefault((event["op"], tuple(event["group"])), [])
            entry.append(event["bytes"])
    return {"coordinates": coordinates, "losses": losses,
            "sent": [{"op": op, "ranks": list(ranks), "bytes": sizes_} for (op, ranks), sizes_ in sent.items()]}


def single_process_losses(config: GPTConfig, seed: int, batches, lr: float) -> list[float]:
    """The same model trained in one process on the whole batches: the oracle."""
    torch.manual_seed(seed)
    model = GPT(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for tokens, targets in batches:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def text_batches(n_steps: int, batch: int, seq: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of next-byte prediction from the English help texts that ship with Python
    (dtp.ep.training.python_documentation_bytes): tokens and targets, each (batch, seq)."""
    from dtp.ep.training import python_documentation_bytes

    text = python_documentation_bytes()
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n_steps):
        starts = torch.randint(0, len(text) - seq - 1, (batch,), generator=generator)
        window = torch.stack([text[start:start + seq + 1] for start in starts.tolist()])
        batches.append((window[:, :-1], window[:, 1:]))
    return batches


def run_3d(sizes: dict[str, int], config: GPTConfig = TINY_GPT, seed: int = 0, n_steps: int = 8, batch: int = 8,
           lr: float = 3e-3, micro_batches: int = 2, **world_options) -> dict:
    """The run on dp·pp·tp gloo processes beside single-process training: {"ranks": per-rank
    results, "losses": the full batch's loss per step (the mean over DP ranks of their last
    stage's loss), "reference": single-process losses}."""
    from dtp.common.world import run_world

    batches = text_batches(n_steps, batch, config.n_positions, seed)
    reference = single_process_losses(config, seed, batches, lr)
    world = sizes["dp"] * sizes["pp"] * sizes["tp"]
    ranks = run_world(train_3d_rank, world, (sizes, config, seed, batches, lr, micro_batches), **world_options)
    last = [r for r in ranks if r["coordinates"]["pp"] == sizes["pp"] - 1 and r["coordinates"]["tp"] == 0]
    losses = [sum(r["losses"][step] for r in last) / len(last) for step in range(n_steps)]
    return {"ranks": ranks, "losses": losses, "reference": reference}
