"""ZeRO that wraps real models: the chapter's reference implementations, for a reader's own model
and optimizer rather than the course's toy ones.

- `ShardedOptimizer(params, torch.optim.AdamW, stage=1 or 2, lr=..., weight_decay=...)`: ZeRO-1
  (optimizer states sharded) and ZeRO-2 (gradients too), a `torch.optim.Optimizer` (param groups,
  `step(closure)`, `state_dict()` in torch's format, driven by torch's LR schedulers). Any
  `torch.optim.Optimizer` class with its keyword arguments, parameter groups, frozen parameters,
  parameters unused in a step, tied parameters (a parameter listed twice is one parameter: one
  owner, one update). In `dtp.zero.sharded_optimizer`.
- `ZeRO3(model, units=[...], replicated=[...])`: ZeRO-3 (weights sharded too) for any `nn.Module`,
  by units the user chooses (as `fully_shard` is applied per transformer block), plus the root for
  what is left, and modules left whole on every rank (`replicated`, their gradients averaged as DDP
  does). A unit's weights are all-gathered just before its forward and freed after it;
  saved-tensor hooks keep autograd from holding them, and backward all-gathers them again when it
  first needs them; the unit's gradients are reduce-scattered as soon as backward has produced them.
- `MixedPrecision(param_dtype, reduce_dtype, full_precision=NORMALIZATION_LAYERS)`: compute in 16
  bits from fp32 master shards, reduce gradients in `reduce_dtype`, as FSDP2's
  `MixedPrecisionPolicy`; modules of the `full_precision` types keep fp32. What each costs in bytes
  held and sent is in `dtp.zero.formulas` (`mixed_precision_bytes_per_parameter`, `accumulation_*`).

Every parameter is sharded on its own (FSDP2's way, `dtp.zero.pieces`): flattened, padded to
n·ceil(u/n), rank r keeps elements [r·c, (r+1)·c). A unit moves as one collective per dtype.

ZeRO-3's parameters stay where user code looks, as FSDP2's do: `model.named_parameters()` yields
every parameter by name with its full shape, as a `PieceTensor` (`dtp.zero.pieces`) whose only
storage is this rank's fp32 piece; its `.grad` after backward is the averaged gradient, shown the
same way (this rank's piece; `.full_tensor()` gathers all of it, a collective). Elementwise
operations (any torch optimizer, EMA copies) act on the pieces; norms and sums are global, so
`torch.nn.utils.clip_grad_norm_(model.parameters(), c)` is correct on every rank (one all-reduce per
parameter; `ZeRO3.clip_grad_norm_` does it with one in all). Weight decay by name (`"norm" in name`)
or by shape (`p.dim() < 2`) both work.

Gradients are averaged over the ranks (as data parallelism does); with gradient accumulation the
loss of each micro-batch is divided by the number of micro-batches by the caller, as on one process.
Both wrappers offer `no_sync()`: inside it, backward accumulates full gradients locally and reduces
nothing; the first backward outside it reduces the sum once ("accumulate unsharded, reduce once").
Outside it, ZeRO-2 and ZeRO-3 reduce-scatter every micro-batch and accumulate pieces.

Checkpoints: `full_state_dict()` / `load_full_state_dict()` gather and scatter whole tensors (weights
in fp32, and the optimizer's state), so a run saved on one world size resumes on another.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from dtp.zero.mixed_precision import NORMALIZATION_LAYERS, MixedPrecision, cast_floating
from dtp.zero.pieces import PieceTensor, clip_to_norm, gather_pieces, piece_of, reduce_scatter_mean
from dtp.zero.sharded_optimizer import ShardedOptimizer

__all__ = ["MixedPrecision", "NORMALIZATION_LAYERS", "PieceTensor", "ShardedOptimizer", "ZeRO3", "piece_of"]


class _GatherUnit(torch.autograd.Function):
    """The unit's weights from its pieces (one all-gather per dtype). Backward: one reduce-scatter
    per dtype of the unit's gradients, averaged, to its pieces; full gradients are dropped."""

    @staticmethod
    def forward(ctx, unit, *params):
        ctx.unit = unit
        return tuple(unit.all_gather())

    @staticmethod
    def backward(ctx, *full_gradients):
        return (None, *ctx.unit.reduce_gradients(full_gradients))


