"""Checks of the tensor-parallelism chapter (notebook 03_tensor_parallel).

Oracles, computed in the grader: the dense computation in float64 (numpy, or a dtp.gpt Block
with the same weights), torch's own cross-entropy and embedding, and the closed forms of
`dtp.tensor_parallel`, which tests/test_tp_formulas.py checks against gloo runs.
Mechanisms, from what the learner's code did on each rank: the collectives recorded on the
process group between marks (forward, backward), where each parameter a rank holds sits in the
dense layer (located by value, so any layout of the shards is accepted), and the shape of every
tensor the rank created while computing the loss.
"""
from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from dtp import tensor_parallel as tp
from dtp.traffic import CommunicationLog

from ..compare import CheckFailed, expect, expect_answer, expect_close
from ..registry import Check, exercise
from .common import FixedAnswers, completed_worlds, describe_call, events_as_data, raise_world_failure, run_worlds

# PyTorch's own tensor parallelism (DTensor): each exercise asks for what these do. (Not loss_parallel:
# a @contextmanager, whose source file the guard would take to be the standard library's contextlib.py.)
DTENSOR_TP = tuple(f"torch.distributed.tensor.parallel.{name}" for name in
                   ("parallelize_module", "ColwiseParallel", "RowwiseParallel", "SequenceParallel"))


def _close(actual, expected, what: str, rtol: float = 1e-4) -> None:
    """float32 work against a float64 oracle: tolerance scaled to the reference's magnitude."""
    expect(actual is not None, f"{what} is missing (None): did the gradient reach it?")
    expected = np.asarray(expected)
    scale = float(np.abs(expected).max()) if expected.size else 1.0
    expect_close(actual, expected.astype(np.float32), what, rtol=rtol, atol=rtol * max(scale, 1.0))


def _matches(actual, expected, rtol: float = 1e-4) -> bool:
    try:
        _close(actual, expected, "", rtol)
        return True
    except CheckFailed:
        return False


def _parameters(module: nn.Module) -> list[dict]:
    """What a rank holds: each parameter's name, values and gradient."""
    return [{"name": name, "value": p.detach().numpy().copy(),
             "grad": None if p.grad is None else p.grad.numpy().copy()} for name, p in module.named_parameters()]


def _leaf(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array)).requires_grad_()


def _backward(output, upstream: torch.Tensor, what: str) -> None:
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


def _describe(summary: dict[str, list[int]]) -> str:
    if not summary:
        return "no collective"
    return ", ".join(f"{len(sizes)} {op} ({', '.join(f'{s:,}' for s in sizes)} bytes)" for op, sizes in summary.items())


def _expect_collectives(events: list[dict], start: str, stop: str, wanted: dict[str, list[int]], what: str,
                        advice: str = "", merge: bool = True) -> None:
    """The collectives between two marks are `wanted` ({op: [bytes, ...]}, any order); with
    `merge`, a reduce-scatter followed by an all-gather counts as the all-reduce it is."""
    found = tp.events_between(events, start, stop)
    summary = tp.summarize(tp.as_all_reduces(found) if merge else found)
    if not _same_collectives(summary, wanted, padding=64 if merge else 0):
        raise CheckFailed(f"{what} issued {_describe(summary)}; it should issue {_describe(wanted)}"
                          + (f": {advice}" if advice else ""))


def _same_collectives(found: dict[str, list[int]], wanted: dict[str, list[int]], padding: int) -> bool:
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


def judge_gradients(located: list[tuple], dense_grads: dict[str, np.ndarray], split: set[str], n: int, what: str,
                    rtol: float = 1e-4) -> None:
    """Each located parameter's gradient equals the dense gradient at the same place."""
    for rank, parameter, name, indices in located:
        expected = dense_grads[name].ravel()[indices]
        grad = parameter["grad"]
        expect(grad is not None, f"{what}: rank {rank}'s `{parameter['name']}` got no gradient: is it used in forward?")
        if name not in split and isinstance(grad, np.ndarray) and grad.shape == expected.shape \
                and np.abs(expected).max() > 0 and not _matches(grad, expected, rtol):
            ratio = float(np.sum(grad * expected) / np.sum(expected * expected))
            if abs(ratio - n) < 0.05 * n:
                raise CheckFailed(f"{what}: rank {rank}'s gradient of the replicated `{name}` is {n}x the dense one: "
                                  "it was summed over ranks that each already held all of it")
            if abs(ratio - 1 / n) < 0.05 / n:
                raise CheckFailed(f"{what}: rank {rank}'s gradient of the replicated `{name}` is 1/{n} of the dense "
                                  "one: the ranks' contributions must be summed, not averaged")
        _close(grad, expected, f"{what}: rank {rank}'s gradient of `{parameter['name']}` (part of `{name}`)", rtol)


def judge_shards(dense: DenseParameters, dense_grads: dict[str, np.ndarray], per_rank: list[list[dict]],
                 split: set[str], what: str) -> list[tuple]:
    located = locate_shards(dense, per_rank, split, what)
    judge_gradients(located, dense_grads, split, len(per_rank), what)
    return located


# --- 1. numpy MLP over simulated ranks -------------------------------------------------------------

def _gelu(x: np.ndarray) -> np.ndarray:
    return F.gelu(torch.from_numpy(x)).numpy()  # torch's exact GeLU in float64, independent of gelu_numpy


