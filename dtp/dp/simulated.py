"""A network of simulated ranks in one process, for writing collectives in numpy before running
them on real processes. Ranks exchange messages in synchronous steps, as in the textbook ring:

    network = SimulatedNetwork(4)
    network.send(0, 1, chunk)        # rank 0 queues a copy of `chunk` for rank 1
    ...                              # every rank queues its message of this step
    network.exchange()               # all queued messages arrive at once; the next step begins
    incoming = network.receive(1, 0) # what rank 0 sent rank 1 in the step just delivered

The network counts what each rank sends (`bytes_sent`) and keeps every message (`messages`),
so the bytes a collective moves are measured, not reported by the algorithm itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Message:
    step: int
    source: int
    destination: int
    payload: np.ndarray


class SimulatedNetwork:
    def __init__(self, n_ranks: int):
        if n_ranks < 1:
            raise ValueError(f"a network needs at least one rank, got {n_ranks}")
        self.n_ranks = n_ranks
        self.step = 0
        self.messages: list[Message] = []
        self.bytes_sent = [0] * n_ranks
        self._queued: dict[tuple[int, int], list[np.ndarray]] = {}
        self._delivered: dict[tuple[int, int], list[np.ndarray]] = {}

    def _check_rank(self, rank: int, role: str) -> None:
        if not (isinstance(rank, (int, np.integer)) and 0 <= rank < self.n_ranks):
            raise ValueError(f"{role} rank must be an int in 0..{self.n_ranks - 1}, got {rank!r}")

    def send(self, source: int, destination: int, array) -> None:
        """Queue a copy of `array` from `source` to `destination`, delivered at the next exchange()."""
        self._check_rank(source, "source")
        self._check_rank(destination, "destination")
        if source == destination:
            raise ValueError(f"rank {source} cannot send to itself")
        payload = np.array(array, copy=True)
        self._queued.setdefault((int(source), int(destination)), []).append(payload)
        self.messages.append(Message(self.step, int(source), int(destination), payload.copy()))
        self.bytes_sent[source] += payload.nbytes

    def exchange(self) -> None:
        """Deliver every message queued in this step; what was delivered before is gone."""
        self._delivered, self._queued = self._queued, {}
        self.step += 1

    def receive(self, destination: int, source: int) -> np.ndarray:
        """The next message `source` sent `destination` in the step last delivered (FIFO)."""
        waiting = self._delivered.get((int(source), int(destination)), [])
        if not waiting:
            raise LookupError(f"rank {destination} has no message from rank {source} in this step: "
                              "did every rank send() before exchange()?")
        return waiting.pop(0).copy()
