"""One ordered record per rank of what it computed and what it communicated, and the replay of
such records on a logical clock.

A `Timeline` is a CommunicationLog whose list of events also receives the rank's computations,
in the order they start: an op a caller reports (`computed("F", micro_batch=3)`, a pipeline
stage's forward) or, inside `matrix_products()`, every matrix product torch runs. Sends and
receives also keep their tag, which is what pairs a send with its receive. Nothing in the record
is a duration: a judge reads the order (was this all-gather issued before that product and
waited on after it?), and `replay` turns the order into a timeline of its own, in which each
compute op lasts what `durations` says and every wait ends when its message can have arrived,
so that no verdict depends on how busy the machine was.
"""
from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dtp.common.traffic import CommunicationLog

# aten operations that are matrix products: the compute a collective can hide under
MATRIX_PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_addmm_activation"}
_BIAS_FIRST = ("addmm", "baddbmm", "addbmm", "_addmm_activation")  # addmm(bias, a, b): the matrices come second
# fused attention kernels, recorded as their score product Q @ K^T
FUSED_ATTENTION = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_efficient_attention")


def _product_shape(name: str, tensors: list) -> dict:
    """batch, m, k, n of a (batched) product of an m x k and a k x n matrix; "rows" is m (a chunk
    of rows tells a chunked GEMM from a whole one)."""
    if name in FUSED_ATTENTION:
        q, k = tensors[0], tensors[1]
        batch, m, inner, n = math.prod(q.shape[:-2]), q.shape[-2], q.shape[-1], k.shape[-2]
    else:
        a, b = tensors[1:3] if name in _BIAS_FIRST else tensors[:2]
        batch = a.shape[0] if a.dim() == 3 else 1
        m, inner, n = (a.shape[-2] if a.dim() > 1 else 1), a.shape[-1], b.shape[-1]
    return {"rows": int(m), "batch": int(batch), "m": int(m), "k": int(inner), "n": int(n)}


class MatrixProducts(TorchDispatchMode):
    """Appends {"op": "compute", "rows", "batch", "m", "k", "n"} to `events` for every matrix
    product (a fused attention kernel counts as its score product); with a tracker
    (dtp.zero.measure.FullTensorTracker) also "gathers", the gathers (numbered from 1, in issue
    order) its operands' values came from, and with `kept` (a function of nothing) "kept", what
    it returns as the product runs (the received bytes still referenced, say)."""

    def __init__(self, events: list, tracker=None, kept=None):
        super().__init__()
        self.events, self.tracker, self.kept = events, tracker, kept

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing compiled runs here (see dtp.common.traffic)

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "aten" and (name in MATRIX_PRODUCTS or name in FUSED_ATTENTION):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            event = {"op": "compute", **_product_shape(name, tensors)}
            if self.tracker is not None:
                event["gathers"] = self.tracker.gathers_of(tensors)
            if self.kept is not None:
                event["kept"] = self.kept()
            self.events.append(event)
        return func(*args, **(kwargs or {}))


class Timeline(CommunicationLog):
    """A CommunicationLog that records, in the same ordered list, what the rank computed, and
    each send's and receive's tag (gloo matches the n-th send from a to b with tag t to the n-th
    receive on b from a with tag t)."""

    def _record(self, method, group, args):
        event = super()._record(method, group, args)
        if event["op"] in ("send", "recv"):
            position = 1 if method == "recv_anysource" else 2  # (tensors, peer, tag) or (tensors, tag)
            event["tag"] = int(args[position]) if len(args) > position else 0
        return event

    def computed(self, op: str, **fields) -> None:
        """Put a computation the caller runs (a stage's forward "F", ...) into the sequence."""
        self.events.append({"op": op, **fields})

    def matrix_products(self, tracker=None, kept=None) -> MatrixProducts:
        """A dispatch mode to enter inside this log (and inside `tracker`, when given): it puts
        every matrix product into the sequence as {"op": "compute", ...} (see MatrixProducts)."""
        return MatrixProducts(self.events, tracker, kept)


# --- the logical clock --------------------------------------------------------------------------

class Deadlock(Exception):
    """No rank can go on: `stuck` maps each rank that did not finish to the index of the wait
    it is blocked on."""

    def __init__(self, stuck: dict[int, int]):
        super().__init__(f"ranks {sorted(stuck)} wait for messages that are never issued")
        self.stuck = stuck


def _message_keys(events: list, rank: int) -> list:
    """Per event: ((src, dst, tag), the event's ordinal among that key's sends or receives), or
    None for what is not a send or a receive."""
    seen, keys = {}, []
    for event in events:
        if event["op"] in ("send", "recv"):
            key = (rank, event["peer"], event["tag"]) if event["op"] == "send" else (event["peer"], rank, event["tag"])
            seen[(event["op"], key)] = seen.get((event["op"], key), -1) + 1
            keys.append((key, seen[(event["op"], key)]))
        else:
            keys.append(None)
    return keys


def replay(sequences: list, durations: dict[str, float]) -> dict:
    """Replay every rank's sequence (Timeline events with "peer" and "tag") on a logical clock:
    an op named in `durations` takes that long, issuing a send or a receive takes nothing.
    Waiting on a receive ends when the matching send (the n-th from that peer with that tag)
    has been issued, if that is later; waiting on a send ends when the matching receive has
    been posted: measured on torch 2.13's gloo, a send's handle completes only once the
    receiver has posted its recv, even for a 32-byte message
    (tests/pp/test_pp_load.py::test_a_gloo_send_completes_only_once_its_receive_is_posted).
    Returns each rank's compute intervals (start, end, op) and each wait that advanced a rank's
    clock as (rank, from, to, index of the awaited event, index of the wait); raises Deadlock
    if no rank can go on."""
    p = len(sequences)
    keys = [_message_keys(events, rank) for rank, events in enumerate(sequences)]
    issued = {"send": {}, "recv": {}}  # key -> issue times in order
    clock, position = [0.0] * p, [0] * p
    intervals = [[] for _ in range(p)]
    delays = []
    progress = True
    while progress:
        progress = False
        for rank, events in enumerate(sequences):
            while position[rank] < len(events):
                index, event = position[rank], events[position[rank]]
                if event["op"] in durations:
                    took = durations[event["op"]]
                    intervals[rank].append((clock[rank], clock[rank] + took, event["op"]))
                    clock[rank] += took
                elif event["op"] in ("send", "recv"):
                    key, _ = keys[rank][index]
                    issued[event["op"]].setdefault(key, []).append(clock[rank])
                elif event["op"] == "wait":
                    awaited = event.get("of")
                    if isinstance(awaited, int) and 0 <= awaited < index and keys[rank][awaited] is not None:
                        key, ordinal = keys[rank][awaited]
                        partner = issued["recv" if events[awaited]["op"] == "send" else "send"].get(key, [])
                        if len(partner) <= ordinal:
                            break  # blocked until the peer issues the matching message
                        if partner[ordinal] > clock[rank]:
                            delays.append((rank, clock[rank], partner[ordinal], awaited, index))
                            clock[rank] = partner[ordinal]
                position[rank] += 1
                progress = True
    stuck = {rank: position[rank] for rank in range(p) if position[rank] < len(sequences[rank])}
    if stuck:
        raise Deadlock(stuck)
    return {"intervals": intervals, "delays": delays}
