"""Checks of the pipeline-parallelism chapter (notebook 04_pipeline_parallel), one module per
exercise group, registered in the notebook's order when this package is imported.

Oracles, computed in the grader: a discrete-event simulation of a schedule written here
(`schedules.event_simulation`), the closed forms of `dtp.pp.schedules`, single-process training of
the same model on the full batch, and a replay of what each rank of a real pipeline did on a
logical clock. Mechanisms, from what the learner's code did: the order of its ops, the messages
its ranks sent (recorded on the process group), what they carried and when they were waited on.
"""
from . import closed_forms, interview, measured_bubble, real_pipeline, schedules, simulator  # noqa: F401 - registers
from .schedules import KINDS, Deadlock, describe_op, event_simulation  # noqa: F401 - used by tests and the book
from .simulator import random_valid_schedule  # noqa: F401
