"""The mixed-precision policy of dtp.zero.sharded's wrappers, as FSDP2's `MixedPrecisionPolicy`:
compute in 16 bits from fp32 master shards, reduce gradients in `reduce_dtype`; and, per module
type, modules that keep their fp32 weights (normalisation layers, as common recipes do)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# The normalisation layers of torch.nn (those with weights): what recipes keep in fp32.
NORMALIZATION_LAYERS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
                        nn.SyncBatchNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


@dataclass(frozen=True)
class MixedPrecision:
    """Compute in `param_dtype` (weights cast, and sent, in it); reduce gradients in `reduce_dtype`
    (None: in `param_dtype`). Master weights and optimizer states stay fp32, as the shards.

    `full_precision`: module types that keep fp32 (for example `NORMALIZATION_LAYERS`): ZeRO3
    gathers their weights in fp32, runs them on fp32 inputs, reduces their gradients in fp32 and
    casts their outputs back to `param_dtype` (FSDP2 does the same when such a module gets its own
    `fully_shard` with `MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch.bfloat16)`).
    It costs one more all-gather and reduce-scatter per unit that holds such modules."""
    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = None
    full_precision: tuple[type[nn.Module], ...] = ()

    @property
    def gradient_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype

    def keeps_fp32(self, module: nn.Module) -> bool:
        return bool(self.full_precision) and isinstance(module, self.full_precision)


def cast_floating(value, dtype: torch.dtype):
    """`value` cast to `dtype` if it is a floating-point tensor; anything else unchanged."""
    if torch.is_tensor(value) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value