class _Unit:
    """One sharded unit: its own parameters (those of its subtree not in a nested unit, a tied one
    in the smallest unit holding all its uses), their pieces, and where they live in the model.
    Its parameters are split by the dtype they compute in (one collective each)."""

    def __init__(self, owner: "ZeRO3", module: nn.Module, name: str, entries: list):
        self.owner, self.module, self.name = owner, module, name
        # entries: (qualified name, [(module, attribute, qualified name)] of every use, the Parameter, compute dtype)
        self.uses = [uses for _, uses, _, _ in entries]
        self.shapes = [p.shape for _, _, p, _ in entries]
        self.numels = [p.numel() for _, _, p, _ in entries]
        rank, n = dist.get_rank(), dist.get_world_size()
        self.params = [nn.Parameter(PieceTensor(piece_of(p.detach().float(), rank, n), p.shape),
                                    requires_grad=p.requires_grad) for _, _, p, _ in entries]
        dtypes = [dtype or self.params[i].dtype for i, (_, _, _, dtype) in enumerate(entries)]
        self.groups = [(dtype, [i for i, d in enumerate(dtypes) if d == dtype]) for dtype in dict.fromkeys(dtypes)]
        self.full = None  # the gathered flat weights (one per group) while the unit runs forward
        self.full_for_backward = None  # gathered again for backward, until its gradients are reduced
        self.unsharded_gradient = None  # no_sync: the full gradients accumulated, reduced once

    def all_gather(self) -> list[torch.Tensor]:
        return [torch.cat(gather_pieces([self.params[i].to_local() for i in members],
                                        [self.numels[i] for i in members], dtype)) for dtype, members in self.groups]

    def reduce_gradients(self, full_gradients) -> list:
        self.owner.queue_after_backward()
        self.full_for_backward = None  # backward of this unit is over: its weights can go
        if self.unsharded_gradient is not None:
            full_gradients = [g + held for g, held in zip(full_gradients, self.unsharded_gradient)]
            self.unsharded_gradient = None
        if not self.owner.syncing:
            self.unsharded_gradient = [g.detach() for g in full_gradients]  # held in full until the last micro-batch
            return [None] * len(self.params)
        mp = self.owner.mixed_precision
        grads = [None] * len(self.params)
        for (dtype, members), full_gradient in zip(self.groups, full_gradients):
            trainable = [i for i in members if self.params[i].requires_grad]
            segments = dict(zip(members, full_gradient.split([self.numels[i] for i in members])))
            reduce_dtype = mp.gradient_dtype if mp and dtype == mp.param_dtype else dtype
            for i, piece in zip(trainable, reduce_scatter_mean([segments[i] for i in trainable], reduce_dtype)):
                grads[i] = PieceTensor(piece.to(self.params[i].dtype), self.shapes[i])
        return grads

    def install(self, flats: list[torch.Tensor]) -> None:
        """Set every use of the unit's parameters to its view of the gathered weights."""
        for (_, members), flat in zip(self.groups, flats):
            for i, view in zip(members, flat.split([self.numels[i] for i in members])):
                for module, attribute, _ in self.uses[i]:
                    module._parameters[attribute] = view.view(self.shapes[i])

    def uninstall(self) -> None:
        """Every use back to the sharded parameter (full shape, this rank's piece only)."""
        for param, uses in zip(self.params, self.uses):
            for module, attribute, _ in uses:
                module._parameters[attribute] = param


