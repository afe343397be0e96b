"""dtp.cp.context_parallel against single-process attention and autograd: the online softmax, ring
attention forward and backward, the zigzag layout and Ulysses on gloo worlds, with the bytes
recorded on the process group equal to the cost formulas and the causal work per rank counted."""
import math

import numpy as np
import pytest
import torch

from dtp.cp import context_parallel as cp
from dtp.memory import formulas as memory
from dtp.common.traffic import CommunicationLog
from dtp.common.world import run_world


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tokens, block", [(13, 4), (16, 16), (7, 1)])
def test_online_softmax_equals_attention_even_where_exp_overflows(causal, tokens, block):
    rng = np.random.default_rng(tokens)
    q, k, v = (rng.normal(size=(tokens, 5)) for _ in range(3))
    q = q * 400  # scores of order 1e3: np.exp of them is inf
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.exp(q @ k.T / math.sqrt(5))).all()
    np.testing.assert_allclose(cp.online_softmax_attention(q, k, v, block, causal), cp.attention_numpy(q, k, v, causal),
                               rtol=1e-9, atol=1e-9)


def _full(seed, heads, seq, d):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(heads, seq, d, generator=generator, dtype=torch.float64) for _ in range(3)]


def _ring_rank(rank, c, seed, heads, seq, d, causal, zigzag):
    q, k, v = _full(seed, heads, seq, d)
    layout = cp.zigzag_positions(seq, c) if zigzag else cp.contiguous_positions(seq, c)
    mine = layout[rank]
    with CommunicationLog() as log:
        out, lse = cp.ring_attention_forward(q[:, mine], k[:, mine], v[:, mine], causal, layout)
    return out, lse, log.bytes_sent


@pytest.mark.parametrize("c, causal, zigzag", [(2, False, False), (4, True, False), (3, True, True), (4, True, True)])
def test_ring_attention_forward_equals_attention_and_sends_the_formula(c, causal, zigzag):
    heads, seq, d = 2, 8 * c, 3
    results = run_world(_ring_rank, c, (0, heads, seq, d, causal, zigzag))
    q, k, v = _full(0, heads, seq, d)
    wanted = cp.attention_torch(q, k, v, causal)
    layout = cp.zigzag_positions(seq, c) if zigzag else cp.contiguous_positions(seq, c)
    for rank, (out, _, sent) in enumerate(results):
        torch.testing.assert_close(out, wanted[:, layout[rank]])
        assert sent == cp.ring_bytes_per_layer(seq, heads * d, c, dtype_bytes=8)


def _backward_rank(rank, c, seed, heads, seq, d, causal):
    q, k, v = _full(seed, heads, seq, d)
    dout = _full(seed + 1, heads, seq, d)[0]
    mine = cp.contiguous_positions(seq, c)[rank]
    out, lse = cp.ring_attention_forward(q[:, mine], k[:, mine], v[:, mine], causal)
    with CommunicationLog() as log:
        grads = cp.ring_attention_backward(q[:, mine], k[:, mine], v[:, mine], out, lse, dout[:, mine], causal)
    return grads, log.bytes_sent


@pytest.mark.parametrize("c, causal", [(2, True), (3, False), (4, True)])
def test_ring_attention_backward_equals_autograd(c, causal):
    heads, seq, d = 2, 4 * c, 3
    results = run_world(_backward_rank, c, (1, heads, seq, d, causal))
    q, k, v = (x.requires_grad_() for x in _full(1, heads, seq, d))
    cp.attention_torch(q, k, v, causal).backward(_full(2, heads, seq, d)[0])
    for rank, (grads, sent) in enumerate(results):
        mine = cp.contiguous_positions(seq, c)[rank]
        for got, full in zip(grads, (q, k, v)):
            torch.testing.assert_close(got, full.grad[:, mine])
        assert sent == cp.ring_backward_bytes_per_layer(seq, heads * d, c, dtype_bytes=8)


