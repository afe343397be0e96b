"""Every check of the context-parallel chapter rejects plausible wrong answers with feedback that
names the mistake (softmax without the running-max rescale, a ring that sends keys but not
values, a ring that keeps every block it used, the causal mask forgotten between blocks, a zigzag that returns its chunks swapped, an
all-gather where a ring or an all-to-all is asked for), and accepts correct answers written
differently from the course's (isend/irecv instead of batch_isend_irecv)."""

import pytest

from conftest import assert_fails, changed, graded, solution_cell

SOFTMAX_CELL = solution_cell("cp", "online_softmax_attention")
RING_CELL = solution_cell("cp", "ring_attention")
BACKWARD_CELL = solution_cell("cp", "ring_attention_backward")
ZIGZAG_CELL = solution_cell("cp", "zigzag_ring_attention")
ULYSSES_CELL = solution_cell("cp", "ulysses_attention")
COSTS_CELL = solution_cell("cp", "ring_bytes_per_layer")
INTERVIEW_CELL = solution_cell("cp", "interview_ulysses_degree")
RING_STEP = ("handles = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % c),\n"
             "                                              dist.P2POp(dist.irecv, incoming, (rank - 1) % c)])")


# --- exercise 1: the online softmax ---

def test_online_softmax_names_sums_without_the_running_max_rescale(tmp_notebook):
    slip = changed(SOFTMAX_CELL, ("rescale = np.where(seen, np.exp(np.where(seen, running_max - shift, 0.0)), 1.0)",
                                  "rescale = np.ones(tokens)  # earlier sums kept as they were"),
                   ("new_max = np.maximum(running_max, scores.max(axis=1))", "new_max = scores.max(axis=1)"))
    assert_fails(graded(tmp_notebook, "cp.online_softmax", {"online_softmax_attention": slip}),
                 "sums exponentials taken against different maxima")


def test_online_softmax_rejects_a_naive_exponential(tmp_notebook):
    naive = changed(SOFTMAX_CELL, ("weights = np.exp(scores - shift[:, None])", "weights = np.exp(scores)"),
                    ("rescale = np.where(seen, np.exp(np.where(seen, running_max - shift, 0.0)), 1.0)",
                     "rescale = np.ones(tokens)"))
    assert_fails(graded(tmp_notebook, "cp.online_softmax", {"online_softmax_attention": naive}), "overflows")


def test_online_softmax_rejects_storing_the_blocks_and_computing_at_the_end(tmp_notebook):
    stored = changed(SOFTMAX_CELL, ("    for k_block, v_block in blocks:", "    for k_block, v_block in list(blocks):"))
    assert graded(tmp_notebook, "cp.online_softmax", {"online_softmax_attention": stored}).status == "failed"


def test_online_softmax_rejects_copying_every_block_then_one_softmax(tmp_notebook):
    """Copies of the blocks are what the reused buffer cannot catch: the memory kept as the blocks
    arrive can (the issue's 'copy every block, then one softmax over all of them' scored 3/3)."""
    copied = changed(SOFTMAX_CELL, ("    for k_block, v_block in blocks:",
                                    "    for k_block, v_block in [(k.copy(), v.copy()) for k, v in blocks]:"))
    assert_fails(graded(tmp_notebook, "cp.online_softmax", {"online_softmax_attention": copied}),
                 "keeps the blocks it has read")
    one_softmax = '''def online_softmax_attention(q, blocks, causal=False):
    keys, values = zip(*[(np.array(k_block), np.array(v_block)) for k_block, v_block in blocks])
    k, v = np.concatenate(keys), np.concatenate(values)
    scores = q @ k.T / math.sqrt(q.shape[1])
    if causal:
        scores = np.where(np.tril(np.ones(scores.shape, dtype=bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    return weights / weights.sum(axis=1, keepdims=True) @ v
'''
    assert_fails(graded(tmp_notebook, "cp.online_softmax", {"online_softmax_attention": one_softmax}),
                 "keeps the blocks it has read")


def test_online_softmax_names_a_causal_mask_that_hides_the_querys_own_key(tmp_notebook):
    strict = changed(SOFTMAX_CELL, ("keys[None, :] <= np.arange(tokens)[:, None]", "keys[None, :] < np.arange(tokens)[:, None]"))
    assert_fails(graded(tmp_notebook, "cp.online_softmax", {"online_softmax_attention": strict}),
                 "masks each query's own key")


