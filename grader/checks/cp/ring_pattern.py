"""Judging a ring from what each rank sent: every piece of every message must be one rank's K or V
block (the grader drew them, so it recognises them), sent on to one neighbour, the block the rank
holds at that step of the ring; and no rank may keep all the blocks it received: not in one big
receive buffer, not by receiving them all before computing, not by keeping the used ones alive."""
from __future__ import annotations

import numpy as np

from ...compare import CheckFailed, expect
from .harness import contiguous, full_tensors, zigzag


def unexpected_ops(events, allowed):
    return sorted({e["op"] for e in events} - set(allowed) - {"wait", "mark", "compute"})


class RingBlocks:
    """Every rank's K and V blocks, as the harness cut them (float32, as sent)."""

    def __init__(self, c, heads, seq, d, seed, layout="contiguous"):
        self.c, self.heads, self.seq, self.d = c, heads, seq, d
        _, k, v = full_tensors(seed, heads, seq, d)
        self.positions = (zigzag if layout == "zigzag" else contiguous)(seq, c)
        self.blocks = {(name, j): x[:, self.positions[j]].numpy().ravel()
                       for name, x in (("K", k), ("V", v)) for j in range(c)}
        self.size = heads * (seq // c) * d
        self.sorted = {key: np.sort(block) for key, block in self.blocks.items()}
        self.pairs = [np.sort(np.concatenate([self.blocks["K", j], self.blocks["V", j]])) for j in range(c)]

    def pieces(self, payloads) -> list:
        """What a message's tensors carry, as ("K", j), ("V", j) or None per block. A tensor is
        recognised by its values as a multiset, so any layout of a block (transposed, K and V
        concatenated along any axis) is recognised; a tensor of two blocks is one rank's K and V."""
        named = []
        for payload in payloads:
            values = np.sort(np.ravel(np.asarray(payload, dtype=np.float32)))
            if values.size == self.size:
                named.append(next((key for key, block in self.sorted.items() if np.array_equal(block, values)), None))
            elif values.size == 2 * self.size:
                both = next((j for j in range(self.c) if np.array_equal(self.pairs[j], values)), None)
                named += [("K", both), ("V", both)] if both is not None else self._halves(np.asarray(payload))
            else:
                named += [None] * max(1, round(values.size / self.size))
        return named

    def _one(self, values):
        values = np.sort(np.ravel(np.asarray(values, dtype=np.float32)))
        return next((key for key, block in self.sorted.items() if np.array_equal(block, values)), None)

    def _halves(self, payload) -> list:
        """Two blocks in one tensor that are not one rank's K and V (two K blocks?): named by
        the halves along the first axis that splits them into two blocks."""
        for axis, length in enumerate(np.shape(payload)):
            if length % 2 == 0:
                first, second = np.split(payload, 2, axis=axis)
                found = [self._one(first), self._one(second)]
                if None not in found:
                    return found
        return [None, None]


def check_ring_pattern(blocks: RingBlocks, rank: int, events: list, where: str) -> None:
    """Forward ring attention on one rank: send/recv only, one neighbour each way, c - 1 steps of K
    and V, each step's block the one the ring brought (its own first)."""
    c = blocks.c
    other = unexpected_ops(events, {"send", "recv"})
    expect(not other, f"{where}: rank {rank} called {', '.join(other)}; ring attention passes K/V blocks to the "
                      "neighbour with send/recv (isend/irecv or batch_isend_irecv), so no rank gathers all of K and V")
    sends = [e for e in events if e["op"] == "send"]
    receives = [e for e in events if e["op"] == "recv"]
    to, come = {e.get("peer") for e in sends}, {e.get("peer") for e in receives}
    if c > 1 and (sends or receives):
        expect((to, come) in (({(rank + 1) % c}, {(rank - 1) % c}), ({(rank - 1) % c}, {(rank + 1) % c})),
               f"{where}: rank {rank} sent to ranks {sorted(p for p in to if p is not None)} and received from "
               f"{sorted(p for p in come if p is not None)}; in a ring each rank sends to one neighbour and receives "
               "from the other, every step")
    step = 1 if to == {(rank + 1) % c} else -1
    sent = [piece for e in sends for piece in blocks.pieces(e.get("payload", []))]
    expect(None not in sent, f"{where}: rank {rank} sent data that is not a K or V block of any rank (a block "
                             "changed before sending, or a block of a different size?); the ring passes each K/V "
                             "block on unchanged")
    keys = [j for name, j in sent if name == "K"]
    values = [j for name, j in sent if name == "V"]
    expect(values or not keys, f"{where}: rank {rank} sent K blocks but no V blocks; every query needs the values of "
                               "every (earlier) token too: send each step's V with its K")
    expect(keys or not values, f"{where}: rank {rank} sent V blocks but no K blocks; send each step's K with its V")
    held = [(rank - step * i) % c for i in range(c - 1)]  # the block held at step i, sent on at that step
    expect(len(receives) in (c - 1, 2 * (c - 1)) and sorted(keys) == sorted(held) and sorted(values) == sorted(held),
           f"{where}: rank {rank} received {len(receives)} messages and sent the K blocks of ranks {keys} and V blocks "
           f"of ranks {values}; in c - 1 = {c - 1} steps it should pass on the block it holds at each step: its own, "
           f"then those of ranks {held[1:]} as they arrive")
    expect(keys == held and values == held,
           f"{where}: rank {rank} sent the blocks of ranks {keys} in that order; a rank can only pass on what the ring "
           f"has brought it: its own block first, then each block the step after it arrived ({held})")


def check_not_all_held(blocks: RingBlocks, rank: int, events: list, largest_buffer: int, where: str,
                       skipped=lambda source: False) -> None:
    """With c >= 3: no receive buffer bigger than two steps' K and V (a buffer for all of them),
    and a score product between every two steps' receives (each block used as it arrives, not
    all blocks received first), unless the block held in between is one a causal mask skips."""
    c = blocks.c
    if c < 3:
        return
    if largest_buffer > 4 * blocks.size:
        raise CheckFailed(f"{where}: rank {rank} received into a buffer of {largest_buffer} elements, room for the K "
                          f"and V of {largest_buffer // (2 * blocks.size)} ranks: it gathered K and V, which ring "
                          "attention exists to avoid. Receive each step's block into a buffer of one (or two) blocks")
    receives = [i for i, e in enumerate(events) if e["op"] == "recv"]
    per_step = len(receives) // (c - 1) if receives and len(receives) % (c - 1) == 0 else 1
    starts = receives[::per_step]
    sends = [e for e in events if e["op"] == "send"]
    step = 1 if sends and sends[0].get("peer") == (rank + 1) % c else -1
    for i, (first, second) in enumerate(zip(starts, starts[1:])):
        # the block computed here is the one held at step i, or at step i + 1 if the rank computes
        # before it issues a step's messages
        if skipped((rank - step * i) % c) and skipped((rank - step * (i + 1)) % c):
            continue
        if not any(e["op"] == "compute" and e.get("k") == blocks.d for e in events[first:second]):
            raise CheckFailed(f"{where}: rank {rank} received the next block before computing any scores on the one "
                              "that had arrived: a ring computes on each block while the next is in flight, so it "
                              "never needs them all")


def check_blocks_not_kept(blocks: RingBlocks, rank: int, events: list, where: str) -> None:
    """While it computes scores, a rank references at most two steps' received K and V (the block
    it computes on and the one arriving, or the one it just passed on): a rank that keeps the
    blocks it has used (in a list, as copies, or through the works that received them) ends the
    ring holding every rank's K and V. Measured from c = 4 on (at c = 3 two steps are all the
    blocks there are to receive)."""
    if blocks.c < 4:
        return
    step_bytes = 2 * blocks.size * 4  # one step's K and V, fp32
    kept = [e for e in events if e["op"] == "compute" and e.get("k") == blocks.d and e.get("kept", 0) > 2 * step_bytes]
    if kept:
        most = max(e["kept"] for e in kept)
        raise CheckFailed(f"{where}: rank {rank} still referenced {most} bytes of received K and V while computing "
                          f"scores, the blocks of {most / step_bytes:.0f} ranks: it keeps blocks it has already used "
                          "(in a list, as copies, or in a list of the works that received them), so by the end of "
                          "the ring it holds every rank's keys and values, which ring attention exists to avoid. "
                          "Drop each block once it has been used and passed on: the block you compute on and the "
                          "one arriving are all a rank needs")


def check_score_products(blocks: RingBlocks, rank: int, events: list, where: str) -> None:
    """No score product spans more keys than one block: attention is computed block by block."""
    block = blocks.seq // blocks.c
    wide = [e for e in events if e["op"] == "compute" and e.get("k") == blocks.d and e.get("n", 0) > block]
    expect(not wide, f"{where}: rank {rank} computed scores of its queries against {wide[0]['n'] if wide else 0} keys "
                     f"at once; a ring computes each arriving block of {block} keys and merges it with the online "
                     "softmax")


def score_entries(events: list, heads: int, d: int) -> float:
    """Query x key entries of the score products (inner size d), per head."""
    return sum(e["batch"] * e["m"] * e["n"] for e in events if e["op"] == "compute" and e.get("k") == d) / heads
