"""dtp (Distributed Training, Parallelism): the library the book, the notebooks and the grader share.

- `dtp.world`: launch a real torch.distributed gloo world of several processes on this machine.
- `dtp.costs`: closed-form communication and memory formulas used as the book's numbers.
- `dtp.models`: the small, seeded models and data the chapters train.
- `dtp.measure`: build-time measurements (bandwidth curves) and `dtp.plots` their figures.
"""
