"""Checks of the context-parallel chapter (notebook 08_context_parallel), one module per exercise group.

Oracles, computed in the grader: attention and its autograd on one process in float64, from the
seeds the ranks drew their slices from, and the closed forms of `dtp.cp.context_parallel` (tested
against gloo runs in tests/cp/test_cp_formulas.py). Mechanisms, from what each rank did in order:
which K/V blocks its messages carried (recognised from their payloads), to which neighbour, the
largest buffer it received into, the received K/V it still referenced at each score product
(`kept.ReceivedKept`), and the order and shapes of its score products. Never from time.
"""
from . import costs, ring, softmax, ulysses  # noqa: F401 - importing registers the exercises, in this order
