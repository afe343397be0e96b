"""Closed forms of the memory chapter: parameter counts, model-state bytes per training recipe,
activation bytes (Korthikanti et al. 2022), FLOPs, training time and MFU. The book prints these
numbers, the notebook's calculator draws them, and the grader holds answers to them;
tests/memory/test_memory_formulas.py checks them against real torch models."""
from __future__ import annotations

import numbers

from dtp.common.gpt import GPTConfig

# --- parameters ---------------------------------------------------------------------------


def gpt_parameter_count(config: GPTConfig) -> int:
    """Exact parameters of `dtp.common.gpt.GPT(config)`, counted layer by layer."""
    h, bias = config.hidden, int(config.bias)
    width = config.mlp_ratio * h
    layer_norm = h + bias * h
    attention = (h * 3 * h + bias * 3 * h) + (h * h + bias * h)
    mlp = (h * width + bias * width) + (width * h + bias * h)
    block = 2 * layer_norm + attention + mlp
    embeddings = config.vocab_size * h + config.n_positions * h
    output = 0 if config.tied_embeddings else config.vocab_size * h
    return embeddings + config.n_layers * block + layer_norm + output


def megatron_parameter_formula(n_layers: int, hidden: int, vocab_size: int, n_positions: int) -> float:
    """12Lh²(1 + 13/(12h) + (V+s)/(12Lh)) (Narayanan et al. 2021): biases, MLP ratio 4, tied
    embeddings, learned positions; it leaves out the final LayerNorm's 2h parameters."""
    L, h, V, s = n_layers, hidden, vocab_size, n_positions
    return 12 * L * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))


# --- model states -----------------------------------------------------------------------------

# Bytes per parameter of each training recipe, by what they hold.
RECIPES: dict[str, dict[str, int]] = {
    "fp32_adam": {"fp32 weights": 4, "fp32 gradients": 4, "Adam momentum": 4, "Adam variance": 4},
    "mixed_adam": {"fp16 weights": 2, "fp16 gradients": 2, "fp32 master weights": 4,
                   "Adam momentum": 4, "Adam variance": 4},
    "mixed_adam_fp32_grad_accum": {"fp16 weights": 2, "fp16 gradients": 2, "fp32 gradient accumulator": 4,
                                   "fp32 master weights": 4, "Adam momentum": 4, "Adam variance": 4},
    "mixed_sgd_momentum": {"fp16 weights": 2, "fp16 gradients": 2, "fp32 master weights": 4, "SGD momentum": 4},
}

# Memory of some GPUs as nvidia-smi reports it, in MiB. The "GB" in a product's name is a label,
# not a unit: an A100 80GB holds exactly 80 GiB, an H100 80GB somewhat less, an H200 "141GB"
# about 140 GiB.
GPU_MEMORY_MIB: dict[str, int] = {"A100 80GB": 81920, "H100 80GB": 81559, "H200": 143771}
A100_80GB_BYTES = GPU_MEMORY_MIB["A100 80GB"] * 2**20

UNITS: dict[str, int] = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                         "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def bytes_per_parameter(recipe: str) -> int:
    return sum(RECIPES[recipe].values())


def model_state_memory(n_params: float, recipe: str, unit: str = "B") -> float:
    """Weights, gradients and optimizer state of `n_params` parameters, in `unit` (GB = 10⁹ bytes, GiB = 2³⁰)."""
    return n_params * bytes_per_parameter(recipe) / UNITS[unit]


def largest_trainable_model(device_bytes: float, recipe: str) -> float:
    """Parameters whose model states alone fill `device_bytes` (activations not counted)."""
    return device_bytes / bytes_per_parameter(recipe)


# --- activations ------------------------------------------------------------------------------

RECOMPUTE = ("none", "selective", "full")


def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, tensor_parallel: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               context_parallel: int = 1) -> float:
    """Bytes one transformer layer keeps for backward, fp16 activations with dropout masks
    (Korthikanti et al. 2022, table 2), with t = tensor_parallel:

    none:               sbh(10 + 24/t + 5as/(ht))    with sequence parallelism: sbh(34/t + 5as/(ht))
    selective:          sbh(10 + 24/t)               with sequence parallelism: sbh(34/t)
    full:               2sbh                         (only the layer's input is kept)

    The 10 in the first column is what tensor parallelism alone cannot split (Korthikanti et al.
    2022, section 4.2.1): the two LayerNorms' inputs (4sbh), the inputs of the QKV and h→4h matrix
    multiplies (4sbh) and two 1-byte dropout masks (2sbh), which sequence parallelism shards too.
    The 5as/h term is attention's softmax, its dropout mask and output (all of size as²b).

    Context parallelism c = context_parallel divides every row by c: each rank keeps the
    per-token tensors of its s/c tokens, and of the s x s attention terms the rows of its s/c
    queries (against all s keys, which reach it block by block): 5a(s/c)sb/t. (Putting s/c in
    for s would be wrong there: it would give the queries only their own rank's keys.)"""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if isinstance(context_parallel, bool) or not isinstance(context_parallel, numbers.Integral) or context_parallel < 1:
        raise ValueError(f"context_parallel must be a whole number of at least 1, got {context_parallel!r}")
    s, b, h, a, t = seq, batch, hidden, heads, tensor_parallel
    if recompute == "full":
        return 2 * s * b * h / context_parallel
    unsplit = 34 / t if sequence_parallel else 10 + 24 / t
    attention = 0 if recompute == "selective" else 5 * a * s / (h * t)
    return s * b * h * (unsplit + attention) / context_parallel


