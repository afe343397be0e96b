"""Context parallelism: the sequence split across c ranks, and attention computed anyway.

Everything token-local (projections, MLP, LayerNorm) runs on a rank's own tokens unchanged;
attention needs every earlier key and value. Three ways to get them, all here:

- ring attention (Liu et al. 2023): K/V blocks go around the ring, c - 1 steps, and each
  block's attention is merged into the output with the online softmax (Milakov and Gimelshein
  2018), so no rank ever holds all keys and values; its backward sends dK/dV around too;
- the zigzag layout (Llama 3, Striped Attention): rank r holds chunks r and 2c-1-r of 2c, so a
  causal mask leaves every rank the same work;
- Ulysses (Jacobs et al. 2023): an all-to-all turns sequence shards into head shards.

Attention tensors are (heads, tokens, head_dim); the softmax scale is 1/sqrt(head_dim). The cost
formulas count bytes a rank sends per layer and score entries (query x key pairs) it computes.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from dtp.memory import formulas as memory

# --- numpy: full attention and the online softmax ---------------------------------------------


def attention_numpy(q, k, v, causal=False):
    """softmax(q k^T / sqrt(d)) v for one head, q, k, v of shape (tokens, d), in float64."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    scores = q @ k.T / math.sqrt(q.shape[-1])
    if causal:
        scores = np.where(np.tril(np.ones(scores.shape, dtype=bool)), scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)  # the max subtracted: exp never overflows
    weights = np.exp(scores)
    return weights / weights.sum(axis=-1, keepdims=True) @ v


def online_softmax_attention(q, k, v, block, causal=False):
    """The same attention, reading keys and values `block` at a time: a running maximum m and
    sum of exponentials l per query, both rescaled by exp(m_old - m_new) when a block raises the
    maximum, so the result is exact and no exponential exceeds 1."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    tokens = q.shape[0]
    running_max = np.full(tokens, -np.inf)
    running_sum = np.zeros(tokens)
    acc = np.zeros((tokens, v.shape[1]))
    for start in range(0, k.shape[0], block):
        scores = q @ k[start:start + block].T / math.sqrt(q.shape[-1])
        if causal:
            keys = np.arange(start, start + scores.shape[1])
            scores = np.where(keys[None, :] <= np.arange(tokens)[:, None], scores, -np.inf)
        new_max = np.maximum(running_max, scores.max(axis=1))
        seen = np.isfinite(new_max)  # a query whose keys so far are all masked has nothing yet
        rescale = np.where(seen, np.exp(np.where(seen, running_max - new_max, 0.0)), 1.0)
        weights = np.exp(scores - np.where(seen, new_max, 0.0)[:, None])
        running_sum = running_sum * rescale + weights.sum(axis=1)
        acc = acc * rescale[:, None] + weights @ v[start:start + block]
        running_max = new_max
    return acc / running_sum[:, None]


# --- torch: attention of one block, with its log-sum-exp ---------------------------------------


def attention_torch(q, k, v, causal=False):
    """Single-process attention over (heads, tokens, d): the oracle for every distributed variant."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def masked_block(q, k, v, q_positions, k_positions, causal):
    """(out, lse) of q's attention to this block only: out normalised over the block, lse the
    log-sum-exp of its scores per query (-inf, with out 0, where every key is masked)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(k_positions[None, :] > q_positions[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None]).nan_to_num(0.0)
    return weights @ v, lse


def merge(out, lse, block_out, block_lse):
    """Two partial softmax results over disjoint keys combined exactly: each weighted by its share
    exp(lse_part - lse_total) of the total sum of exponentials."""
    if out is None:
        return block_out, block_lse
    total = torch.logaddexp(lse, block_lse)
    safe = total.nan_to_num(neginf=0.0)
    return (out * torch.exp(lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None]), total


def chunked_attention(q, k, v, q_positions, k_positions, causal, pieces):
    """(out, lse) of q over one K/V block, split into `pieces` query and key chunks, skipping the
    chunk pairs a causal mask hides entirely: what keeps the zigzag layout's work balanced."""
    q_chunks, qp_chunks = q.chunk(pieces, dim=-2), q_positions.chunk(pieces)
    k_chunks, v_chunks, kp_chunks = k.chunk(pieces, dim=-2), v.chunk(pieces, dim=-2), k_positions.chunk(pieces)
    outs, lses = [], []
    for qc, qp in zip(q_chunks, qp_chunks):
        out = lse = None
        for kc, vc, kp in zip(k_chunks, v_chunks, kp_chunks):
            if causal and kp.min() > qp.max():
                continue  # every key of this chunk comes after every query: nothing to compute
            out, lse = merge(out, lse, *masked_block(qc, kc, vc, qp, kp, causal))
        if out is None:
            out, lse = torch.zeros_like(qc), torch.full(qc.shape[:-1], float("-inf"), dtype=qc.dtype)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


