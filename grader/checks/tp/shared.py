"""What the tensor-parallelism checks share: float tolerances against a float64 oracle, the
collectives recorded between marks, and where each parameter a rank holds sits in the dense layer."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from dtp.tp import tensor_parallel as tp

from ...compare import CheckFailed, expect, expect_close

# PyTorch's own tensor parallelism (DTensor): each exercise asks for what these do. (Not loss_parallel:
# a @contextmanager, whose source file the guard would take to be the standard library's contextlib.py.)
DTENSOR_TP = tuple(f"torch.distributed.tensor.parallel.{name}" for name in
                   ("parallelize_module", "ColwiseParallel", "RowwiseParallel", "SequenceParallel"))


def close(actual, expected, what: str, rtol: float = 1e-4) -> None:
    """float32 work against a float64 oracle: tolerance scaled to the reference's magnitude."""
    expect(actual is not None, f"{what} is missing (None): did the gradient reach it?")
    expected = np.asarray(expected)
    scale = float(np.abs(expected).max()) if expected.size else 1.0
    expect_close(actual, expected.astype(np.float32), what, rtol=rtol, atol=rtol * max(scale, 1.0))


def matches(actual, expected, rtol: float = 1e-4) -> bool:
    try:
        close(actual, expected, "", rtol)
        return True
    except CheckFailed:
        return False


def held_parameters(module: nn.Module) -> list[dict]:
    """What a rank holds: each parameter's name, values and gradient."""
    return [{"name": name, "value": p.detach().numpy().copy(),
             "grad": None if p.grad is None else p.grad.numpy().copy()} for name, p in module.named_parameters()]


def leaf(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array)).requires_grad_()


def run_backward(output, upstream: torch.Tensor, what: str) -> None:
    """output.backward(upstream), with the learner's most likely slips explained."""
    if not isinstance(output, torch.Tensor):
        raise CheckFailed(f"{what} returned a {type(output).__name__}, not a tensor")
    if tuple(output.shape) != tuple(upstream.shape):
        raise CheckFailed(f"{what} returned shape {tuple(output.shape)}; this rank's output should have shape "
                          f"{tuple(upstream.shape)}")
    if not output.requires_grad:
        raise CheckFailed(f"{what}'s output does not require grad: autograd lost track of it (a detach, .data or "
                          "numpy inside?); write the communication as a torch.autograd.Function")
    output.backward(upstream)


def describe_collectives(summary: dict[str, list[int]]) -> str:
    if not summary:
        return "no collective"
    return ", ".join(f"{len(sizes)} {op} ({', '.join(f'{s:,}' for s in sizes)} bytes)" for op, sizes in summary.items())


def expect_collectives(events: list[dict], start: str, stop: str, wanted: dict[str, list[int]], what: str,
                        advice: str = "", merge: bool = True) -> None:
    """The collectives between two marks are `wanted` ({op: [bytes, ...]}, any order); with
    `merge`, a reduce-scatter followed by an all-gather counts as the all-reduce it is."""
    found = tp.events_between(events, start, stop)
    summary = tp.summarize(tp.as_all_reduces(found) if merge else found)
    if not same_collectives(summary, wanted, padding=64 if merge else 0):
        raise CheckFailed(f"{what} issued {describe_collectives(summary)}; it should issue {describe_collectives(wanted)}"
                          + (f": {advice}" if advice else ""))


def same_collectives(found: dict[str, list[int]], wanted: dict[str, list[int]], padding: int) -> bool:
    """Same operations, counts and sizes; a size may exceed the wanted one by less than `padding`
    bytes (a reduce-scatter pads a tensor to a multiple of t elements)."""
    if set(found) != set(wanted):
        return False
    return all(len(found[op]) == len(sizes) and all(0 <= got - want <= padding for got, want in
                                                     zip(sorted(found[op]), sorted(sizes))) for op, sizes in wanted.items())


# --- where a rank's parameters sit in the dense model -------------------------------------------

class DenseParameters:
    """The dense model's parameters by name, and a way to find any piece of them by value: a row
    of a matrix by its bytes, a column likewise, a vector element by its value (the grader makes
    every value random, so each identifies one place)."""

    def __init__(self, named: dict[str, np.ndarray]):
        self.named = {name: np.asarray(value, dtype=np.float32) for name, value in named.items()}
        self._rows = {name: {v.tobytes(): i for i, v in enumerate(m)} for name, m in self.named.items() if m.ndim == 2}
        self._columns = {name: {v.tobytes(): i for i, v in enumerate(np.ascontiguousarray(m.T))}
                         for name, m in self.named.items() if m.ndim == 2}
        self._elements = {name: {float(x): i for i, x in enumerate(m.ravel())} for name, m in self.named.items()}

    def locate(self, value: np.ndarray) -> tuple[str, np.ndarray] | None:
        """(dense name, flat indices with value's shape) of a piece of a dense parameter, or None.
        A matrix may be stored either way round (nn.Linear's weight, or A = weightᵀ)."""
        value = np.asarray(value)
        if value.dtype != np.float32 or value.size == 0:
            return None
        found = self._locate(value)
        if found is None and value.ndim == 2:
            transposed = self._locate(np.ascontiguousarray(value.T))
            found = None if transposed is None else (transposed[0], transposed[1].T)
        return found

    def _locate(self, value: np.ndarray) -> tuple[str, np.ndarray] | None:
        for name, dense in self.named.items():
            if value.ndim == 2 and dense.ndim == 2 and value.shape[1] == dense.shape[1]:
                rows = [self._rows[name].get(np.ascontiguousarray(r).tobytes()) for r in value]
                if None not in rows:
                    return name, np.array(rows)[:, None] * dense.shape[1] + np.arange(dense.shape[1])
            if value.ndim == 2 and dense.ndim == 2 and value.shape[0] == dense.shape[0]:
                columns = [self._columns[name].get(np.ascontiguousarray(c).tobytes()) for c in value.T]
                if None not in columns:
                    return name, np.arange(dense.shape[0])[:, None] * dense.shape[1] + np.array(columns)
            if value.ndim == 1 and dense.ndim == 1:
                indices = [self._elements[name].get(float(x)) for x in value]
                if None not in indices:
                    return name, np.array(indices)
        return None


