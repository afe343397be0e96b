"""The tensor-parallelism chapter's checks of exercises 4 to 7 (the block, sequence parallelism, the
vocabulary-parallel loss, costs and the interview) reject plausible wrong answers with feedback that
names the mistake, and accept correct answers written differently from the course's."""
import numpy as np
import pytest
from conftest import assert_fails, graded

from grader.checks.tp.costs import Costs


# --- exercise 4: the tensor-parallel block ---

CONTIGUOUS_QKV = '''
class TensorParallelAttention(nn.Module):
    def __init__(self, attention, enter, leave):
        super().__init__()
        self.local_heads = attention.n_heads // dist.get_world_size()
        self.qkv = ColumnParallelLinear(attention.qkv, enter)  # a contiguous split of [q; k; v]: wrong heads
        self.proj = RowParallelLinear(attention.proj, leave)
        self.attention_dropout = copy.deepcopy(attention.attention_dropout)
        self.output_dropout = copy.deepcopy(attention.output_dropout)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        batch, seq, width = q.shape
        size = width // self.local_heads
        q, k, v = (z.view(batch, seq, self.local_heads, size).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1) / math.sqrt(size)).masked_fill(
            ~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, width)
        return self.output_dropout(self.proj(context))
'''

SEPARATE_Q_K_V = '''
def head_rows(dense, part, hidden):
    """The rows of part (0: q, 1: k, 2: v) of a fused qkv Linear, as a Linear of its own."""
    layer = nn.Linear(hidden, hidden)
    with torch.no_grad():
        layer.weight.copy_(dense.weight[part * hidden:(part + 1) * hidden])
        layer.bias.copy_(dense.bias[part * hidden:(part + 1) * hidden])
    return layer


class TensorParallelAttention(nn.Module):
    """q, k and v as three column-parallel layers, each splitting its own rows by heads; the input
    enters the parallel region once."""
    def __init__(self, attention, enter, leave):
        super().__init__()
        hidden = attention.qkv.in_features
        self.local_heads = attention.n_heads // dist.get_world_size()
        self.enter = enter
        self.q, self.k, self.v = (ColumnParallelLinear(head_rows(attention.qkv, part, hidden), {ENTER})
                                  for part in range(3))
        self.proj = RowParallelLinear(attention.proj, leave)

    def forward(self, x):
        batch, seq, _ = x.shape
        x = {ENTER_ONCE}
        q, k, v = self.q(x), self.k(x), self.v(x)
        width = q.shape[-1]
        q, k, v = (z.view(batch, seq, self.local_heads, -1).transpose(1, 2) for z in (q, k, v))
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(context.transpose(1, 2).reshape(batch, seq, width))
'''

REPLICATED_BLOCK = '''
class TensorParallelBlock(nn.Module):
    """The dense block on every rank: right outputs, nothing split."""
    def __init__(self, block, enter=copy_to_tensor_parallel, leave=reduce_from_tensor_parallel):
        super().__init__()
        self.block = copy.deepcopy(block)

    def forward(self, x):
        return self.block(x)
'''

BLOCK_WITH_AN_EXTRA_ALL_REDUCE = '''
class TensorParallelBlock(nn.Module):
    def __init__(self, block, enter=copy_to_tensor_parallel, leave=reduce_from_tensor_parallel):
        super().__init__()
        self.norm1, self.norm2 = copy.deepcopy(block.norm1), copy.deepcopy(block.norm2)
        self.attention = TensorParallelAttention(block.attention, enter, leave)
        self.mlp = TensorParallelMLP(block.mlp, enter, leave)

    def forward(self, x):
        x = x + 0 * reduce_from_tensor_parallel(x)  # "make sure the ranks agree": one more all-reduce
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))
'''


@pytest.mark.parametrize("replacements, feedback", [
    ({"TensorParallelAttention": CONTIGUOUS_QKV}, "Split attention by heads"),
    ({"TensorParallelBlock": REPLICATED_BLOCK}, "is held by 2 ranks"),
    ({"TensorParallelBlock": BLOCK_WITH_AN_EXTRA_ALL_REDUCE}, "forward issued 3 all_reduce"),
], ids=["contiguous-qkv-split", "dense-block-on-every-rank", "extra-all-reduce"])
def test_parallel_block_rejects(tmp_notebook, replacements, feedback):
    assert_fails(graded(tmp_notebook, "tp.parallel_block", replacements), feedback)


