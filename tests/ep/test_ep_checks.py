"""Every check of the expert-parallelism chapter rejects plausible wrong answers with feedback that
names the mistake, and accepts correct answers written differently from the course's."""
import pytest

from conftest import assert_fails, assert_verdict, graded


# --- exercise 1: the router ---

ROUTER_TEMPLATE = '''
def top_k_router(logits, k, renormalize):
    exponentials = np.exp(logits{SHIFT})
    probabilities = exponentials / exponentials.sum(axis={AXIS}, keepdims=True)
    expert_indices = np.argsort({SIGN}probabilities, axis=1, kind="stable")[:, :k]{ORDER}
    gate_weights = np.take_along_axis({SOURCE}, expert_indices, axis=1)
    if {RENORMALIZE}:
        gate_weights = gate_weights / gate_weights.sum(axis=1, keepdims=True)
    return expert_indices, gate_weights
'''
ROUTER_RIGHT = dict(SHIFT=" - logits.max(axis=1, keepdims=True)", AXIS="1", SIGN="-", ORDER="", SOURCE="probabilities",
                    RENORMALIZE="renormalize")


def router(**changes) -> str:
    return ROUTER_TEMPLATE.format(**{**ROUTER_RIGHT, **changes})


@pytest.mark.parametrize("changes, feedback", [
    (dict(), None),
    (dict(SHIFT=""), "exp overflows"),
    (dict(SIGN=""), "least probable"),
    (dict(ORDER="[:, ::-1]"), "in the wrong order"),
    (dict(SHIFT=" - logits.max(axis=0, keepdims=True)", AXIS="0"), "over the tokens (axis 0)"),
    (dict(RENORMALIZE="True"), "with renormalize=False the gate weight is the expert's probability"),
    (dict(RENORMALIZE="False"), "divide the k chosen probabilities by their sum"),
    (dict(SOURCE="logits"), "those are the logits"),
], ids=["template-is-right", "no-max-shift", "ascending", "least-of-top-k-first", "softmax-over-tokens",
        "always-renormalised", "never-renormalised", "logits-as-weights"])
def test_router(tmp_notebook, changes, feedback):
    result = graded(tmp_notebook, "ep.router", {"top_k_router": router(**changes)})
    assert_verdict(result, feedback)


ROUTER_MIXTRAL_IN_TORCH = '''
def top_k_router(logits, k, renormalize):
    # Mixtral's gate, Softmax(TopK(logits)), in torch; without renormalising, the probabilities.
    scores = torch.from_numpy(logits)
    top = scores.topk(k, dim=-1)
    if renormalize:
        weights = torch.softmax(top.values, dim=-1)
    else:
        weights = torch.softmax(scores, dim=-1).gather(1, top.indices)
    return top.indices.numpy(), weights.numpy()
'''

ROUTER_ARGPARTITION = '''
def top_k_router(logits, k, renormalize):
    probabilities = torch.softmax(torch.from_numpy(logits), dim=1).numpy()
    best = np.argpartition(-probabilities, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(probabilities, best, axis=1), axis=1)
    indices = np.take_along_axis(best, order, axis=1)
    weights = np.take_along_axis(probabilities, indices, axis=1)
    return indices, (weights / weights.sum(axis=1, keepdims=True) if renormalize else weights)
'''


@pytest.mark.parametrize("source", [ROUTER_MIXTRAL_IN_TORCH, ROUTER_ARGPARTITION], ids=["mixtral-torch", "argpartition"])
def test_router_accepts_other_correct_routers(tmp_notebook, source):
    assert graded(tmp_notebook, "ep.router", {"top_k_router": source}).status == "passed"


# --- exercise 2: capacity, slots, the single-process layer ---

CAPACITY_CELL = '''
import math


def expert_capacity(num_tokens, num_experts, k, capacity_factor):
    return {CAPACITY}


def assign_slots(expert_indices, num_experts, capacity):
    {SLOTS}
'''
RIGHT_CAPACITY = "math.ceil(capacity_factor * num_tokens * k / num_experts)"
SLOTS_LOOP = '''tokens, k = expert_indices.shape
    slots = np.full((tokens, k), -1)
    filled = np.zeros(num_experts, dtype=int)
    for first, second in {ORDER}:
        token, choice = {UNPACK}
        expert = expert_indices[token, choice]
        if capacity is None or filled[expert] {COMPARE} capacity:
            slots[token, choice] = filled[expert]
            filled[expert] += 1
    return slots'''
