"""Mixture of experts as practised since DeepSeek-V3: auxiliary-loss-free load balancing (a
per-expert bias that steers the choice of experts, never the gate weights).

Conventions are dtp.moe's: logits (T, E), softmax probabilities, `indices[t, j]` token t's j-th
choice, best first, ties to the lower expert index.

tests/test_ep_routing.py checks every function here against a brute-force loop.
"""
from __future__ import annotations

import numpy as np

from .moe import softmax

# --- auxiliary-loss-free load balancing (Wang et al. 2024; DeepSeek-V3, section 2.1.2) ----------


def biased_top_k_routing(logits: np.ndarray, bias: np.ndarray, k: int,
                         renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """(indices, weights), each (T, k). The experts are chosen by probability + bias (the k
    largest, best first); the gate weights are the chosen experts' probabilities, without the bias
    (divided by their sum when `renormalize`). The bias only decides who computes a token, so it
    never enters the output's value, and the gradient never reaches it."""
    probabilities = softmax(logits)
    indices = np.argsort(-(probabilities + bias), axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probabilities, indices, axis=-1)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return indices, weights


def update_choice_bias(bias: np.ndarray, indices, rate: float) -> np.ndarray:
    """The bias after one step: b_i + rate·sign(mean load - load_i), the load being the number of
    assignments expert i received in this step's routing (`indices`, T×k). An overloaded expert
    loses `rate`, an underloaded one gains it, one exactly at the mean keeps its bias. The sign,
    not the size of the error: every step moves a bias by the same fixed amount, so that a few
    unusual batches cannot swing the routing."""
    bias = np.asarray(bias, dtype=float)
    loads = np.bincount(np.asarray(indices).reshape(-1), minlength=bias.shape[0])
    return bias + rate * np.sign(loads.mean() - loads)


def load_imbalance(indices, num_experts: int, k: int) -> float:
    """E · max_i f_i, f counted over the T·k assignments: 1 when even, at most E/k (no expert can
    receive more than one of each token's k distinct choices)."""
    counts = np.bincount(np.asarray(indices).reshape(-1), minlength=num_experts)
    return float(num_experts * counts.max() / counts.sum())
