"""The course autograder. In a notebook: `from grader import check`; from a shell:
`python -m grader PATH... [--json FILE] [--only ID...] [--timeout SECONDS]`."""
from .in_notebook import check

__all__ = ["check"]
