"""The tensor-parallelism chapter's checks of exercises 1 to 3 (the numpy MLP, f and g, the parallel
linear layers) reject plausible wrong answers with feedback that names the mistake, and accept
correct answers written differently from the course's."""
import pytest

from conftest import assert_fails, grade, graded


# --- exercise 1: the numpy MLP ---

MLP_TEMPLATE = '''
def tensor_parallel_mlp_numpy(x, w1, b1, w2, b2, t):
    partial_sums = []
    for a, b, rows in zip(np.split(w1, t, axis=1), np.split(b1, t), np.split(w2, t, axis=0)):
        partial_sums.append({PARTIAL})
    return {Y}, partial_sums
'''
MLP_RIGHT = dict(PARTIAL="gelu_numpy(x @ a + b) @ rows", Y="np.sum(partial_sums, axis=0) + b2")


def mlp(**changes) -> str:
    return MLP_TEMPLATE.format(**{**MLP_RIGHT, **changes})


MLP_ROWS_FIRST = '''
def tensor_parallel_mlp_numpy(x, w1, b1, w2, b2, t):
    # w1 split by rows: each rank multiplies its slice of x's features, applies GeLU, and the sum comes last.
    pieces = zip(np.split(x, t, axis=1), np.split(w1, t, axis=0))
    partial_sums = [gelu_numpy(xp @ rows + b1 / t) @ w2 for xp, rows in pieces]
    return np.sum(partial_sums, axis=0) + b2, partial_sums
'''

MLP_W2_BY_COLUMNS = '''
def tensor_parallel_mlp_numpy(x, w1, b1, w2, b2, t):
    # The hidden layer gathered on every rank, then w2 split by columns: right y, wrong communication.
    hidden = np.concatenate([gelu_numpy(x @ a + b) for a, b in zip(np.split(w1, t, axis=1), np.split(b1, t))], axis=1)
    outputs = [hidden @ columns for columns in np.array_split(w2, t, axis=1)]
    return np.concatenate(outputs, axis=1) + b2, outputs
'''

MLP_DENSE_WITH_FAKE_PARTIALS = '''
def tensor_parallel_mlp_numpy(x, w1, b1, w2, b2, t):
    y = gelu_numpy(x @ w1 + b1) @ w2 + b2
    return y, [(y - b2) / t for _ in range(t)]
'''


@pytest.mark.parametrize("source, feedback", [
    (mlp(PARTIAL="np.maximum(x @ a + b, 0) @ rows"), "ReLU"),
    (mlp(PARTIAL="gelu_numpy(x @ a + b) @ rows + b2", Y="np.sum(partial_sums, axis=0)"), "includes b2"),
    (mlp(Y="np.sum([p + b2 for p in partial_sums], axis=0)"), "(t-1)·b2"),
    (MLP_ROWS_FIRST, "you split w1 by rows"),
    (MLP_W2_BY_COLUMNS, "Splitting w2 by columns"),
    (MLP_DENSE_WITH_FAKE_PARTIALS, "partial_sums[0]"),
    (mlp(Y="(np.sum(partial_sums, axis=0) + b2).astype(np.float32)"), "dtype float32, expected float64"),
    (mlp(PARTIAL="(0.5 * (x @ a + b) * (1 + np.tanh(0.79788456 * ((x @ a + b) + 0.044715 * (x @ a + b) ** 3)))) @ rows"),
     "differs from the dense MLP"),
], ids=["relu-as-in-the-notes", "b2-in-every-partial", "b2-added-t-times", "w1-split-by-rows", "w2-split-by-columns",
        "dense-with-fake-partials", "float32", "tanh-gelu"])
def test_mlp_numpy_rejects(tmp_notebook, source, feedback):
    assert_fails(graded(tmp_notebook, "tp.mlp_numpy", {"tensor_parallel_mlp_numpy": source}), feedback)