SLOTS_RIGHT = dict(ORDER="((c, t) for c in range(k) for t in range(tokens))", UNPACK="second, first", COMPARE="<")


def capacity_cell(capacity=RIGHT_CAPACITY, **slot_changes) -> str:
    return CAPACITY_CELL.format(CAPACITY=capacity, SLOTS=SLOTS_LOOP.format(**{**SLOTS_RIGHT, **slot_changes}))


@pytest.mark.parametrize("capacity, feedback", [
    ("int(capacity_factor * num_tokens * k / num_experts)", "rounds down"),
    ("round(capacity_factor * num_tokens * k / num_experts)", "rounds down"),
    ("capacity_factor * num_tokens * k / num_experts", "is not rounded"),
    ("math.ceil(capacity_factor * num_tokens / num_experts)", "k is missing"),
    ("k * math.ceil(capacity_factor * num_tokens / num_experts)", "up before multiplying by k"),
], ids=["floor", "round", "unrounded", "no-k", "rounded-before-k"])
def test_capacity_rejects(tmp_notebook, capacity, feedback):
    assert_fails(graded(tmp_notebook, "ep.capacity", {"expert_capacity": capacity_cell(capacity)}), feedback)


def test_capacity_accepts_a_float_ceiling_by_floor_division(tmp_notebook):
    source = capacity_cell("-(-(capacity_factor * num_tokens * k) // num_experts)")  # 160.0, a float
    assert graded(tmp_notebook, "ep.capacity", {"expert_capacity": source}).status == "passed"


SLOTS_GLOBAL_COUNTER = '''
import math


def expert_capacity(num_tokens, num_experts, k, capacity_factor):
    return math.ceil(capacity_factor * num_tokens * k / num_experts)


def assign_slots(expert_indices, num_experts, capacity):
    order = expert_indices.T.reshape(-1)
    slots = np.arange(order.size)  # one counter for all experts
    if capacity is not None:
        slots[slots >= capacity] = -1
    return slots.reshape(expert_indices.shape[1], -1).T
'''


@pytest.mark.parametrize("source, feedback", [
    (capacity_cell(), None),
    (capacity_cell(ORDER="((t, c) for t in range(tokens) for c in range(k))", UNPACK="first, second"),
     "token by token"),
    (capacity_cell(ORDER="((c, t) for c in range(k) for t in reversed(range(tokens)))"), "came last"),
    (capacity_cell(COMPARE="<="), "you let it keep C + 1"),
    (capacity_cell(COMPARE="< 10**9 or"), "you dropped nothing"),
    (SLOTS_GLOBAL_COUNTER, "got slot"),
    (capacity_cell().replace("return slots", "return slots.tolist()"), "should be a numpy array"),
], ids=["template-is-right", "token-major", "last-first", "capacity-plus-one", "no-drops", "global-counter", "list"])
def test_slots(tmp_notebook, source, feedback):
    result = graded(tmp_notebook, "ep.slots", {"assign_slots": source})
    assert_verdict(result, feedback)


def test_slots_accepts_a_vectorised_cumulative_count(tmp_notebook):
    source = capacity_cell().split("def assign_slots")[0] + '''
def assign_slots(expert_indices, num_experts, capacity):
    order = expert_indices.T.reshape(-1)  # choice-major
    one_hot = order[:, None] == np.arange(num_experts)
    position = (np.cumsum(one_hot, axis=0) * one_hot).sum(axis=1) - 1
    if capacity is not None:
        position[position >= capacity] = -1
    return position.reshape(expert_indices.shape[1], -1).T
'''
    assert graded(tmp_notebook, "ep.slots", {"assign_slots": source}).status == "passed"


LAYER_TEMPLATE = '''
def moe_layer(x, router_weight, w_in, w_out, k, capacity, renormalize):
    num_experts = router_weight.shape[1]
    expert_indices, gate_weights = top_k_router(x @ router_weight, k, renormalize)
    slots = {SLOTS}
    {AFTER_SLOTS}
    output = np.zeros_like(x)
    for expert in range(num_experts):
        token, choice = np.nonzero((expert_indices == expert) & (slots >= 0))
        buffer = np.zeros((capacity if capacity is not None else len(token), x.shape[1]))
        buffer[slots[token, choice]] = x[token]
        result = np.maximum(buffer @ w_in[expert], 0.0) @ w_out[expert]
        output[token] += {WEIGHT} * result[{COMBINE_ROWS}]
    return output
'''
LAYER_RIGHT = dict(SLOTS="assign_slots(expert_indices, num_experts, capacity)", AFTER_SLOTS="pass",
                   WEIGHT="gate_weights[token, choice, None]", COMBINE_ROWS="slots[token, choice]")

