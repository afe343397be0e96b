"""ZeRO that wraps real models: the chapter's reference implementations, for a reader's own model
and optimizer rather than the course's toy ones.

- `ShardedOptimizer(params, torch.optim.AdamW, stage=1 or 2, lr=..., weight_decay=...)`: ZeRO-1
  (optimizer states sharded) and ZeRO-2 (gradients too). Any `torch.optim.Optimizer` class with its
  keyword arguments, parameter groups, frozen parameters, parameters unused in a step, tied
  parameters (a parameter listed twice is one parameter: one owner, one update).
- `ZeRO3(model, units=[...])`: ZeRO-3 (weights sharded too) for any `nn.Module`, by units the user
  chooses (as `fully_shard` is applied per transformer block), plus the root for what is left.
  A unit's weights are all-gathered just before its forward and freed after it; saved-tensor hooks
  keep autograd from holding them, and backward all-gathers them again when it first needs them;
  the unit's gradients are reduce-scattered as soon as backward has produced them.
- `MixedPrecision(param_dtype, reduce_dtype)`: compute in 16 bits from fp32 master shards, reduce
  gradients in `reduce_dtype`, as FSDP2's `MixedPrecisionPolicy`. What each costs in bytes held and
  sent is in `dtp.zero.formulas` (`mixed_precision_bytes_per_parameter`, `accumulation_*`).

Every parameter is sharded on its own (FSDP2's way): a tensor of u elements is flattened, padded to
n·ceil(u/n) and rank r keeps elements [r·c, (r+1)·c). A unit moves as one collective: the pieces of
its parameters are concatenated, so that one all-gather (or reduce-scatter) serves the unit.

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
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class MixedPrecision:
    """Compute in `param_dtype` (weights cast, and sent, in it); reduce gradients in `reduce_dtype`
    (None: in `param_dtype`). Master weights and optimizer states stay fp32, as the shards."""
    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = None

    @property
    def gradient_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype


def _piece_size(numel: int, world_size: int) -> int:
    return -(-numel // world_size)


def piece_of(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's piece of `tensor` flattened and zero-padded to a multiple of world_size: a new tensor."""
    c = _piece_size(tensor.numel(), world_size)
    padded = tensor.new_zeros(c * world_size)
    padded[:tensor.numel()] = tensor.detach().reshape(-1)
    return padded[rank * c:(rank + 1) * c].clone()