def test_zigzag_balances_the_causal_work_and_the_contiguous_split_does_not():
    for c in (2, 3, 4, 8):
        plain, zigzag = cp.causal_work_per_rank(64 * c, c), cp.causal_work_per_rank(64 * c, c, "zigzag")
        assert plain[-1] == c * plain[0] and len(set(zigzag)) == 1
        # both compute every visible (query, key) pair at least once; zigzag no more than plain in all
        assert sum(plain) >= (64 * c) * (64 * c + 1) / 2 and sum(zigzag) <= sum(plain)


def test_chunked_attention_skips_masked_chunk_pairs_as_the_work_formula_counts():
    c, seq = 4, 32
    layout = cp.zigzag_positions(seq, c)
    counted = []
    for rank in range(c):
        pairs = 0
        for source in range(c):
            for qp in layout[rank].chunk(2):
                for kp in layout[source].chunk(2):
                    pairs += 0 if kp.min() > qp.max() else len(qp) * len(kp)
        counted.append(pairs)
    assert counted == cp.causal_work_per_rank(seq, c, "zigzag")


def _ulysses_rank(rank, c, seed, heads, seq, d, causal):
    q, k, v = _full(seed, heads, seq, d)
    mine = cp.contiguous_positions(seq, c)[rank]
    with CommunicationLog() as log:
        out = cp.ulysses_attention(q[:, mine], k[:, mine], v[:, mine], causal)
    return out, sum(event["bytes"] for event in log.of("all_to_all"))


@pytest.mark.parametrize("c, causal", [(2, True), (4, False)])
def test_ulysses_equals_attention_and_moves_the_formula(c, causal):
    heads, seq, d = 2 * c, 3 * c, 5
    results = run_world(_ulysses_rank, c, (3, heads, seq, d, causal))
    q, k, v = _full(3, heads, seq, d)
    wanted = cp.attention_torch(q, k, v, causal)
    for rank, (out, recorded) in enumerate(results):
        torch.testing.assert_close(out, wanted[:, cp.contiguous_positions(seq, c)[rank]])
        assert recorded == cp.alltoall_input_bytes(seq, heads * d, heads * d, c, dtype_bytes=8)
        # what leaves the rank is (c-1)/c of it
        assert recorded * (c - 1) / c == cp.ulysses_bytes_per_layer(seq, heads * d, heads * d, c, dtype_bytes=8)


def test_ring_and_allgather_send_the_same_bytes_and_ulysses_shrinks_with_c():
    for c in (2, 4, 16):
        assert cp.ring_bytes_per_layer(131072, 1024, c) == cp.allgather_kv_bytes_per_layer(131072, 1024, c)
    assert cp.ulysses_bytes_per_layer(131072, 16384, 1024, 16) < cp.ulysses_bytes_per_layer(131072, 16384, 1024, 2)


def test_activation_memory_per_rank_divides_by_c():
    one = cp.activation_bytes_per_rank(131072, 1, 16384, 128, 126, 8, 1)
    assert one == memory.activation_bytes(126, 131072, 1, 16384, 128, 8, sequence_parallel=True, recompute="selective")
    assert cp.activation_bytes_per_rank(131072, 1, 16384, 128, 126, 8, 16) == pytest.approx(one / 16)


def _allgather_rank(rank, c, seed, heads, seq, d):
    q, k, v = _full(seed, heads, seq, d)
    layout = cp.zigzag_positions(seq, c)
    mine = layout[rank]
    with CommunicationLog() as log:
        out = cp.allgather_kv_attention(q[:, mine], k[:, mine], v[:, mine], True, layout)
    return out, sum(event["bytes"] for event in log.of("all_gather"))


def test_allgather_kv_attention_equals_attention_and_sends_the_formula():
    c, heads, seq, d = 4, 2, 16, 3
    q, k, v = _full(4, heads, seq, d)
    wanted = cp.attention_torch(q, k, v, True)
    for rank, (out, contributed) in enumerate(run_world(_allgather_rank, c, (4, heads, seq, d))):
        torch.testing.assert_close(out, wanted[:, cp.zigzag_positions(seq, c)[rank]])
        # its block goes to each of the c - 1 others
        assert (c - 1) * contributed == cp.allgather_kv_bytes_per_layer(seq, heads * d, c, dtype_bytes=8)