@pytest.mark.parametrize("old, new, feedback", [
    ("out = out * rescale[:, None] + weights", "out = out + weights", "rescales the running sum but not the running output"),
    ("running_sum = running_sum * rescale + weights", "running_sum = running_sum + weights",
     "rescales the running output but not the running sum"),
], ids=["output-not-rescaled", "sum-not-rescaled"])
def test_online_softmax_names_half_a_rescale(tmp_notebook, old, new, feedback):
    assert_fails(graded(tmp_notebook, "cp.online_softmax", {"online_softmax_attention": changed(SOFTMAX_CELL, (old, new))}),
                 feedback)


# --- exercise 2: ring attention forward ---

def test_ring_rejects_sending_keys_but_not_values(tmp_notebook):
    keys_only = changed(RING_CELL, ("kv = torch.stack([k, v])  # K and V travel together: one message per step",
                                    "kv = torch.stack([k, k])  # only K travels; V stays local"))
    assert_fails(graded(tmp_notebook, "cp.ring_forward", {"ring_attention": keys_only}), "sent K blocks but no V blocks")


def test_ring_names_the_causal_mask_forgotten_between_blocks(tmp_notebook):
    local_mask = changed(RING_CELL, ("                if causal and kp.min() > qp.max():\n"
                                     "                    continue  # every key after every query: nothing to compute\n", ""),
                         ("*block_attention(qc, kc, vc, qp, kp, causal)", "*block_attention(qc, kc, vc, qp, kp, causal and source == rank)"))
    assert_fails(graded(tmp_notebook, "cp.ring_forward", {"ring_attention": local_mask}),
                 "causal mask applied only inside the rank's own block")


def test_ring_names_a_causal_mask_on_positions_within_each_block(tmp_notebook):
    local = changed(RING_CELL, ("    positions = list(torch.arange(block * c).chunk(c))\n    return ring_pass(",
                                "    positions = [torch.arange(block)] * c  # positions within the block\n    return ring_pass("))
    assert_fails(graded(tmp_notebook, "cp.ring_forward", {"ring_attention": local}), "positions within each block")


def test_ring_names_blocks_labelled_with_the_rank_on_the_other_side(tmp_notebook):
    """The block held at step i came from rank r - i; labelled r + i, the causal mask and the skip
    are those of another block. It was told it received a block too early."""
    mislabelled = changed(RING_CELL, ("        source = (rank - step) % c\n", "        source = (rank + step) % c\n"))
    assert_fails(graded(tmp_notebook, "cp.ring_forward", {"ring_attention": mislabelled}),
                 "as if it came from the wrong rank")


def test_ring_rejects_an_all_gather_of_k_and_v(tmp_notebook):
    gathered = RING_CELL + '''


def ring_attention(q, k, v, causal=False):
    c = dist.get_world_size()
    ks, vs = [torch.empty_like(k) for _ in range(c)], [torch.empty_like(v) for _ in range(c)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    rank, block = dist.get_rank(), q.shape[-2]
    full = reference_attention(torch.cat([torch.zeros(q.shape[0], rank * block, q.shape[-1]), q,
                                          torch.zeros(q.shape[0], (c - rank - 1) * block, q.shape[-1])], 1),
                               torch.cat(ks, 1), torch.cat(vs, 1), causal)
    return full[:, rank * block:(rank + 1) * block]
'''
    assert_fails(graded(tmp_notebook, "cp.ring_forward", {"ring_attention": gathered}), "called all_gather")


def test_ring_rejects_receiving_every_block_before_computing(tmp_notebook):
    first_all = changed(RING_CELL, (
        "    for step in range(c):\n        if step < c - 1:",
        "    arrived = [kv]\n"
        "    for _ in range(c - 1):\n"
        "        incoming = torch.empty_like(kv)\n"
        "        for handle in dist.batch_isend_irecv([dist.P2POp(dist.isend, arrived[-1], (rank + 1) % c),\n"
        "                                              dist.P2POp(dist.irecv, incoming, (rank - 1) % c)]):\n"
        "            handle.wait()\n"
        "        arrived.append(incoming)\n"
        "    for step in range(c):\n"
        "        kv = arrived[step]\n"
        "        if False:"), ("        if step < c - 1:\n            for handle", "        if False:\n            for handle"))
    assert_fails(graded(tmp_notebook, "cp.ring_forward", {"ring_attention": first_all}),
                 "received the next block before computing any scores")


