"""Measuring what autograd really keeps for backward: every tensor a forward pass saves goes
through a saved-tensors hook, and we add up the distinct storages that are not parameters."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def saved_activation_bytes(module: nn.Module, inputs: torch.Tensor, recompute_fully: bool = False) -> int:
    """Bytes of the activations a forward pass of `module` saves for backward. Views of one
    storage count once; parameters (which Linear layers also save) are not activations."""
    parameter_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        if recompute_fully:
            output = checkpoint(module, inputs, use_reentrant=False)
        else:
            output = module(inputs)
    del output
    return sum(storages.values())
