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


def saved_activation_breakdown(module: nn.Module, inputs: torch.Tensor) -> dict[str, int]:
    """Like `saved_activation_bytes`, by the submodule whose forward saved each storage first
    (its name in `module.named_modules()`, "" for the module's own code)."""
    parameter_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    running: list[str] = [""]
    owners: dict[int, tuple[str, int]] = {}
    handles = []
    def enter(name):
        return lambda module, args: running.append(name)  # returns None: the inputs stay as they are

    def leave(module, args, output):
        running.pop()  # returns None: the output stays as it is

    for name, submodule in module.named_modules():
        if name:
            handles += [submodule.register_forward_pre_hook(enter(name)), submodule.register_forward_hook(leave)]

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages and storage.data_ptr() not in owners:
            owners[storage.data_ptr()] = (running[-1], storage.nbytes())
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = module(inputs)
        del output
    finally:
        for handle in handles:
            handle.remove()
    breakdown: dict[str, int] = {}
    for name, nbytes in owners.values():
        breakdown[name] = breakdown.get(name, 0) + nbytes
    return breakdown