@exercise("tp.mlp_numpy", points=2)
class MlpNumpy(Check):
    """Verifies: y equals the dense GeLU(x·w1 + b1)·w2 + b2 in float64, and partial_sums[r] is
    what rank r holds before the all-reduce, GeLU(x·A_r + b1_r)·B_r (A_r: the r-th block of
    columns of w1, B_r: the r-th block of rows of w2), for t = 1, 4h and random divisors of 4h.
    Fakes: the dense MLP with made-up partial sums (each is compared with its own oracle);
    w2 split by columns after gathering the hidden layer (partial sums of the wrong shape).
    """

    reads = ("tensor_parallel_mlp_numpy",)
    timeout_s = 30

    def prepare(self, rng):
        cases = []
        for index in range(5):
            hidden = int(rng.choice([3, 4, 5, 6, 8]))
            divisors = [d for d in range(2, 4 * hidden) if (4 * hidden) % d == 0]
            # t = 1; a t dividing h too (so a split of x's features is possible); one column per rank; any divisor
            t = [1, int(rng.choice([d for d in divisors + [hidden] if hidden % d == 0])), 4 * hidden][index] \
                if index < 3 else int(rng.choice(divisors))
            tokens = int(rng.integers(1, 6))
            cases.append({"t": t, "x": rng.standard_normal((tokens, hidden)),
                          "w1": rng.standard_normal((hidden, 4 * hidden)) / np.sqrt(hidden),
                          "b1": rng.standard_normal(4 * hidden), "w2": rng.standard_normal((4 * hidden, hidden)) / 2,
                          "b2": rng.standard_normal(hidden)})
        return cases

    def collect(self, student, cases):
        answers = []
        for case in cases:  # every case, so that the judge can report the first one that goes wrong
            copies = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in case.items()}
            try:
                answers.append(student.tensor_parallel_mlp_numpy(copies["x"], copies["w1"], copies["b1"], copies["w2"],
                                                                 copies["b2"], copies["t"]))
            except NotImplementedError:
                raise
            except Exception as error:  # noqa: BLE001 - reported for its case, in order
                answers.append({"raised": f"{type(error).__name__}: {str(error)[:200]}"})
        return answers

    def judge(self, cases, answers) -> str:
        expect(len(answers) == len(cases), "the grader's calls did not all return")
        for case, answer in zip(cases, answers):
            t, x, w1, b1, w2, b2 = (case[k] for k in ("t", "x", "w1", "b1", "w2", "b2"))
            what = f"t={t}, x of shape {x.shape}, w1 of shape {w1.shape}"
            if isinstance(answer, dict) and "raised" in answer:
                raise CheckFailed(f"{what}: tensor_parallel_mlp_numpy raised {answer['raised']}")
            expect(isinstance(answer, (tuple, list)) and len(answer) == 2,
                   f"{what}: return a pair (y, partial_sums)")
            y, partial_sums = answer
            dense = _gelu(x @ w1 + b1) @ w2 + b2
            if not _matches_f64(y, dense):
                well_formed = isinstance(y, np.ndarray) and y.shape == dense.shape and y.dtype == np.float64 \
                    and np.all(np.isfinite(y))
                if not well_formed:
                    expect_close(y, dense, f"{what}: y", rtol=1e-9, atol=1e-9)  # names the shape, dtype or NaN
                worst = float(np.abs(y - dense).max())
                raise CheckFailed(f"{what}: y differs from the dense MLP GeLU(x·w1 + b1)·w2 + b2 (max abs error "
                                  f"{worst:.3g}){_diagnose_numpy_mlp(y, case)}")
            expect(isinstance(partial_sums, (list, tuple)) and len(partial_sums) == t,
                   f"{what}: partial_sums should be a list of t = {t} arrays, one per rank")
            for rank, (a, b, rows) in enumerate(zip(np.split(w1, t, axis=1), np.split(b1, t), np.split(w2, t, axis=0))):
                expected = _gelu(x @ a + b) @ rows
                mine = partial_sums[rank]
                if isinstance(mine, np.ndarray) and mine.shape != expected.shape:
                    raise CheckFailed(f"{what}: partial_sums[{rank}] has shape {mine.shape}, expected {expected.shape}: "
                                      "each rank's partial sum covers every output feature. Splitting w2 by columns "
                                      "instead gives each rank a slice of the outputs, and needs the whole hidden "
                                      "activation GeLU(x·w1) on every rank (an all-gather of 4h values per token)")
                if isinstance(mine, np.ndarray) and _matches_f64(mine, expected + b2):
                    raise CheckFailed(f"{what}: partial_sums[{rank}] includes b2; add b2 once, after the sum, or the "
                                      f"all-reduce adds it t = {t} times")
                expect_close(mine, expected, f"{what}: partial_sums[{rank}], which should be GeLU(x·A_r + b1_r)·B_r "
                             "(A_r: rank r's block of w1's columns, B_r: its block of w2's rows, as np.split cuts them)",
                             rtol=1e-9, atol=1e-9)
        return ("y equals the dense MLP and every rank's partial sum is GeLU(x·A_r + b1_r)·B_r, for t = 1, 4h and "
                "random divisors of 4h: no communication before the GeLU, one sum after it")


def _matches_f64(actual, expected) -> bool:
    return isinstance(actual, np.ndarray) and actual.shape == expected.shape and \
        np.allclose(actual, expected, rtol=1e-9, atol=1e-9)


def _diagnose_numpy_mlp(y, case) -> str:
    t, x, w1, b1, w2, b2 = (case[k] for k in ("t", "x", "w1", "b1", "w2", "b2"))
    dense = _gelu(x @ w1 + b1) @ w2 + b2
    if _matches_f64(y, dense + (t - 1) * b2):
        return f": it is b2 too large by (t-1)·b2; each rank added b2 to its partial sum, so the sum holds it t = {t} times"
    if _matches_f64(y, np.maximum(x @ w1 + b1, 0) @ w2 + b2):
        return ": that is a ReLU MLP (np.maximum); this one uses the exact GeLU, x·Φ(x) (gelu_numpy)"
    if x.shape[1] % t == 0:
        x_parts, w1_rows = np.split(x, t, axis=1), np.split(w1, t, axis=0)
        for b1_share in (b1 / t, b1):
            row_first = sum(_gelu(xp @ w + b1_share) for xp, w in zip(x_parts, w1_rows)) @ w2 + b2
            if _matches_f64(y, row_first):
                return (": you split w1 by rows, so each rank holds a partial sum of x·w1, and GeLU(a + b) is not "
                        "GeLU(a) + GeLU(b); that split needs an all-reduce before the GeLU. Split w1 by columns")
    return ""


# --- 2. the conjugate operators f and g ------------------------------------------------------------

def _f_and_g_on_rank(rank, world_size, f, g, arrays):
    mine = {k: v[rank] for k, v in arrays.items()}
    x_f, x_g = _leaf(mine["x_f"]), _leaf(mine["x_g"])
    with CommunicationLog() as log:
        log.mark("f forward")
        out_f = f(x_f)
        log.mark("f backward")
        _backward(out_f, torch.from_numpy(mine["dy_f"]), "f")
        log.mark("g forward")
        out_g = g(x_g)
        log.mark("g backward")
        _backward(out_g, torch.from_numpy(mine["dy_g"]), "g")
        log.mark("done")
    return {"f": out_f, "f_grad": x_f.grad, "g": out_g, "g_grad": x_g.grad, "events": events_as_data(log)}


