"""Counting what a rank sends, to put measured bytes beside the formulas."""
from __future__ import annotations

import sys

from torch._C._distributed_c10d import ProcessGroup


class TrafficCounter:
    """Inside one rank, count the bytes sent point to point and the all-reduces launched.

    Use it as `with TrafficCounter() as traffic: ...`. The counting happens on the process
    group itself, where every torch.distributed call ends up (`dist.isend`, a `send` imported
    by name, `batch_isend_irecv`), so each byte is counted once whichever API sent it.
    """

    def __init__(self):
        self.bytes_sent = 0
        # Per all-reduce: "bytes", and "async_op" as torch.distributed.all_reduce was called
        # (None when the process group was reached another way).
        self.all_reduce_calls: list[dict] = []
        self._originals = {}

    def __enter__(self):
        counter = self
        send, allreduce = ProcessGroup.send, ProcessGroup.allreduce
        # Restore the class's own descriptors: the attributes read above no longer bind as methods.
        self._originals = {"send": vars(ProcessGroup)["send"], "allreduce": vars(ProcessGroup)["allreduce"]}

        def counted_send(group, tensors, *args, **kwargs):
            counter.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
            return send(group, tensors, *args, **kwargs)

        def counted_allreduce(group, tensors, *args, **kwargs):
            tensors_list = tensors if isinstance(tensors, (list, tuple)) else [tensors]
            caller = sys._getframe(1)  # torch.distributed.all_reduce, however the learner imported it
            counter.all_reduce_calls.append({"bytes": sum(t.numel() * t.element_size() for t in tensors_list),
                                             "async_op": caller.f_locals.get("async_op")})
            return allreduce(group, tensors, *args, **kwargs)

        ProcessGroup.send, ProcessGroup.allreduce = counted_send, counted_allreduce
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(ProcessGroup, name, original)