def test_mlp_numpy_b2_in_the_partial_sums_never_says_t_1_times(tmp_notebook):
    # the first case has t = 1, where y comes out right and the sum adds b2 once
    source = mlp(PARTIAL="gelu_numpy(x @ a + b) @ rows + b2", Y="np.sum(partial_sums, axis=0)")
    result = graded(tmp_notebook, "tp.mlp_numpy", {"tensor_parallel_mlp_numpy": source})
    assert_fails(result, "t=1, ")
    assert "b2 is not part of it" in result.feedback and "t = 1 times" not in result.feedback


MLP_SLICES_AND_A_TUPLE = '''
def tensor_parallel_mlp_numpy(x, w1, b1, w2, b2, t):
    width = w1.shape[1] // t
    partial_sums = tuple(gelu_numpy(x @ w1[:, r * width:(r + 1) * width] + b1[r * width:(r + 1) * width])
                         @ w2[r * width:(r + 1) * width] for r in range(t))
    y = b2 + np.add.reduce(partial_sums)
    return y, partial_sums
'''


@pytest.mark.parametrize("source", [mlp(), MLP_SLICES_AND_A_TUPLE], ids=["np.split", "slices-and-a-tuple"])
def test_mlp_numpy_accepts(tmp_notebook, source):
    assert graded(tmp_notebook, "tp.mlp_numpy", {"tensor_parallel_mlp_numpy": source}).status == "passed"


# --- exercise 2: f and g ---

F_AND_G_TEMPLATE = '''
class CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        {F_FORWARD}

    @staticmethod
    def backward(ctx, grad_output):
        {F_BACKWARD}


class ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        {G_FORWARD}

    @staticmethod
    def backward(ctx, grad_output):
        {G_BACKWARD}


copy_to_tensor_parallel = CopyToTensorParallel.apply
reduce_from_tensor_parallel = ReduceFromTensorParallel.apply
'''
IDENTITY = "return grad_output"
ALL_REDUCED_GRADIENT = "grad = grad_output.clone()\n        dist.all_reduce(grad)\n        return grad"
F_AND_G_RIGHT = dict(F_FORWARD="return x.view_as(x)", F_BACKWARD=ALL_REDUCED_GRADIENT,
                     G_FORWARD="total = x.clone()\n        dist.all_reduce(total)\n        return total", G_BACKWARD=IDENTITY)


def f_and_g(**changes) -> str:
    return F_AND_G_TEMPLATE.format(**{**F_AND_G_RIGHT, **changes})


SWAPPED = f_and_g(F_FORWARD=F_AND_G_RIGHT["G_FORWARD"], F_BACKWARD=IDENTITY,
                  G_FORWARD=F_AND_G_RIGHT["F_FORWARD"], G_BACKWARD=ALL_REDUCED_GRADIENT)

G_FROM_TORCH_DISTRIBUTED_NN = f_and_g() + '''
import warnings
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce

def reduce_from_tensor_parallel(x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return differentiable_all_reduce(x)
'''


@pytest.mark.parametrize("source, feedback", [
    (SWAPPED, "f returned the sum over ranks"),
    (f_and_g(F_BACKWARD=IDENTITY), "f's backward returned the rank's own gradient"),
    (f_and_g(F_BACKWARD=ALL_REDUCED_GRADIENT + " / dist.get_world_size()"), "averaged"),
    (G_FROM_TORCH_DISTRIBUTED_NN, "g's backward all-reduced the gradient"),
    (f_and_g(G_FORWARD="return x.clone()"), "g returned its input"),
    (f_and_g(F_FORWARD="dist.all_reduce(x.clone())\n        return x.view_as(x)"), "f's forward issued 1 all_reduce"),
    (f_and_g() + "\ndef copy_to_tensor_parallel(x):\n    return x.detach()\n", "does not require grad"),
    (f_and_g(G_FORWARD="dist.all_reduce(x)\n        return x"),
     "the input autograd handed to g's forward now holds the sum over ranks: it was all-reduced in place"),
    (f_and_g(F_BACKWARD="dist.all_reduce(grad_output)\n        return grad_output"),
     "the gradient autograd handed to f's backward now holds the sum over ranks: it was all-reduced in place"),
], ids=["swapped", "f-backward-identity", "f-backward-average", "g-from-torch.distributed.nn", "g-forward-identity",
        "extra-all-reduce-in-f-forward", "f-detaches", "g-forward-in-place", "f-backward-in-place"])