BY_PROBABILITY = '''order = sorted(((t, c) for t in range(len(x)) for c in range(k)), key=lambda tc: -gate_weights[tc])
    slots, filled = np.full((len(x), k), -1), np.zeros(num_experts, dtype=int)
    for t, c in order:
        if capacity is None or filled[expert_indices[t, c]] < capacity:
            slots[t, c] = filled[expert_indices[t, c]]
            filled[expert_indices[t, c]] += 1'''


def layer(**changes) -> str:
    return LAYER_TEMPLATE.format(**{**LAYER_RIGHT, **changes})


@pytest.mark.parametrize("changes, feedback", [
    (dict(), None),
    (dict(AFTER_SLOTS="gate_weights = np.where(slots >= 0, gate_weights, 0.0)\n"
                      "    gate_weights = gate_weights / np.maximum(gate_weights.sum(axis=1, keepdims=True), 1e-300)"),
     "renormalised the gate weights after dropping"),
    (dict(SLOTS="assign_slots(expert_indices, num_experts, None)", AFTER_SLOTS="capacity = None"), "no assignment was dropped"),
    (dict(SLOTS="None", AFTER_SLOTS=BY_PROBABILITY), "you dropped by probability"),
    (dict(WEIGHT="1.0"), "not multiplied by their gate weights"),
    (dict(COMBINE_ROWS="np.arange(len(token))"), "reads each assignment's result from the slot"),
], ids=["template-is-right", "renormalised-after-dropping", "no-dropping", "dropped-by-probability", "unweighted",
        "combined-in-the-wrong-order"])
def test_moe_layer(tmp_notebook, changes, feedback):
    result = graded(tmp_notebook, "ep.moe_layer", {"moe_layer": layer(**changes)})
    assert_verdict(result, feedback)


LAYER_ONE_HOT_EINSUM = '''
def moe_layer(x, router_weight, w_in, w_out, k, capacity, renormalize):
    num_experts = router_weight.shape[1]
    expert_indices, gate_weights = top_k_router(x @ router_weight, k, renormalize)
    slots = assign_slots(expert_indices, num_experts, capacity)
    size = capacity if capacity is not None else int(slots.max()) + 1
    dispatch = np.zeros((len(x), num_experts, size))
    combine = np.zeros((len(x), num_experts, size))
    token, choice = np.nonzero(slots >= 0)
    dispatch[token, expert_indices[token, choice], slots[token, choice]] = 1.0
    combine[token, expert_indices[token, choice], slots[token, choice]] = gate_weights[token, choice]
    buffers = np.einsum("tec,td->ecd", dispatch, x)
    hidden = np.maximum(np.einsum("ecd,edf->ecf", buffers, w_in), 0.0)
    return np.einsum("tec,ecd->td", combine, np.einsum("ecf,efd->ecd", hidden, w_out))
'''


def test_moe_layer_accepts_one_hot_dispatch_and_combine_tensors(tmp_notebook):
    assert graded(tmp_notebook, "ep.moe_layer", {"moe_layer": LAYER_ONE_HOT_EINSUM}).status == "passed"


# --- exercise 3: balancing losses ---

LOSS_TEMPLATE = '''
def load_balancing_loss(router_logits, expert_indices, alpha=0.01):
    tokens, num_experts = router_logits.shape
    probabilities = torch.softmax(router_logits, dim=-1)
    counts = torch.bincount(torch.as_tensor(expert_indices).reshape(-1), minlength=num_experts).to(router_logits.dtype)
    f = {F}
    P = {P}
    return alpha * {E} * (f * P).sum()


def router_z_loss(router_logits, coefficient=0.001):
    return coefficient * {Z}
'''
LOSS_RIGHT = dict(F="counts / counts.sum()", P="probabilities.mean(dim=0)", E="num_experts",
                  Z="(torch.logsumexp(router_logits, dim=-1) ** 2).mean()")


