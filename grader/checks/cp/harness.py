"""What runs on each gloo rank of the chapter's checks (in the sandbox), and the oracles the grader
computes from the same seeds. A rank's Q, K, V (and dO) are slices of full tensors drawn from a
seed, so the grader knows every rank's blocks and can tell, from the payloads, which block each
message carried. Per rank the harness records, in order: messages and collectives (with payloads),
waits, and every matrix product with its shape (dtp.common.timeline), so the score products (inner size = head_dim) say
how many query x key entries the rank computed, and the largest buffer it received into; in the
forward, each product also records the bytes of received K/V still referenced when it ran
(`kept.ReceivedKept`), so a rank that keeps old blocks shows."""
from __future__ import annotations

import contextlib
import math

import torch
from torch._C._distributed_c10d import ProcessGroup

from dtp.common.timeline import Timeline

from .kept import ReceivedKept


class ReceivedHeld:
    """Wraps the process group's recv (over the log's wrapper): the most elements of any tensor a
    rank received into, a view counting its whole base tensor, so that receiving each block into
    its slice of one buffer for all of K and V shows. (Whether a rank keeps old blocks alive is
    what `kept.ReceivedKept` follows.)"""

    def __init__(self):
        self.peak = 0

    def __enter__(self):
        held, original = self, ProcessGroup.recv

        def recv(group, tensors, *args, **kwargs):
            bases = [t._base if t._base is not None else t for t in tensors]
            held.peak = max([held.peak] + [base.numel() for base in bases])
            return original(group, tensors, *args, **kwargs)

        self.original = original
        ProcessGroup.recv = recv
        return self

    def __exit__(self, *exc):
        ProcessGroup.recv = self.original


def full_tensors(seed, heads, seq, d, count=3, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(heads, seq, d, generator=generator).to(dtype) for _ in range(count)]


def contiguous(seq, c):
    return [list(range(r * seq // c, (r + 1) * seq // c)) for r in range(c)]


def zigzag(seq, c):
    size = seq // (2 * c)
    return [list(range(r * size, (r + 1) * size)) + list(range((2 * c - 1 - r) * size, (2 * c - r) * size))
            for r in range(c)]


def attention(q, k, v, causal):
    """Full attention and its log-sum-exp (float64 in the grader; in the harness, the forward a
    backward exercise starts from)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ v, lse


def _plain(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def forward_rank(rank, c, function, seed, heads, seq, d, causal, layout):
    """`function(q, k, v, causal)` (or `function(q, k, v)` for the zigzag layout, causal) on this
    rank's tokens; its output and what it did."""
    q, k, v = full_tensors(seed, heads, seq, d)
    mine = (zigzag if layout == "zigzag" else contiguous)(seq, c)[rank]
    args = (q[:, mine].contiguous(), k[:, mine].contiguous(), v[:, mine].contiguous())
    two_steps = 2 * 2 * args[1].numel() * args[1].element_size()  # K and V of two ring steps
    return _with_computes(function, *(args if layout == "zigzag" else args + (causal,)), kept_limit=two_steps)


def backward_rank(rank, c, function, seed, heads, seq, d, causal):
    """`function(q, k, v, out, lse, dout, causal)` on this rank's blocks, out and lse being this
    rank's rows of the full forward: (dq, dk, dv) and what it did."""
    q, k, v, dout = full_tensors(seed, heads, seq, d, count=4)
    out, lse = attention(q, k, v, causal)
    mine = contiguous(seq, c)[rank]
    blocks = [x[:, mine].contiguous() for x in (q, k, v, out)] + [lse[:, mine].contiguous(), dout[:, mine].contiguous()]
    return _with_computes(function, *blocks, causal)


def _with_computes(function, *args, kept_limit=None):
    with Timeline(payloads=True) as log, ReceivedHeld() as held, \
            (ReceivedKept(kept_limit, log.events) if kept_limit is not None else contextlib.nullcontext()) as kept, \
            log.matrix_products(kept=kept.settled if kept is not None else None):
        result = function(*args)
    result = tuple(_plain(x) for x in result) if isinstance(result, (tuple, list)) else _plain(result)
    return {"result": result, "events": list(_events_with_shapes(log)), "held": held.peak}


def _events_with_shapes(log):
    """The log's events as data, matrix products with their shapes."""
    keep = ("op", "bytes", "peer", "of", "label", "batch", "m", "k", "n", "kept")
    for event in log.events:
        plain_event = {key: event[key] for key in keep if key in event}
        if "payload" in event:
            plain_event["payload"] = [t.numpy() for t in event["payload"]]
        yield plain_event