def test_f_and_g_rejects(tmp_notebook, source, feedback):
    assert_fails(graded(tmp_notebook, "tp.f_and_g", {"CopyToTensorParallel": source}), feedback)


HOOK_F_AND_G = '''
def copy_to_tensor_parallel(x):
    # A view whose gradient hook sums the ranks' gradients: no autograd.Function needed.
    y = x.view_as(x)

    def all_reduced(grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad
    y.register_hook(all_reduced)
    return y


def reduce_from_tensor_parallel(x):
    # Straight-through: the value of the sum, the gradient of the identity.
    total = x.detach().clone()
    dist.all_reduce(total)
    return x + (total - x).detach()
'''
F_AND_G_WITH_HOOKS = f_and_g() + HOOK_F_AND_G

G_AS_REDUCE_SCATTER_AND_ALL_GATHER = f_and_g(G_FORWARD='''n = dist.get_world_size()
        flat = x.reshape(-1)
        padded = torch.cat([flat, flat.new_zeros(-flat.numel() % n)])
        piece = padded.new_empty(padded.numel() // n)
        dist.reduce_scatter_single(piece, padded)
        gathered = torch.empty_like(padded)
        dist.all_gather_single(gathered, piece)
        return gathered[:flat.numel()].view_as(x)''')


@pytest.mark.parametrize("source", [f_and_g(), F_AND_G_WITH_HOOKS, G_AS_REDUCE_SCATTER_AND_ALL_GATHER],
                         ids=["autograd.Function", "hook-and-straight-through", "reduce-scatter+all-gather"])
def test_f_and_g_accepts(tmp_notebook, source):
    assert graded(tmp_notebook, "tp.f_and_g", {"CopyToTensorParallel": source}).status == "passed"


# --- exercise 3: column- and row-parallel linear layers ---

LINEAR_TEMPLATE = '''
class ColumnParallelLinear(nn.Module):
    def __init__(self, dense, enter=copy_to_tensor_parallel):
        super().__init__()
        self.enter = enter
        self.weight = nn.Parameter({COLUMN_WEIGHT})
        self.bias = nn.Parameter(shard_of(dense.bias, 0))

    def forward(self, x):
        return F.linear({COLUMN_INPUT}, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, dense, leave=reduce_from_tensor_parallel):
        super().__init__()
        self.leave = leave
        self.weight = nn.Parameter(shard_of(dense.weight, {ROW_DIM}))
        self.bias = nn.Parameter(dense.bias.detach().clone())

    def forward(self, x_shard):
        {ROW_FORWARD}
'''
LINEAR_RIGHT = dict(COLUMN_WEIGHT="shard_of(dense.weight, 0)", COLUMN_INPUT="self.enter(x)", ROW_DIM="1",
                    ROW_FORWARD="return self.leave(F.linear(x_shard, self.weight)) + self.bias")


def linears(**changes) -> str:
    return LINEAR_TEMPLATE.format(**{**LINEAR_RIGHT, **changes})


ROW_GATHERS_AND_SUMS = linears(ROW_FORWARD='''partial = F.linear(x_shard, self.weight)
        # every rank's partial product gathered, then summed locally: the sum is right, the traffic is not
        pieces = [torch.empty_like(partial) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, partial.detach().contiguous())
        pieces[dist.get_rank()] = partial
        return torch.stack(pieces).sum(0) + self.bias''')

COLUMN_WITH_THE_WHOLE_WEIGHT = linears(COLUMN_WEIGHT="dense.weight.detach().clone()").replace(
    "return F.linear(self.enter(x), self.weight, self.bias)",
    "return F.linear(self.enter(x), shard_of(self.weight, 0), self.bias)")