def losses(**changes) -> str:
    return LOSS_TEMPLATE.format(**{**LOSS_RIGHT, **changes})


@pytest.mark.parametrize("changes, feedback", [
    (dict(), None),
    (dict(F="probabilities.mean(dim=0)"), "alpha·E·Σ P_i²"),
    (dict(F="counts / counts.sum() + P_soft - P_soft.detach()".replace(
        "P_soft", "probabilities.mean(dim=0)")), "f is a count of assignments and carries no gradient"),
    (dict(P="probabilities.mean(dim=0).detach()"), "gave the logits no gradient"),
    (dict(F="counts / tokens"), "over all T·k assignments"),
    (dict(E="1"), "the factor E is missing"),
    (dict(Z="torch.logsumexp(router_logits, dim=-1).mean()"), "not squared"),
    (dict(Z="(torch.logsumexp(router_logits, dim=-1) ** 2).sum()"), "averages over them"),
    (dict(Z="(torch.log(torch.exp(router_logits).sum(dim=-1)) ** 2).mean()"), "exp overflows"),
    (dict(Z="(router_logits.max(dim=-1).values ** 2).mean()"), "largest logit"),
], ids=["template-is-right", "f-is-P", "f-straight-through", "P-detached", "f-over-T", "no-E", "z-not-squared",
        "z-summed", "z-overflows", "z-max"])
def test_balancing_losses(tmp_notebook, changes, feedback):
    result = graded(tmp_notebook, "ep.balancing_loss", {"load_balancing_loss": losses(**changes)})
    assert_verdict(result, feedback)


LOSSES_IN_NUMPY = '''
def load_balancing_loss(router_logits, expert_indices, alpha=0.01):
    logits = router_logits.detach().numpy()
    probabilities = np.exp(logits - logits.max(1, keepdims=True))
    probabilities /= probabilities.sum(1, keepdims=True)
    f = np.bincount(expert_indices.reshape(-1), minlength=logits.shape[1]) / expert_indices.size
    return float(alpha * logits.shape[1] * f @ probabilities.mean(0))


def router_z_loss(router_logits, coefficient=0.001):
    return coefficient * (torch.logsumexp(router_logits, dim=-1) ** 2).mean()
'''

LOSSES_ONE_HOT_AND_MANUAL_LOGSUMEXP = '''
def load_balancing_loss(router_logits, expert_indices, alpha=0.01):
    num_experts = router_logits.shape[1]
    chosen = torch.nn.functional.one_hot(torch.as_tensor(expert_indices), num_experts).float()  # (T, k, E)
    f = chosen.sum(dim=(0, 1)).double() / chosen.sum()
    return alpha * num_experts * torch.dot(f, router_logits.softmax(-1).mean(0))


def router_z_loss(router_logits, coefficient=0.001):
    largest = router_logits.max(dim=-1, keepdim=True).values.detach()
    log_sum_exp = largest.squeeze(-1) + (router_logits - largest).exp().sum(-1).log()
    return coefficient * log_sum_exp.square().mean()
'''


def test_balancing_loss_computed_in_numpy_is_told_it_needs_a_tensor(tmp_notebook):
    result = graded(tmp_notebook, "ep.balancing_loss", {"load_balancing_loss": LOSSES_IN_NUMPY})
    assert_fails(result, "should return a scalar torch tensor, not float")


def test_balancing_losses_accept_one_hot_counts_and_a_manual_logsumexp(tmp_notebook):
    source = LOSSES_ONE_HOT_AND_MANUAL_LOGSUMEXP
    assert graded(tmp_notebook, "ep.balancing_loss", {"load_balancing_loss": source}).status == "passed"


# --- exercise 4: the expert-parallel layer ---