@exercise("tp.f_and_g", points=2)
class FAndG(Check):
    """Verifies: on gloo worlds of 2 and 3 with different inputs and upstream gradients on every
    rank, f returns its input and its backward returns the sum of the ranks' gradients; g returns
    the sum of the ranks' inputs and its backward returns the rank's own gradient; f issues one
    all-reduce in backward only, g one in forward only (a reduce-scatter plus an all-gather counts
    as one). Fakes: swapped operators, torch.distributed.nn's all_reduce (which all-reduces in
    backward too), averaging: each is caught by its values or by the recorded collectives.
    """

    reads = ("copy_to_tensor_parallel", "reduce_from_tensor_parallel")
    timeout_s = 40
    runs_world = True

    def prepare(self, rng):
        worlds = []
        for n in (2, 3):
            shape = (int(rng.integers(2, 5)), int(rng.integers(3, 7)))
            worlds.append((n, {k: [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]
                               for k in ("x_f", "dy_f", "x_g", "dy_g")}))
        return worlds

    def collect(self, student, worlds):
        return run_worlds(_f_and_g_on_rank, [(n, (student.copy_to_tensor_parallel, student.reduce_from_tensor_parallel,
                                                  arrays)) for n, arrays in worlds])

    def judge(self, worlds, outcomes) -> str:
        done, failure = completed_worlds(outcomes)
        for (n, arrays), per_rank in zip(worlds, done):
            sums = {k: np.sum(np.array(v, dtype=np.float64), axis=0) for k, v in arrays.items()}
            nbytes = arrays["x_f"][0].nbytes
            for rank, outcome in enumerate(per_rank):
                what = f"world {n}, rank {rank}"
                if _matches(outcome["f"], sums["x_f"]):
                    raise CheckFailed(f"{what}: f returned the sum over ranks; f is the identity in forward (its "
                                      "input is already whole on every rank); the forward all-reduce is g's")
                _close(outcome["f"], arrays["x_f"][rank], f"{what}: f(x), which should be x unchanged")
                if outcome["f_grad"] is not None and _matches(outcome["f_grad"], arrays["dy_f"][rank]):
                    raise CheckFailed(f"{what}: f's backward returned the rank's own gradient; x is used on every "
                                      "rank, so dL/dx is the sum of every rank's gradient: all-reduce it")
                if outcome["f_grad"] is not None and _matches(outcome["f_grad"], sums["dy_f"] / n):
                    raise CheckFailed(f"{what}: f's backward averaged the gradients; sum them (dist.all_reduce's default)")
                expect(outcome["f_grad"] is not None, f"{what}: no gradient reached f's input")
                _close(outcome["f_grad"], sums["dy_f"], f"{what}: the gradient f passes back, which should be the sum")
                if _matches(outcome["g"], arrays["x_g"][rank]):
                    raise CheckFailed(f"{what}: g returned its input; g sums the ranks' partial results in forward")
                _close(outcome["g"], sums["x_g"], f"{what}: g(x), which should be the sum over ranks")
                expect(outcome["g_grad"] is not None, f"{what}: no gradient reached g's input")
                if _matches(outcome["g_grad"], sums["dy_g"]):
                    raise CheckFailed(f"{what}: g's backward all-reduced the gradient; g's output is the same on every "
                                      "rank, so each rank already holds the whole gradient: pass it through unchanged "
                                      "(torch.distributed.nn.functional.all_reduce is not g: it all-reduces in backward "
                                      "too)")
                _close(outcome["g_grad"], arrays["dy_g"][rank], f"{what}: the gradient g passes back, which should be "
                                                                  "the rank's own, unchanged")
                events, one = outcome["events"], {"all_reduce": [nbytes]}
                _expect_collectives(events, "f forward", "f backward", {}, f"{what}: f's forward")
                _expect_collectives(events, "f backward", "g forward", one, f"{what}: f's backward")
                _expect_collectives(events, "g forward", "g backward", one, f"{what}: g's forward")
                _expect_collectives(events, "g backward", "done", {}, f"{what}: g's backward")
        raise_world_failure(failure)
        return ("f: identity forward, one all-reduce (sum) backward; g: one all-reduce forward, identity backward; "
                "checked with different inputs and gradients on 2 and 3 ranks")


# --- 3. column- and row-parallel linear layers -------------------------------------------------------

def _dense_linear(weight: np.ndarray, bias: np.ndarray) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(weight))
        layer.bias.copy_(torch.from_numpy(bias))
    return layer


def _slice(array: np.ndarray, n: int, rank: int, dim: int = -1) -> np.ndarray:
    start, stop = tp.shard_bounds(array.shape[dim], n, rank)
    return np.ascontiguousarray(np.moveaxis(np.moveaxis(array, dim, 0)[start:stop], 0, dim))


def _linears_on_rank(rank, world_size, column_class, row_class, data):
    column = column_class(_dense_linear(data["w_column"], data["b_column"]))
    row = row_class(_dense_linear(data["w_row"], data["b_row"]))
    x = _leaf(data["x_column"])
    x_shard = _leaf(_slice(data["x_row"], world_size, rank))
    with CommunicationLog() as log:
        log.mark("column forward")
        y = column(x)
        log.mark("column backward")
        _backward(y, torch.from_numpy(_slice(data["dy_column"], world_size, rank)),
                  "ColumnParallelLinear (its output holds this rank's out_features, by tensor_split)")
        log.mark("row forward")
        try:
            z = row(x_shard)
        except RuntimeError as error:
            if "shapes cannot be multiplied" not in str(error):
                raise
            raise CheckFailed(f"RowParallelLinear failed on an input shard of shape {tuple(x_shard.shape)}: {error}. "
                              "A row-parallel layer multiplies its in_features/t inputs by the matching columns of "
                              "nn.Linear's weight (dim 1), the rows of W") from None
        log.mark("row backward")
        _backward(z, torch.from_numpy(data["dy_row"]), "RowParallelLinear (its output is whole on every rank)")
        log.mark("done")
    return {"y": y, "x_grad": x.grad, "column": _parameters(column), "z": z, "x_shard_grad": x_shard.grad,
            "row": _parameters(row), "events": events_as_data(log)}