def test_ulysses_under_gqa_replicates_kv_heads_and_sends_more_than_the_ring_until_c_is_large():
    # with at least c KV heads, the plain formula
    assert cp.ulysses_gqa_bytes_per_layer(4096, 32, 8, 128, 8) == cp.ulysses_bytes_per_layer(4096, 32 * 128, 8 * 128, 8)
    # fewer KV heads than ranks: each rank gets a copy of the KV head its query heads share
    assert cp.ulysses_gqa_bytes_per_layer(4096, 16, 1, 128, 8) == cp.ulysses_bytes_per_layer(4096, 16 * 128, 8 * 128, 8)
    with pytest.raises(ValueError):
        cp.ulysses_gqa_bytes_per_layer(4096, 16, 3, 128, 4)
    # Llama 3 405B: 128 query heads, 8 KV heads; without TP Ulysses sends less only from c = 32
    assert cp.ulysses_ring_crossover(128, 8, 128) == 32
    assert cp.ulysses_over_ring_bytes(128, 8, 128, 16) > 1 > cp.ulysses_over_ring_bytes(128, 8, 128, 32)
    # per TP rank (TP 8): 16 query heads and 1 KV head: never
    assert cp.ulysses_ring_crossover(16, 1, 128) is None
    assert cp.ulysses_over_ring_bytes(16, 1, 128, 16) == pytest.approx(2.0)
    # multi-head attention: Ulysses wins from c = 3 (c > heads/kv + 1 = 2)
    assert cp.ulysses_ring_crossover(12, 12, 64) == 3


def test_a_causal_zigzag_step_needs_twice_the_tokens_to_hide_its_transfer():
    plain = cp.ring_step_hiding_tokens(989e12, 50e9, 16384, 1024, 2)
    assert plain == math.ceil(1024 * 2 * 989e12 / (2 * 16384 * 50e9)) == 1237
    assert cp.ring_step_hiding_tokens(989e12, 50e9, 16384, 1024, 2, causal_zigzag=True) == 2 * plain
    # a full block's FLOPs (4 b^2 h) cover its transfer (2 b h_kv bytes) at that b, not one token below
    def compute_s(b):
        return 4 * b**2 * 16384 / 989e12

    def transfer_s(b):
        return 2 * b * 1024 * 2 / 50e9

    assert compute_s(plain) >= transfer_s(plain) and compute_s(plain - 1) < transfer_s(plain - 1)
    # zigzag: a step on another rank's block computes half a block
    assert compute_s(2 * plain) / 2 >= transfer_s(2 * plain) and compute_s(2 * plain - 2) / 2 < transfer_s(2 * plain - 2)


@pytest.mark.parametrize("c", [2, 3, 4, 8])
def test_causal_ring_time_counts_the_busiest_rank_of_each_step(c):
    seq = 8 * c
    for layout, positions in (("contiguous", cp.contiguous_positions(seq, c)), ("zigzag", cp.zigzag_positions(seq, c))):
        pieces = 2 if layout == "zigzag" else 1
        total = 0.0
        for step in range(c):
            busiest = 0.0
            for rank in range(c):
                source = (rank - step) % c
                pairs = sum(not kp.min() > qp.max() for qp in positions[rank].chunk(pieces)
                            for kp in positions[source].chunk(pieces))
                busiest = max(busiest, pairs / pieces**2)  # in blocks
            total += busiest
        assert total == pytest.approx(cp.causal_ring_time_in_blocks(c, layout))
    assert cp.causal_ring_time_in_blocks(16, "contiguous") / cp.causal_ring_time_in_blocks(16, "zigzag") > 1.9


def test_torch_head_tail_load_balancer_is_the_zigzag_layout():
    """The pinned torch's experimental context parallelism balances a causal mask with the same
    layout as the course's zigzag (rank r: chunks r and 2c-1-r)."""
    for seq, c in ((16, 2), (32, 4), (48, 3)):
        assert [p.tolist() for p in cp.torch_head_tail_positions(seq, c)] == [
            p.tolist() for p in cp.zigzag_positions(seq, c)]
