"""Checks of the expert-parallelism chapter (notebook 05_expert_parallel).

Oracles, computed in the grader: dtp.ep.moe's router, slots and one-hot layer (tests/ep/test_ep_moe.py
checks them against token-by-token loops and torch), autograd through dtp.ep.moe.moe_layer_torch
run once per rank's tokens (the single-process layer with the same weights and routing), and
dtp.ep.moe's closed forms; for exercises 7 to 10, dtp.ep.routing (bias balancing, node-limited
routing), dtp.ep.experts (shared and fine-grained experts) and dtp.ep.tp_ep (EP beside TP),
which tests/ep/test_ep_routing.py checks against loops, torch modules and a gloo world. Mechanisms, from what the learner's code did in a gloo world: every
collective recorded on the process group, and for every all-to-all the rows sent to each rank.

One module per exercise group. They are imported in the notebook's order, which is the order
the exercises register in and are listed in.
"""
# isort: off
from . import router  # noqa: F401  exercise 1
from . import layer  # noqa: F401  exercise 2: capacity, slots, the single-process layer
from . import losses  # noqa: F401  exercise 3
from . import expert_parallel  # noqa: F401  exercise 4, on gloo
from . import all_to_all_bytes  # noqa: F401  exercise 5
from . import interview  # noqa: F401  exercise 6
from . import bias_balancing  # noqa: F401  exercise 7: auxiliary-loss-free balancing
from . import shared_experts  # noqa: F401  exercise 8: shared and fine-grained experts
from . import node_limited  # noqa: F401  exercise 9: node-limited routing
from . import tp_ep  # noqa: F401  exercise 10: EP beside TP with sequence parallelism