class ZeRO3(nn.Module):
    """ZeRO-3 around `model`: `units` are submodules sharded and gathered one at a time (for
    example each transformer block); the root is a unit for every parameter left; `replicated`
    modules keep their parameters whole on every rank, as given (they are their own masters: under
    mixed precision they run in fp32, as `full_precision` modules), their gradients averaged with
    one all-reduce at the end of backward, as DDP's. Step `wrapper.parameters()` (the model's
    parameters) with any torch optimizer: its state is then sharded too.

    Between forward passes no full weight exists. Call the wrapper, not the inner model's units."""

    def __init__(self, model: nn.Module, units=(), *, mixed_precision: MixedPrecision | None = None, replicated=()):
        super().__init__()
        self.module, self.mixed_precision, self.syncing = model, mixed_precision, True
        modules = {id(m): name for name, m in model.named_modules()}
        unit_modules = [model] + [u for u in units if u is not model]
        replicated = list(replicated)
        for u in unit_modules + replicated:
            if id(u) not in modules:
                raise ValueError(f"{type(u).__name__} is not a submodule of the wrapped model")
        if len({id(u) for u in unit_modules}) != len(unit_modules):
            raise ValueError("a module is listed twice among the units")
        unit_names = [modules[id(u)] for u in unit_modules]
        replicated_names = [modules[id(m)] for m in replicated]
        if "" in replicated_names:
            raise ValueError("the whole model cannot be replicated: that is data parallelism (DDP), not ZeRO-3")
        for name in unit_names[1:]:
            inside = [r for r in replicated_names if name == r or _within(name, r)]
            if inside:
                raise ValueError(f"unit {name!r} lies in the replicated module {inside[0]!r}")
        # Every use of every parameter: (module, attribute, qualified name).
        uses: dict[int, list] = {}
        parameters: dict[int, nn.Parameter] = {}
        for module_name, module in model.named_modules(remove_duplicate=False):
            for attribute, p in module.named_parameters(recurse=False):
                uses.setdefault(id(p), []).append((module, attribute, f"{module_name}.{attribute}".lstrip(".")))
                parameters[id(p)] = p
        entries_by_unit: list[list] = [[] for _ in unit_modules]
        self._replicated: list[nn.Parameter] = []
        for key, places in uses.items():
            in_replicated = [any(_within(q, r) for r in replicated_names) for _, _, q in places]
            if any(in_replicated):
                if not all(in_replicated):
                    raise ValueError(f"{places[0][2]} is used inside a replicated module and outside it; "
                                     "replicate or shard every module that uses it")
                self._replicated.append(parameters[key])
                continue
            # The unit owning a parameter: the deepest unit whose subtree holds every use of it.
            owner = max((i for i, name in enumerate(unit_names)
                         if all(_within(qualified, name) for _, _, qualified in places)),
                        key=lambda i: unit_names[i].count(".") + (unit_names[i] != ""))
            fp32 = mixed_precision is not None and all(mixed_precision.keeps_fp32(m) for m, _, _ in places)
            dtype = None if mixed_precision is None else torch.float32 if fp32 else mixed_precision.param_dtype
            entries_by_unit[owner].append((places[0][2], places, parameters[key], dtype))
        self._units = [_Unit(self, m, name, entries) for m, name, entries in zip(unit_modules, unit_names, entries_by_unit)
                       if entries]
        for unit in self._units:  # from here on the model's parameters are the sharded ones
            unit.uninstall()
        self._gathered: dict[int, tuple] = {}  # storage address of weights gathered for forward -> (unit, group)
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._backward_callback_queued = False
        self.peak_gathered_units = 0  # the most units with gathered weights at once (reset it at will)
        for unit in self._units:
            unit.module.register_forward_pre_hook(self._before_forward(unit), with_kwargs=True)
            unit.module.register_forward_hook(self._after_forward(unit))
        for p in self._replicated:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _p: self.queue_after_backward())
        if mixed_precision is not None:  # fp32 modules: fp32 in, the compute dtype out
            for name, module in model.named_modules():
                if mixed_precision.keeps_fp32(module) or name in replicated_names:
                    module.register_forward_pre_hook(_cast_inputs(torch.float32), with_kwargs=True)
                    module.register_forward_hook(_cast_output(mixed_precision.param_dtype))

    # --- forward: gather, run, free ---

    def forward(self, *args, **kwargs):
        with self._saved_hooks:
            return self.module(*args, **kwargs)

    def _before_forward(self, unit: _Unit):
        cast = _cast_inputs(self.mixed_precision.param_dtype) if self.mixed_precision else None

        def hook(module, args, kwargs):
            unit.full = list(_GatherUnit.apply(unit, *unit.params))
            for group, flat in enumerate(unit.full):
                self._gathered[flat.untyped_storage().data_ptr()] = (unit, group)
            unit.install(unit.full)
            self._note_peak()
            return None if cast is None else cast(module, args, kwargs)
        return hook

    def _after_forward(self, unit: _Unit):
        def hook(_module, _args, output):
            for flat in unit.full:
                self._gathered.pop(flat.untyped_storage().data_ptr(), None)
            unit.full = None
            unit.uninstall()  # the views go; autograd holds markers (_pack), not the weights
            return output
        return hook

    # --- backward: what autograd saved of a unit's weights is gathered again when needed ---

    def _pack(self, tensor):
        try:
            found = self._gathered.get(tensor.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # a tensor without a plain storage is none of ours
            found = None
        if found is None:
            return tensor
        return (_Unit, *found, tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset())

    def _unpack(self, packed):
        if not (isinstance(packed, tuple) and packed and packed[0] is _Unit):
            return packed
        _, unit, group, dtype, shape, stride, offset = packed
        self.queue_after_backward()
        if unit.full_for_backward is None:
            with torch.no_grad():
                unit.full_for_backward = unit.all_gather()
                self._note_peak()
        return unit.full_for_backward[group].as_strided(shape, stride, offset)

    def queue_after_backward(self) -> None:
        """Once per backward: free what is left and average the replicated gradients at its end."""
        if not self._backward_callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
            self._backward_callback_queued = True

    def _after_backward(self):
        for unit in self._units:
            unit.full_for_backward = None
        self._backward_callback_queued = False
        if self.syncing:
            self._average_replicated()

    def _average_replicated(self) -> None:
        """One all-reduce: which replicated parameters got a gradient on some rank, and the sum of
        the gradients (a rank without one adds zeros, as DDP counts it)."""
        trainable = [p for p in self._replicated if p.requires_grad]
        if not trainable:
            return
        flags = torch.tensor([float(p.grad is not None) for p in trainable])
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in trainable]
        summed = torch.cat([flags, *grads])
        dist.all_reduce(summed)
        n = dist.get_world_size()
        for p, flag, mean in zip(trainable, summed[:len(trainable)].tolist(),
                                 summed[len(trainable):].split([p.numel() for p in trainable])):
            if flag > 0:
                p.grad = (mean / n).view(p.shape).to(p.dtype)

    # --- accumulation, clipping, names, checkpoints ---

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate full gradients over micro-batches and reduce-scatter once, in the first
        backward after the block (costs a full gradient of every unit held meanwhile)."""
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_(self.parameters(), ...)` with one all-reduce in all (a
        collective: every rank calls it): the global norm of the averaged gradients, returned
        before clipping, the same on every rank."""
        sharded = [p.grad for unit in self._units for p in unit.params if p.grad is not None]
        whole = [p.grad for p in self._replicated if p.grad is not None]
        return clip_to_norm([(g.to_local(), g.real_part()) for g in sharded], whole, max_norm, norm_type)

    def named_pieces(self):
        """(parameter name, parameter) as `self.module.named_parameters()` (older name, kept)."""
        return self.module.named_parameters()

    def full_state_dict(self, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """The model's state_dict with whole fp32 weights (tied names all present, buffers
        included), and, given the optimizer stepping the parameters, its state as whole tensors
        (a collective: every rank calls it)."""
        model = {name: tensor.detach().clone() for name, tensor in self.module.state_dict().items()
                 if tensor is not None and not isinstance(tensor, PieceTensor)}
        for unit in self._units:
            fulls = gather_pieces([p.to_local() for p in unit.params], unit.numels, torch.float32)
            for names_of_uses, full, shape in zip(unit.uses, fulls, unit.shapes):
                for _, _, qualified in names_of_uses:
                    model[qualified] = full.view(shape)
        saved = {"model": model}
        if optimizer is not None:
            state = {}
            for name, p in self.module.named_parameters():
                entry = optimizer.state.get(p, {})
                sharded = [k for k, v in entry.items() if isinstance(v, PieceTensor)]
                fulls = gather_pieces([entry[k].to_local() for k in sharded], [p.numel()] * len(sharded), torch.float32)
                if entry:
                    state[name] = {"sharded": {k: f.view(p.shape) for k, f in zip(sharded, fulls)},
                                   "replicated": {k: v.clone() if torch.is_tensor(v) else v
                                                  for k, v in entry.items() if k not in sharded}}
            names = {id(p): name for name, p in self.module.named_parameters()}
            groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
                      for g in optimizer.param_groups]
            saved["optimizer"] = {"state": state, "param_groups": groups}
        return saved

    def load_full_state_dict(self, saved: dict, optimizer: torch.optim.Optimizer | None = None) -> None:
        rank, n = dist.get_rank(), dist.get_world_size()
        model = saved["model"]
        params = dict(self.module.named_parameters())
        missing = sorted(set(params) - set(model))
        if missing:
            raise KeyError(f"checkpoint lacks {missing[:3]}")
        with torch.no_grad():
            for name, p in params.items():
                if model[name].shape != p.shape:
                    raise ValueError(f"checkpoint's {name} has shape {tuple(model[name].shape)}, "
                                     f"the model's {tuple(p.shape)}")
                p.copy_(model[name].to(p.dtype))  # a PieceTensor keeps this rank's piece of it
        buffers = {k: v for k, v in model.items() if k in dict(self.module.named_buffers())}
        self.module.load_state_dict(buffers, strict=False)
        if optimizer is not None and "optimizer" in saved:
            for group, options in zip(optimizer.param_groups, saved["optimizer"]["param_groups"]):
                group.update({k: v for k, v in options.items() if k != "params"})
            for name, entry in saved["optimizer"]["state"].items():
                state = {k: PieceTensor(piece_of(v.float(), rank, n), v.shape) for k, v in entry["sharded"].items()}
                state.update({k: v.clone() if torch.is_tensor(v) else v for k, v in entry["replicated"].items()})
                optimizer.state[params[name]] = state

    def _note_peak(self) -> None:
        self.peak_gathered_units = max(self.peak_gathered_units, self.gathered_units())

    def gathered_units(self) -> int:
        """How many units have full weights alive now (forward's and backward's)."""
        return sum((u.full is not None) + (u.full_for_backward is not None) for u in self._units)


def _within(qualified: str, unit_name: str) -> bool:
    return unit_name == "" or qualified.startswith(unit_name + ".")


def _cast_inputs(dtype: torch.dtype):
    def hook(_module, args, kwargs):
        return tree_map(lambda v: cast_floating(v, dtype), (args, kwargs))
    return hook


def _cast_output(dtype: torch.dtype):
    def hook(_module, _args, output):
        return tree_map(lambda v: cast_floating(v, dtype), output)
    return hook
