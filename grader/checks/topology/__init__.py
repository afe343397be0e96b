"""Checks of the topology chapter (notebook 09_topology), one module per exercise group.

Oracles, computed in the grader: `dtp.topology.mesh` (coordinates, groups, mesh arguments and links;
tests/topology/test_topology_layout.py checks them against init_device_mesh on gloo worlds),
`dtp.topology.planner` (built from the memory, ZeRO, tensor, pipeline and expert chapters'
closed forms; tests/topology/test_topology_planner.py checks its counts against torch models and its
traffic against gloo runs) and single-process training. Mechanisms, from what the learner's code
did in a gloo world: the groups its mesh arguments gave init_device_mesh, and every collective it
issued with the ranks of the group it ran on.
"""
from . import interview, layout, planning, training  # noqa: F401 - importing registers the exercises, in this order