@pytest.mark.parametrize("source, feedback", [
    (linears(ROW_FORWARD="return self.leave(F.linear(x_shard, self.weight, self.bias))"), "holds the bias 2 times"),
    (linears(ROW_FORWARD="return self.leave(F.linear(x_shard, self.weight, self.bias / dist.get_world_size()))"),
     "it is 1/2 of the dense one"),
    (linears(ROW_FORWARD="rows = x_shard.shape[:-1].numel()  # the bias's gradient averaged over the rows\n"
                         "        bias = self.bias / rows + (self.bias - self.bias / rows).detach()\n"
                         "        return self.leave(F.linear(x_shard, self.weight)) + bias"),
     "the mean over the"),
    (linears(ROW_FORWARD="bias = self.bias if dist.get_rank() == 0 else torch.zeros_like(self.bias)\n"
                         "        return self.leave(F.linear(x_shard, self.weight, bias))"), "after the sum"),
    (linears(COLUMN_INPUT="x"), "passed back only this rank's part of dL/dx"),
    (linears(ROW_DIM="0"), "the matching columns of nn.Linear's weight"),
    (ROW_GATHERS_AND_SUMS, "RowParallelLinear's forward issued 1 all_gather"),
    (COLUMN_WITH_THE_WHOLE_WEIGHT, "is held by 2 ranks"),
], ids=["bias-on-every-rank", "bias-divided-by-t", "bias-gradient-averaged-over-rows", "bias-on-rank-0-only", "no-f", "w2-split-by-columns",
        "all-gather-and-local-sum", "whole-weight-on-every-rank"])
def test_parallel_linear_rejects(tmp_notebook, source, feedback):
    assert_fails(graded(tmp_notebook, "tp.parallel_linear", {"ColumnParallelLinear": source}), feedback)


LINEAR_TRANSPOSED_WITH_HOOKS = '''
class ColumnParallelLinear(nn.Module):
    """Stores A_r = weightᵀ's columns, shape (in, out/t), and multiplies with matmul."""
    def __init__(self, dense, enter=copy_to_tensor_parallel):
        super().__init__()
        self.enter = enter
        start, stop = shard_bounds(dense.out_features, dist.get_world_size(), dist.get_rank())
        self.a = nn.Parameter(dense.weight.detach()[start:stop].T.contiguous())
        self.bias = nn.Parameter(dense.bias.detach()[start:stop].clone())

    def forward(self, x):
        return torch.matmul(self.enter(x), self.a) + self.bias


class RowParallelLinear(nn.Module):
    def __init__(self, dense, leave=reduce_from_tensor_parallel):
        super().__init__()
        self.leave = leave
        start, stop = shard_bounds(dense.in_features, dist.get_world_size(), dist.get_rank())
        self.a = nn.Parameter(dense.weight.detach()[:, start:stop].T.contiguous())
        self.bias = nn.Parameter(dense.bias.detach().clone())

    def forward(self, x_shard):
        return self.leave(torch.matmul(x_shard, self.a)) + self.bias
'''


@pytest.mark.parametrize("replacements", [
    {"ColumnParallelLinear": linears()},
    {"ColumnParallelLinear": LINEAR_TRANSPOSED_WITH_HOOKS, "CopyToTensorParallel": F_AND_G_WITH_HOOKS},
    {"CopyToTensorParallel": G_AS_REDUCE_SCATTER_AND_ALL_GATHER},
], ids=["nn.Linear-layout", "A-layout-with-hooks", "g-as-reduce-scatter+all-gather"])
def test_parallel_linear_accepts(tmp_notebook, replacements):
    result = graded(tmp_notebook, "tp.parallel_linear", replacements)
    assert result.status == "passed", result


