"""What the ring exercises' known slips compute, from the seeds the ranks drew their slices from:
attention under the mask a slip applies (each as a matrix of which keys each query sees), the
zigzag layout with a chunk off by one, the backward without its rowsum term. The judges compare a
wrong output with these, so that the feedback names the mistake."""
from __future__ import annotations

import numpy as np
import torch

from .harness import contiguous, full_tensors, zigzag


def _attention_where(seed, heads, seq, d, visible: np.ndarray) -> np.ndarray:
    """Attention of every query over the keys `visible[query, key]` lets it see (float64); a
    query that sees no key gets nan, as a learner's 0/0 does."""
    q, k, v = (x.double() for x in full_tensors(seed, heads, seq, d))
    scores = (q @ k.transpose(-1, -2) / np.sqrt(d)).masked_fill(~torch.from_numpy(visible), float("-inf"))
    return (torch.softmax(scores, -1) @ v).numpy()


def _rows_of_each_rank(seed, heads, seq, d, c, layout, visible) -> list[np.ndarray]:
    """Each rank's output rows, its queries seeing the keys `visible` allows: one matrix for every
    rank, or a function of the rank."""
    rows = (zigzag if layout == "zigzag" else contiguous)(seq, c)
    if not callable(visible):
        whole = _attention_where(seed, heads, seq, d, visible)
        return [whole[:, rows[rank]] for rank in range(c)]
    return [_attention_where(seed, heads, seq, d, visible(rank))[:, rows[rank]] for rank in range(c)]


def ring_forward_slips(seed, heads, seq, d, c, causal) -> list[tuple[str, list[np.ndarray]]]:
    """(feedback, every rank's output under that slip), contiguous layout."""
    if not causal:
        return []
    block = seq // c
    position = np.arange(seq)
    owner, local = position // block, position % block
    own_block = owner[:, None] == owner[None, :]
    causal_mask = position[None, :] <= position[:, None]
    local_mask = local[None, :] <= local[:, None]

    def relabelled(rank):
        """The ring turned one way and the blocks labelled as if it turned the other: at step i the
        block of rank r - i is taken for that of rank r + i, its keys for those positions."""
        label = ((2 * rank - owner) % c) * block + local
        return label[None, :] <= position[:, None]

    local_positions = ("is attention with the causal mask taken on positions within each block (key j <= query i of "
                       "the block, whichever rank's block it is): compare global positions, rank j's block holding "
                       "tokens j·s/c to (j+1)·s/c - 1, so that a rank's queries see every key of an earlier block")
    slips = [
        ("is attention with the causal mask applied only inside the rank's own block: queries also saw the keys of "
         "later ranks' blocks. Skip (or mask) a block whose tokens all come after the rank's",
         ~own_block | causal_mask),
        (local_positions, local_mask),
        (local_positions, local_mask & (owner[None, :] <= owner[:, None])),  # later blocks skipped
        ("masks each block as if it came from the wrong rank: at step i a rank holds the block of rank r - i (it "
         "receives from r - 1 and sends to r + 1), not of rank r + i. Label each block with the rank it started on "
         "(the direction your messages travel decides which)", relabelled),
    ]
    return [(feedback, _rows_of_each_rank(seed, heads, seq, d, c, "contiguous", visible)) for feedback, visible in slips]


def zigzag_positions(seq, c, shift: int = 0) -> list[np.ndarray]:
    """Each rank's token positions in the zigzag layout, its second chunk moved by `shift` chunks."""
    chunk = seq // (2 * c)
    return [np.concatenate([np.arange(r * chunk, (r + 1) * chunk),
                            np.arange((2 * c - 1 - r + shift) * chunk, (2 * c - r + shift) * chunk)]) for r in range(c)]


def zigzag_slips(seed, heads, seq, d, c) -> list[tuple[str, list[np.ndarray]]]:
    """(feedback, every rank's output) when the ranks' positions have the second chunk one early
    (chunk 2c - 2 - r; one late, 2c - r, keeps every position's order, and so the right answer)."""
    label = np.empty(seq, dtype=int)
    label[np.concatenate(zigzag(seq, c))] = np.concatenate(zigzag_positions(seq, c, -1))
    visible = label[None, :] <= label[:, None]
    return [("is causal attention with each rank's second chunk taken as chunk 2c - 2 - r: rank r holds chunks r "
             "and 2c - 1 - r of the 2c (rank 0 the first and the last), and its positions are those chunks' tokens",
             _rows_of_each_rank(seed, heads, seq, d, c, "zigzag", visible))]


def backward_without_rowsum(seed, heads, seq, d, c, causal) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every rank's (dQ, dK) when dS = P ⊙ dP, the rowsum(dO ⊙ O) term left out."""
    q, k, v, dout = (x.double() for x in full_tensors(seed, heads, seq, d, count=4))
    scores = q @ k.transpose(-1, -2) / np.sqrt(d)
    if causal:
        scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    p = torch.softmax(scores, -1)
    ds = p * (dout @ v.transpose(-1, -2))
    dq, dk = ds @ k / np.sqrt(d), ds.transpose(-1, -2) @ q / np.sqrt(d)
    return [(dq[:, rows].numpy(), dk[:, rows].numpy()) for rows in contiguous(seq, c)]
