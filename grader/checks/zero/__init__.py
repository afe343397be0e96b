"""Checks of the ZeRO and FSDP chapter (notebook 06_zero), one module per exercise group.

Oracles, computed in the grader: single-process Adam on the full batch (which plain data-parallel
Adam equals), the closed forms of `dtp.zero.formulas` (checked against measurements in
tests/zero/test_zero_formulas.py), and the layout a run used, recovered from the pieces it
all-gathered. Mechanisms, from what the learner's code did on each rank (see `stages`).
"""
from . import exact_bytes, interview, memory, stages, zero3  # noqa: F401 - importing registers the exercises, in this order