def test_ring_rejects_keeping_every_used_block_in_a_list(tmp_notebook):
    """Each block computed as it arrives and passed on, as the ring asks, but also kept: by the end
    of the ring the rank holds all keys and values. Every message and product is as the solution's;
    only what stays referenced differs."""
    keeper = changed(RING_CELL, ("    outs = [None] * pieces\n", "    outs = [None] * pieces\n    used = []\n"),
                     ("            kv = incoming  #", "            used.append(kv)  # kept, in case it is needed again\n"
                                                  "            kv = incoming  #"))
    assert_fails(graded(tmp_notebook, "cp.ring_forward", {"ring_attention": keeper}),
                 "keeps blocks it has already used")


def test_ring_accepts_isend_irecv(tmp_notebook):
    plain = changed(RING_CELL, (RING_STEP, "handles = [dist.isend(kv, (rank + 1) % c), dist.irecv(incoming, (rank - 1) % c)]"))
    assert graded(tmp_notebook, "cp.ring_forward", {"ring_attention": plain}).status == "passed"


def test_ring_accepts_k_and_v_concatenated_along_the_head_dimension(tmp_notebook):
    concatenated = changed(RING_CELL, ("kv = torch.stack([k, v])  # K and V travel together: one message per step",
                                       "kv = torch.cat([k, v], dim=-1)  # (heads, block, 2d)"),
                           ("kv[0].chunk(pieces, -2), kv[1].chunk(pieces, -2)",
                            "kv.chunk(2, -1)[0].chunk(pieces, -2), kv.chunk(2, -1)[1].chunk(pieces, -2)"))
    assert graded(tmp_notebook, "cp.ring_forward", {"ring_attention": concatenated}).status == "passed"


# --- exercise 3: the backward ---

def test_ring_backward_rejects_gradients_that_never_come_home(tmp_notebook):
    # the accumulators stop after c - 1 steps: each rank ends with a neighbour's dK/dV
    short = changed(BACKWARD_CELL, ("        incoming_grad = torch.empty_like(dkv)",
                                    "        if step == c - 1:\n            break\n        incoming_grad = torch.empty_like(dkv)"))
    assert graded(tmp_notebook, "cp.ring_backward", {"ring_attention_backward": short}).status == "failed"


def test_ring_backward_names_the_missing_rowsum_term(tmp_notebook):
    without = changed(BACKWARD_CELL, ("ds = p * (dout @ kv[1].transpose(-1, -2) - delta)", "ds = p * (dout @ kv[1].transpose(-1, -2))"))
    assert_fails(graded(tmp_notebook, "cp.ring_backward", {"ring_attention_backward": without}),
                 "subtracts each query's rowsum(dO ⊙ O)")


# --- exercise 4: zigzag ---

def test_zigzag_names_swapped_chunks(tmp_notebook):
    swapped = changed(ZIGZAG_CELL, ("    return ring_pass(q, k, v, positions, True, pieces=2)[0]",
                                    "    out = ring_pass(q, k, v, positions, True, pieces=2)[0]\n"
                                    "    return torch.cat([out[:, chunk:], out[:, :chunk]], dim=1)"))
    assert_fails(graded(tmp_notebook, "cp.zigzag", {"zigzag_ring_attention": swapped}), "two chunks swapped")


def test_zigzag_names_a_second_chunk_one_early(tmp_notebook):
    off = changed(ZIGZAG_CELL, ("    positions = [torch.cat([chunks[r], chunks[2 * c - 1 - r]]) for r in range(c)]",
                                "    positions = [torch.cat([chunks[r], chunks[2 * c - 2 - r]]) for r in range(c)]"))
    assert_fails(graded(tmp_notebook, "cp.zigzag", {"zigzag_ring_attention": off}), "second chunk taken as chunk 2c - 2 - r")


def test_zigzag_accepts_second_chunks_labelled_one_late(tmp_notebook):
    """Positions shifted together keep their order, and a causal mask sees only order: right."""
    late = changed(ZIGZAG_CELL, ("    positions = [torch.cat([chunks[r], chunks[2 * c - 1 - r]]) for r in range(c)]",
                                 "    positions = [torch.cat([chunks[r], torch.arange((2 * c - r) * chunk, (2 * c - r + 1) * chunk)])"
                                 " for r in range(c)]"))
    assert graded(tmp_notebook, "cp.zigzag", {"zigzag_ring_attention": late}).status == "passed"