def separate_q_k_v(enter_each_projection: bool) -> str:
    if enter_each_projection:
        return SEPARATE_Q_K_V.replace("{ENTER}", "enter").replace("{ENTER_ONCE}", "x")
    return SEPARATE_Q_K_V.replace("{ENTER}", "lambda x: x").replace("{ENTER_ONCE}", "self.enter(x)")


def test_parallel_block_rejects_f_on_each_of_q_k_and_v(tmp_notebook):
    result = graded(tmp_notebook, "tp.parallel_block", {"TensorParallelAttention": separate_q_k_v(True)})
    assert_fails(result, "backward issued 4 all_reduce")


def test_parallel_block_accepts_separate_q_k_v_and_fused_attention(tmp_notebook):
    result = graded(tmp_notebook, "tp.parallel_block", {"TensorParallelAttention": separate_q_k_v(False)})
    assert result.status == "passed", result


# --- exercise 5: sequence parallelism ---

SP_AS_TP_AND_A_SLICE = '''
class SequenceParallelBlock(TensorParallelBlock):
    """Gathers the sequence, runs plain tensor parallelism, keeps its piece: all-reduces remain."""
    def __init__(self, block):
        super().__init__(block)

    def forward(self, x_shard):
        full = all_gather_along_sequence(x_shard.detach())
        return super().forward(full).chunk(dist.get_world_size(), dim=1)[dist.get_rank()]
'''

GATHER_WITHOUT_REDUCE_SCATTER = '''
class GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard):
        return all_gather_along_sequence(shard)

    @staticmethod
    def backward(ctx, grad_output):  # keeps its piece, forgetting the other ranks' contributions
        return grad_output.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous()


class ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, full):
        return reduce_scatter_along_sequence(full)

    @staticmethod
    def backward(ctx, grad_output):
        return all_gather_along_sequence(grad_output)


gather_sequence = GatherSequence.apply
reduce_scatter_sequence = ReduceScatterSequence.apply
'''

SYNC_EVERYTHING = '''
def all_reduce_replicated_gradients(block):
    for parameter in block.parameters():
        dist.all_reduce(parameter.grad)
'''

SYNC_AVERAGE = '''
def all_reduce_replicated_gradients(block):
    for parameter in [*block.norm1.parameters(), *block.norm2.parameters(), block.attention.proj.bias,
                      block.mlp.down.bias]:
        dist.all_reduce(parameter.grad)
        parameter.grad /= dist.get_world_size()
'''


SP_KEEPING_THE_GATHERED_INPUT = '''
class SequenceParallelBlock(TensorParallelBlock):
    """The new operators, and autograd left alone: the column-parallel layers keep the gathered sequence."""
    def __init__(self, block):
        super().__init__(block, enter=gather_sequence, leave=reduce_scatter_sequence)
'''

SP_GATHER_WITH_VIEW = '''
def all_gather_along_sequence(shard):
    n_ranks = dist.get_world_size()
    batch, seq, hidden = shard.shape
    gathered = torch.empty((n_ranks * batch, seq, hidden), dtype=shard.dtype)
    dist.all_gather_single(gathered, shard.contiguous())
    return gathered.view(batch, n_ranks * seq, hidden)  # right only for batch 1: ranks' shards are stacked on dim 0


def reduce_scatter_along_sequence(full):
    n_ranks = dist.get_world_size()
    batch, seq, hidden = full.shape
    shard = torch.empty((batch, seq // n_ranks, hidden), dtype=full.dtype)
    dist.reduce_scatter_single(shard, full.contiguous().view(n_ranks * batch, seq // n_ranks, hidden))
    return shard
'''


@pytest.mark.parametrize("replacements, feedback", [
    ({"SequenceParallelBlock": SP_KEEPING_THE_GATHERED_INPUT}, "keeps for backward a tensor of shape"),
    ({"all_gather_along_sequence": SP_GATHER_WITH_VIEW}, "differs from the reference"),
    ({"SequenceParallelBlock": SP_AS_TP_AND_A_SLICE}, "forward issued"),
    ({"GatherSequence": GATHER_WITHOUT_REDUCE_SCATTER}, "backward issued"),
    ({"all_reduce_replicated_gradients": "def all_reduce_replicated_gradients(block):\n    pass\n"},
     "issued no collective"),
    ({"all_reduce_replicated_gradients": SYNC_EVERYTHING}, "gradients of the replicated parameters only"),
    ({"all_reduce_replicated_gradients": SYNC_AVERAGE}, "not averaged"),
], ids=["keeps-the-gathered-input", "gathered-with-view", "tensor-parallel-and-a-slice",
        "gather-backward-without-reduce-scatter", "no-gradient-sync",
        "sync-every-gradient", "sync-averages"])
