"""Checks of the overlap chapter (notebook 07_overlap), one module per exercise group.

Oracles, computed in the grader: the closed forms of `dtp.overlap.model` (checked against simulations in
tests/overlap/test_overlap_model.py), single-process training, and the plain all-gather then GEMM.
Mechanisms, from what each rank did in order: the collectives and messages it issued, when it
waited on each handle, which matrix products ran in between (one ordered list per rank, recorded
by `dtp.overlap.runs`), and the gathered units alive after every operation. Never from time.
"""
from . import buckets, collective_matmul, interview, model, zero3  # noqa: F401 - importing registers the exercises, in this order
