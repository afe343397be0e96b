"""Small seeded models and data that the chapters train and the checks compare."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn


class InputScaling(nn.Module):
    """Multiplies the inputs by a fixed random vector held as a buffer, not a parameter: the
    optimizer never touches it, so data-parallel replicas agree on it only if it is broadcast."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("scale", 0.5 + torch.rand(width))

    def forward(self, x):
        return x * self.scale


def tiny_mlp(sizes=(8, 32, 16, 4), seed: int = 0, input_scaling: bool = False) -> nn.Sequential:
    """An MLP with ReLUs between Linear layers, identically initialised for a given seed;
    with `input_scaling`, an `InputScaling` buffer module comes first."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    layers: list[nn.Module] = [InputScaling(sizes[0])] if input_scaling else []
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


def parameters_as_numpy(model: nn.Module) -> list[np.ndarray]:
    return [p.detach().clone().numpy() for p in model.parameters()]


def state_as_numpy(model: nn.Module) -> dict[str, np.ndarray]:
    """Parameters and buffers by name: what data-parallel replicas must agree on."""
    return {name: tensor.detach().clone().numpy() for name, tensor in model.state_dict().items()}
