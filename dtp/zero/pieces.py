"""A rank's pieces of sharded tensors, how they move, and how user code sees them.

Every tensor is sharded on its own (FSDP2's way): a tensor of u elements is flattened, zero-padded
to n·c elements, c = ceil(u/n), and rank r keeps elements [r·c, (r+1)·c) (its *piece*). Several
pieces move as one collective (`gather_pieces`, `reduce_scatter_mean`).

`PieceTensor` is how `dtp.zero.sharded.ZeRO3` shows a sharded parameter, its gradient and the
optimizer's state to user code: a tensor with the *full* shape whose only storage is this rank's
flat piece (`.to_local()`), as FSDP2 shows a `DTensor` sharded on dim 0 (`.to_local()` too).
- Elementwise operations (an optimizer's step, `g.mul_(c)`, `ema.lerp_(p, w)`, `.to(dtype)`, `zeros_like`)
  run on the pieces alone; their results are PieceTensors. A plain tensor of the full shape among
  the inputs is cut to this rank's piece first (`p.copy_(full)` loads a weight).
- Whole-tensor reductions (`norm` / `linalg.vector_norm`, `sum`, `mean`, `max`, `min`) are global:
  each rank reduces the real elements of its piece, and one all-reduce combines them, so
  `torch.nn.utils.clip_grad_norm_` computes the true norm. They are collectives: every rank must
  make the same calls in the same order (FSDP2's DTensors defer the same all-reduce to the first
  read of the result, with the same rule).
- `full_tensor()` all-gathers the whole tensor (a collective too).
- Anything else (indexing, matmul, a reduction over some dimensions) raises a one-line error:
  the full tensor exists only inside its unit's forward and backward.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

# --- pieces and their collectives ---------------------------------------------------------------


def piece_size(numel: int, world_size: int) -> int:
    return -(-numel // world_size)


def piece_of(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's piece of `tensor` flattened and zero-padded to a multiple of world_size: a new tensor."""
    c = piece_size(tensor.numel(), world_size)
    padded = tensor.new_zeros(c * world_size)
    padded[:tensor.numel()] = tensor.detach().reshape(-1)
    return padded[rank * c:(rank + 1) * c].clone()


def real_elements(numel: int, rank: int, world_size: int) -> int:
    """How many elements of rank's piece belong to the tensor (the rest is padding)."""
    c = piece_size(numel, world_size)
    return max(0, min(c, numel - rank * c))


