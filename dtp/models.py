"""Small seeded models and data that the chapters train and the checks compare."""
from __future__ import annotations

import torch
from torch import nn


def tiny_mlp(sizes=(8, 32, 16, 4), seed: int = 0) -> nn.Sequential:
    """An MLP with ReLUs between Linear layers, identically initialised for a given seed."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(d_in, d_out))
    torch.random.set_rng_state(generator_state)  # do not disturb the caller's random stream
    return nn.Sequential(*layers)


def regression_batch(batch: int, d_in: int, d_out: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random regression batch (inputs, targets) from its own generator."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, d_in, generator=generator), torch.randn(batch, d_out, generator=generator)


def parameters_as_numpy(model: nn.Module) -> list:
    return [p.detach().clone().numpy() for p in model.parameters()]
