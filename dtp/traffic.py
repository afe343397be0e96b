"""Counting what a rank sends, to put measured bytes beside the formulas."""
from __future__ import annotations

import torch.distributed as dist


class TrafficCounter:
    """Inside one rank, count the bytes sent point to point and the calls to dist.all_reduce.

    Use it as `with TrafficCounter() as traffic: ...`; it wraps the functions of the
    torch.distributed module, so code that calls them as `dist.send(...)` is counted."""

    def __init__(self):
        self.bytes_sent = 0
        self.all_reduce_calls = []  # per call: its async_op flag and its tensor's bytes
        self._originals = {}

    def __enter__(self):
        def counted_send(original):
            def send(tensor, *args, **kwargs):
                self.bytes_sent += tensor.numel() * tensor.element_size()
                return original(tensor, *args, **kwargs)
            return send

        def counted_batch(original):
            def batch_isend_irecv(ops):
                self.bytes_sent += sum(op.tensor.numel() * op.tensor.element_size()
                                       for op in ops if op.op in (dist.isend, self._originals["isend"]))
                return original(ops)
            return batch_isend_irecv

        def counted_all_reduce(original):
            def all_reduce(tensor, *args, **kwargs):
                self.all_reduce_calls.append({"async_op": kwargs.get("async_op", len(args) >= 3 and args[2]),
                                              "bytes": tensor.numel() * tensor.element_size()})
                return original(tensor, *args, **kwargs)
            return all_reduce

        for name, wrap in (("send", counted_send), ("isend", counted_send),
                           ("batch_isend_irecv", counted_batch), ("all_reduce", counted_all_reduce)):
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, wrap(self._originals[name]))
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)
