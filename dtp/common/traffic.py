"""Recording what a rank communicates, to put measured bytes beside the formulas and to let the
grader check how an exercise communicates, not only what it computes.

Every torch.distributed call (`dist.send`, `dist.isend`, a `send` imported by name,
`batch_isend_irecv`, `all_reduce`, `all_gather_into_tensor`, ...) ends up in a method of the
ProcessGroup object; `CommunicationLog` wraps those methods for as long as it is open, so each
operation is recorded once, whichever API issued it. The methods it calls through are the ones
this module found when it was imported, before any learner code could replace them.
"""
from __future__ import annotations

import time

import torch
from torch._C._distributed_c10d import ProcessGroup, Work
from torch.utils._python_dispatch import TorchDispatchMode

# ProcessGroup method -> (operation, index of the argument holding this rank's input tensors)
_OPERATIONS = {
    "send": ("send", 0), "recv": ("recv", 0), "recv_anysource": ("recv", 0),
    "allreduce": ("all_reduce", 0), "allreduce_coalesced": ("all_reduce", 0),
    "allgather": ("all_gather", 1), "allgather_coalesced": ("all_gather", 1),
    "allgather_into_tensor_coalesced": ("all_gather", 1), "all_gather_single": ("all_gather", 1),
    "all_gather_single_coalesced": ("all_gather", 1), "_allgather_base": ("all_gather", 1),
    "reduce_scatter": ("reduce_scatter", 1), "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter_single_coalesced": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1), "_reduce_scatter_base": ("reduce_scatter", 1),
    "alltoall": ("all_to_all", 1), "all_to_all_single": ("all_to_all", 1), "alltoall_base": ("all_to_all", 1),
    "broadcast": ("broadcast", 0), "reduce": ("reduce", 0), "gather": ("gather", 1), "scatter": ("scatter", 0),
    "barrier": ("barrier", None), "monitored_barrier": ("barrier", None),
}
_ORIGINALS = {name: vars(ProcessGroup)[name] for name in _OPERATIONS if name in vars(ProcessGroup)}
_ORIGINAL_WAIT = vars(Work)["wait"]


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _group_ranks(group) -> tuple[int, ...] | None:
    try:
        import torch.distributed as dist
        return tuple(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - a group torch no longer knows
        return None


# Functional collectives (torch.distributed._functional_collectives, used by DTensor and by
# compiled code) do not go through the ProcessGroup's Python methods: they are dispatcher ops.
_FUNCTIONAL_NAMESPACES = ("_c10d_functional", "c10d_functional")
_FUNCTIONAL_OPERATIONS = (("all_to_all", "all_to_all"), ("all_reduce", "all_reduce"), ("all_gather", "all_gather"),
                          ("reduce_scatter", "reduce_scatter"), ("broadcast", "broadcast"))


class _FunctionalCollectives(TorchDispatchMode):
    """Records the functional collectives a rank issues into a CommunicationLog."""

    def __init__(self, log: "CommunicationLog"):
        super().__init__()
        self.log = log

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing here is compiled. Left to its default, torch wraps __torch_dispatch__ so as to
        # skip its compiler, and the wrapper imports torch._dynamo on first use: over a second in
        # every process, every forked rank included.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in _FUNCTIONAL_NAMESPACES:
            name = func.__name__.split(".")[0]
            op = next((normal for key, normal in _FUNCTIONAL_OPERATIONS if key in name), None)
            if op is not None:
                self.log.events.append({"op": op, "bytes": _nbytes(args[0]) if args else 0, "functional": True,
                                        "t": time.perf_counter()})
            elif name == "wait_tensor":
                self.log.events.append({"op": "wait", "of": None, "functional": True, "t": time.perf_counter()})
        return func(*args, **(kwargs or {}))


class CommunicationLog:
    """Inside one rank: `with CommunicationLog() as log: ...` records every operation in order.

    Each event is a dict: "op" ("send", "recv", "all_reduce", "all_gather", "reduce_scatter",
    "all_to_all", "broadcast", "reduce", "gather", "scatter", "barrier", "wait" or "mark"),
    "bytes" (this rank's input: what it sends, or contributes to a collective), "peer" (for
    send/recv, the group rank of the other side), "root" (broadcast, reduce, ...), "group" (the
    global ranks of the group), "t" (perf_counter when issued), "splits" (an all-to-all's input
    and output split sizes), and with `payloads=True` a copy of every sent tensor as "payload".
    A "wait" event names the event whose handle was waited on. Functional collectives (dispatcher
    ops that bypass the process group's methods) are recorded too, marked "functional".
    """

    def __init__(self, payloads: bool = False):
        self.payloads = payloads
        self.events: list[dict] = []
        self._handles: dict[int, tuple[int, Work]] = {}  # id(work) -> (event index, work kept alive)

    # --- reading the log ---
    def of(self, *ops: str) -> list[dict]:
        return [event for event in self.events if event["op"] in ops]

    @property
    def bytes_sent(self) -> int:
        """Bytes sent point to point."""
        return sum(event["bytes"] for event in self.of("send"))

    def kept(self, keys: tuple) -> list[dict]:
        """The events as plain dicts of the fields in `keys` (those an event has): what a rank
        hands back to a judge, without tensors, handles or times."""
        return [{key: event[key] for key in keys if key in event} for event in self.events]

    def mark(self, label: str) -> None:
        """Put a named point into the sequence (e.g. "optimizer step"), to order events against."""
        self.events.append({"op": "mark", "label": label, "t": time.perf_counter()})

    # --- recording ---
    def _record(self, method: str, group, args) -> dict:
        op, index = _OPERATIONS[method]
        event = {"op": op, "bytes": 0 if index is None or len(args) <= index else _nbytes(args[index]),
                 "group": _group_ranks(group), "t": time.perf_counter()}
        if op in ("send", "recv"):
            event["peer"] = args[1] if method != "recv_anysource" else None
            if op == "send" and self.payloads:
                event["payload"] = [t.detach().clone() for t in _tensors(args[0])]
        elif len(args) > 1 and hasattr(args[-1], "rootRank"):
            event["root"] = args[-1].rootRank
        if method in ("all_to_all_single", "alltoall_base") and len(args) > 3:
            event["splits"] = {"output": list(args[2]), "input": list(args[3])}
        self.events.append(event)
        return event

    def __enter__(self):
        log = self

        def wrap(method, original):
            def recorded(group, *args, **kwargs):
                log._record(method, group, args)
                index = len(log.events) - 1
                work = original(group, *args, **kwargs)
                if isinstance(work, Work):
                    log._handles[id(work)] = (index, work)
                return work
            return recorded

        def recorded_wait(work, *args, **kwargs):
            handle = log._handles.get(id(work))
            if handle is not None and handle[1] is work:
                log.events.append({"op": "wait", "of": handle[0], "t": time.perf_counter()})
                del log._handles[id(work)]  # a handle keeps its tensors alive: release it once waited on
            return _ORIGINAL_WAIT(work, *args, **kwargs)

        for method, original in _ORIGINALS.items():
            setattr(ProcessGroup, method, wrap(method, original))
        Work.wait = recorded_wait
        self._functional = _FunctionalCollectives(self)
        self._functional.__enter__()
        return self

    def __exit__(self, *exc):
        self._functional.__exit__(*exc)
        for method, original in _ORIGINALS.items():
            setattr(ProcessGroup, method, original)
        Work.wait = _ORIGINAL_WAIT