def test_zigzag_rejects_whole_masked_blocks(tmp_notebook):
    whole = changed(ZIGZAG_CELL, ("ring_pass(q, k, v, positions, True, pieces=2)", "ring_pass(q, k, v, positions, True)"))
    assert_fails(graded(tmp_notebook, "cp.zigzag", {"zigzag_ring_attention": whole}), "chunk pairs")


# --- exercise 5: Ulysses ---

def test_ulysses_rejects_an_all_gather(tmp_notebook):
    gathered = '''def ulysses_attention(q, k, v, causal=False):
    c, rank = dist.get_world_size(), dist.get_rank()
    parts = [[torch.empty_like(x) for _ in range(c)] for x in (q, k, v)]
    for part, x in zip(parts, (q, k, v)):
        dist.all_gather(part, x)
    out = reference_attention(*(torch.cat(part, 1) for part in parts), causal)
    return out[:, rank * q.shape[1]:(rank + 1) * q.shape[1]]
'''
    assert_fails(graded(tmp_notebook, "cp.ulysses", {"ulysses_attention": gathered}), "called all_gather")


def test_ulysses_names_attention_without_the_causal_flag(tmp_notebook):
    unmasked = changed(ULYSSES_CELL, ("local = reference_attention(full[0], full[1], full[2], causal)",
                                      "local = reference_attention(full[0], full[1], full[2])"))
    assert_fails(graded(tmp_notebook, "cp.ulysses", {"ulysses_attention": unmasked}), "without the causal mask")


def test_ulysses_accepts_all_to_all_single(tmp_notebook):
    single = '''def ulysses_attention(q, k, v, causal=False):
    c = dist.get_world_size()
    heads, block, d = q.shape
    qkv = torch.stack([q, k, v]).reshape(3, c, heads // c, block, d).transpose(0, 1).contiguous()
    received = torch.empty_like(qkv)
    dist.all_to_all_single(received, qkv)  # received[j]: rank j's tokens of my heads
    full = received.permute(1, 2, 0, 3, 4).reshape(3, heads // c, c * block, d)
    local = reference_attention(full[0], full[1], full[2], causal)
    send = local.reshape(heads // c, c, block, d).transpose(0, 1).contiguous()
    back = torch.empty_like(send)
    dist.all_to_all_single(back, send)
    return back.reshape(heads, block, d)
'''
    assert graded(tmp_notebook, "cp.ulysses", {"ulysses_attention": single}).status == "passed"


# --- exercise 6: costs and interview ---

def test_costs_name_forgetting_v(tmp_notebook):
    slip = changed(COSTS_CELL, ("return (c - 1) * 2 * tokens / c * kv_hidden * dtype_bytes",
                                "return (c - 1) * tokens / c * kv_hidden * dtype_bytes"))
    assert_fails(graded(tmp_notebook, "cp.costs", {"ring_bytes_per_layer": slip}), "counts K only")


def test_interview_names_splitting_query_heads(tmp_notebook):
    slip = changed(INTERVIEW_CELL, ("    return kv_heads // t", "    return heads // t"))
    assert_fails(graded(tmp_notebook, "cp.interview", {"interview_ulysses_degree": slip}), "splits the query heads")


