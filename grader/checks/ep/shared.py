"""What the expert-parallelism checks share: the module whose code they refuse, torch's all-to-alls, answer-shape checks,
naming a known mistake by its value, and routings skewed so that capacity binds."""
from __future__ import annotations

import numpy as np

from ...compare import expect

MOE = "dtp.ep.moe"  # the module of the chapter's oracles, whose every answer each exercise refuses (references.py)
# torch's differentiable all-to-alls: the exercise is to write the backward exchange
TORCH_DIFFERENTIABLE_ALL_TO_ALL = ("torch.distributed.nn.functional.all_to_all_single",
                                   "torch.distributed.nn.functional.all_to_all",
                                   "torch.distributed._functional_collectives.all_to_all_single_autograd",
                                   "torch.distributed._functional_collectives.all_to_all_single")


def pair(answer, names: str, what: str) -> tuple:
    expect(isinstance(answer, (tuple, list)) and len(answer) == 2, f"{what} should return a pair ({names})")
    return answer[0], answer[1]


def integer_array(value, shape: tuple, name: str, what: str) -> np.ndarray:
    expect(isinstance(value, np.ndarray), f"{what}: {name} should be a numpy array, not {type(value).__name__}")
    expect(value.shape == shape, f"{what}: {name} has shape {value.shape}, expected {shape}")
    expect(value.dtype.kind in "iu", f"{what}: {name} should hold integers, not {value.dtype}")
    return value


def known_mistake(actual: np.ndarray, slips: dict, rtol: float = 1e-9, atol: float = 1e-12) -> str | None:
    """The diagnosis for an `actual` that equals a known mistake (feedback -> the value, or values,
    it gives), or None. When several mistakes give the same value for these inputs, any of them
    may be the learner's, so all are named."""
    matching = [feedback for feedback, values in slips.items()
                if any(value.shape == actual.shape and np.allclose(actual, value, rtol=rtol, atol=atol)
                       for value in (values if isinstance(values, list) else [values]))]
    return name_mistakes(matching) if matching else None


def name_mistakes(diagnoses: list[str]) -> str:
    """One diagnosis as it is; several that fit the same answer, all of them (any may be the one)."""
    if len(diagnoses) == 1:
        return diagnoses[0]
    return "for these inputs more than one mistake gives exactly this answer: " + "; or ".join(diagnoses)


def skewed_choices(rng, tokens: int, experts: int, k: int) -> np.ndarray:
    """Each token's k distinct experts, popular experts more often (so that capacity binds)."""
    popularity = rng.standard_normal(experts) * 1.5
    scores = popularity + rng.gumbel(size=(tokens, experts))
    return np.argsort(-scores, axis=1)[:, :k]