@exercise("tp.parallel_linear", points=3)
class ParallelLinear(Check):
    """Verifies: on 2 and 4 ranks, with feature counts not divisible by t, ColumnParallelLinear
    returns its rank's output features and passes back the full input gradient (one all-reduce,
    in backward only); RowParallelLinear takes its rank's input features and returns the whole
    output with the bias added once (one all-reduce, in forward only); every weight and bias a
    rank holds is a piece of the dense layer (split where it should be, the row layer's bias
    whole on every rank) and its gradient equals the dense gradient there.
    Fakes: a dense layer on every rank (the weights it holds are not split); the bias added on
    every rank, or divided by t (output or bias gradient off); all-gathers in place of the
    all-reduce (the recorded collectives).
    """

    reads = ("ColumnParallelLinear", "RowParallelLinear")
    references = DTENSOR_TP
    timeout_s = 40
    runs_world = True

    def prepare(self, rng):
        worlds = []
        for n in (2, 4):
            batch, seq = int(rng.integers(1, 3)), int(rng.integers(2, 5))
            d_in, width, d_out = int(rng.integers(3, 8)), n * int(rng.integers(2, 4)) + int(rng.integers(1, n)), \
                int(rng.integers(3, 8))
            normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
            worlds.append((n, {"w_column": normal(width, d_in) / np.float32(np.sqrt(d_in)), "b_column": normal(width),
                               "w_row": normal(d_out, width) / np.float32(np.sqrt(width)), "b_row": normal(d_out),
                               "x_column": normal(batch, seq, d_in), "dy_column": normal(batch, seq, width),
                               "x_row": normal(batch, seq, width), "dy_row": normal(batch, seq, d_out)}))
        return worlds

    def collect(self, student, worlds):
        return run_worlds(_linears_on_rank, [(n, (student.ColumnParallelLinear, student.RowParallelLinear, data))
                                             for n, data in worlds])

    def judge(self, worlds, outcomes) -> str:
        done, failure = completed_worlds(outcomes)
        for (n, data), per_rank in zip(worlds, done):
            d = {k: v.astype(np.float64) for k, v in data.items()}
            y = d["x_column"] @ d["w_column"].T + d["b_column"]
            z = d["x_row"] @ d["w_row"].T + d["b_row"]
            column_grads = {"weight": np.einsum("bso,bsi->oi", d["dy_column"], d["x_column"]),
                            "bias": d["dy_column"].sum(axis=(0, 1))}
            row_grads = {"weight": np.einsum("bso,bsi->oi", d["dy_row"], d["x_row"]), "bias": d["dy_row"].sum(axis=(0, 1))}
            for rank, outcome in enumerate(per_rank):
                what = f"world {n}, rank {rank}"
                _close(outcome["y"], _slice(y, n, rank), f"{what}: ColumnParallelLinear's output")
                partial = _slice(d["dy_column"], n, rank) @ _slice(d["w_column"], n, rank, 0)
                if _matches(outcome["x_grad"], partial):
                    raise CheckFailed(f"{what}: ColumnParallelLinear passed back only this rank's part of dL/dx; the "
                                      "input is used by every rank's columns, so its gradient is the sum over ranks: "
                                      "apply f (copy_to_tensor_parallel) to the input")
                _close(outcome["x_grad"], d["dy_column"] @ d["w_column"], f"{what}: ColumnParallelLinear's input gradient")
                if _matches(outcome["z"], z + (n - 1) * d["b_row"]):
                    raise CheckFailed(f"{what}: RowParallelLinear's output holds the bias {n} times: every rank added "
                                      "it before the all-reduce; add it once, after the sum")
                _close(outcome["z"], z, f"{what}: RowParallelLinear's output")
                _close(outcome["x_shard_grad"], _slice(d["dy_row"] @ d["w_row"], n, rank),
                       f"{what}: RowParallelLinear's input-shard gradient")
                bias = [p for p in outcome["row"] if np.shape(p["value"]) == d["b_row"].shape
                        and np.array_equal(p["value"], data["b_row"])]
                if bias and bias[0]["grad"] is None:
                    raise CheckFailed(f"{what}: RowParallelLinear's bias got no gradient on this rank; every rank must "
                                      "add the whole bias to the all-reduced output, once, after the sum")
                if bias and not _matches(bias[0]["grad"], row_grads["bias"]):
                    ratio = float(np.sum(bias[0]["grad"] * row_grads["bias"]) / np.sum(row_grads["bias"] ** 2))
                    hint = (f"it is 1/{n} of the dense gradient: the bias was divided among the ranks"
                            if abs(ratio - 1 / n) < 0.05 / n else "the bias must be added by every rank, after the sum")
                    raise CheckFailed(f"{what}: the gradient of RowParallelLinear's bias differs from the dense layer's "
                                      f"({hint}); add the whole bias once to the all-reduced output, on every rank")
            judge_shards(DenseParameters({"weight": data["w_column"], "bias": data["b_column"]}), column_grads,
                         [o["column"] for o in per_rank], {"weight", "bias"}, f"ColumnParallelLinear (world {n})")
            judge_shards(DenseParameters({"weight": data["w_row"], "bias": data["b_row"]}), row_grads,
                         [o["row"] for o in per_rank], {"weight"}, f"RowParallelLinear (world {n})")
            for rank, outcome in enumerate(per_rank):
                events, what = outcome["events"], f"world {n}, rank {rank}"
                _expect_collectives(events, "column forward", "column backward", {},
                                    f"{what}: ColumnParallelLinear's forward",
                                    "its input is whole on every rank and each rank computes its own columns")
                _expect_collectives(events, "column backward", "row forward", {"all_reduce": [data["x_column"].nbytes]},
                                    f"{what}: ColumnParallelLinear's backward", "one all-reduce of dL/dx (f)")
                _expect_collectives(events, "row forward", "row backward", {"all_reduce": [data["dy_row"].nbytes]},
                                    f"{what}: RowParallelLinear's forward",
                                    "one all-reduce adds the ranks' partial products (g); a column split of W needs "
                                    "all-gathers instead")
                _expect_collectives(events, "row backward", "done", {}, f"{what}: RowParallelLinear's backward")
        raise_world_failure(failure)
        return ("on 2 and 4 ranks (features not divisible by t): outputs, input, weight and bias gradients equal the "
                "dense layer's; the row layer adds its bias once; one all-reduce each, in backward (column) and "
                "forward (row)")


# --- 4 and 5. the tensor-parallel and sequence-parallel block ------------------------------------------

BLOCK_SPLIT = {"attention.qkv.weight", "attention.qkv.bias", "attention.proj.weight", "mlp.up.weight",
               "mlp.up.bias", "mlp.down.weight"}


