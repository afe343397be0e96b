"""The course autograder. In a notebook: `from grader import check, demo`; from a shell:
`python -m grader PATH... [--json FILE] [--only ID...] [--timeout SECONDS]`."""
from .in_notebook import check, demo

__all__ = ["check", "demo"]
