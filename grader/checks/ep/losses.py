"""Exercise 3: the Switch load-balancing loss and ST-MoE's router z-loss, value and gradient."""
from __future__ import annotations

import numpy as np
import torch

from dtp.common.threads import torch_on_one_thread
from dtp.ep import moe

from ...compare import CheckFailed, expect, expect_answer
from ...registry import Check, exercise
from ..references import refuses_library
from .shared import MOE


@exercise("ep.balancing_loss", points=2)
@refuses_library(MOE)
class BalancingLoss(Check):
    """Verifies: value and gradient with respect to the logits of the Switch load-balancing loss
    (random alpha, and the default 0.01) for top-1 and top-2 routing, and of the router z-loss
    (random coefficient and the default 0.001), also for logits near 800 (float64 exp overflows).
    Fakes: dtp.ep.moe's losses trip; a value without a gradient, or with f carrying gradient, fails
    on the gradient.
    """

    reads = ("load_balancing_loss", "router_z_loss")
    timeout_s = 15

    def prepare(self, rng):
        cases = []
        for k, alpha in ((1, None), (2, float(rng.uniform(1e-3, 1e-1))), (2, None), (1, float(rng.uniform(1e-3, 1.0)))):
            experts, tokens = int(rng.integers(k + 2, 12)), int(rng.integers(6, 60))
            logits = rng.standard_normal((tokens, experts)) * 2 + rng.standard_normal(experts)
            indices, _ = moe.top_k_routing(logits, k, True)
            cases.append({"logits": logits, "indices": indices, "alpha": alpha, "coefficient": None})
        for offset, coefficient in ((0.0, float(rng.uniform(1e-4, 1e-2))), (800.0, None)):
            logits = rng.standard_normal((int(rng.integers(6, 30)), int(rng.integers(3, 10)))) * 3 + offset
            cases.append({"logits": logits, "indices": None, "alpha": None, "coefficient": coefficient})
        return cases

    def collect(self, student, cases):
        with torch_on_one_thread():
            return [self._loss(student, case) for case in cases]

    @staticmethod
    def _loss(student, case) -> dict:
        logits = torch.tensor(case["logits"], requires_grad=True)
        if case["indices"] is not None:
            kwargs = {} if case["alpha"] is None else {"alpha": case["alpha"]}
            loss = student.load_balancing_loss(logits, case["indices"].copy(), **kwargs)
        else:
            kwargs = {} if case["coefficient"] is None else {"coefficient": case["coefficient"]}
            loss = student.router_z_loss(logits, **kwargs)
        return _value_and_gradient(loss, logits)

    def judge(self, cases, results) -> str:
        expect(len(results) == len(cases), "the grader's calls did not all return")
        for case, result in zip(cases, results):
            if case["indices"] is not None:
                _judge_balancing(case, result)
            else:
                _judge_z_loss(case, result)
        return ("the load-balancing loss (top-1 and top-2, default and random alpha) and the z-loss (also for logits "
                "near 800) have the right values and gradients, only P carrying gradient")


def _value_and_gradient(loss, logits) -> dict:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        return {"wrong_type": type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"shape {tuple(loss.shape)}"}
    if loss.requires_grad:
        loss.backward()
    return {"value": float(loss.detach().reshape(())), "gradient": logits.grad}


def _loss_oracle(case) -> tuple[float, np.ndarray]:
    """Value and gradient in closed form (dtp.ep.moe; tests/ep/test_ep_moe.py checks them against autograd)."""
    if case["indices"] is not None:
        return moe.load_balancing_loss_and_gradient(case["logits"], case["indices"],
                                                    0.01 if case["alpha"] is None else case["alpha"])
    return moe.router_z_loss_and_gradient(case["logits"], 0.001 if case["coefficient"] is None else case["coefficient"])


def _checked_value(result, what: str) -> float:
    expect("wrong_type" not in result, f"{what} should return a scalar torch tensor, not {result.get('wrong_type')}")
    return result["value"]


def _judge_balancing(case, result) -> None:
    tokens, experts = case["logits"].shape
    k = case["indices"].shape[1]
    alpha = case["alpha"]
    what = f"load_balancing_loss({tokens}×{experts} logits, top-{k}, {'default alpha' if alpha is None else f'alpha={alpha:.4g}'})"
    value, gradient = _loss_oracle(case)
    expect_answer(_checked_value(result, what), value, what, rel=1e-9, slips=balancing_slips(case))
    _judge_gradient(result, gradient, what, "f is a count of assignments and carries no gradient; only P does "
                    "(compute f from the indices, or detach it)")


def balancing_slips(case) -> dict:
    """feedback -> the load-balancing loss that mistake gives."""
    experts, k = case["logits"].shape[1], case["indices"].shape[1]
    value, _ = _loss_oracle(case)
    used_alpha = 0.01 if case["alpha"] is None else case["alpha"]
    probabilities = moe.softmax(case["logits"]).mean(axis=0)
    return {"that is alpha·E·Σ P_i²: f_i is the fraction of assignments each expert received (a count, from the "
            "indices), not its mean probability": used_alpha * experts * float(probabilities @ probabilities),
            "f is normalised by T; count it over all T·k assignments so that it sums to 1 (the loss is alpha at "
            "perfect balance)": value * k,
            "the factor E is missing (it makes the loss alpha at perfect balance, whatever E)": value / experts,
            "alpha is missing": value / used_alpha}


def z_slips(case) -> dict:
    """feedback -> the z-loss that mistake gives."""
    logits = case["logits"]
    used = 0.001 if case["coefficient"] is None else case["coefficient"]
    value, _ = _loss_oracle(case)
    log_sum_exp = logits.max(axis=1) + np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1))
    return {"the log-sum-exp is not squared": used * log_sum_exp.mean(),
            "that sums over tokens; the z-loss averages over them": value * logits.shape[0],
            "that squares each token's largest logit, not its log-sum-exp": used * (logits.max(axis=1) ** 2).mean(),
            "the coefficient is missing (ST-MoE's c_z is 0.001)": value / used}


def _judge_z_loss(case, result) -> None:
    logits = case["logits"]
    coefficient = case["coefficient"]
    what = (f"router_z_loss({logits.shape[0]}×{logits.shape[1]} logits near {logits.mean():.0f}, "
            f"{'default coefficient' if coefficient is None else f'coefficient={coefficient:.4g}'})")
    value, gradient = _loss_oracle(case)
    actual = _checked_value(result, what)
    expect(np.isfinite(actual), f"{what} is {actual}: exp overflows for logits this large; use torch.logsumexp "
                                "(it subtracts the maximum first)")
    expect_answer(actual, value, what, rel=1e-9, slips=z_slips(case))
    _judge_gradient(result, gradient, what, "differentiate through torch.logsumexp")


def _judge_gradient(result, expected: np.ndarray, what: str, hint: str) -> None:
    gradient = result.get("gradient")
    expect(gradient is not None and np.any(gradient != 0),
           f"{what}: the value is right, but backward() gave the logits no gradient: build the loss from torch "
           "operations on router_logits (P must carry the gradient), not from numpy or detached values")
    if not np.allclose(gradient, expected, rtol=1e-7, atol=1e-12):
        raise CheckFailed(f"{what}: the value is right but its gradient with respect to the logits is not: {hint}")

