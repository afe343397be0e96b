"""Checks of the tensor-parallelism chapter (notebook 03_tensor_parallel).

Oracles, computed in the grader: the dense computation in float64 (numpy, or a dtp.common.gpt Block
with the same weights), torch's own cross-entropy and embedding, and the closed forms of
`dtp.tp.tensor_parallel`, which tests/tp/test_tp_formulas.py checks against gloo runs.
Mechanisms, from what the learner's code did on each rank: the collectives recorded on the
process group between marks (forward, backward), where each parameter a rank holds sits in the
dense layer (located by value, so any layout of the shards is accepted), and the shape of every
tensor the rank created while computing the loss.
"""
# importing the modules registers their exercises, in the notebook's order
from . import blocks, costs, linear, operators, vocabulary  # noqa: F401