def locate_shards(dense: DenseParameters, per_rank: list[list[dict]], split: set[str], what: str) -> list[tuple]:
    """Every parameter of every rank is an exact piece of one dense parameter; the ranks together
    hold every dense element, those in `split` once in all, the others whole on every rank.
    Returns (rank, parameter, dense name, flat indices) for each parameter."""
    n = len(per_rank)
    held: dict[str, list[np.ndarray]] = {name: [np.zeros(0, dtype=int)] * n for name in dense.named}
    located = []
    for rank, parameters in enumerate(per_rank):
        for parameter in parameters:
            found = dense.locate(parameter["value"])
            expect(found is not None,
                   f"{what}: rank {rank}'s parameter `{parameter['name']}` (shape {np.shape(parameter['value'])}) is not "
                   "a piece of the dense layer's weights: copy the dense values into your shards (float32, by rows or "
                   "columns of the dense matrices), without changing them")
            name, indices = found
            held[name][rank] = np.concatenate([held[name][rank], indices.ravel()])
            located.append((rank, parameter, name, indices))
    for name, per_rank_indices in held.items():
        size = dense.named[name].size
        counts = np.bincount(np.concatenate(per_rank_indices), minlength=size)
        if not counts.all():
            raise CheckFailed(f"{what}: no rank holds element {int(np.argmin(counts))} of the dense `{name}` "
                              f"(shape {dense.named[name].shape}): the shards must cover the whole layer")
        if name in split and counts.max() > 1:
            raise CheckFailed(f"{what}: some of `{name}` is held by {int(counts.max())} ranks; tensor parallelism "
                              f"splits it, so each rank should hold a different 1/{n} of it")
        if name not in split and any(len(np.unique(i)) != size for i in per_rank_indices):
            raise CheckFailed(f"{what}: `{name}` should be whole on every rank (it is replicated), but some rank "
                              "holds only part of it")
    return located


def scaled_gradient_causes(grad, expected, n: int, rows: int | None) -> list[str]:
    """The mistakes that give exactly `grad` for a replicated parameter whose dense gradient is
    `expected`: summed over n ranks that each held all of it (n times), divided among the ranks
    (1/n), or averaged over the `rows` tokens instead of summed (1/rows). Several when the
    numbers coincide (rows = n), none when grad is no such multiple."""
    causes = []
    if matches(grad, n * expected):
        causes.append(f"{n}x the dense one: it was summed over ranks that each already held all of it")
    if matches(grad, expected / n):
        causes.append(f"1/{n} of the dense one: the ranks' contributions must be summed, not averaged (or the "
                      f"parameter was divided among the {n} ranks)")
    if rows and rows > 1 and matches(grad, expected / rows):
        causes.append(f"1/{rows} of the dense one: the mean over the {rows} rows (b·s tokens) instead of their sum; a "
                      "parameter applied to every row receives every row's gradient")
    return causes


def judge_gradients(located: list[tuple], dense_grads: dict[str, np.ndarray], split: set[str], n: int, what: str,
                    rtol: float = 1e-4, rows: int | None = None) -> None:
    """Each located parameter's gradient equals the dense gradient at the same place."""
    for rank, parameter, name, indices in located:
        expected = dense_grads[name].ravel()[indices]
        grad = parameter["grad"]
        expect(grad is not None, f"{what}: rank {rank}'s `{parameter['name']}` got no gradient: is it used in forward?")
        if name not in split and isinstance(grad, np.ndarray) and grad.shape == expected.shape \
                and np.abs(expected).max() > 0 and not matches(grad, expected, rtol):
            causes = scaled_gradient_causes(grad, expected, n, rows)
            if causes:
                raise CheckFailed(f"{what}: rank {rank}'s gradient of the replicated `{name}` is "
                                  + "; or it is ".join(causes))
        close(grad, expected, f"{what}: rank {rank}'s gradient of `{parameter['name']}` (part of `{name}`)", rtol)


def judge_shards(dense: DenseParameters, dense_grads: dict[str, np.ndarray], per_rank: list[list[dict]],
                 split: set[str], what: str) -> list[tuple]:
    located = locate_shards(dense, per_rank, split, what)
    judge_gradients(located, dense_grads, split, len(per_rank), what)
    return located