def _gather_pieces(pieces: list[torch.Tensor], numels: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """All-gather several flat pieces with one collective; the full flat tensors, padding dropped."""
    n = dist.get_world_size()
    local = torch.cat([p.detach().reshape(-1).to(dtype) for p in pieces]) if pieces else torch.empty(0, dtype=dtype)
    out = torch.empty(n * local.numel(), dtype=dtype)
    dist.all_gather_single(out, local)
    by_rank, fulls, offset = out.view(n, -1), [], 0
    for piece, numel in zip(pieces, numels):
        fulls.append(by_rank[:, offset:offset + piece.numel()].reshape(-1)[:numel].clone())
        offset += piece.numel()
    return fulls


def _reduce_scatter_mean(fulls: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Reduce-scatter several flat tensors with one collective; this rank's averaged pieces."""
    n = dist.get_world_size()
    padded = []
    for full in fulls:
        c = _piece_size(full.numel(), n)
        row = full.new_zeros(n * c, dtype=dtype)
        row[:full.numel()] = full.reshape(-1)
        padded.append(row.view(n, c))
    send = torch.cat(padded, dim=1).reshape(-1)  # rank-major: rank r's pieces of every tensor together
    out = torch.empty(send.numel() // n, dtype=dtype)
    dist.reduce_scatter_single(out, send)
    out /= n
    return list(out.split([p.shape[1] for p in padded]))


def _split_state(state: dict, shape: torch.Size) -> tuple[dict, dict]:
    """An optimizer's per-parameter state: tensors shaped like the piece (sharded) and the rest."""
    sharded = {k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == shape and v.dim() > 0}
    return sharded, {k: v for k, v in state.items() if k not in sharded}


# --- ZeRO-1 and ZeRO-2 ------------------------------------------------------------------------

class ShardedOptimizer:
    """ZeRO-1 (stage=1) or ZeRO-2 (stage=2) around `optimizer_class(pieces, **defaults)`.

    Every rank keeps the whole model (in `mixed_precision.param_dtype` if given) and an fp32 master
    piece of each parameter, which the inner optimizer steps; `step()` then all-gathers the pieces
    back into the model. Stage 1 reduce-scatters each gradient in `step()`; stage 2 as soon as
    backward has produced it (a post-accumulate-grad hook), keeping only the averaged piece.

    A parameter with no gradient on any rank in a step is not stepped (as torch's optimizers skip
    it); with stage 1, one missing on some ranks only counts as zero there (as DDP does). Stage 2
    reduces in backward, so, as DDP without `find_unused_parameters`, it needs every parameter used
    on all ranks or on none."""

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                 stage: int = 1, mixed_precision: MixedPrecision | None = None, **defaults):
        if stage not in (1, 2):
            raise ValueError(f"ShardedOptimizer is ZeRO-1 or ZeRO-2 (stage 1 or 2), got stage={stage!r}; "
                             "for ZeRO-3 wrap the model with ZeRO3")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer class, got {optimizer_class!r}")
        self.stage, self.mixed_precision = stage, mixed_precision
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        groups = list(params)
        if not groups:
            raise ValueError("ShardedOptimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.parameters: list[nn.Parameter] = []
        seen: set[int] = set()
        inner_groups = []
        for group in groups:
            members = [group["params"]] if torch.is_tensor(group["params"]) else list(group["params"])
            pieces = []
            for p in members:
                if id(p) in seen:  # tied: the same Parameter listed again is the same parameter
                    continue
                seen.add(id(p))
                self.parameters.append(p)
                pieces.append(piece_of(p.detach().float(), self.rank, self.world_size))
            inner_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": pieces})
        self.pieces = [piece for group in inner_groups for piece in group["params"]]
        self.optimizer = optimizer_class(inner_groups, **defaults)
        if mixed_precision is not None:
            with torch.no_grad():
                for p in self.parameters:  # the model computes in 16 bits; the pieces are the fp32 masters
                    p.data = p.data.to(mixed_precision.param_dtype)
        self._syncing = True
        self._reduced_in_backward: set[int] = set()
        if stage == 2:
            for index, p in enumerate(self.parameters):
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._reduce_hook(index))

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def _gradient_dtype(self, p) -> torch.dtype:
        return self.mixed_precision.gradient_dtype if self.mixed_precision else p.dtype

    def _accumulate_piece(self, index: int, gradient: torch.Tensor) -> None:
        piece = self.pieces[index]
        averaged = _reduce_scatter_mean([gradient.reshape(-1)], self._gradient_dtype(gradient))[0].float()
        piece.grad = averaged if piece.grad is None else piece.grad.add_(averaged)

    def _reduce_hook(self, index: int):
        def hook(p):
            if not self._syncing:
                return  # no_sync: the full gradient accumulates in p.grad, reduced after the last micro-batch
            self._accumulate_piece(index, p.grad)
            self._reduced_in_backward.add(index)
            p.grad = None  # the full gradient is gone as soon as its piece is averaged
        return hook

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate full gradients over micro-batches and reduce once (only stage 2 reduces in
        backward; stage 1 always reduces once, in step())."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def step(self) -> None:
        if self.stage == 1:
            # Which parameters got a gradient on some rank: one small all-reduce, so that the ranks
            # issue the same reduce-scatters and a parameter no rank used is skipped, as torch does.
            has_grad = torch.tensor([float(p.grad is not None) for p in self.parameters])
            dist.all_reduce(has_grad)
            stepped = [i for i, flag in enumerate(has_grad.tolist()) if flag > 0]
            for i in stepped:
                p = self.parameters[i]
                self._accumulate_piece(i, p.grad if p.grad is not None else torch.zeros_like(p))
        else:
            stepped = sorted(self._reduced_in_backward)
            self._reduced_in_backward = set()
        self.optimizer.step()
        fulls = _gather_pieces([self.pieces[i] for i in stepped], [self.parameters[i].numel() for i in stepped],
                               self.mixed_precision.param_dtype if self.mixed_precision else self.pieces[0].dtype)
        with torch.no_grad():
            for i, full in zip(stepped, fulls):
                self.parameters[i].copy_(full.view_as(self.parameters[i]))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # --- checkpoints: whole tensors, whatever the world size ---

    def full_state_dict(self) -> dict:
        """fp32 weights and the optimizer's state as whole tensors, parameters by index."""
        weights = _gather_pieces(self.pieces, [p.numel() for p in self.parameters], torch.float32)
        state = {}
        for i, (p, piece) in enumerate(zip(self.parameters, self.pieces)):
            sharded, replicated = _split_state(self.optimizer.state.get(piece, {}), piece.shape)
            full = _gather_pieces(list(sharded.values()), [p.numel()] * len(sharded), torch.float32)
            if sharded or replicated:
                state[i] = {"sharded": {k: f.view(p.shape) for k, f in zip(sharded, full)},
                            "replicated": {k: v.clone() if torch.is_tensor(v) else v for k, v in replicated.items()}}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"weights": [w.view(p.shape) for w, p in zip(weights, self.parameters)],
                "optimizer": {"state": state, "param_groups": groups}}

    def load_full_state_dict(self, saved: dict) -> None:
        if len(saved["weights"]) != len(self.parameters):
            raise ValueError(f"checkpoint has {len(saved['weights'])} parameters, this optimizer {len(self.parameters)}")
        with torch.no_grad():
            for p, piece, full in zip(self.parameters, self.pieces, saved["weights"]):
                if full.shape != p.shape:
                    raise ValueError(f"checkpoint weight of shape {tuple(full.shape)} for a parameter of {tuple(p.shape)}")
                piece.copy_(piece_of(full.float(), self.rank, self.world_size))
                p.copy_(full.to(p.dtype))
            for group, options in zip(self.optimizer.param_groups, saved["optimizer"]["param_groups"]):
                group.update(options)
            for i, entry in saved["optimizer"]["state"].items():
                piece = self.pieces[i]
                state = {k: piece_of(v.float(), self.rank, self.world_size) for k, v in entry["sharded"].items()}
                state.update({k: v.clone() if torch.is_tensor(v) else v for k, v in entry["replicated"].items()})
                self.optimizer.state[piece] = state


# --- ZeRO-3 -----------------------------------------------------------------------------------

class _GatherUnit(torch.autograd.Function):
    """The unit's weights from its pieces (one all-gather). Backward: one reduce-scatter of the
    unit's gradients, averaged, to its pieces; full gradients are dropped."""

    @staticmethod
    def forward(ctx, unit, *pieces):
        ctx.unit = unit
        return unit.all_gather(pieces)

    @staticmethod
    def backward(ctx, full_gradient):
        return (None, *ctx.unit.reduce_gradient(full_gradient))


class _Unit:
    """One sharded unit: its own parameters (those of its subtree not in a nested unit, a tied one
    in the smallest unit holding all its uses), their pieces, and where they live in the model."""

    def __init__(self, owner: "ZeRO3", module: nn.Module, name: str, entries: list):
        self.owner, self.module, self.name = owner, module, name
        # entries: (qualified name, [(module, attribute, qualified name)] of every use, the Parameter)
        self.names = [qualified for qualified, _, _ in entries]
        self.uses = [uses for _, uses, _ in entries]
        self.shapes = [p.shape for _, _, p in entries]
        self.numels = [p.numel() for _, _, p in entries]
        rank, n = dist.get_rank(), dist.get_world_size()
        self.pieces = [nn.Parameter(piece_of(p.detach().float(), rank, n), requires_grad=p.requires_grad)
                       for _, _, p in entries]
        self.full = None  # the gathered flat weights while the unit runs forward
        self.full_for_backward = None  # gathered again for backward, until its gradients are reduced
        self.unsharded_gradient = None  # no_sync: the full gradients accumulated, reduced once

    def dtype(self) -> torch.dtype:
        mp = self.owner.mixed_precision
        return mp.param_dtype if mp else self.pieces[0].dtype

    def all_gather(self, pieces) -> torch.Tensor:
        return torch.cat(_gather_pieces(list(pieces), self.numels, self.dtype())) if pieces else torch.empty(0)

    def reduce_gradient(self, full_gradient: torch.Tensor) -> list:
        self.full_for_backward = None  # backward of this unit is over: its weights can go
        if self.unsharded_gradient is not None:
            full_gradient = full_gradient + self.unsharded_gradient
            self.unsharded_gradient = None
        if not self.owner.syncing:
            self.unsharded_gradient = full_gradient.detach()  # held in full until the last micro-batch
            return [None] * len(self.pieces)
        mp = self.owner.mixed_precision
        trainable = [i for i, p in enumerate(self.pieces) if p.requires_grad]
        segments = full_gradient.split(self.numels)
        reduced = _reduce_scatter_mean([segments[i] for i in trainable], mp.gradient_dtype if mp else full_gradient.dtype)
        grads = [None] * len(self.pieces)
        for i, piece_gradient in zip(trainable, reduced):
            grads[i] = piece_gradient.to(self.pieces[i].dtype)
        return grads

    def install(self, flat: torch.Tensor) -> None:
        """Set every use of the unit's parameters to its view of the gathered weights."""
        for shape, uses, view in zip(self.shapes, self.uses, flat.split(self.numels)):
            for module, attribute, _ in uses:
                setattr(module, attribute, view.view(shape))

    def uninstall(self) -> None:
        for uses in self.uses:
            for module, attribute, _ in uses:
                setattr(module, attribute, None)


class ZeRO3(nn.Module):
    """ZeRO-3 around `model`: `units` are submodules sharded and gathered one at a time (for
    example each transformer block); the root is a unit for every parameter left. The wrapper's
    parameters are this rank's pieces only; step them with any optimizer (its state is then
    sharded too). `named_pieces()` gives each piece with its parameter's name, for parameter groups.

    Between forward passes no full weight exists. Call the wrapper, not the inner model's units."""

    def __init__(self, model: nn.Module, units=(), *, mixed_precision: MixedPrecision | None = None):
        super().__init__()
        self.module, self.mixed_precision, self.syncing = model, mixed_precision, True
        modules = {id(m): name for name, m in model.named_modules()}
        unit_modules = [model] + [u for u in units if u is not model]
        for u in unit_modules:
            if id(u) not in modules:
                raise ValueError(f"unit {type(u).__name__} is not a submodule of the wrapped model")
        if len({id(u) for u in unit_modules}) != len(unit_modules):
            raise ValueError("a module is listed twice among the units")
        unit_names = [modules[id(u)] for u in unit_modules]
        # Every use of every parameter: (module, attribute, qualified name).
        uses: dict[int, list] = {}
        parameters: dict[int, nn.Parameter] = {}
        for module_name, module in model.named_modules(remove_duplicate=False):
            for attribute, p in module.named_parameters(recurse=False):
                uses.setdefault(id(p), []).append((module, attribute, f"{module_name}.{attribute}".lstrip(".")))
                parameters[id(p)] = p
        entries_by_unit: list[list] = [[] for _ in unit_modules]
        for key, places in uses.items():
            # The unit owning a parameter: the deepest unit whose subtree holds every use of it.
            owner = max((i for i, name in enumerate(unit_names)
                         if all(_within(qualified, name) for _, _, qualified in places)),
                        key=lambda i: unit_names[i].count(".") + (unit_names[i] != ""))
            entries_by_unit[owner].append((places[0][2], places, parameters[key]))
        self._units = [_Unit(self, m, name, entries) for m, name, entries in zip(unit_modules, unit_names, entries_by_unit)
                       if entries]
        self.pieces = nn.ParameterList([piece for unit in self._units for piece in unit.pieces])
        for unit in self._units:  # from here on the model holds no parameter of its own
            for uses_of_one in unit.uses:
                for module, attribute, _ in uses_of_one:
                    module._parameters.pop(attribute, None)  # a module used twice lists it twice
            unit.uninstall()
        self._gathered: dict[int, _Unit] = {}  # storage address of a unit's weights gathered for forward -> unit
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._backward_callback_queued = False
        self.peak_gathered_units = 0  # the most units with gathered weights at once (reset it at will)
        for unit in self._units:
            unit.module.register_forward_pre_hook(self._before_forward(unit), with_kwargs=True)
            unit.module.register_forward_hook(self._after_forward(unit))

    # --- forward: gather, run, free ---

    def forward(self, *args, **kwargs):
        with self._saved_hooks:
            return self.module(*args, **kwargs)

    def _cast(self, value):
        mp = self.mixed_precision
        if mp is not None and torch.is_tensor(value) and value.is_floating_point():
            return value.to(mp.param_dtype)
        return value

    def _before_forward(self, unit: _Unit):
        def hook(_module, args, kwargs):
            unit.full = _GatherUnit.apply(unit, *unit.pieces)
            self._gathered[unit.full.untyped_storage().data_ptr()] = unit
            unit.install(unit.full)
            self._note_peak()
            if self.mixed_precision is None:
                return None
            return tuple(self._cast(a) for a in args), {k: self._cast(v) for k, v in kwargs.items()}
        return hook

    def _after_forward(self, unit: _Unit):
        def hook(_module, _args, output):
            self._gathered.pop(unit.full.untyped_storage().data_ptr(), None)
            unit.full = None
            unit.uninstall()  # the views go; autograd holds markers (_pack), not the weights
            return output
        return hook

    # --- backward: what autograd saved of a unit's weights is gathered again when needed ---

    def _pack(self, tensor):
        try:
            unit = self._gathered.get(tensor.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # a tensor without a plain storage is none of ours
            unit = None
        if unit is None:
            return tensor
        return (_Unit, unit, tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset())

    def _unpack(self, packed):
        if not (isinstance(packed, tuple) and packed and packed[0] is _Unit):
            return packed
        _, unit, dtype, shape, stride, offset = packed
        if not self._backward_callback_queued:  # free whatever is left once backward ends
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
            self._backward_callback_queued = True
        if unit.full_for_backward is None:
            with torch.no_grad():
                unit.full_for_backward = unit.all_gather(unit.pieces)
                self._note_peak()
        return unit.full_for_backward.as_strided(shape, stride, offset)

    def _after_backward(self):
        for unit in self._units:
            unit.full_for_backward = None
        self._backward_callback_queued = False

    # --- accumulation, names, checkpoints ---

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate full gradients over micro-batches and reduce-scatter once, in the first
        backward after the block (costs a full gradient of every unit held meanwhile)."""
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def named_pieces(self):
        """(parameter name, this rank's piece), for building an optimizer's parameter groups."""
        for unit in self._units:
            yield from zip(unit.names, unit.pieces)

    def full_state_dict(self, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """The model's state_dict with whole fp32 weights (tied names all present, buffers
        included), and, given the optimizer stepping the pieces, its state as whole tensors."""
        model = {name: tensor.detach().clone() for name, tensor in self.module.state_dict().items()
                 if tensor is not None}
        for unit in self._units:
            for names_of_uses, full, shape in zip(unit.uses, _gather_pieces(unit.pieces, unit.numels, torch.float32),
                                                  unit.shapes):
                for _, _, qualified in names_of_uses:
                    model[qualified] = full.view(shape)
        saved = {"model": model}
        if optimizer is not None:
            state = {}
            for name, piece, numel, shape in self._pieces_with_shapes():
                sharded, replicated = _split_state(optimizer.state.get(piece, {}), piece.shape)
                fulls = _gather_pieces(list(sharded.values()), [numel] * len(sharded), torch.float32)
                if sharded or replicated:
                    state[name] = {"sharded": {k: f.view(shape) for k, f in zip(sharded, fulls)},
                                   "replicated": {k: v.clone() if torch.is_tensor(v) else v for k, v in replicated.items()}}
            names = {id(piece): name for name, piece in self.named_pieces()}
            groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
                      for g in optimizer.param_groups]
            saved["optimizer"] = {"state": state, "param_groups": groups}
        return saved

    def load_full_state_dict(self, saved: dict, optimizer: torch.optim.Optimizer | None = None) -> None:
        rank, n = dist.get_rank(), dist.get_world_size()
        model = saved["model"]
        piece_names = {name for name, _ in self.named_pieces()}
        missing = sorted(piece_names - set(model))
        if missing:
            raise KeyError(f"checkpoint lacks {missing[:3]}")
        with torch.no_grad():
            for name, piece, numel, shape in self._pieces_with_shapes():
                if model[name].shape != shape:
                    raise ValueError(f"checkpoint's {name} has shape {tuple(model[name].shape)}, the model's {tuple(shape)}")
                piece.copy_(piece_of(model[name].float(), rank, n))
        buffers = {k: v for k, v in model.items() if k in dict(self.module.named_buffers())}
        self.module.load_state_dict(buffers, strict=False)
        if optimizer is not None and "optimizer" in saved:
            pieces = dict(self.named_pieces())
            for group, options in zip(optimizer.param_groups, saved["optimizer"]["param_groups"]):
                group.update({k: v for k, v in options.items() if k != "params"})
            for name, entry in saved["optimizer"]["state"].items():
                state = {k: piece_of(v.float(), rank, n) for k, v in entry["sharded"].items()}
                state.update({k: v.clone() if torch.is_tensor(v) else v for k, v in entry["replicated"].items()})
                optimizer.state[pieces[name]] = state

    def _pieces_with_shapes(self):
        for unit in self._units:
            yield from zip(unit.names, unit.pieces, unit.numels, unit.shapes)

    def _note_peak(self) -> None:
        self.peak_gathered_units = max(self.peak_gathered_units, self.gathered_units())

    def gathered_units(self) -> int:
        """How many units have full weights alive now (forward's and backward's)."""
        return sum((u.full is not None) + (u.full_for_backward is not None) for u in self._units)


def _within(qualified: str, unit_name: str) -> bool:
    return unit_name == "" or qualified.startswith(unit_name + ".")