def test_sequence_parallel_rejects(tmp_notebook, replacements, feedback):
    assert_fails(graded(tmp_notebook, "tp.sequence_parallel", replacements), feedback)


SP_REGATHERING_IN_ITS_OWN_BACKWARD = '''
class GatheredLinear(torch.autograd.Function):
    """Megatron-LM's way: save the sequence piece, all-gather it again in backward for the weight gradient."""
    @staticmethod
    def forward(ctx, shard, weight, bias):
        ctx.save_for_backward(shard, weight)
        return F.linear(all_gather_along_sequence(shard), weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        shard, weight = ctx.saved_tensors
        full = all_gather_along_sequence(shard)
        grad_weight = grad_output.flatten(0, -2).T @ full.flatten(0, -2)
        return reduce_scatter_along_sequence(grad_output @ weight), grad_weight, grad_output.flatten(0, -2).sum(0)


class PieceKeepingColumn(nn.Module):
    def __init__(self, column):
        super().__init__()
        self.weight, self.bias = column.weight, column.bias

    def forward(self, shard):
        return GatheredLinear.apply(shard, self.weight, self.bias)


class SequenceParallelBlock(TensorParallelBlock):
    def __init__(self, block):
        super().__init__(block, enter=gather_sequence, leave=reduce_scatter_sequence)
        self.attention.qkv, self.mlp.up = PieceKeepingColumn(self.attention.qkv), PieceKeepingColumn(self.mlp.up)
'''

SP_WITH_LIST_COLLECTIVES = '''
def all_gather_along_sequence(shard):
    pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, shard.contiguous())
    return torch.cat(pieces, dim=1)


def reduce_scatter_along_sequence(full):
    pieces = [piece.contiguous() for piece in full.chunk(dist.get_world_size(), dim=1)]
    shard = torch.empty_like(pieces[0])
    dist.reduce_scatter(shard, pieces)
    return shard
'''


@pytest.mark.parametrize("replacements", [{"SequenceParallelBlock": SP_REGATHERING_IN_ITS_OWN_BACKWARD},
                                          {"all_gather_along_sequence": SP_WITH_LIST_COLLECTIVES}],
                         ids=["autograd-function-regathering", "list-collectives"])
def test_sequence_parallel_accepts(tmp_notebook, replacements):
    result = graded(tmp_notebook, "tp.sequence_parallel", replacements)
    assert result.status == "passed", result


def test_sequence_parallel_draws_batches_that_tell_view_from_concatenation():
    import numpy as np

    from grader.registry import find_exercise
    check = find_exercise("tp.sequence_parallel").check
    for seed in range(200):  # every grading, both worlds: batch > 1, where view and cat differ
        for n, case in check.prepare(np.random.default_rng(seed)):
            assert case["x"].shape[0] > 1 and case["x"].shape[1] % n == 0


# --- exercise 6: vocabulary-parallel embedding and cross-entropy ---

LOSS_TEMPLATE = '''
def vocab_parallel_cross_entropy(local_logits, targets, vocab_start):
    maximum = local_logits.detach().max(dim=-1).values
    {MAX}
    shifted = local_logits - maximum.unsqueeze(-1)
    local_targets = targets - vocab_start
    mine = (local_targets >= 0) & (local_targets < local_logits.shape[-1])
    picked = shifted.gather(-1, local_targets.clamp(0, local_logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    sum_exp = {SUM}(shifted.exp().sum(dim=-1))
    target = {SUM}(torch.where(mine, picked, torch.zeros_like(picked)))
    return sum_exp.log() - target
'''
LOSS_RIGHT = dict(MAX="dist.all_reduce(maximum, op=dist.ReduceOp.MAX)", SUM="reduce_from_tensor_parallel")