# --- layouts: which global tokens each rank holds -----------------------------------------------


def contiguous_positions(seq_len, c):
    """Rank r holds tokens r·s/c .. (r+1)·s/c - 1."""
    return list(torch.arange(seq_len).chunk(c))


def zigzag_positions(seq_len, c):
    """The sequence in 2c chunks; rank r holds chunk r and chunk 2c-1-r, in that order."""
    chunks = torch.arange(seq_len).chunk(2 * c)
    return [torch.cat([chunks[r], chunks[2 * c - 1 - r]]) for r in range(c)]


def torch_head_tail_positions(seq_len, c):
    """Every rank's token positions under the pinned torch's experimental context parallelism
    with its default causal load balancing (the private `_HeadTailLoadBalancer`)."""
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    order = _HeadTailLoadBalancer(seq_len, c, "cpu")._generate_indices().reshape(-1)
    return list(order.chunk(c))


# --- ring attention on a process group ----------------------------------------------------------


def _ring_step(send, receive, rank, c):
    """Start one ring step: send to rank + 1, receive from rank - 1; the handles to wait on."""
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (rank + 1) % c),
                                   dist.P2POp(dist.irecv, receive, (rank - 1) % c)])


def ring_attention_forward(q, k, v, causal=False, layout=None):
    """This rank's attention output and log-sum-exp, its (heads, s/c, d) blocks of Q, K and V in,
    with K and V passed around the ring: at step i the rank holds the block of rank (r - i) mod c,
    starts sending it on and receiving the next, and computes on it meanwhile. `layout` lists
    every rank's global token positions (contiguous by default); with the zigzag layout each
    block is computed as 2 x 2 chunk pairs so that masked pairs are skipped."""
    rank, c = dist.get_rank(), dist.get_world_size()
    layout = layout if layout is not None else contiguous_positions(q.shape[-2] * c, c)
    pieces = 2 if len(layout[0]) > 1 and not bool((layout[0].diff() == 1).all()) else 1
    kv = torch.stack([k, v])  # K and V travel together: one message per step
    out = lse = None
    for step in range(c):
        handles, incoming = None, None
        if step < c - 1:
            incoming = torch.empty_like(kv)
            handles = _ring_step(kv, incoming, rank, c)
        source = (rank - step) % c
        out, lse = merge(out, lse, *chunked_attention(q, kv[0], kv[1], layout[rank], layout[source], causal, pieces))
        if handles is not None:
            for handle in handles:
                handle.wait()
            kv = incoming
    return out, lse


def ring_attention_backward(q, k, v, out, lse, dout, causal=False):
    """dQ, dK, dV of this rank's blocks (contiguous layout). K and V go around the ring as in the
    forward; each block's dK/dV accumulator travels with it and is sent on after this rank added
    its share, so after c steps (one more than the forward) every accumulator is home."""
    rank, c = dist.get_rank(), dist.get_world_size()
    layout = contiguous_positions(q.shape[-2] * c, c)
    scale = 1 / math.sqrt(q.shape[-1])
    delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO * O): the softmax backward's correction
    dq = torch.zeros_like(q)
    kv, dkv = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=k.dtype)
    for step in range(c):
        handles, incoming = None, None
        if step < c - 1:
            incoming = torch.empty_like(kv)
            handles = _ring_step(kv, incoming, rank, c)
        source = (rank - step) % c
        scores = q @ kv[0].transpose(-1, -2) * scale
        if causal:
            scores = scores.masked_fill(layout[source][None, :] > layout[rank][:, None], float("-inf"))
        p = torch.exp(scores - lse[..., None])  # the forward's probabilities, from the saved lse
        dp = dout @ kv[1].transpose(-1, -2)
        ds = p * (dp - delta)
        dq += ds @ kv[0] * scale
        dkv = dkv + torch.stack([ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ dout])
        incoming_grad = torch.empty_like(dkv)
        grad_handles = _ring_step(dkv, incoming_grad, rank, c)  # this block's gradients go on with it
        for handle in (handles or []) + grad_handles:
            handle.wait()
        dkv = incoming_grad
        if incoming is not None:
            kv = incoming
    return dq, dkv[0], dkv[1]


