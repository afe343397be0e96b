"""Shared and fine-grained experts (DeepSeekMoE; DeepSeek-V3): parameters, parameters a token
uses, and FLOPs per token of an MoE feed-forward against a dense one, and DeepSeek-V3's totals
from its published configuration.

Experts are SwiGLU (three bias-free h×f matrices); the router is a bias-free h×E_routed map
(shared experts are not routed: every token uses all of them). FLOPs are matrix-multiply FLOPs of
the forward pass, 2 per multiply-add.

tests/ep/test_ep_routing.py checks these counts against torch modules' numel and FlopCounterMode.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def moe_ffn_parameters(hidden: int, expert_hidden: int, routed: int, shared: int, k: int) -> dict[str, int]:
    """One MoE feed-forward with `routed` experts (k chosen per token) and `shared` ones (always
    used): every parameter, and those one token uses (its k routed experts, all shared ones and
    the router, which scores every routed expert)."""
    expert, router = 3 * hidden * expert_hidden, hidden * routed
    return {"total": (routed + shared) * expert + router, "active": (k + shared) * expert + router}


def moe_ffn_flops_per_token(hidden: int, expert_hidden: int, routed: int, shared: int, k: int) -> int:
    """Forward FLOPs one token costs in that layer: the router (2·h·E_routed) and k + shared
    SwiGLU experts (2·3·h·f each): twice its active parameters."""
    return 2 * moe_ffn_parameters(hidden, expert_hidden, routed, shared, k)["active"]


def dense_ffn_parameters(hidden: int, ffn_hidden: int) -> int:
    """A dense SwiGLU feed-forward of width `ffn_hidden`; its forward FLOPs per token are twice this."""
    return 3 * hidden * ffn_hidden


def expert_combinations(routed: int, k: int) -> int:
    """The number of different expert sets a token can be routed to: C(E, k). Fine-grained
    segmentation (each expert split into m of width f/m, mk chosen) keeps parameters and FLOPs and
    multiplies this (DeepSeekMoE's argument for specialisation)."""
    return math.comb(routed, k)


@dataclass(frozen=True)
class DeepSeekV3Config:
    """DeepSeek-V3 as its released configuration states it (DeepSeek-AI 2024, section 4.2 and
    config.json): multi-head latent attention, 3 dense blocks then 58 MoE blocks of 1 shared and
    256 routed experts, 8 routed per token. The multi-token-prediction module is not counted (the
    report's 671B excludes it)."""
    vocab_size: int = 129280
    hidden: int = 7168
    n_layers: int = 61
    dense_layers: int = 3
    dense_ffn_hidden: int = 18432
    expert_hidden: int = 2048
    routed: int = 256
    shared: int = 1
    top_k: int = 8
    n_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128


DEEPSEEK_V3 = DeepSeekV3Config()


def mla_attention_parameters(c: DeepSeekV3Config) -> int:
    """Multi-head latent attention: queries through a rank-q_lora bottleneck, keys and values from
    one kv_lora-wide latent (plus a shared rotary key), the output projection, and the bottleneck
    norms and the block's two RMSNorms."""
    query = c.hidden * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * c.n_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
    key_value = (c.hidden * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
                 + c.kv_lora_rank * c.n_heads * (c.qk_nope_head_dim + c.v_head_dim))
    return query + key_value + c.n_heads * c.v_head_dim * c.hidden + 2 * c.hidden


def deepseek_parameter_counts(c: DeepSeekV3Config = DEEPSEEK_V3) -> dict[str, int]:
    """Total and active parameters (embedding and output matrix both counted) of a DeepSeek-V3
    shaped model, and the same model made dense: every MoE layer's feed-forward replaced by one
    dense SwiGLU of the active experts' total width, (k + shared)·f."""
    moe = moe_ffn_parameters(c.hidden, c.expert_hidden, c.routed, c.shared, c.top_k)
    outside = 2 * c.vocab_size * c.hidden + c.hidden
    common = outside + c.n_layers * mla_attention_parameters(c) + c.dense_layers * dense_ffn_parameters(
        c.hidden, c.dense_ffn_hidden)
    moe_layers = c.n_layers - c.dense_layers
    return {"total": common + moe_layers * moe["total"], "active": common + moe_layers * moe["active"],
            "dense_same_flops": common + moe_layers * dense_ffn_parameters(c.hidden, (c.top_k + c.shared) * c.expert_hidden)}
