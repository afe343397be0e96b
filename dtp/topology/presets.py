"""Models the planner's command line knows by name, each with the sequence length and global
batch it was (or, for the source notes' 409B MoE, is asked to be) trained with. Shapes from each
model's paper: GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, h 12288, 96 heads, 2048
tokens, 3.2M tokens per batch), Llama 3 8B, 70B and 405B (Dubey et al. 2024, Table 3: SwiGLU,
8 K/V heads, a 128K vocabulary, 8192 tokens; 405B's batch 16M tokens, section 3.4), Mixtral 8x7B
(Jiang et al. 2024: 32 layers, h 4096, 8 experts of width 14336, top-2, 8 K/V heads, 32,000
tokens), DeepSeek-V3 (DeepSeek-AI 2024, approximated as dtp.topology.published describes), and
the source notes' 409B MoE (dtp.topology.planner.MOE_409B)."""
from __future__ import annotations

import dataclasses

from dtp.topology.planner import MOE_409B
from dtp.topology.published import DEEPSEEK_V3, LLAMA3_405B, gpt, llama
from dtp.topology.shapes import ModelShape

# name: (shape, global batch in sequences)
MODELS: dict[str, tuple[ModelShape, int]] = {
    "gpt3-175b": (gpt(96, 12288, 96, vocab=51200, seq=2048, name="GPT-3 175B"), 1536),
    "llama3-8b": (llama(32, 4096, 32, 14336, 8192, name="Llama 3 8B"), 512),
    "llama3-70b": (llama(80, 8192, 64, 28672, 8192, name="Llama 3 70B"), 1024),
    "llama3-405b": (LLAMA3_405B, 2048),
    "mixtral-8x7b": (dataclasses.replace(llama(32, 4096, 32, 14336, 4096, vocab=32000, name="Mixtral 8x7B"),
                                         experts=8, top_k=2), 1024),
    "deepseek-v3": (DEEPSEEK_V3, 15360),
    "moe-409b": (MOE_409B, 1024),
}
