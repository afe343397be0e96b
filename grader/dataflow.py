"""Checking that an all-reduce really moved its data around a ring, from the messages it sent.

The grader knows every rank's input. Each message a rank sent must then be a partial sum of one
contiguous piece of the inputs, sum_{k in K} input_k[a:b], and the ranks K it sums over must be
ranks whose piece the sender held at that moment: its own, or pieces it had received. A rank's
final result must be made of pieces that reached it the same way. So a "ring" that gathers the
inputs by other means (dist.all_gather, a file, the process group's store) and sends dummy
messages for the byte count fails, whatever its result; so does a message that adds a rank twice.

Rank r's log is a list of ("send", peer, payload) and ("recv", peer) in the order r issued them;
the k-th message from s to d is the one d received k-th from s.
"""
from __future__ import annotations

import numpy as np

from .compare import CheckFailed


class _PartialSums:
    """Every subset sum of the ranks' inputs, to recognise a payload as one."""

    def __init__(self, inputs: list[np.ndarray], rtol: float, atol: float):
        self.n = len(inputs)
        self.length = inputs[0].size
        members = (np.arange(2 ** self.n)[:, None] >> np.arange(self.n)) & 1  # subset -> which ranks
        self.members = members.astype(bool)
        self.sums = members.astype(np.float64) @ np.stack([np.ravel(x) for x in inputs]).astype(np.float64)
        self.rtol, self.atol = rtol, atol

    def identify(self, payload: np.ndarray) -> tuple[int, np.ndarray] | None:
        """(start, ranks summed) of the piece `payload` is a partial sum of, or None. Of several
        within tolerance, the closest: a short payload (one element of a small chunk) can fall
        within float32's tolerance of another subset's sum by chance, and the true one is closer."""
        payload = np.ravel(payload).astype(np.float64)
        width = payload.size
        if width == 0 or width > self.length:
            return None
        starts = self.sums[:, :self.length - width + 1]
        best, best_error = None, np.inf
        for subset, start in np.argwhere(np.isclose(starts, payload[0], rtol=self.rtol, atol=self.atol)):
            piece = self.sums[subset, start:start + width]
            if np.allclose(piece, payload, rtol=self.rtol, atol=self.atol):
                error = np.abs(piece - payload).max()
                if error < best_error:
                    best, best_error = (int(start), self.members[subset]), error
        return best


def check_ring_neighbours(logs: list[list[tuple]], what: str) -> None:
    """Every message goes to a neighbour on the ring, rank r+1 or r-1 (mod n)."""
    n = len(logs)
    for rank, log in enumerate(logs):
        for entry in log:
            if entry[0] == "send" and entry[1] not in ((rank + 1) % n, (rank - 1) % n):
                raise CheckFailed(f"{what}: rank {rank} sent to rank {entry[1]}, which is not its neighbour on the "
                                  f"ring; in a ring each rank talks only to rank r+1 and rank r-1 (mod {n})")


def check_ring_dataflow(inputs: list[np.ndarray], logs: list[list[tuple]], *, rtol: float, atol: float, what: str) -> None:
    """Raise CheckFailed unless every message and every result can be explained by data that
    travelled along the recorded messages."""
    n = len(inputs)
    sums = _PartialSums(inputs, rtol, atol)
    # What each message carries, identified from its payload alone.
    carried: dict[tuple[int, int], list[tuple[int, int, np.ndarray]]] = {}
    for rank, log in enumerate(logs):
        for entry in log:
            if entry[0] != "send":
                continue
            _, peer, payload = entry
            found = sums.identify(np.asarray(payload))
            if found is None:
                raise CheckFailed(f"{what}: rank {rank} sent rank {peer} {np.size(payload)} values that are not a "
                                  "partial sum of one piece of the ranks' inputs (a chunk added twice, or a "
                                  "wrong chunk?)")
            start, members = found
            carried.setdefault((rank, peer), []).append((start, start + np.size(payload), members))
    # Replay each rank's log: what it holds of every element, as a set of ranks per element.
    for rank, log in enumerate(logs):
        holds = np.zeros((n, sums.length), dtype=bool)
        holds[rank] = True
        received: dict[int, int] = {}
        sent: dict[int, int] = {}
        for entry in log:
            peer = entry[1]
            if entry[0] == "recv":
                index = received.get(peer, 0)
                received[peer] = index + 1
                messages = carried.get((peer, rank), [])
                if index >= len(messages):
                    raise CheckFailed(f"{what}: rank {rank} received more messages from rank {peer} than it sent")
                start, stop, members = messages[index]
                holds[members, start:stop] = True
            else:
                index = sent.get(peer, 0)
                sent[peer] = index + 1
                start, stop, members = carried[(rank, peer)][index]
                missing = members[:, None] & ~holds[:, start:stop]
                if missing.any():
                    source = int(np.argwhere(missing.any(axis=1))[0][0])
                    raise CheckFailed(f"{what}: rank {rank} sent rank {peer} a sum that includes rank {source}'s "
                                      f"elements {start}..{stop - 1}, which had not reached rank {rank} through any "
                                      "message: every piece of data must travel around the ring")
        if not holds.all():
            source = int(np.argwhere(~holds.all(axis=1))[0][0])
            raise CheckFailed(f"{what}: rank {rank}'s result needs rank {source}'s data, but not all of it reached "
                              f"rank {rank} through the ring's messages (was it gathered some other way?)")