def _block_case(rng, n: int, sequence_parallel: bool) -> tuple:
    heads = int(rng.choice([4, 8]))
    head_size = int(rng.integers(2, 5))
    batch = int(rng.integers(1, 3))
    seq = n * int(rng.integers(1, 4)) if sequence_parallel else int(rng.integers(2, 7))
    hidden = heads * head_size
    return (n, {"hidden": hidden, "heads": heads, "seed": int(rng.integers(1 << 20)),
                "x": rng.standard_normal((batch, seq, hidden)).astype(np.float32),
                "dy": rng.standard_normal((batch, seq, hidden)).astype(np.float32)})


def _block_on_rank(rank, world_size, block_class, sync, case, sequence_parallel):
    block = tp.random_block(case["hidden"], case["heads"], case["seed"])
    parallel = block_class(block)
    x, dy = case["x"], case["dy"]
    if sequence_parallel:
        x, dy = (np.ascontiguousarray(np.array_split(a, world_size, axis=1)[rank]) for a in (x, dy))
    x = _leaf(x)
    with CommunicationLog() as log:
        log.mark("forward")
        out = parallel(x)
        log.mark("backward")
        _backward(out, torch.from_numpy(dy), type(parallel).__name__)
        log.mark("sync")
        if sync is not None:
            sync(parallel)
        log.mark("done")
    return {"out": out, "x_grad": x.grad, "parameters": _parameters(parallel), "events": events_as_data(log)}