def gather_pieces(pieces: list[torch.Tensor], numels: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
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


def reduce_scatter_mean(fulls: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Reduce-scatter several flat tensors with one collective; this rank's averaged pieces."""
    n = dist.get_world_size()
    padded = []
    for full in fulls:
        c = piece_size(full.numel(), n)
        row = full.new_zeros(n * c, dtype=dtype)
        row[:full.numel()] = full.reshape(-1)
        padded.append(row.view(n, c))
    send = torch.cat(padded, dim=1).reshape(-1)  # rank-major: rank r's pieces of every tensor together
    out = torch.empty(send.numel() // n, dtype=dtype)
    dist.reduce_scatter_single(out, send)
    out /= n
    return list(out.split([p.shape[1] for p in padded]))


def global_norm(local_values: list[torch.Tensor], norm_type: float, replicated: list[torch.Tensor] = ()) -> torch.Tensor:
    """The p-norm of tensors whose elements are spread over the ranks (`local_values`: this rank's
    real elements of each) together with tensors every rank holds whole (`replicated`, counted
    once): one all-reduce, of the p-th powers summed (of the largest magnitude for p = inf, the
    smallest for p = -inf)."""
    norm_type = float(norm_type)
    if math.isinf(norm_type):
        extreme, op = (torch.max, dist.ReduceOp.MAX) if norm_type > 0 else (torch.min, dist.ReduceOp.MIN)
        values = [extreme(v.detach().abs()).float() for v in local_values if v.numel()]
        local = extreme(torch.stack(values)) if values else torch.tensor(0.0 if norm_type > 0 else math.inf)
        dist.all_reduce(local, op=op)
        whole = [extreme(r.detach().abs()).float() for r in replicated if r.numel()]
        return extreme(torch.stack([local, *whole]))
    # Each tensor's p-norm raised to p: summed, they are the p-th power of the norm of them all
    # (for p = 0, the count of non-zero elements, which sums as it is).
    power = 1.0 if norm_type == 0 else norm_type
    powers = [torch.linalg.vector_norm(v.detach(), norm_type).float() ** power for v in local_values]
    local = torch.stack(powers).sum() if powers else torch.zeros(())
    dist.all_reduce(local)
    for r in replicated:
        local = local + torch.linalg.vector_norm(r.detach(), norm_type).float() ** power
    return local ** (1.0 / power)


@torch.no_grad()
def clip_to_norm(spread: list[tuple[torch.Tensor, torch.Tensor]], whole: list[torch.Tensor], max_norm: float,
                 norm_type: float = 2.0) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over gradients spread over the ranks ((a rank's gradient
    piece, its real elements) pairs) and gradients every rank holds whole: the global norm (one
    all-reduce), returned before clipping; the gradients scaled by min(1, max_norm / (norm + 1e-6))."""
    total = global_norm([real for _, real in spread], norm_type, whole)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in [g for g, _ in spread] + list(whole):
        g.mul_(coefficient)
    return total


# --- PieceTensor ----------------------------------------------------------------------------------

_aten = torch.ops.aten
# Not tagged pointwise, yet elementwise on a piece: creation "like" a tensor, copies, fills, casts.
_ELEMENTWISE = {_aten.zeros_like.default, _aten.ones_like.default, _aten.empty_like.default, _aten.full_like.default,
                _aten.rand_like.default, _aten.randn_like.default, _aten.copy_.default, _aten.fill_.Scalar,
                _aten.fill_.Tensor, _aten.zero_.default, _aten.normal_.default, _aten.uniform_.default,
                _aten._to_copy.default, _aten.clone.default}
_ALIASES = {_aten.detach.default, _aten.alias.default}
_NEW_OF_SHAPE = {_aten.new_empty_strided.default: torch.empty_like, _aten.new_empty.default: torch.empty_like,
                 _aten.new_zeros.default: torch.zeros_like}


class PieceTensor(torch.Tensor):
    """A tensor of its full shape of which this rank holds one flat piece (see the module's
    docstring). `PieceTensor(piece, shape)`: `piece` is this rank's c = ceil(numel/n) elements."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # every op reaches __torch_dispatch__

    @staticmethod
    def __new__(cls, piece: torch.Tensor, shape, requires_grad: bool = False):
        shape = torch.Size(shape)
        tensor = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=piece.dtype, device=piece.device,
                                                     requires_grad=requires_grad)
        tensor._local_tensor = piece  # DTensor's name: dtp.zero.measure counts what a rank holds by it
        return tensor

    def __init__(self, piece, shape, requires_grad=False):
        super().__init__()

    def to_local(self) -> torch.Tensor:
        """This rank's flat piece (padding included), as `DTensor.to_local()`."""
        return self._local_tensor

    def real_part(self) -> torch.Tensor:
        """The elements of this rank's piece that belong to the tensor (padding left out)."""
        return self._local_tensor[:real_elements(self.numel(), dist.get_rank(), dist.get_world_size())]

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor, all-gathered (a collective: every rank calls it), as `DTensor.full_tensor()`."""
        return gather_pieces([self._local_tensor], [self.numel()], self.dtype)[0].view(self.shape)

    def __repr__(self):
        return (f"PieceTensor(shape={tuple(self.shape)}, dtype={self.dtype}, piece of "
                f"{self._local_tensor.numel()} elements on rank {dist.get_rank()} of {dist.get_world_size()})")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pieces = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, PieceTensor)]
        if func.__name__.startswith("_foreach_"):
            return _foreach(func, args, kwargs)
        if func in _ALIASES:
            return PieceTensor(func(args[0]._local_tensor), args[0].shape)
        if func in _NEW_OF_SHAPE and tuple(args[1]) == tuple(args[0].shape):
            return PieceTensor(_NEW_OF_SHAPE[func](args[0]._local_tensor, dtype=kwargs.get("dtype")), args[0].shape)
        if func in _GLOBAL_REDUCTIONS:
            return _GLOBAL_REDUCTIONS[func](*args, **kwargs)
        if func == _aten.is_same_size.default:
            return args[0].shape == args[1].shape
        if torch.Tag.pointwise in func.tags or func in _ELEMENTWISE:
            shape = pieces[0].shape
            if any(p.shape != shape for p in pieces):
                raise RuntimeError(f"{func}: PieceTensors of shapes {sorted({tuple(p.shape) for p in pieces})} do not match")
            target = args[0] if torch.Tag.inplace in func.tags else kwargs.get("out")
            if torch.is_tensor(target) and not isinstance(target, PieceTensor):
                raise RuntimeError(f"{func} would write a rank's piece into a whole tensor; call .full_tensor() first")
            result = func(*_locals(args, shape), **_locals(kwargs, shape))
            if torch.Tag.inplace in func.tags:
                return args[0]
            if "out" in kwargs:
                return kwargs["out"]
            return tree_map(lambda t: PieceTensor(t, shape) if torch.is_tensor(t) else t, result)
        raise RuntimeError(f"{func} is not defined on a ZeRO-3 sharded tensor (this rank holds one flat piece of "
                           f"{tuple(pieces[0].shape)}): elementwise operations and whole-tensor norm/sum/mean/max/min are; "
                           "for anything else call .full_tensor() (a collective)")


def _locals(tree, shape):
    """PieceTensors replaced by their pieces; a plain tensor of the full shape cut to this rank's piece."""
    def local(value):
        if isinstance(value, PieceTensor):
            return value._local_tensor
        if torch.is_tensor(value) and value.dim() and value.shape == shape:
            return piece_of(value, dist.get_rank(), dist.get_world_size())
        if torch.is_tensor(value) and value.numel() > 1:
            raise RuntimeError(f"a tensor of shape {tuple(value.shape)} cannot meet a ZeRO-3 sharded tensor "
                               f"of {tuple(shape)}")
        return value
    return tree_map(local, tree)


def _foreach(func, args, kwargs):
    """`torch._foreach_*`: element i of every list belongs together; norms are global per tensor."""
    if func == _aten._foreach_norm.Scalar:
        norm_type = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        return [_vector_norm(t, norm_type) for t in args[0]]
    lists = [a for a in args if isinstance(a, (list, tuple))]
    shapes = [t.shape for t in lists[0]]
    columns = [[(a[i] if isinstance(a, (list, tuple)) else a) for a in args] for i in range(len(shapes))]
    local_args = [list(column) for column in zip(*[_locals(column, shape) for column, shape in zip(columns, shapes)])]
    rebuilt = [(local_args[j] if isinstance(a, (list, tuple)) else a) for j, a in enumerate(args)]
    result = func(*rebuilt, **kwargs)
    if result is None:
        return None
    return [PieceTensor(t, shape) for t, shape in zip(result, shapes)]


def _whole(dim) -> bool:
    return dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0)


def _check_whole(name, dim, keepdim=False):
    if not _whole(dim) or keepdim:
        raise RuntimeError(f"{name} over some dimensions of a ZeRO-3 sharded tensor is not defined (its piece is flat); "
                           "reduce the whole tensor, or call .full_tensor() (a collective)")


def _vector_norm(tensor, ord=2, dim=None, keepdim=False, *, dtype=None):
    _check_whole("norm", dim, keepdim)
    real = tensor.real_part() if isinstance(tensor, PieceTensor) else tensor
    return global_norm([real if dtype is None else real.to(dtype)], ord).to(dtype or tensor.dtype)


def _sum(tensor, dim=None, keepdim=False, *, dtype=None):
    _check_whole("sum", dim, keepdim)
    total = tensor.real_part().sum(dtype=dtype)
    dist.all_reduce(total)
    return total


def _mean(tensor, dim=None, keepdim=False, *, dtype=None):
    return _sum(tensor, dim, keepdim, dtype=dtype) / tensor.numel()


def _extreme(op, identity):
    def reduce(tensor, dim=None, keepdim=False):
        _check_whole("max/min", dim, keepdim)
        real = tensor.real_part()
        value = getattr(real, op)() if real.numel() else torch.tensor(identity, dtype=tensor.dtype)
        dist.all_reduce(value, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN)
        return value
    return reduce


_GLOBAL_REDUCTIONS = {
    _aten.linalg_vector_norm.default: _vector_norm,
    _aten.sum.default: _sum, _aten.sum.dim_IntList: _sum, _aten.mean.default: _mean, _aten.mean.dim: _mean,
    _aten.max.default: _extreme("max", -math.inf), _aten.min.default: _extreme("min", math.inf),
    _aten.amax.default: _extreme("max", -math.inf), _aten.amin.default: _extreme("min", math.inf),
}