def activation_bytes(n_layers: int, *args, **kwargs) -> float:
    """All layers' activation bytes: L times the per-layer figure (embeddings and loss left out)."""
    return n_layers * activation_bytes_per_layer(*args, **kwargs)


# --- compute ----------------------------------------------------------------------------------


def training_flops(n_params: float, n_tokens: float) -> float:
    """6·N FLOPs per token: 2N in the forward pass (a multiply and an add per parameter) and 4N
    in the backward pass (gradients with respect to activations and to weights)."""
    return 6 * n_params * n_tokens


def transformer_training_flops(config: GPTConfig, batch: int, seq: int) -> float:
    """Exact matrix-multiply FLOPs of one forward and backward pass of `dtp.common.gpt.GPT`: 6 per token
    per weight of every matrix multiplied (the blocks' (4 + 2r)h² each and the V×h output layer;
    embedding look-ups multiply nothing), plus attention's QKᵀ and AV, 2·2s²h per layer forward."""
    h, L = config.hidden, config.n_layers
    matrix_weights = L * (4 + 2 * config.mlp_ratio) * h * h + config.vocab_size * h
    return 6 * batch * seq * matrix_weights + 3 * L * batch * 4 * seq * seq * h


def model_flops_per_token(n_params: float, n_layers: int, hidden: int, seq: int) -> float:
    """Model FLOPs per token of a training step as PaLM defines them (Chowdhery et al. 2022,
    appendix B): 6N for the weights' matrix multiplies, plus 12·L·H·Q·T for attention's QKᵀ and
    AV in forward and backward, where H·Q = hidden (heads times head size) and T = seq."""
    return 6 * n_params + 12 * n_layers * hidden * seq


def hardware_flops_per_token(n_params: float, n_layers: int, hidden: int, seq: int,
                             recompute: str = "none") -> float:
    """FLOPs the hardware performs per token. With full recomputation each layer's forward runs
    twice, adding 2N + 4·L·h·s: 8N + 16·L·h·s in all. (Selective recomputation adds attention's
    forward only.) Model FLOPs do not change with recomputation; hardware FLOPs do."""
    model = model_flops_per_token(n_params, n_layers, hidden, seq)
    if recompute == "none":
        return model
    if recompute == "selective":
        return model + 4 * n_layers * hidden * seq
    if recompute == "full":
        return model + 2 * n_params + 4 * n_layers * hidden * seq
    raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")


def training_time_s(n_params: float, n_tokens: float, n_gpus: int, peak_flops: float, mfu: float) -> float:
    """Wall-clock seconds to train on `n_tokens`, with model FLOPs approximated by 6N per token,
    at a model-FLOPs utilisation `mfu`."""
    return training_flops(n_params, n_tokens) / (n_gpus * peak_flops * mfu)


def model_flops_utilization(n_params: float, n_layers: int, hidden: int, seq: int, tokens_per_s: float,
                            n_gpus: int, peak_flops: float) -> float:
    """MFU: model FLOPs per token (PaLM's 6N + 12·L·h·s) at the observed throughput, over the peak."""
    return model_flops_per_token(n_params, n_layers, hidden, seq) * tokens_per_s / (n_gpus * peak_flops)


def hardware_flops_utilization(n_params: float, n_layers: int, hidden: int, seq: int, tokens_per_s: float,
                               n_gpus: int, peak_flops: float, recompute: str = "full") -> float:
    """HFU: the FLOPs the hardware really did (recomputation included) over the peak."""
    flops = hardware_flops_per_token(n_params, n_layers, hidden, seq, recompute)
    return flops * tokens_per_s / (n_gpus * peak_flops)


# --- one GPU's memory, by component -----------------------------------------------------------

def component_of(entry: str) -> str:
    """The part of the model states a recipe's entry belongs to: weights, gradients or optimizer states."""
    if "master" in entry or "Adam" in entry or "SGD" in entry:
        return "optimizer states"
    return "gradients" if "gradient" in entry else "weights"


def logits_bytes(seq: int, batch: int, vocab_size: int, tensor_parallel: int = 1, context_parallel: int = 1) -> float:
    """The output layer's logits, kept in fp32 for the cross-entropy: 4·s·b·V/t bytes
    (Korthikanti et al. 2022, section 4.3), for a vocabulary split t ways; with context
    parallelism c each rank holds the logits of its s/c tokens only: 4·s·b·V/(t·c)."""
    return 4 * seq * batch * vocab_size / (tensor_parallel * context_parallel)


def memory_breakdown(config: GPTConfig, recipe: str, micro_batch: int, tensor_parallel: int = 1,
                     sequence_parallel: bool = False, recompute: str = "none") -> dict[str, float]:
    """Bytes on one GPU by component, for a model sharded `tensor_parallel` ways (model states
    split evenly; embeddings included) training on sequences of `config.n_positions` tokens:
    model states, the layers' activations and the fp32 logits."""
    shard = gpt_parameter_count(config) / tensor_parallel
    breakdown = {"weights": 0.0, "gradients": 0.0, "optimizer states": 0.0}
    for entry, nbytes in RECIPES[recipe].items():
        breakdown[component_of(entry)] += shard * nbytes
    breakdown["activations"] = activation_bytes(
        config.n_layers, config.n_positions, micro_batch, config.hidden, config.n_heads,
        tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel, recompute=recompute)
    breakdown["logits"] = logits_bytes(config.n_positions, micro_batch, config.vocab_size, tensor_parallel)
    return breakdown