def dense_block_reference(case) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The oracle: the same dtp.gpt Block in float64, forward and backward on the whole input."""
    block = tp.random_block(case["hidden"], case["heads"], case["seed"])
    values = {name: p.detach().numpy().copy() for name, p in block.named_parameters()}
    reference = copy.deepcopy(block).double()
    x = torch.from_numpy(case["x"]).double().requires_grad_()
    out = reference(x)
    out.backward(torch.from_numpy(case["dy"]).double())
    grads = {name: p.grad.numpy() for name, p in reference.named_parameters()}
    return out.detach().numpy(), x.grad.numpy(), values, grads


def _judge_heads(located: list[tuple], n: int, hidden: int, heads: int, what: str) -> None:
    """Each rank's rows of the fused [q; k; v] weight are q, k and v of the same whole heads."""
    head_size = hidden // heads
    for rank in range(n):
        indices = np.concatenate([i.ravel() for r, _, name, i in located if r == rank and name == "attention.qkv.weight"])
        rows = np.unique(indices // hidden)
        by_part = [set((rows[rows // hidden == part] % hidden) // head_size) for part in range(3)]
        whole = all(np.sum((rows // head_size) == head) == head_size for head in np.unique(rows // head_size))
        if not (by_part[0] == by_part[1] == by_part[2]) or not whole:
            names = ", ".join(f"{part} of heads {sorted(int(h) for h in heads_held)}"
                              for part, heads_held in zip("qkv", by_part))
            raise CheckFailed(f"{what}: rank {rank} holds rows of the fused qkv weight giving {names}. Split attention "
                              f"by heads: each rank needs q, k and v of the same {heads // n} whole heads (the weight "
                              "stacks [q; k; v], so a contiguous split of its rows does not do that)")


def _judge_block(case, n, per_rank, sequence_parallel: bool, what_block: str) -> None:
    out, x_grad, values, grads = dense_block_reference(case)
    dense = DenseParameters(values)
    label = f"{what_block} (world {n}, hidden {case['hidden']}, {case['heads']} heads)"
    located = locate_shards(dense, [o["parameters"] for o in per_rank], BLOCK_SPLIT, label)
    _judge_heads(located, n, case["hidden"], case["heads"], label)
    judge_gradients(located, grads, BLOCK_SPLIT, n, label)
    for rank, outcome in enumerate(per_rank):
        want_out, want_grad = out, x_grad
        if sequence_parallel:
            want_out, want_grad = (np.array_split(a, n, axis=1)[rank] for a in (out, x_grad))
        _close(outcome["out"], want_out, f"{label}: rank {rank}'s output")
        _close(outcome["x_grad"], want_grad, f"{label}: rank {rank}'s input gradient")


@exercise("tp.parallel_block", points=4)
class ParallelBlock(Check):
    """Verifies: TensorParallelBlock(block) on 2 and 4 ranks equals the dense dtp.gpt Block (same
    random weights, LayerNorms included) in output, input gradient and every parameter gradient;
    each rank holds q, k and v of the same t-th of the heads and 1/t of every matrix; forward
    issues exactly 2 all-reduces of b·s·h floats and backward 2 more (a reduce-scatter plus an
    all-gather counts as one all-reduce). Fakes: the dense block on every rank (weights not
    split); a contiguous split of the fused qkv rows (heads check); gathering activations
    instead of all-reducing them (the recorded collectives).
    """

    reads = ("TensorParallelBlock",)
    references = DTENSOR_TP
    timeout_s = 50
    runs_world = True

    def prepare(self, rng):
        return [_block_case(rng, n, False) for n in (2, 4)]

    def collect(self, student, cases):
        return run_worlds(_block_on_rank, [(n, (student.TensorParallelBlock, None, case, False)) for n, case in cases])

    def judge(self, cases, outcomes) -> str:
        done, failure = completed_worlds(outcomes)
        for (n, case), per_rank in zip(cases, done):
            _judge_block(case, n, per_rank, False, "TensorParallelBlock")
            message = {"all_reduce": [case["x"].nbytes] * 2}
            for rank, outcome in enumerate(per_rank):
                what = f"world {n}, rank {rank}: TensorParallelBlock's"
                _expect_collectives(outcome["events"], "forward", "backward", message, f"{what} forward",
                                    "g after attention's output projection and after the MLP, each b·s·h values")
                _expect_collectives(outcome["events"], "backward", "sync", message, f"{what} backward",
                                    "f's all-reduce of dL/dx before the QKV projection and before the MLP")
        raise_world_failure(failure)
        return ("equal to the dense block in output and every gradient on 2 and 4 ranks, attention split by heads; "
                "2 all-reduces of b·s·h values in forward and 2 in backward")


@exercise("tp.sequence_parallel", points=3)
class SequenceParallel(Check):
    """Verifies: SequenceParallelBlock(block), fed its rank's piece of the sequence on 2 and 4
    ranks, returns its piece of the dense block's output and input gradient; after
    all_reduce_replicated_gradients every gradient equals the dense block's; forward issues
    2 all-gathers of b·s/t·h floats and 2 reduce-scatters of b·s·h and no all-reduce, backward
    2 reduce-scatters and 2 all-gathers (4 when the all-gather is repeated in backward, as
    Megatron-LM does to save memory), and the gradient sync all-reduces exactly the replicated
    parameters (LayerNorms and the row-parallel biases). Fakes: plain tensor parallelism with
    a slice at the end (all-reduces recorded); summing every gradient (byte count).
    """

    reads = ("SequenceParallelBlock", "all_reduce_replicated_gradients")
    references = DTENSOR_TP
    timeout_s = 50
    runs_world = True

    def prepare(self, rng):
        return [_block_case(rng, n, True) for n in (2, 4)]

    def collect(self, student, cases):
        return run_worlds(_block_on_rank, [(n, (student.SequenceParallelBlock, student.all_reduce_replicated_gradients,
                                                case, True)) for n, case in cases])

    def judge(self, cases, outcomes) -> str:
        done, failure = completed_worlds(outcomes)
        for (n, case), per_rank in zip(cases, done):
            full, shard, hidden = case["x"].nbytes, case["x"].nbytes // n, case["hidden"]
            replicated_bytes = 6 * hidden * 4
            for rank, outcome in enumerate(per_rank):
                what = f"world {n}, rank {rank}: SequenceParallelBlock's"
                events = outcome["events"]
                _expect_collectives(events, "forward", "backward", {"all_gather": [shard] * 2, "reduce_scatter": [full] * 2},
                                    f"{what} forward", "each all-reduce of tensor parallelism becomes an all-gather of "
                                    "the sequence (before the column-parallel layer) and a reduce-scatter (after the "
                                    "row-parallel one)", merge=False)
                backward = tp.summarize(tp.events_between(events, "backward", "sync"))
                expect(backward.get("reduce_scatter") == [full] * 2 and backward.get("all_gather") in ([shard] * 2, [shard] * 4)
                       and set(backward) == {"reduce_scatter", "all_gather"},
                       f"{what} backward issued {_describe(backward)}; it should issue 2 reduce_scatter ({full:,} bytes "
                       f"each: the all-gathers' backward) and 2 all_gather ({shard:,} bytes each: the reduce-scatters' "
                       "backward), or 4 all-gathers if you repeat the forward all-gather in backward")
                sync = tp.summarize(tp.events_between(events, "sync", "done"))
                expect(set(sync) <= {"all_reduce"} and sum(sync.get("all_reduce", [])) == replicated_bytes,
                       f"{what} all_reduce_replicated_gradients issued {_describe(sync)}; it should all-reduce the "
                       f"gradients of the replicated parameters only (two LayerNorms and two row-parallel biases, "
                       f"6h = {6 * hidden} floats, {replicated_bytes} bytes), which each rank computed from its own "
                       "piece of the sequence")
            _judge_block(case, n, per_rank, True, "SequenceParallelBlock")
        raise_world_failure(failure)
        return ("equal to the dense block (output and input gradient by sequence piece, every parameter gradient after "
                "the sync) on 2 and 4 ranks; all-gathers and reduce-scatters of equal volume replace the all-reduces")


# --- 6. vocabulary-parallel embedding and cross-entropy -------------------------------------------

def _vocabulary_on_rank(rank, world_size, embedding_class, cross_entropy, data):
    dense = nn.Embedding(*data["table"].shape)
    with torch.no_grad():
        dense.weight.copy_(torch.from_numpy(data["table"]))
    embedding = embedding_class(dense)
    start, stop = tp.shard_bounds(data["logits"].shape[1], world_size, rank)
    local_logits = _leaf(data["logits"][:, start:stop])
    targets = torch.from_numpy(data["targets"])
    with CommunicationLog() as log:
        log.mark("embedding forward")
        rows = embedding(torch.from_numpy(data["tokens"]))
        log.mark("embedding backward")
        _backward(rows, torch.from_numpy(data["dy_rows"]), "VocabParallelEmbedding")
        log.mark("loss forward")
        with tp.TensorShapes() as shapes:
            losses = cross_entropy(local_logits, targets, start)
            log.mark("loss backward")
            _backward(losses, torch.from_numpy(data["loss_weights"]),
                      "vocab_parallel_cross_entropy (one loss per token)")
        log.mark("done")
    return {"rows": rows, "embedding": _parameters(embedding), "losses": losses, "logits_grad": local_logits.grad,
            "shapes": shapes.shapes, "events": events_as_data(log)}


@exercise("tp.vocab_parallel", points=4)
class VocabParallel(Check):
    """Verifies: on 2 and 3 ranks with a vocabulary not divisible by t, VocabParallelEmbedding
    returns the dense embedding's rows with one all-reduce in forward and none in backward, each
    rank holding its rows of the table with the dense gradient; vocab_parallel_cross_entropy
    returns every token's loss and the gradient of the rank's logits equal to torch's
    cross_entropy on the whole logits (logits near 100 included, where exp overflows unless the
    max is subtracted); its forward all-reduces at most 3 numbers per token (no gather, no
    all-to-all), its backward nothing; no tensor any rank creates has the vocabulary's size.
    Fakes: all-gathering the logits or all-reducing a zero-padded copy (bytes and shapes); a
    side channel (the store, files) with numpy is not seen by the shape record, but then no
    torch operation touches the full logits and the three all-reduces must still carry the
    right values for the loss to come out right.
    """

    reads = ("VocabParallelEmbedding", "vocab_parallel_cross_entropy")
    references = DTENSOR_TP
    timeout_s = 40
    runs_world = True

    def prepare(self, rng):
        worlds = []
        for n, offset in ((2, 0.0), (3, 100.0)):
            tokens, vocab, hidden = int(rng.integers(4, 8)), n * int(rng.integers(6, 10)) + int(rng.integers(1, n)), \
                int(rng.integers(3, 6))
            batch_tokens = rng.integers(0, vocab, size=(2, int(rng.integers(2, 5))))
            worlds.append((n, {"table": rng.standard_normal((vocab, hidden)).astype(np.float32),
                               "tokens": batch_tokens, "dy_rows": rng.standard_normal((*batch_tokens.shape, hidden))
                               .astype(np.float32),
                               "logits": (3 * rng.standard_normal((tokens, vocab)) + offset).astype(np.float32),
                               "targets": rng.integers(0, vocab, size=tokens),
                               "loss_weights": rng.uniform(0.5, 1.5, size=tokens).astype(np.float32)}))
        return worlds

    def collect(self, student, worlds):
        return run_worlds(_vocabulary_on_rank, [(n, (student.VocabParallelEmbedding, student.vocab_parallel_cross_entropy,
                                                     data)) for n, data in worlds])

    def judge(self, worlds, outcomes) -> str:
        done, failure = completed_worlds(outcomes)
        for (n, data), per_rank in zip(worlds, done):
            self._judge_embedding(n, data, per_rank)
            self._judge_loss(n, data, per_rank)
        raise_world_failure(failure)
        return ("embedding and per-token cross-entropy equal the dense ones in value and gradient on 2 and 3 ranks "
                "(uneven vocabulary shards, logits near 100); the loss all-reduces at most 3 numbers per token and no "
                "rank ever creates a tensor of the vocabulary's size")

    @staticmethod
    def _judge_embedding(n, data, per_rank) -> None:
        table = torch.from_numpy(data["table"]).double().requires_grad_()
        rows = F.embedding(torch.from_numpy(data["tokens"]), table)
        rows.backward(torch.from_numpy(data["dy_rows"]).double())
        for rank, outcome in enumerate(per_rank):
            _close(outcome["rows"], rows.detach().numpy(), f"world {n}, rank {rank}: VocabParallelEmbedding's output")
        judge_shards(DenseParameters({"weight": data["table"]}), {"weight": table.grad.numpy()},
                     [o["embedding"] for o in per_rank], {"weight"}, f"VocabParallelEmbedding (world {n})")
        for rank, outcome in enumerate(per_rank):
            what = f"world {n}, rank {rank}: VocabParallelEmbedding's"
            _expect_collectives(outcome["events"], "embedding forward", "embedding backward",
                                {"all_reduce": [data["dy_rows"].nbytes]}, f"{what} forward",
                                "each rank looks up the tokens of its own rows (zeros for the others), and one "
                                "all-reduce (g) adds them up")
            _expect_collectives(outcome["events"], "embedding backward", "loss forward", {}, f"{what} backward",
                                "the gradient of the rows each rank holds is already on that rank")

    @staticmethod
    def _judge_loss(n, data, per_rank) -> None:
        tokens, vocab = data["logits"].shape
        logits = torch.from_numpy(data["logits"]).double().requires_grad_()
        losses = F.cross_entropy(logits, torch.from_numpy(data["targets"]), reduction="none")
        losses.backward(torch.from_numpy(data["loss_weights"]).double())
        scale = 1e-5 * max(1.0, float(np.abs(data["logits"]).max()))
        dense_losses = losses.detach().numpy()
        for rank, outcome in enumerate(per_rank):  # a known slip on any rank explains the others' errors too
            start, stop = tp.shard_bounds(vocab, n, rank)
            mine = outcome["losses"]
            if not isinstance(mine, np.ndarray) or mine.shape != dense_losses.shape or \
                    np.allclose(mine, dense_losses, atol=scale, rtol=1e-4):
                continue
            if not np.all(np.isfinite(mine)):
                raise CheckFailed(f"world {n}, rank {rank}: the losses contain NaN or inf with logits near "
                                  f"{np.abs(data['logits']).max():.0f}: exp overflows float32 above 88; subtract the "
                                  "maximum logit over the whole vocabulary (all-reduced with ReduceOp.MAX) before "
                                  "exponentiating")
            held = (data["targets"] >= start) & (data["targets"] < stop)
            local = torch.from_numpy(data["logits"][:, start:stop]).double().logsumexp(-1).numpy()
            target = data["logits"][np.arange(tokens), data["targets"]]
            if held.any() and np.allclose(mine[held], (local - target)[held], atol=scale, rtol=1e-4):
                raise CheckFailed(f"world {n}, rank {rank}: the losses use this rank's logits only in the softmax's "
                                  "denominator: the sum of exponentials runs over the whole vocabulary, so all-reduce "
                                  "the local sums (after subtracting the all-reduced maximum)")
        for rank, outcome in enumerate(per_rank):
            what = f"world {n}, rank {rank}"
            start, stop = tp.shard_bounds(vocab, n, rank)
            mine = outcome["losses"]
            expect_close(mine, losses.detach().numpy().astype(np.float32), f"{what}: the per-token losses",
                         rtol=1e-4, atol=scale)
            expect_close(outcome["logits_grad"], logits.grad.numpy()[:, start:stop].astype(np.float32),
                         f"{what}: the gradient of this rank's logits (softmax minus one-hot, times each token's "
                         "upstream gradient)", rtol=1e-4, atol=1e-5)
            shapes = [tuple(s) for s in outcome["shapes"]]
            expect(any(int(np.prod(s)) == tokens * (stop - start) for s in shapes),
                   f"{what}: the grader saw no operation on this rank's logits while the loss was computed")
            whole = [s for s in shapes if vocab in s or int(np.prod(s)) >= tokens * vocab]
            expect(not whole, f"{what}: a tensor of shape {whole[0] if whole else ''} was created while computing the "
                              f"loss; it has the size of the whole vocabulary ({vocab}): no rank may hold the full "
                              "logits. Combine per-token numbers (max, sum of exponentials, target logit) instead")
            forward = tp.events_between(outcome["events"], "loss forward", "loss backward")
            others = sorted({e["op"] for e in forward} - {"all_reduce"})
            expect(not others, f"{what}: the loss's forward issued {', '.join(others)}; it needs only all-reduces of "
                               "per-token numbers")
            sent = sum(e["bytes"] for e in forward)
            expect(0 < sent <= 3 * tokens * 8,
                   f"{what}: the loss's forward all-reduced {sent:,} bytes; the maximum, the sum of exponentials and the "
                   f"target logit are 3 numbers per token, {3 * tokens * 4:,} bytes in float32 for {tokens} tokens")
            _expect_collectives(outcome["events"], "loss backward", "done", {}, f"{what}: the loss's backward",
                                "each rank's gradient, softmax minus one-hot on its own logits, needs no communication")


# --- 7. message sizes, traffic and memory -------------------------------------------------------------

@exercise("tp.costs", points=2)
class Costs(Check):
    """Verifies: the bytes of one tensor-parallel all-reduce (b·s·h·e), each GPU's ring traffic
    per layer in forward and backward (4 all-reduces of 2(t-1)/t·S), and the activation bytes
    sequence parallelism saves per layer (10sbh(1 - 1/t) from the memory chapter's formula), on
    random inputs. Fakes: dtp's closed forms and the memory formula trip when called.
    """

    reads = ("allreduce_message_bytes", "ring_traffic_per_gpu_per_layer", "sequence_parallel_saving")
    references = ("dtp.tensor_parallel.all_reduce_message_bytes", "dtp.tensor_parallel.ring_bytes_per_gpu_per_layer",
                  "dtp.tensor_parallel.sequence_parallel_saving_bytes", "dtp.memory.activation_bytes_per_layer",
                  "dtp.costs.ring_all_reduce_bytes_per_rank")
    timeout_s = 15

    def prepare(self, rng):
        cases = []
        for _ in range(5):
            heads = int(rng.choice([16, 32, 64]))
            cases.append({"tokens": int(rng.integers(1, 64)) * 512, "seq": int(rng.choice([1024, 2048, 4096])),
                          "batch": int(rng.integers(1, 9)), "hidden": heads * int(rng.choice([64, 128])),
                          "heads": heads, "t": int(rng.choice([2, 4, 8])), "bytes": int(rng.choice([2, 4]))})
        return cases

    def collect(self, student, cases):
        return [[student.allreduce_message_bytes(c["tokens"], c["hidden"], c["bytes"]),
                 student.ring_traffic_per_gpu_per_layer(c["tokens"], c["hidden"], c["t"], c["bytes"]),
                 student.sequence_parallel_saving(c["seq"], c["batch"], c["hidden"], c["heads"], c["t"])] for c in cases]

    def judge(self, cases, answers) -> str:
        expect(len(answers) == len(cases), "the grader's calls did not all return")
        for c, (message, traffic, saving) in zip(cases, answers):
            size = tp.all_reduce_message_bytes(c["tokens"], c["hidden"], c["bytes"])
            expect_answer(message, size, describe_call("allreduce_message_bytes", (c["tokens"], c["hidden"], c["bytes"]), {}),
                          slips={"that counts elements; multiply by the bytes per element": size / c["bytes"]})
            n = c["t"]
            expect_answer(traffic, tp.ring_bytes_per_gpu_per_layer(c["tokens"], c["hidden"], n, c["bytes"]),
                          describe_call("ring_traffic_per_gpu_per_layer", (c["tokens"], c["hidden"], n, c["bytes"]), {}),
                          # first the slip that covers both readings of 2·S (at t = 2 it is also the forward pass)
                          slips={"that counts 2 all-reduces of S: the source notes' 2 per layer are the forward pass "
                                 "only, and each costs 2(t-1)/t·S per GPU in a ring": 2 * size,
                                 "that is the forward pass only; backward all-reduces twice more (f's gradients)":
                                 tp.ring_bytes_per_gpu_per_layer(c["tokens"], c["hidden"], n, c["bytes"], ("forward",)),
                                 "that counts 4·S; in a ring each GPU sends 2(t-1)/t·S per all-reduce": 4 * size})
            s, b, h, t = c["seq"], c["batch"], c["hidden"], c["t"]
            expect_answer(saving, tp.sequence_parallel_saving_bytes(s, b, h, c["heads"], t),
                          describe_call("sequence_parallel_saving", (s, b, h, c["heads"], t), {}),
                          slips={"that is 10sbh/t, what remains of the 10sbh; the saving is 10sbh(1 - 1/t)": 10 * s * b * h / t,
                                 "that is all of 10sbh; each GPU still keeps its 1/t of it": 10 * s * b * h})
        return "message bytes b·s·h·e, ring traffic 4·2(t-1)/t·S per layer and the saving 10sbh(1 - 1/t) are right"


INTERVIEW_ANSWERS = ("interview_allreduce_mib", "interview_traffic_per_gpu_mib", "interview_nvlink_ms",
                     "interview_infiniband_ms")
# The source notes' example: 4096 tokens, hidden 8192, fp16 activations, TP = 8.
INTERVIEW = dict(tokens=4096, hidden=8192, bytes_per_element=2, t=8)


@exercise("tp.interview", points=2)
class Interview(FixedAnswers):
    """Verifies: four fixed answers about the source notes' example: MiB per all-reduce, MiB each
    GPU sends per layer (forward and backward, ring), and that traffic's time at NVLink-4's 450
    GB/s per direction and at InfiniBand NDR's 400 Gb/s. Fakes: a fixed question, so a copied
    number passes; it is worth two points for that reason."""

    reads = INTERVIEW_ANSWERS

    def judge(self, inputs, answers) -> str:
        q = INTERVIEW
        size = tp.all_reduce_message_bytes(q["tokens"], q["hidden"], q["bytes_per_element"])
        traffic = tp.ring_bytes_per_gpu_per_layer(q["tokens"], q["hidden"], q["t"], q["bytes_per_element"])
        mib_answer, traffic_answer, nvlink_ms, infiniband_ms = answers
        expect_answer(mib_answer, size / 2**20, "interview_allreduce_mib", rel=1e-3,
                      slips={"that is in MB (10⁶ bytes); 1 MiB = 2²⁰ bytes": size / 1e6})
        expect_answer(traffic_answer, traffic / 2**20, "interview_traffic_per_gpu_mib", rel=1e-3, slips={
            "that is the forward pass only; backward has 2 all-reduces too": traffic / 2 / 2**20,
            "that adds the messages (4·S); in a ring each GPU sends 2(t-1)/t of each": 4 * size / 2**20,
            "that is 2·64 MiB, the notes' 128 MB per layer: forward only, and not what a GPU sends": 2 * size / 2**20})
        nvlink = tp.NVLINK4_PER_DIRECTION_BYTES_PER_S
        expect_answer(nvlink_ms, traffic / nvlink * 1e3, "interview_nvlink_ms", rel=1e-3, slips={
            "that uses 900 GB/s, NVLink's total over both directions; a GPU sends at 450 GB/s":
                traffic / tp.NVLINK4_BIDIRECTIONAL_BYTES_PER_S * 1e3,
            "that is in seconds; answer in milliseconds": traffic / nvlink})
        infiniband = tp.gigabits_to_bytes_per_s(tp.INFINIBAND_NDR_GBIT_PER_S)
        expect_answer(infiniband_ms, traffic / infiniband * 1e3, "interview_infiniband_ms", rel=1e-3, slips={
            "that reads 400 Gb/s as 400 GB/s; a network's Gb/s are gigabits: 400 Gb/s = 50 GB/s":
                traffic / 400e9 * 1e3,
            "that is in seconds; answer in milliseconds": traffic / infiniband})
        return "all four answers are right: 64 MiB, 448 MiB per GPU per layer, about 1 ms on NVLink and 9 ms on InfiniBand"
