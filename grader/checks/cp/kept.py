"""What a ring rank keeps of what it received: the way the ZeRO checks follow gathered weights
(`dtp.zero.measure.FullTensorTracker`: the outputs of receiving collectives, and every tensor
copied from them, followed through weak references to their storages), applied to the K/V
blocks a rank receives. Each receive is one tag, of the bytes it received; a tensor copied from
received data (clone, cat, stack, a dtype cast, ...) carries the tags of the parts it was copied
from, so a block kept as a copy still counts and a temporary copy counts once (it has the same
tag as its source). A receive or a copy_ into a tensor replaces the tags of the bytes it
overwrites: a buffer received into at every step holds one block, not all it ever held.

`received_bytes_kept()` is the bytes of the received blocks still referenced anywhere in the
process, by the rank's code (a list of blocks) or by torch (a Work object not yet dropped).
Gloo's worker thread lets go of a finished message's tensors a moment after the caller's wait
returns, so an excess over the limit counts only if it is still there once gloo has let go
(the same settling as the ZeRO checks; after one confirmed excess it stops waiting)."""
from __future__ import annotations

import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtp.zero.measure import CONFIRM_ATTEMPTS, MOVING, RECEIVING, SETTLE_PAUSE_S

_OVERWRITING = {"copy_", "fill_", "zero_"}  # in-place operations that replace every element they write


def _tensors(value) -> list:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor (or view) covers, from its first element to its last."""
    item = tensor.element_size()
    if tensor.numel() == 0:
        return 0, 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.storage_offset() * item
    return start, start + (last + 1) * item


class ReceivedKept(TorchDispatchMode):
    """Follows every received tensor and its copies; see the module docstring."""

    def __init__(self, limit_bytes: float, recorded_events: list = ()):
        super().__init__()
        self.limit = limit_bytes
        self.recorded = recorded_events  # the communication log's events: its payload copies are not the rank's
        self.spans: dict[StorageWeakRef, list[tuple[int, int, int]]] = {}  # storage -> (start, end, tag)
        self.sizes: dict[int, int] = {}  # tag -> bytes that receive brought
        self.confirmed = False

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing compiled runs here (see dtp.zero.measure.FullTensorTracker)

    def _tags(self, tensors) -> set:
        found = set()
        for tensor in tensors:
            start, end = _span(tensor)
            found |= {tag for a, b, tag in self.spans.get(StorageWeakRef(tensor.untyped_storage()), ())
                      if a < end and start < b}
        return found

    def _write(self, tensor: torch.Tensor, tags, overwrite: bool) -> None:
        ref, (start, end) = StorageWeakRef(tensor.untyped_storage()), _span(tensor)
        entries = self.spans.get(ref, [])
        if overwrite:  # what was in [start, end) is gone; what lies around it stays
            entries = [piece for a, b, tag in entries
                       for piece in ((a, min(b, start), tag), (max(a, end), b, tag)) if piece[0] < piece[1]]
        entries += [(start, end, tag) for tag in sorted(tags)]
        if entries:
            self.spans[ref] = entries
        else:
            self.spans.pop(ref, None)

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        namespace, name = func.namespace, func.overloadpacket.__name__
        if namespace == "c10d" and name in RECEIVING and args:
            for tensor in _tensors(args[0]):
                tag = len(self.sizes) + 1
                self.sizes[tag] = tensor.numel() * tensor.element_size()
                self._write(tensor, {tag}, overwrite=True)
        elif namespace == "aten" and (name in MOVING or name in _OVERWRITING):
            in_place = name.endswith("_")
            sources = _tensors((args[1:] if in_place else args, {k: v for k, v in kwargs.items() if k != "out"}))
            tags = self._tags(sources) if name in MOVING else set()
            if in_place and args and isinstance(args[0], torch.Tensor) and (tags or name in _OVERWRITING):
                self._write(args[0], tags, overwrite=name in _OVERWRITING)
            elif not in_place and tags:
                for tensor in _tensors(out) + _tensors(kwargs.get("out")):
                    self._write(tensor, tags, overwrite=True)
        return out

    def received_bytes_kept(self) -> int:
        recorded = {StorageWeakRef(tensor.untyped_storage()) for event in self.recorded
                    for tensor in event.get("payload", ())}
        alive: set = set()
        for ref in list(self.spans):
            if ref.expired():
                del self.spans[ref]
            elif ref not in recorded:
                alive |= {tag for _, _, tag in self.spans[ref]}
        return sum(self.sizes[tag] for tag in alive)

    def settled(self) -> int:
        """The bytes kept now; over the limit, only once gloo has had time to let go."""
        if not self.confirmed and self.received_bytes_kept() > self.limit:
            for _ in range(CONFIRM_ATTEMPTS):
                if self.received_bytes_kept() <= self.limit:
                    break
                time.sleep(SETTLE_PAUSE_S)
            self.confirmed = self.received_bytes_kept() > self.limit
        return self.received_bytes_kept()