def loss(**changes) -> str:
    return LOSS_TEMPLATE.format(**{**LOSS_RIGHT, **changes})


LOSS_FROM_GATHERED_LOGITS = '''
def vocab_parallel_cross_entropy(local_logits, targets, vocab_start):
    # Every rank's columns gathered (padded to the widest shard), then torch's loss on the whole logits.
    widths = [None] * dist.get_world_size()
    dist.all_gather_object(widths, local_logits.shape[-1])
    padded = F.pad(local_logits.detach(), (0, max(widths) - local_logits.shape[-1]))
    gathered = [torch.empty_like(padded) for _ in widths]
    dist.all_gather(gathered, padded)
    pieces = [piece[:, :width] for piece, width in zip(gathered, widths)]
    pieces[dist.get_rank()] = local_logits
    return F.cross_entropy(torch.cat(pieces, dim=-1), targets, reduction="none")
'''

LOSS_FROM_ZERO_PADDED_LOGITS = '''
def vocab_parallel_cross_entropy(local_logits, targets, vocab_start):
    vocab = torch.tensor([local_logits.shape[-1]])
    dist.all_reduce(vocab)
    full = local_logits.new_zeros(local_logits.shape[0], int(vocab))
    full[:, vocab_start:vocab_start + local_logits.shape[-1]] = local_logits
    return F.cross_entropy(reduce_from_tensor_parallel(full), targets, reduction="none")
'''

LOSS_ALL_REDUCE_BOTH_WAYS = '''
import warnings
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce


def all_reduce_both_ways(x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return differentiable_all_reduce(x)
''' + loss(SUM="all_reduce_both_ways")

EMBEDDING_WITHOUT_MASK = '''
class VocabParallelEmbedding(nn.Module):
    def __init__(self, dense):
        super().__init__()
        self.weight = nn.Parameter(shard_of(dense.weight, 0))
        self.start, _ = shard_bounds(dense.weight.shape[0], dist.get_world_size(), dist.get_rank())

    def forward(self, tokens):
        local = (tokens - self.start).clamp(0, self.weight.shape[0] - 1)  # other ranks' tokens not zeroed
        return reduce_from_tensor_parallel(F.embedding(local, self.weight))
'''


@pytest.mark.parametrize("replacements, feedback", [
    ({"VocabParallelCrossEntropy": loss(SUM="")}, "use this rank's logits only"),
    ({"VocabParallelCrossEntropy": loss(MAX="maximum = maximum * 0")}, "NaN or inf"),
    ({"VocabParallelCrossEntropy": LOSS_FROM_GATHERED_LOGITS}, "has the size of the whole vocabulary"),
    ({"VocabParallelCrossEntropy": LOSS_FROM_ZERO_PADDED_LOGITS}, "has the size of the whole vocabulary"),
    ({"VocabParallelCrossEntropy": LOSS_ALL_REDUCE_BOTH_WAYS}, "gradient of this rank's logits"),
    ({"VocabParallelEmbedding": EMBEDDING_WITHOUT_MASK}, "VocabParallelEmbedding's output"),
], ids=["softmax-over-the-local-shard", "no-max-subtracted", "gathered-logits", "zero-padded-logits",
        "all-reduce-in-backward", "embedding-without-mask"])
def test_vocab_parallel_rejects(tmp_notebook, replacements, feedback):
    assert_fails(graded(tmp_notebook, "tp.vocab_parallel", replacements), feedback)


FUSED_SUMS_EXPLICIT_BACKWARD = '''
class VocabParallelCrossEntropy(torch.autograd.Function):
    """Two all-reduces: the max, then the sum of exponentials and the target logit in one message."""
    @staticmethod
    def forward(ctx, local_logits, targets, vocab_start):
        maximum = local_logits.max(dim=-1).values
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX)
        exponentials = (local_logits - maximum[:, None]).exp()
        local_targets = targets - vocab_start
        mine = (local_targets >= 0) & (local_targets < local_logits.shape[-1])
        rows = torch.arange(len(targets))
        target = torch.zeros_like(maximum)
        target[mine] = local_logits[rows[mine], local_targets[mine]] - maximum[mine]
        sums = torch.stack([exponentials.sum(dim=-1), target])
        dist.all_reduce(sums)
        ctx.save_for_backward(exponentials / sums[0][:, None], local_targets, mine)
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx, grad_losses):
        softmax, local_targets, mine = ctx.saved_tensors
        one_hot = torch.zeros_like(softmax)
        one_hot[torch.arange(len(mine))[mine], local_targets[mine]] = 1.0
        return (softmax - one_hot) * grad_losses[:, None], None, None


def vocab_parallel_cross_entropy(local_logits, targets, vocab_start):
    return VocabParallelCrossEntropy.apply(local_logits, targets, vocab_start)
'''


