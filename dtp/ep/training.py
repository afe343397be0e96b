"""The expert-parallelism chapter's experiment: a small MoE language model trained on real text (the
English help texts every CPython ships), with the router's balance measured as it learns: no
balancing, Switch's auxiliary loss, or DeepSeek-V3's bias (dtp.ep.routing); and the tokens each
capacity factor would drop. The book draws its two figures from here."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from dtp.common.threads import torch_on_one_thread
from dtp.ep.moe import (
    MoEConfig,
    MoETransformer,
    assign_slots,
    dispatched_fractions,
    expert_capacity,
    load_balancing_loss,
    router_z_loss,
)
from dtp.ep.routing import update_choice_bias


def python_documentation_bytes() -> torch.Tensor:
    """English prose that ships with every CPython (the pydoc help topics) as byte tokens, 0 to
    255: a real corpus that needs no download."""
    import pydoc_data.topics

    text = "\n".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def routing_statistics(model: MoETransformer, tokens: torch.Tensor, capacity_factors=(1.0,)) -> dict:
    """Run `tokens` (batch, seq) through the model and measure each MoE layer's routing, averaged
    over layers: `imbalance`, the busiest expert's load over the mean load (E·max f, 1 when
    even, at most E/k), and `dropped[cf]`, the fraction of assignments over capacity with capacity factor cf,
    the batch being one group."""
    with torch.no_grad():
        model(tokens)
    imbalance, dropped = [], {factor: [] for factor in capacity_factors}
    for layer in model.moe_layers():
        indices = layer.last_indices.numpy()
        experts = layer.router.out_features
        imbalance.append(experts * dispatched_fractions(indices, experts).max())
        for factor in capacity_factors:
            capacity = expert_capacity(len(indices), experts, indices.shape[1], factor)
            dropped[factor].append(float(np.mean(assign_slots(indices, experts, capacity) < 0)))
    return {"imbalance": float(np.mean(imbalance)), "dropped": {f: float(np.mean(d)) for f, d in dropped.items()}}


def train_on_text(config: MoEConfig, alpha: float, steps: int, measure_every: int, seed: int = 0,
                  batch: int = 8, seq: int = 128, lr: float = 3e-3, z_loss: float = 1e-3,
                  bias_rate: float = 0.0) -> dict:
    """Train `MoETransformer(config)` (byte tokens) on `python_documentation_bytes` with AdamW,
    the load-balancing loss with `alpha` (0: none) and the router z-loss on every MoE layer; the
    routing statistics of a fixed held-out batch (the text's last batch·seq bytes) at step 0 and
    every `measure_every` steps. `bias_rate` > 0 balances by DeepSeek-V3's bias rule instead of a
    loss: after every step each layer's choice bias moves by the rate towards the mean load
    (dtp.ep.routing)."""
    with torch_on_one_thread():  # tiny matrices: more threads only contend (and change the rounding)
        return _train_on_text(config, alpha, steps, measure_every, seed, batch, seq, lr, z_loss, bias_rate)


def _train_on_text(config, alpha, steps, measure_every, seed, batch, seq, lr, z_loss, bias_rate) -> dict:

    data = python_documentation_bytes()
    held_out = data[-batch * seq:].view(batch, seq)
    training = data[:-batch * seq]
    torch.manual_seed(seed)
    model = MoETransformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    history = {"step": [0], "statistics": [routing_statistics(model, held_out)], "loss": []}
    for step in range(1, steps + 1):
        generator = torch.Generator().manual_seed(seed * 100003 + step)
        starts = torch.randint(0, len(training) - seq - 1, (batch,), generator=generator)
        window = torch.stack([training[s:s + seq + 1] for s in starts.tolist()])
        logits = model(window[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), window[:, 1:].reshape(-1))
        auxiliary = sum(router_z_loss(layer.last_logits, z_loss) + (
            load_balancing_loss(layer.last_logits, layer.last_indices.numpy(), alpha) if alpha else 0.0)
            for layer in model.moe_layers())
        optimizer.zero_grad()
        (loss + auxiliary).backward()
        optimizer.step()
        if bias_rate:  # outside autograd: the bias is counted, not learned
            for layer in model.moe_layers():
                layer.choice_bias.copy_(torch.from_numpy(update_choice_bias(
                    layer.choice_bias.numpy(), layer.last_indices.numpy(), bias_rate)))
        history["loss"].append(loss.item())
        if step % measure_every == 0:
            history["step"].append(step)
            history["statistics"].append(routing_statistics(model, held_out))
    history["model"], history["held_out"] = model, held_out
    return history


# --- figures ---------------------------------------------------------------------------------------


def imbalance_figure(histories: dict[str, dict], num_experts: int, top_k: int | None = None):
    """The busiest expert's load over the mean load on the held-out batch, against training step,
    one line per labelled run; 1 is perfect balance, and E/k the ceiling (every token choosing the
    same k experts: no expert can receive more than one of a token's k distinct choices)."""
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.8))
    for label, history in histories.items():
        axis.plot(history["step"], [s["imbalance"] for s in history["statistics"]], marker="o", markersize=3,
                  label=label)
    axis.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="perfect balance")
    if top_k is not None:
        axis.axhline(num_experts / top_k, color="black", linestyle=":", linewidth=1,
                     label=f"ceiling E/k = {num_experts / top_k:g}")
    axis.set_ylim(0.8, None)
    axis.set_xlabel("training step")
    axis.set_ylabel(f"busiest expert's load / mean load\n(E·max f, {num_experts} experts)")
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.tight_layout()
    plt.close(figure)
    return figure


def dropped_figure(curves: dict[str, dict[float, float]]):
    """Fraction of assignments dropped against the capacity factor, one line per labelled router."""
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.8))
    for label, dropped in curves.items():
        factors = sorted(dropped)
        axis.plot(factors, [100 * dropped[f] for f in factors], marker="o", markersize=3, label=label)
    axis.set_xlabel("capacity factor (capacity = ceil(factor · T·k / E))")
    axis.set_ylabel("assignments dropped (%)")
    axis.set_ylim(0, None)
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.tight_layout()
    plt.close(figure)
    return figure
