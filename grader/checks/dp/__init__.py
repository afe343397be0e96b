"""Checks of the data-parallelism chapter (notebook 02_data_parallel), one module per exercise group.

Oracles, computed in the grader: the sum of the inputs the grader drew, single-process training
on the full batch from rank 0's initial weights, DDP's bucketing rule and the closed forms of
`dtp.dp.costs`. Mechanisms, from what the learner's code sent: the ring's messages replayed
(grader/dataflow.py), the collectives and waits recorded on the process group.
"""
from . import costs, ring, training  # noqa: F401 - importing registers the exercises, in this order