@pytest.mark.parametrize("source", [loss(), FUSED_SUMS_EXPLICIT_BACKWARD],
                         ids=["autograd-through-g", "two-all-reduces-explicit-backward"])
def test_vocab_parallel_accepts(tmp_notebook, source):
    result = graded(tmp_notebook, "tp.vocab_parallel", {"VocabParallelCrossEntropy": source})
    assert result.status == "passed", result


# --- exercise 7 and the interview ---

COSTS_TEMPLATE = '''
def allreduce_message_bytes(tokens, hidden, bytes_per_element):
    return {MESSAGE}


def ring_traffic_per_gpu_per_layer(tokens, hidden, t, bytes_per_element):
    return {TRAFFIC}


def communication_to_compute_ratio(seq, hidden, t, bytes_per_element, link_bytes_per_s, flops_per_s):
    traffic = {RATIO_TRAFFIC}
    flops = {RATIO_FLOPS}
    return (traffic / link_bytes_per_s) / (flops / {RATIO_SHARE} / flops_per_s)
'''
COSTS_RIGHT = dict(MESSAGE="tokens * hidden * bytes_per_element",
                   TRAFFIC="4 * 2 * (t - 1) / t * tokens * hidden * bytes_per_element",
                   RATIO_TRAFFIC="8 * (t - 1) / t * hidden * bytes_per_element",
                   RATIO_FLOPS="72 * hidden**2 + 12 * seq * hidden", RATIO_SHARE="t")


def costs(**changes) -> str:
    return COSTS_TEMPLATE.format(**{**COSTS_RIGHT, **changes})


@pytest.mark.parametrize("changes, feedback", [
    (dict(MESSAGE="tokens * hidden"), "multiply by the bytes per element"),
    (dict(TRAFFIC="4 * tokens * hidden * bytes_per_element"), "that counts 4·S"),
    (dict(RATIO_FLOPS="72 * hidden**2"), "leaves out attention's QKᵀ and AV"),
    (dict(RATIO_SHARE="1"), "each GPU multiplies 1/t of it"),
    (dict(RATIO_FLOPS="24 * hidden**2 + 4 * seq * hidden"), "forward pass's compute only"),
    (dict(MESSAGE="__import__('dtp.tp.tensor_parallel').tp.tensor_parallel.all_reduce_message_bytes(tokens, hidden, "
                  "bytes_per_element)"), "uses the course's reference"),
], ids=["elements-not-bytes", "four-messages", "no-attention-flops", "whole-layer-compute", "forward-compute-only",
        "course-reference"])
def test_costs_rejects(tmp_notebook, changes, feedback):
    assert_fails(graded(tmp_notebook, "tp.costs", {"allreduce_message_bytes": costs(**changes)}), feedback)


def test_costs_draw_a_ring_of_more_than_two_in_every_grading():
    """Counting four messages of S per layer gives a ring's traffic at t = 2: every grading must ask
    t > 2 (with free draws an answer counting messages passed 1 grading in 100)."""
    for seed in range(300):
        assert any(case["t"] > 2 for case in Costs().prepare(np.random.default_rng(seed))), seed


@pytest.mark.parametrize("changes", [dict(TRAFFIC="2 * 2 * (t - 1) / t * tokens * hidden * bytes_per_element"),
                                     dict(TRAFFIC="4 * (t - 1) / t * tokens * hidden * bytes_per_element")],
                         ids=["forward-only", "no-ring-factor-2"])
def test_costs_names_both_slips_that_halve_the_traffic(tmp_notebook, changes):
    # forward only and a ring's missing factor 2 give the same number: the feedback offers both, never one alone
    result = graded(tmp_notebook, "tp.costs", {"allreduce_message_bytes": costs(**changes)})
    assert_fails(result, "more than one mistake gives that value")
    assert "forward pass only" in result.feedback and "one half of the ring" in result.feedback