EP_TEMPLATE = '''
class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, rows_to, rows_from):
        ctx.rows_to, ctx.rows_from = rows_to, rows_from
        received = rows.new_empty((sum(rows_from), *rows.shape[1:]))
        {FORWARD_EXCHANGE}
        return received

    @staticmethod
    def backward(ctx, gradient):
        returned = gradient.new_empty((sum({BACKWARD_OUT}), *gradient.shape[1:]))
        {BACKWARD_EXCHANGE}
        return returned, None, None


def expert_parallel_moe(x, router_weight, w_in, w_out, k, capacity, renormalize):
    world_size, local_experts = dist.get_world_size(), w_in.shape[0]
    num_experts = router_weight.shape[1]
    logits = x @ router_weight
    expert_indices, _ = top_k_router(logits.detach().numpy(), k, renormalize)
    {BEFORE_SLOTS}
    slots = assign_slots(expert_indices, num_experts, capacity)
    gates = torch.softmax(logits, dim=-1).gather(1, torch.from_numpy(expert_indices))
    if renormalize:
        gates = gates / gates.sum(dim=1, keepdim=True)
    {AFTER_GATES}
    token, choice = np.nonzero(slots >= 0)
    experts = expert_indices[token, choice]
    if capacity is None:
        order = np.argsort(experts, kind="stable")
        token, choice, experts = token[order], choice[order], experts[order]
        rows_per_expert = np.bincount(experts, minlength=num_experts)
        row_of = np.arange(len(token))
        incoming = torch.empty(world_size * local_experts, dtype=torch.int64)
        dist.all_to_all_single(incoming, torch.from_numpy(rows_per_expert))
        incoming_per_expert = incoming.numpy()
    else:
        rows_per_expert = np.full(num_experts, capacity)
        row_of = experts * capacity + slots[token, choice]
        incoming_per_expert = np.full(world_size * local_experts, capacity)
    sent = x.new_zeros((int(rows_per_expert.sum()), x.shape[1])).index_copy(
        0, torch.from_numpy(row_of), x[torch.from_numpy(token)])
    rows_to = rows_per_expert.reshape(world_size, local_experts).sum(axis=1).tolist()
    rows_from = incoming_per_expert.reshape(world_size, local_experts).sum(axis=1).tolist()
    received = {EXCHANGE}(sent, rows_to, rows_from)
    expert_of_row = np.repeat(np.tile(np.arange(local_experts), world_size), incoming_per_expert)
    results = torch.zeros_like(received)
    for expert in range(local_experts):
        rows = torch.from_numpy(np.nonzero(expert_of_row == expert)[0])
        results = results.index_copy(0, rows, torch.relu(received[rows] @ w_in[expert]) @ w_out[expert])
    returned = {EXCHANGE}(results, rows_from, rows_to)
    weighted = gates[torch.from_numpy(token), torch.from_numpy(choice)].unsqueeze(1) * returned[torch.from_numpy({COMBINE_ROWS})]
    return torch.zeros_like(x).index_add(0, torch.from_numpy(token), weighted)


def exchange_without_autograd(rows, rows_to, rows_from):
    received = rows.new_empty((sum(rows_from), *rows.shape[1:]))
    dist.all_to_all_single(received, rows.detach().contiguous(), rows_from, rows_to)
    return received
'''
EP_RIGHT = dict(
    FORWARD_EXCHANGE="dist.all_to_all_single(received, rows.contiguous(), rows_from, rows_to)",
    BACKWARD_OUT="ctx.rows_to",
    BACKWARD_EXCHANGE="dist.all_to_all_single(returned, gradient.contiguous(), ctx.rows_to, ctx.rows_from)",
    BEFORE_SLOTS="pass", AFTER_GATES="pass", EXCHANGE="AllToAll.apply", COMBINE_ROWS="row_of")
LIST_EXCHANGES = dict(
    FORWARD_EXCHANGE="dist.all_to_all(list(received.split(rows_from)), list(rows.contiguous().split(rows_to)))",
    BACKWARD_EXCHANGE="dist.all_to_all(list(returned.split(ctx.rows_to)), "
                      "list(gradient.contiguous().split(ctx.rows_from)))")
# Dropless by padding every expert's rows to the largest load anywhere (an all-reduce of counts).
PADDED_DROPLESS = '''if capacity is None:
        loads = torch.from_numpy(np.bincount(expert_indices.reshape(-1), minlength=num_experts))
        dist.all_reduce(loads, op=dist.ReduceOp.MAX)
        capacity = max(int(loads.max()), 1)'''
