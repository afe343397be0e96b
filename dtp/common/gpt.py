"""A GPT-style decoder in plain PyTorch, built from a `GPTConfig`: the real model whose `numel`
the memory chapter's parameter count is checked against, and whose block's saved activations
the book measures. Layer names follow GPT-2 (pre-LayerNorm blocks, learned positions)."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    n_positions: int = 1024  # longest sequence: one learned position embedding each
    n_layers: int = 12
    hidden: int = 768
    n_heads: int = 12
    mlp_ratio: int = 4  # MLP width = mlp_ratio · hidden
    tied_embeddings: bool = True  # the output layer reuses the token embedding matrix
    bias: bool = True  # biases in every Linear and LayerNorm
    dropout: float = 0.1


GPT2_SMALL = GPTConfig()
GPT3_175B = GPTConfig(vocab_size=50257, n_positions=2048, n_layers=96, hidden=12288, n_heads=96)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden, bias=config.bias)
        self.proj = nn.Linear(config.hidden, config.hidden, bias=config.bias)
        self.attention_dropout = nn.Dropout(config.dropout)
        self.output_dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).split(hidden, dim=2)
        q, k, v = (t.view(batch, seq, self.n_heads, hidden // self.n_heads).transpose(1, 2) for t in (q, k, v))
        # Written out (not fused) so that every tensor the formula counts is really saved.
        scores = q @ k.transpose(-2, -1) / math.sqrt(hidden // self.n_heads)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        probabilities = self.attention_dropout(scores.masked_fill(~causal, float("-inf")).softmax(dim=-1))
        context = (probabilities @ v).transpose(1, 2).reshape(batch, seq, hidden)
        return self.output_dropout(self.proj(context))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up = nn.Linear(config.hidden, config.mlp_ratio * config.hidden, bias=config.bias)
        self.down = nn.Linear(config.mlp_ratio * config.hidden, config.hidden, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.down(nn.functional.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden, bias=config.bias)
        self.attention = CausalSelfAttention(config)
        self.norm2 = nn.LayerNorm(config.hidden, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden)
        self.position_embedding = nn.Embedding(config.n_positions, config.hidden)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.final_norm = nn.LayerNorm(config.hidden, bias=config.bias)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tied_embeddings:
            self.lm_head.weight = self.token_embedding.weight

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x))


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied matrix counts once), as `model.parameters()` yields them."""
    return sum(p.numel() for p in model.parameters())


def build_on_meta(config: GPTConfig) -> GPT:
    """The model with no storage allocated: shapes and counts of even a 175B model, instantly."""
    with torch.device("meta"), _parameters_left_uninitialised():
        return GPT(config)


@contextlib.contextmanager
def _parameters_left_uninitialised():
    """Meta tensors hold no values, so initialising them only costs time: torch routes the
    initialisers on the meta device through its reference implementations, whose first call
    imports its compiler (more than a second in a fresh process, such as the grader's)."""
    layers = (nn.Linear, nn.Embedding, nn.LayerNorm)
    initialisers = {layer: layer.reset_parameters for layer in layers}
    for layer in layers:
        layer.reset_parameters = lambda self: None
    try:
        yield
    finally:
        for layer, initialiser in initialisers.items():
            layer.reset_parameters = initialiser