def test_costs_accepts_the_ratio_in_closed_form(tmp_notebook):
    closed_form = dict(RATIO_TRAFFIC="8 * (t - 1) * hidden * bytes_per_element * flops_per_s",
                       RATIO_FLOPS="link_bytes_per_s * (72 * hidden**2 + 12 * seq * hidden)", RATIO_SHARE="1")
    source = costs(**closed_form).replace("return (traffic / link_bytes_per_s) / (flops / 1 / flops_per_s)",
                                          "return traffic / flops")
    assert graded(tmp_notebook, "tp.costs", {"allreduce_message_bytes": source}).status == "passed"


INTERVIEW_RIGHT = {
    "interview_allreduce_mib": "def interview_allreduce_mib(tokens, hidden, bytes_per_element):\n"
                               "    return tokens * hidden * bytes_per_element / 2**20",
    "interview_traffic_per_gpu_mib": "def interview_traffic_per_gpu_mib(tokens, hidden, bytes_per_element, t):\n"
                                     "    return 8 * (t - 1) / t * tokens * hidden * bytes_per_element / 2**20",
    "interview_nvlink_ms": "def interview_nvlink_ms(traffic_mib, datasheet_gb_per_s):\n"
                           "    return traffic_mib * 2**20 / (datasheet_gb_per_s * 1e9 / 2) * 1e3",
    "interview_infiniband_ms": "def interview_infiniband_ms(traffic_mib, gbit_per_s):\n"
                               "    return traffic_mib * 2**20 / (gbit_per_s * 1e9 / 8) * 1e3",
}


def interview(name: str, body: str) -> str:
    sources = {**INTERVIEW_RIGHT, name: INTERVIEW_RIGHT[name].split("\n")[0] + "\n    return " + body}
    return "\n\n\n".join(sources.values())


@pytest.mark.parametrize("name, body, feedback", [
    ("interview_allreduce_mib", "tokens * hidden * bytes_per_element / 1e6", "that is in MB"),
    ("interview_traffic_per_gpu_mib", "4 * tokens * hidden * bytes_per_element / 2**20", "that counts 4·S"),
    ("interview_traffic_per_gpu_mib", "4 * (t - 1) / t * tokens * hidden * bytes_per_element / 2**20",
     "one half of the ring"),
    ("interview_nvlink_ms", "traffic_mib * 2**20 / (datasheet_gb_per_s * 1e9) * 1e3", "total over both directions"),
    ("interview_infiniband_ms", "traffic_mib * 2**20 / (gbit_per_s * 1e9) * 1e3", "reads Gb/s as GB/s"),
    ("interview_infiniband_ms", "traffic_mib * 2**20 / (gbit_per_s * 1e9 / 8)", "in seconds"),
    ("interview_traffic_per_gpu_mib", "448.0", "interview_traffic_per_gpu_mib("),  # right for the asked numbers only
], ids=["MB-not-MiB", "four-messages", "no-ring-factor", "bidirectional-nvlink", "gigabits-as-gigabytes", "seconds",
        "copied-constant"])
def test_interview_rejects(tmp_notebook, name, body, feedback):
    result = graded(tmp_notebook, "tp.interview", {"interview_allreduce_mib": interview(name, body)})
    assert_fails(result, feedback)


def test_interview_rejects_an_answer_copied_as_a_number(tmp_notebook):
    source = "\n\n\n".join(INTERVIEW_RIGHT.values()) + "\n\n\ninterview_traffic_per_gpu_mib = 448"
    result = graded(tmp_notebook, "tp.interview", {"interview_allreduce_mib": source})
    assert result.status != "passed" and result.points == 0, result


def test_interview_refuses_the_course_functions(tmp_notebook):
    body = "__import__('dtp.tp.tensor_parallel').tp.tensor_parallel.all_reduce_message_bytes(tokens, hidden, bytes_per_element) / 2**20"
    result = graded(tmp_notebook, "tp.interview", {"interview_allreduce_mib": interview("interview_allreduce_mib", body)})
    assert_fails(result, "uses the course's reference")


def test_interview_accepts_the_right_functions(tmp_notebook):
    source = "\n\n\n".join(INTERVIEW_RIGHT.values())
    assert graded(tmp_notebook, "tp.interview", {"interview_allreduce_mib": source}).status == "passed"