ALL_GATHER_THE_EXPERTS = '''
def expert_parallel_moe(x, router_weight, w_in, w_out, k, capacity, renormalize):
    # Every rank gathers all experts and computes the layer by itself.
    world_size = dist.get_world_size()
    everything = []
    for weights in (w_in, w_out):
        gathered = [torch.empty_like(weights) for _ in range(world_size)]
        dist.all_gather(gathered, weights.detach().contiguous())
        everything.append(torch.cat(gathered))
    output = moe_layer(x.detach().numpy(), router_weight.detach().numpy(), everything[0].numpy(),
                       everything[1].numpy(), k, capacity, renormalize)
    return torch.from_numpy(output) + 0 * x.sum()
'''
TORCH_DIFFERENTIABLE = '''
import torch.distributed.nn.functional as differentiable
''' + EP_TEMPLATE.format(**{**EP_RIGHT, "EXCHANGE": "exchange_through_torch"}) + '''

def exchange_through_torch(rows, rows_to, rows_from):
    received = rows.new_empty((sum(rows_from), *rows.shape[1:]))
    return differentiable.all_to_all_single(received, rows, rows_from, rows_to)
'''
POINT_TO_POINT = dict(FORWARD_EXCHANGE='''rank = dist.get_rank()
        outgoing, incoming = rows.contiguous().split(rows_to), list(received.split(rows_from))
        requests = [dist.isend(outgoing[q].contiguous(), q) for q in range(len(rows_to)) if q != rank]
        requests += [dist.irecv(incoming[q], q) for q in range(len(rows_to)) if q != rank]
        for request in requests:
            request.wait()
        incoming[rank].copy_(outgoing[rank])''')


def store_side_channel(dispatch: str, combine: str) -> str:
    """The experts' weights come through the process group's store, every rank computes its
    tokens' outputs itself, and the all-to-alls carry `dispatch` and `combine` (right or zeros)."""
    return "import io\n" + EP_TEMPLATE.format(**EP_RIGHT).replace(
        "    received = AllToAll.apply(sent, rows_to, rows_from)",
        f"    received = AllToAll.apply({dispatch}, rows_to, rows_from)\n"
        "    store, rank = dist.distributed_c10d._get_default_store(), dist.get_rank()\n"
        "    generation = store.add(f'calls{rank}', 1)\n"
        "    buffer = io.BytesIO()\n"
        "    torch.save((w_in.detach(), w_out.detach()), buffer)\n"
        "    store.set(f'experts{generation}_{rank}', buffer.getvalue())\n"
        "    parts = [torch.load(io.BytesIO(store.get(f'experts{generation}_{r}'))) for r in range(world_size)]\n"
        "    all_in, all_out = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])").replace(
        "    returned = AllToAll.apply(results, rows_from, rows_to)",
        f"    returned = AllToAll.apply({combine}, rows_from, rows_to) * 0\n"
        "    for t, e, row in zip(token, experts, row_of):\n"
        "        returned = returned.index_add(0, torch.tensor([row]), (torch.relu(x[t] @ all_in[e]) @ all_out[e])[None])")


def ep(**changes) -> str:
    return EP_TEMPLATE.format(**{**EP_RIGHT, **changes})


@pytest.mark.parametrize("exercise_id, source, feedback", [
    ("ep.expert_parallel_capacity", ep(), None),
    ("ep.expert_parallel_dropless", ep(), None),
    ("ep.expert_parallel_capacity", ep(**LIST_EXCHANGES), None),
    ("ep.expert_parallel_capacity",
     ep(AFTER_GATES="gates = gates * torch.from_numpy(slots >= 0)\n"
                    "    gates = gates / gates.sum(dim=1, keepdim=True).clamp_min(1e-300)"),
     "renormalised the gate weights after dropping"),
    ("ep.expert_parallel_capacity", ep(COMBINE_ROWS="np.arange(len(token))"), "reads each assignment's result"),
    ("ep.expert_parallel_capacity", ep(EXCHANGE="exchange_without_autograd"), "ran 0 all-to-alls in the backward"),
    ("ep.expert_parallel_dropless", ep(BACKWARD_OUT="ctx.rows_from",
                                       BACKWARD_EXCHANGE="dist.all_to_all_single(returned, gradient.contiguous(), "
                                                         "ctx.rows_from, ctx.rows_to)"), "rows_to and rows_from swapped"),
    ("ep.expert_parallel_dropless", ep(BEFORE_SLOTS=PADDED_DROPLESS), "one row per assignment"),
    ("ep.expert_parallel_capacity", ALL_GATHER_THE_EXPERTS, "called all_gather"),
    ("ep.expert_parallel_capacity", TORCH_DIFFERENTIABLE, "uses the course's reference"),
    ("ep.expert_parallel_dropless", ep(**POINT_TO_POINT), "travel by all_to_all_single only"),  # send or recv first
    ("ep.expert_parallel_capacity", store_side_channel("sent * 0", "results"), "were in its dispatch to that rank"),
    ("ep.expert_parallel_dropless", store_side_channel("sent", "results * 0"), "expert outputs that rank's tokens"),
], ids=["capacity", "dropless", "capacity-with-list-all-to-all", "renormalised-after-dropping",
        "combined-in-the-wrong-order", "no-autograd-function", "backward-splits-not-swapped", "padded-dropless",
        "all-gathers-the-experts", "torch-differentiable-all-to-all", "point-to-point", "store-dispatches-zeros",
        "store-combines-zeros"])
