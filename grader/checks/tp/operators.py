"""Exercises 1 and 2: the MLP split over simulated ranks in numpy, and the conjugate operators f and g."""
from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F

from dtp.common.traffic import CommunicationLog

from ...compare import CheckFailed, expect, expect_close
from ...registry import Check, exercise
from ..common import WorldsCheck, events_as_data, run_worlds
from .shared import close, expect_collectives, leaf, matches, run_backward

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
                    # with one rank the sum adds nothing up: say what a partial sum is, not how often b2 is added
                    consequence = f"or the all-reduce adds it t = {t} times" if t > 1 else \
                        "a partial sum is what a rank holds before the all-reduce, and b2 is not part of it"
                    raise CheckFailed(f"{what}: partial_sums[{rank}] includes b2; add b2 once, after the sum, "
                                      f"{consequence}")
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
    if t > 1 and _matches_f64(y, dense + (t - 1) * b2):
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
    x_f, x_g = leaf(mine["x_f"]), leaf(mine["x_g"])
    dy_f, dy_g = torch.from_numpy(mine["dy_f"].copy()), torch.from_numpy(mine["dy_g"].copy())
    with CommunicationLog() as log:
        log.mark("f forward")
        out_f = f(x_f)
        log.mark("f backward")
        run_backward(out_f, dy_f, "f")
        log.mark("g forward")
        out_g = g(x_g)
        log.mark("g backward")
        run_backward(out_g, dy_g, "g")
        log.mark("done")
    # the tensors handed to f and g and to their backward, as they are afterwards: an operator that
    # all-reduces the caller's tensor in place changes them
    handed = {"x_f": x_f.detach().clone(), "dy_f": dy_f.clone(), "x_g": x_g.detach().clone(), "dy_g": dy_g.clone()}
    return {"f": out_f, "f_grad": x_f.grad, "g": out_g, "g_grad": x_g.grad, "events": events_as_data(log),
            "handed": handed}


HANDED = {"x_f": "the input autograd handed to f's forward", "dy_f": "the gradient autograd handed to f's backward",
          "x_g": "the input autograd handed to g's forward", "dy_g": "the gradient autograd handed to g's backward"}


def _judge_untouched(handed: dict, arrays: dict, sums: dict, rank: int, what: str) -> None:
    """f and g leave the tensors they are handed as they were: those belong to the caller (the
    layer before, or autograd, which may use the same gradient elsewhere)."""
    for name, description in HANDED.items():
        before = arrays[name][rank]
        if matches(handed[name], before):
            continue
        how = "now holds the sum over ranks: it was all-reduced in place" if matches(handed[name], sums[name]) else \
            "was changed"
        raise CheckFailed(f"{what}: {description} {how}. dist.all_reduce sums into the tensor it is given, and that "
                          "tensor is the caller's: all-reduce a copy (x.clone()) and return the copy")


@exercise("tp.f_and_g", points=2)
class FAndG(WorldsCheck):
    """Verifies: on gloo worlds of 2 and 3 with different inputs and upstream gradients on every
    rank, f returns its input and its backward returns the sum of the ranks' gradients; g returns
    the sum of the ranks' inputs and its backward returns the rank's own gradient; f issues one
    all-reduce in backward only, g one in forward only (a reduce-scatter plus an all-gather counts
    as one); neither changes the tensor it is handed (input or upstream gradient). Fakes: swapped
    operators, torch.distributed.nn's all_reduce (which all-reduces in backward too), averaging:
    each is caught by its values or by the recorded collectives; an all-reduce in place of the
    caller's tensor: caught by comparing the handed tensors afterwards with what was handed.
    """

    reads = ("copy_to_tensor_parallel", "reduce_from_tensor_parallel")
    preimport = ()  # its ranks use no optimizer and no module that imports torch._dynamo (measured)
    timeout_s = 40
    summary = ("f: identity forward, one all-reduce (sum) backward; g: one all-reduce forward, identity backward; "
               "checked with different inputs and gradients on 2 and 3 ranks")

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

    def judge_world(self, world, per_rank) -> None:
        n, arrays = world
        sums = {k: np.sum(np.array(v, dtype=np.float64), axis=0) for k, v in arrays.items()}
        nbytes = arrays["x_f"][0].nbytes
        for rank, outcome in enumerate(per_rank):
            what = f"world {n}, rank {rank}"
            _judge_untouched(outcome["handed"], arrays, sums, rank, what)
            if matches(outcome["f"], sums["x_f"]):
                raise CheckFailed(f"{what}: f returned the sum over ranks; f is the identity in forward (its "
                                  "input is already whole on every rank); the forward all-reduce is g's")
            close(outcome["f"], arrays["x_f"][rank], f"{what}: f(x), which should be x unchanged")
            if outcome["f_grad"] is not None and matches(outcome["f_grad"], arrays["dy_f"][rank]):
                raise CheckFailed(f"{what}: f's backward returned the rank's own gradient; x is used on every "
                                  "rank, so dL/dx is the sum of every rank's gradient: all-reduce it")
            if outcome["f_grad"] is not None and matches(outcome["f_grad"], sums["dy_f"] / n):
                raise CheckFailed(f"{what}: f's backward averaged the gradients; sum them (dist.all_reduce's default)")
            expect(outcome["f_grad"] is not None, f"{what}: no gradient reached f's input")
            close(outcome["f_grad"], sums["dy_f"], f"{what}: the gradient f passes back, which should be the sum")
            if matches(outcome["g"], arrays["x_g"][rank]):
                raise CheckFailed(f"{what}: g returned its input; g sums the ranks' partial results in forward")
            close(outcome["g"], sums["x_g"], f"{what}: g(x), which should be the sum over ranks")
            expect(outcome["g_grad"] is not None, f"{what}: no gradient reached g's input")
            if matches(outcome["g_grad"], sums["dy_g"]):
                raise CheckFailed(f"{what}: g's backward all-reduced the gradient; g's output is the same on every "
                                  "rank, so each rank already holds the whole gradient: pass it through unchanged "
                                  "(torch.distributed.nn.functional.all_reduce is not g: it all-reduces in backward "
                                  "too)")
            close(outcome["g_grad"], arrays["dy_g"][rank], f"{what}: the gradient g passes back, which should be "
                                                              "the rank's own, unchanged")
            events, one = outcome["events"], {"all_reduce": [nbytes]}
            expect_collectives(events, "f forward", "f backward", {}, f"{what}: f's forward")
            expect_collectives(events, "f backward", "g forward", one, f"{what}: f's backward")
            expect_collectives(events, "g forward", "g backward", one, f"{what}: g's forward")
            expect_collectives(events, "g backward", "done", {}, f"{what}: g's backward")