def allgather_kv_attention(q, k, v, causal=False, layout=None):
    """Llama 3's context parallelism: all-gather K and V (small under grouped-query attention),
    then attention of this rank's queries over the whole sequence, with any mask; `layout` lists
    every rank's token positions (contiguous by default, or zigzag)."""
    rank, c = dist.get_rank(), dist.get_world_size()
    layout = layout if layout is not None else contiguous_positions(q.shape[-2] * c, c)
    kv = torch.stack([k, v])
    gathered = [torch.empty_like(kv) for _ in range(c)]
    dist.all_gather(gathered, kv)
    keys = torch.cat([g[0] for g in gathered], dim=-2)
    values = torch.cat([g[1] for g in gathered], dim=-2)
    return masked_block(q, keys, values, layout[rank], torch.cat(layout), causal)[0]


# --- Ulysses ------------------------------------------------------------------------------------


def ulysses_attention(q, k, v, causal=False):
    """Sequence-sharded (heads, s/c, d) Q, K, V in, the same shard of the output out: one
    all-to-all gives each rank h/c heads over the whole sequence, attention runs locally, a
    second all-to-all returns the rank's tokens for every head. Needs heads divisible by c."""
    c = dist.get_world_size()
    heads = q.shape[0]
    if heads % c:
        raise ValueError(f"Ulysses needs the heads ({heads}) divisible by the context-parallel size ({c})")
    qkv = torch.stack([q, k, v])  # (3, h, s/c, d): one all-to-all for all three
    send = [part.contiguous() for part in qkv.chunk(c, dim=1)]
    received = [torch.empty_like(part) for part in send]
    dist.all_to_all(received, send)
    full = torch.cat(received, dim=2)  # (3, h/c, s, d): rank j's tokens, in rank order
    local = attention_torch(full[0], full[1], full[2], causal)
    send_back = [part.contiguous() for part in local.chunk(c, dim=1)]
    back = [torch.empty_like(send_back[0]) for _ in range(c)]
    dist.all_to_all(back, send_back)
    return torch.cat(back, dim=0)


# --- costs: bytes per layer per rank, work, memory ----------------------------------------------


def ring_bytes_per_layer(tokens, kv_hidden, c, dtype_bytes=2):
    """Bytes a rank sends in one layer's forward of ring attention: c - 1 steps, each one block of
    K and V (tokens/c x kv_hidden each): 2(c-1)·(tokens/c)·kv_hidden·bytes."""
    return 2 * (c - 1) * tokens / c * kv_hidden * dtype_bytes


def ring_backward_bytes_per_layer(tokens, kv_hidden, c, dtype_bytes=2, grad_bytes=None):
    """The backward's: K and V again (c - 1 steps) and their gradients (c steps, home at the end)."""
    grad_bytes = dtype_bytes if grad_bytes is None else grad_bytes
    return (ring_bytes_per_layer(tokens, kv_hidden, c, dtype_bytes)
            + 2 * c * tokens / c * kv_hidden * grad_bytes)


def allgather_kv_bytes_per_layer(tokens, kv_hidden, c, dtype_bytes=2):
    """Bytes a rank sends to all-gather K and V (Llama 3's choice): (c-1)/c of the full K and V,
    the same as the ring's, but all before attention starts."""
    return (c - 1) / c * 2 * tokens * kv_hidden * dtype_bytes


def allgather_kv_backward_bytes_per_layer(tokens, kv_hidden, c, grad_bytes=2):
    """The backward's, for the all-gather method: every rank's attention backward gives gradients
    for all `tokens` keys and values, and a reduce-scatter sums each rank's share onto its owner
    (the all-gather's adjoint): (c-1)/c of the full dK and dV, 2(c-1)/c·tokens·kv_hidden·bytes,
    the forward's volume."""
    return allgather_kv_bytes_per_layer(tokens, kv_hidden, c, grad_bytes)


def ulysses_bytes_per_layer(tokens, hidden, kv_hidden, c, dtype_bytes=2):
    """Bytes a rank sends in one layer's forward of Ulysses: (c-1)/c of its Q, K, V shard in the
    first all-to-all and of its output shard in the second: (c-1)/c·(tokens/c)·(2h + 2h_kv)·bytes."""
    return (c - 1) / c * tokens / c * (2 * hidden + 2 * kv_hidden) * dtype_bytes


def ulysses_gqa_bytes_per_layer(tokens, heads, kv_heads, head_dim, c, dtype_bytes=2):
    """Ulysses' bytes per layer per rank under grouped-query attention, for any c dividing the
    query heads: with fewer KV heads than ranks (c a multiple of kv_heads) each rank still needs
    the KV head its query heads share, so K and V go out c·head_dim wide, each KV head replicated
    c/kv_heads times (as veRL does); with at least c KV heads, `ulysses_bytes_per_layer`."""
    if heads % c or (kv_heads % c and c % kv_heads):
        raise ValueError(f"Ulysses needs c ({c}) to divide the query heads ({heads}) and to divide or be a "
                         f"multiple of the KV heads ({kv_heads})")
    kv_width = max(kv_heads, c) * head_dim
    return ulysses_bytes_per_layer(tokens, heads * head_dim, kv_width, c, dtype_bytes)