def test_ring_backward_rejects_gradients_sent_straight_to_their_owner(tmp_notebook):
    # K and V go around the ring, but each rank keeps its share of every block's dK/dV and sends
    # it to the block's owner at the end: correct gradients, but not the ring the exercise asks
    # for (at c = 2 one message too few for the formula; at c = 4 owners two ranks away)
    direct = changed(BACKWARD_CELL, (
        "        incoming_grad = torch.empty_like(dkv)  # this block's gradients go on with it\n"
        "        handles += dist.batch_isend_irecv([dist.P2POp(dist.isend, dkv, (rank + 1) % c),\n"
        "                                           dist.P2POp(dist.irecv, incoming_grad, (rank - 1) % c)])\n"
        "        for handle in handles:\n"
        "            handle.wait()\n"
        "        dkv = incoming_grad\n",
        "        shares[source] = dkv\n"
        "        dkv = torch.zeros_like(dkv)\n"
        "        for handle in handles:\n"
        "            handle.wait()\n"), (
        "    for step in range(c):\n",
        "    shares = {}\n    for step in range(c):\n"), (
        "    return dq, dkv[0], dkv[1]",
        "    received = {j: torch.empty_like(shares[j]) for j in shares if j != rank}\n"
        "    ops = [op for j in received for op in (dist.P2POp(dist.isend, shares[j], j),\n"
        "                                           dist.P2POp(dist.irecv, received[j], j))]\n"
        "    for handle in dist.batch_isend_irecv(ops):\n"
        "        handle.wait()\n"
        "    total = shares[rank] + sum(received.values())\n"
        "    return dq, total[0], total[1]"))
    assert_fails(graded(tmp_notebook, "cp.ring_backward", {"ring_attention_backward": direct}),
                 "dK/dV accumulator on in c = 2 steps")


# --- every exercise refuses what the library holds that solves any part of it ---

SOFTMAX_FROM_PLAIN_ATTENTION = '''def online_softmax_attention(q, blocks, causal=False):
    from dtp.cp.context_parallel import attention_numpy
    keys, values = zip(*[(np.array(k_block), np.array(v_block)) for k_block, v_block in blocks])
    return attention_numpy(q, np.concatenate(keys), np.concatenate(values), causal)
'''


def test_online_softmax_refuses_the_librarys_plain_attention(tmp_notebook):
    assert_fails(graded(tmp_notebook, "cp.online_softmax", {"online_softmax_attention": SOFTMAX_FROM_PLAIN_ATTENTION}),
                 "calls the course's reference dtp.cp.context_parallel.attention_numpy")


def test_ring_forward_refuses_the_per_block_math_of_the_library(tmp_notebook):
    borrowed = changed(RING_CELL, ("def ring_pass(", "import dtp.cp.context_parallel as library\n\n\ndef ring_pass("),
                       ("merge(outs[i], lses[i], *block_attention(qc, kc, vc, qp, kp, causal))",
                        "library.merge(outs[i], lses[i], *library.masked_block(qc, kc, vc, qp, kp, causal))"))
    assert_fails(graded(tmp_notebook, "cp.ring_forward", {"ring_attention": borrowed}),
                 ("calls the course's reference dtp.cp.context_parallel.masked_block",
                  "calls the course's reference dtp.cp.context_parallel.merge"))


def test_the_learners_own_helpers_named_like_the_librarys_are_theirs(tmp_notebook):
    """The guard refuses the library's function objects, not names: a notebook's own `masked_block`
    and `merge` (the solution's is already called merge), or `attention_numpy`, run."""
    own = changed(RING_CELL, ("def block_attention(", "def masked_block("),
                  ("*block_attention(qc, kc, vc, qp, kp, causal)", "*masked_block(qc, kc, vc, qp, kp, causal)"))
    assert graded(tmp_notebook, "cp.ring_forward", {"ring_attention": own}).status == "passed"
    softmax_with_own_helper = '''def combine(out, lse, block_out, block_lse):  # numpy, of the learner's own
    total = np.logaddexp(lse, block_lse)
    safe = np.where(np.isfinite(total), total, 0.0)
    return (out * np.exp(lse - safe)[:, None] + block_out * np.exp(block_lse - safe)[:, None]), total


def attention_numpy(q, k, v, causal, start):  # one block's (output, log-sum-exp), the learner's own
    scores = q @ k.T / math.sqrt(q.shape[1])
    if causal:
        scores = np.where(np.arange(start, start + len(k))[None, :] <= np.arange(len(q))[:, None], scores, -np.inf)
    top = scores.max(axis=1)
    shift = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(scores - shift[:, None])
    total = weights.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.nan_to_num(weights @ v / total[:, None]), np.log(total) + shift


def online_softmax_attention(q, blocks, causal=False):
    out, lse, start = np.zeros(q.shape), np.full(len(q), -np.inf), 0
    for k_block, v_block in blocks:
        out, lse = combine(out, lse, *attention_numpy(q, k_block, v_block, causal, start))
        start += len(k_block)
    return out
'''
    assert graded(tmp_notebook, "cp.online_softmax", {"online_softmax_attention": softmax_with_own_helper}).status == "passed"