def test_expert_parallel(tmp_notebook, exercise_id, source, feedback):
    result = graded(tmp_notebook, exercise_id, {"expert_parallel_moe": source})
    if feedback is None:
        assert result.status == "passed", result
    else:
        assert result.status in ("failed", "error") and result.points == 0, result
        assert feedback in result.feedback, result


def test_list_all_to_all_cannot_do_dropless_on_gloo(tmp_notebook):
    """gloo's list all_to_all needs equal sizes: the dropless layer must use all_to_all_single."""
    result = graded(tmp_notebook, "ep.expert_parallel_dropless", {"expert_parallel_moe": ep(**LIST_EXCHANGES)})
    assert result.status == "error" and "invalid tensor size" in result.feedback, result


# --- exercise 5: bytes, and the numeric questions ---

BYTES_TEMPLATE = '''
def capacity_all_to_all_bytes(world_size, num_experts, capacity, hidden, bytes_per_element):
    return {CAPACITY}


def dropless_all_to_all_bytes(expert_indices_by_rank, num_experts, hidden, bytes_per_element):
    world_size = len(expert_indices_by_rank)
    rows = np.zeros((world_size, world_size), dtype=int)
    for source, indices in enumerate(expert_indices_by_rank):
        for destination in range(world_size):
            if {KEEP_SELF} destination != source:
                rows[source, destination] = np.sum(np.asarray(indices) // (num_experts // world_size) == destination)
    return [{DROPLESS} * hidden * bytes_per_element for rank in range(world_size)]
'''
BYTES_RIGHT = dict(CAPACITY="4 * (world_size - 1) / world_size * num_experts * capacity * hidden * bytes_per_element",
                   KEEP_SELF="", DROPLESS="2 * (rows[rank].sum() + rows[:, rank].sum())")


@pytest.mark.parametrize("changes, feedback", [
    (dict(), None),
    (dict(CAPACITY="4 * num_experts * capacity * hidden * bytes_per_element"), "rows a rank keeps for its own experts"),
    (dict(CAPACITY="2 * (world_size - 1) / world_size * num_experts * capacity * hidden * bytes_per_element"),
     "it counts two all-to-alls"),
    (dict(CAPACITY="(world_size - 1) / world_size * num_experts * capacity * hidden * bytes_per_element"),
     "that is one all-to-all"),
    (dict(DROPLESS="2 * rows[rank].sum()"), "only the rows of this rank's own tokens"),
    (dict(DROPLESS="(rows[rank].sum() + rows[:, rank].sum())"), "counts out + in rows once"),
    (dict(DROPLESS="4 * rows[rank].sum()"), "assumes a rank receives as many rows as it sends"),
    (dict(KEEP_SELF="True or"), "never leave it"),
], ids=["template-is-right", "self-chunk", "capacity-forward-only", "one-all-to-all", "own-rows-only",
        "dropless-forward-only", "dropless-as-if-capacity", "self-rows"])
def test_all_to_all_bytes(tmp_notebook, changes, feedback):
    source = BYTES_TEMPLATE.format(**{**BYTES_RIGHT, **changes})
    result = graded(tmp_notebook, "ep.all_to_all_bytes", {"capacity_all_to_all_bytes": source})
    assert_verdict(result, feedback)


def test_dropless_bytes_of_first_choices_only_are_rejected(tmp_notebook):
    source = BYTES_TEMPLATE.format(**BYTES_RIGHT).replace("np.asarray(indices)", "np.asarray(indices)[:, 0]")
    result = graded(tmp_notebook, "ep.all_to_all_bytes", {"capacity_all_to_all_bytes": source})
    assert_fails(result, "first choice only")


