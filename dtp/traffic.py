"""Counting what a rank sends, to put measured bytes beside the formulas."""
from __future__ import annotations

import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup


class TrafficCounter:
    """Inside one rank, count the bytes sent point to point and the all-reduces launched.

    Use it as `with TrafficCounter() as traffic: ...`. The counting happens on the process
    group itself, where every torch.distributed call ends up (`dist.isend`, a `send` imported
    by name, `batch_isend_irecv`), so each byte is counted once whichever API sent it.
    Whether an all-reduce was asynchronous is only visible to calls made as `dist.all_reduce(...)`;
    for others `async_op` is recorded as None.
    """

    def __init__(self):
        self.bytes_sent = 0
        self.all_reduce_calls: list[dict] = []  # per call: "bytes" and "async_op" (True, False or None)
        self._async_flag = None  # set by the dist.all_reduce wrapper for the call it forwards
        self._originals = {}

    def __enter__(self):
        counter = self
        send, allreduce, all_reduce = ProcessGroup.send, ProcessGroup.allreduce, dist.all_reduce
        # Restore the class's own descriptors: the attributes read above no longer bind as methods.
        self._originals = {"send": vars(ProcessGroup)["send"], "allreduce": vars(ProcessGroup)["allreduce"],
                           "all_reduce": all_reduce}

        def counted_send(group, tensors, *args, **kwargs):
            counter.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
            return send(group, tensors, *args, **kwargs)

        def counted_allreduce(group, tensors, *args, **kwargs):
            tensors_list = tensors if isinstance(tensors, (list, tuple)) else [tensors]
            counter.all_reduce_calls.append({"bytes": sum(t.numel() * t.element_size() for t in tensors_list),
                                             "async_op": counter._async_flag})
            return allreduce(group, tensors, *args, **kwargs)

        def module_all_reduce(tensor, *args, **kwargs):
            counter._async_flag = bool(kwargs.get("async_op", len(args) >= 3 and args[2]))
            try:
                return all_reduce(tensor, *args, **kwargs)
            finally:
                counter._async_flag = None

        ProcessGroup.send, ProcessGroup.allreduce, dist.all_reduce = counted_send, counted_allreduce, module_all_reduce
        return self

    def __exit__(self, *exc):
        ProcessGroup.send = self._originals["send"]
        ProcessGroup.allreduce = self._originals["allreduce"]
        dist.all_reduce = self._originals["all_reduce"]
