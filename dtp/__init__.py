"""dtp (Distributed Training, Parallelism): the library the book, the notebooks and the grader share,
one package per chapter (as grader/checks/ is), in reading order:

- `dtp.memory`, `dtp.dp`, `dtp.tp`, `dtp.pp`, `dtp.ep`, `dtp.zero`, `dtp.overlap`, `dtp.cp`, `dtp.topology`:
  each chapter's closed forms, reference implementations, measurements and figures;
- `dtp.common`: what they all stand on (gloo worlds, traffic recording, the course's models).

The chapters' multi-process programs as command-line demos run the course's solution notebooks, so
they live with the grader, which reads notebooks: `python -m grader.demos`.

A chapter's package imports from `dtp.common` and from earlier chapters (the topology chapter, last,
builds on all of them); the one exception is the memory chapter's calculator, which adds up what
every later chapter shards (ZeRO's states among them). No module imports the grader, and no two
modules import each other (tests/common/test_imports.py reads every import).
"""