LINEAR_FROM_DTENSOR = '''
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class ColumnParallelLinear(nn.Module):
    def __init__(self, dense, enter=copy_to_tensor_parallel):
        super().__init__()
        self.inner = parallelize_module(dense, init_device_mesh("cpu", (dist.get_world_size(),)), ColwiseParallel())

    def forward(self, x):
        return self.inner(x)


class RowParallelLinear(nn.Module):
    def __init__(self, dense, leave=reduce_from_tensor_parallel):
        super().__init__()
        self.inner = parallelize_module(dense, init_device_mesh("cpu", (dist.get_world_size(),)), RowwiseParallel())

    def forward(self, x_shard):
        return self.inner(x_shard)
'''


def test_a_scaled_gradient_is_diagnosed_only_by_the_causes_that_give_it():
    import numpy as np

    from grader.checks.tp.shared import scaled_gradient_causes
    dense = np.random.default_rng(0).standard_normal(5)  # the float64 oracle; a rank's gradient is float32

    def rank_gradient(scale):
        return (dense * scale).astype(np.float32)
    ranks, rows = "divided among the 2 ranks", "the mean over the"
    halved = scaled_gradient_causes(rank_gradient(1 / 2), dense, n=2, rows=6)
    assert len(halved) == 1 and ranks in halved[0]  # 6 rows cannot give 1/2
    sixth = scaled_gradient_causes(rank_gradient(1 / 6), dense, n=2, rows=6)
    assert len(sixth) == 1 and rows in sixth[0]  # and 2 ranks cannot give 1/6
    both = scaled_gradient_causes(rank_gradient(1 / 2), dense, n=2, rows=2)
    assert len(both) == 2 and ranks in both[0] and rows in both[1]  # b·s = t: the numbers cannot tell them apart
    assert scaled_gradient_causes(rank_gradient(0.7), dense, n=2, rows=6) == []


SHARDS_BY_CHUNK = '''
def shard_of(tensor, dim):
    return tensor.detach().chunk(dist.get_world_size(), dim)[dist.get_rank()].clone()
'''


def test_parallel_linear_rejects_shards_cut_by_chunk(tmp_notebook):
    result = graded(tmp_notebook, "tp.parallel_linear", {"shard_of": SHARDS_BY_CHUNK})
    assert_fails(result, "that is torch.chunk's piece")


def test_parallel_linear_draws_a_width_where_chunk_and_tensor_split_differ_in_every_grading():
    import numpy as np
    import torch

    from grader.registry import find_exercise
    check = find_exercise("tp.parallel_linear").check
    for seed in range(200):
        separated = False
        for n, data in check.prepare(np.random.default_rng(seed)):
            width = data["w_column"].shape[0]
            assert width % n and data["x_row"].shape[-1] == width
            chunks = [len(c) for c in torch.arange(width).chunk(n)]
            separated |= chunks != [len(c) for c in torch.arange(width).tensor_split(n)] and len(chunks) == n
        assert separated, seed


def test_parallel_linear_built_on_dtensor_is_told_so(tmp_notebook):
    result = graded(tmp_notebook, "tp.parallel_linear", {"ColumnParallelLinear": LINEAR_FROM_DTENSOR})
    assert_fails(result, "uses the course's reference")


# --- bad input: a broken rank costs only its exercise ---

@pytest.mark.parametrize("backward, status, feedback", [
    ("if dist.get_rank() == 0:\n            dist.all_reduce(grad_output.clone())\n        return grad_output",
     "timeout", "never joined"),
    ("raise ValueError('boom')", "error", "raised ValueError: boom"),
], ids=["rank-never-joins", "rank-raises"])
def test_a_broken_rank_costs_only_its_exercise(tmp_notebook, backward, status, feedback):
    path = tmp_notebook("tp", {"CopyToTensorParallel": f_and_g(F_BACKWARD=backward)})
    results = grade(path, "tp.f_and_g", "tp.costs", timeout_s=12)
    assert results["tp.f_and_g"].status == status, results["tp.f_and_g"]
    assert feedback in results["tp.f_and_g"].feedback
    assert results["tp.costs"].status == "passed"