INTERVIEW_CELL = '''
import math


def interview_capacity(num_tokens, num_experts, k, capacity_factor):
    return {CAPACITY}


def interview_total_parameters_b(vocab_size, hidden, n_layers, n_heads, n_kv_heads, expert_hidden, n_experts):
    kv_width = {KV_WIDTH}
    block = 2 * hidden * hidden + 2 * hidden * kv_width + hidden * n_experts + 2 * hidden + {EXPERTS}
    return ({OUTSIDE} + n_layers * block) / {UNIT}


def interview_active_parameters_b(vocab_size, hidden, n_layers, n_heads, n_kv_heads, expert_hidden, n_experts, top_k):
    total = interview_total_parameters_b(vocab_size, hidden, n_layers, n_heads, n_kv_heads, expert_hidden, n_experts)
    return total - n_layers * (n_experts - {USED}) * 3 * hidden * expert_hidden / 1e9


def interview_gpus_if_ep_multiplies(tp, ep, pp, dp):
    return {GPUS}


def interview_expert_copies(dp, ep):
    return {COPIES}
'''
INTERVIEW_RIGHT = dict(CAPACITY="math.ceil(capacity_factor * num_tokens * k / num_experts)",
                       KV_WIDTH="hidden // n_heads * n_kv_heads", EXPERTS="n_experts * 3 * hidden * expert_hidden",
                       OUTSIDE="2 * vocab_size * hidden + hidden", UNIT="1e9", USED="top_k", GPUS="tp * ep * pp * dp",
                       COPIES="dp // ep")
# the answers to the questions asked, copied from the page: right there, wrong for any other numbers
COPIED = dict(CAPACITY="160", GPUS="8192", COPIES="2")


@pytest.mark.parametrize("changes, feedback", [
    (dict(), None),
    (dict(CAPACITY="math.ceil(capacity_factor * num_tokens / num_experts)"), "k is missing"),
    (dict(CAPACITY="math.ceil(num_tokens * k / num_experts)"), "capacity factor is missing"),
    (dict(UNIT="1"), "answer in billions"),
    (dict(EXPERTS="n_experts * 2 * hidden * expert_hidden"), "three matrices"),
    (dict(KV_WIDTH="hidden"), "grouped-query attention"),
    (dict(OUTSIDE="vocab_size * hidden + hidden"), "count both"),
    (dict(USED="1"), "experts per block, not 1"),
    (dict(USED="n_experts"), "counts every expert"),
    (dict(GPUS="tp * pp * dp"), "leaves EP out"),
    (dict(COPIES="dp"), "every data-parallel rank"),
    (dict(COPIES="ep"), "the EP group size"),
    (dict(CAPACITY=COPIED["CAPACITY"]), "interview_capacity("),
    (dict(GPUS=COPIED["GPUS"]), "interview_gpus_if_ep_multiplies("),
    (dict(COPIES=COPIED["COPIES"]), "interview_expert_copies("),
], ids=["right", "capacity-without-k", "capacity-without-factor", "total-in-parameters", "two-matrix-experts",
        "no-grouped-query-attention", "tied-embeddings", "active-with-one-expert", "active-with-every-expert",
        "gpus-without-ep", "copies-every-dp-rank", "copies-ep", "copied-capacity", "copied-gpus", "copied-copies"])
def test_interview(tmp_notebook, changes, feedback):
    source = INTERVIEW_CELL.format(**{**INTERVIEW_RIGHT, **changes})
    result = graded(tmp_notebook, "ep.interview", {"interview_capacity": source})
    assert_verdict(result, feedback)


def test_interview_refuses_the_course_parameter_count(tmp_notebook):
    source = INTERVIEW_CELL.format(**INTERVIEW_RIGHT) + '''

def interview_total_parameters_b(vocab_size, hidden, n_layers, n_heads, n_kv_heads, expert_hidden, n_experts):
    from dtp.ep import moe
    config = moe.MoEConfig(vocab_size, hidden, n_layers, n_heads, n_kv_heads, expert_hidden, n_experts)
    return moe.moe_parameter_counts(config)["total"] / 1e9
'''
    result = graded(tmp_notebook, "ep.interview", {"interview_capacity": source})
    assert result.points == 0 and "course's reference" in result.feedback, result