def ulysses_over_ring_bytes(heads, kv_heads, head_dim, c):
    """Ulysses' bytes over the ring's, per layer per rank (tokens and dtype cancel):
    (h + h_kv')/(c·h_kv), h_kv' the KV width after replication."""
    return ulysses_gqa_bytes_per_layer(1.0, heads, kv_heads, head_dim, c, 1) / ring_bytes_per_layer(
        1.0, kv_heads * head_dim, c, 1)


def ulysses_ring_crossover(heads, kv_heads, head_dim):
    """The smallest Ulysses degree (a divisor of the query heads, at least 2) at which Ulysses sends
    fewer bytes than the ring, or None where it never does: without replication that needs
    c > heads/kv_heads + 1, with it c > heads/(kv_heads - 1), never for one KV head."""
    for c in range(2, heads + 1):
        if heads % c == 0 and not (kv_heads % c and c % kv_heads) and ulysses_over_ring_bytes(
                heads, kv_heads, head_dim, c) < 1:
            return c
    return None


def ring_step_hiding_tokens(flops, bandwidth, hidden, kv_hidden, dtype_bytes=2, causal_zigzag=False):
    """The fewest tokens per rank b at which a ring step's transfer of one K/V block (2·b·h_kv
    elements) fits under its attention compute at `flops` FLOP/s and `bandwidth` bytes/s. A full
    (non-causal) block is 4·b^2·h FLOPs (QK^T and PV): b >= h_kv·bytes·F/(2hB). Under a causal
    mask with the zigzag layout a step on another rank's block computes 2 of its 4 chunk pairs,
    half a block, so b must be twice as large."""
    half = 2 if causal_zigzag else 1
    return half * math.ceil(kv_hidden * dtype_bytes * flops / (2 * hidden * bandwidth))


def causal_ring_time_in_blocks(c, layout="contiguous"):
    """A causal ring forward's time in block-times (one full (s/c)^2 block each): every step lasts
    as long as its busiest rank. Contiguous: at step i the ranks r >= i each compute a whole
    block, so all c steps last one block, c in all, while the average rank computes (c+1)/2.
    Zigzag: 3 of 4 chunk pairs at step 0 (every rank's own block), 2 of 4 at every other step:
    3/4 + (c-1)/2."""
    if layout == "contiguous":
        return float(c)
    if layout == "zigzag":
        return 0.75 + (c - 1) / 2
    raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")


def alltoall_input_bytes(tokens, hidden, kv_hidden, c, dtype_bytes=4):
    """What `dtp.common.traffic` records for Ulysses' two all-to-alls on one rank: each call's whole input,
    the rank's own part included: (tokens/c)·(2h + 2h_kv)·bytes."""
    return tokens / c * (2 * hidden + 2 * kv_hidden) * dtype_bytes


def causal_work_per_rank(seq_len, c, layout="contiguous"):
    """Query x key score entries each rank computes under a causal mask, skipping blocks (or, in
    the zigzag layout, chunk pairs) that the mask hides entirely. Contiguous: rank r computes r + 1
    blocks of (s/c)^2, so the last does c times the first's work. Zigzag: 2c + 1 chunk pairs of
    (s/2c)^2 on every rank: 3 on its own block (its first chunk never sees its second), 2 on each of
    the c - 1 others (of a lower rank's block, the first chunk; of a higher rank's, both, seen only
    by the second chunk)."""
    if layout == "contiguous":
        return [(r + 1) * (seq_len / c) ** 2 for r in range(c)]
    if layout == "zigzag":
        return [(2 * c + 1) * (seq_len / (2 * c)) ** 2 for _ in range(c)]
    raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")


def activation_bytes_per_rank(seq, batch, hidden, heads, layers, tensor_parallel=1, c=1):
    """Activation bytes per GPU with sequence parallelism inside TP, selective recomputation (or
    FlashAttention: no s x s scores kept) and context parallelism c: the memory chapter's
    L·sbh·34/t divided by c, since every saved tensor is per token (the one formula,
    `dtp.memory.formulas.activation_bytes_per_layer`, that dtp.memory.calculator uses too)."""
    return memory.activation_bytes(layers, seq, batch, hidden, heads, tensor_parallel,
                                   sequence_parallel=True, recompute="selective", context_parallel=c)
