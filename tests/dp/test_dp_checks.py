"""The data-parallelism chapter's checks of exercises 1 to 3 (the numpy ring, the ring on gloo, data
parallelism by hand) reject plausible wrong answers with feedback that names the mistake, and accept
correct answers written differently from the course's."""
import pytest

from conftest import grade

# --- exercise 1: the numpy ring over a SimulatedNetwork ---

RING_NUMPY_TEMPLATE = '''
def ring_all_reduce_numpy(arrays, network):
    n = len(arrays)
    chunks = [np.array_split(np.array(a, dtype={DTYPE}), n) for a in arrays]
    for phase in {PHASES}:
        for step in range(n - 1):
            def sent_by(rank):
                return (rank - step) % n if phase == "reduce-scatter" else ({ALL_GATHER_INDEX}) % n
            for rank in range(n):
                network.send(rank, {DESTINATION}, chunks[rank][sent_by(rank)])
            network.exchange()
            for rank in range(n):
                left = (rank - 1) % n
                incoming = network.receive(rank, left)
                if phase == "reduce-scatter":
                    chunks[rank][sent_by(left)] += {INCOMING}
                else:
                    chunks[rank][sent_by(left)] = incoming
    return [np.concatenate(c){FINISH} for c in chunks]
'''
RING_NUMPY_RIGHT = dict(DTYPE="np.float64", PHASES='("reduce-scatter", "all-gather")', ALL_GATHER_INDEX="rank + 1 - step",
                        DESTINATION="(rank + 1) % n", INCOMING="incoming", FINISH="")


def ring_numpy(**changes) -> str:
    return RING_NUMPY_TEMPLATE.format(**{**RING_NUMPY_RIGHT, **changes})


RING_NUMPY_DOUBLED_MESSAGES = ring_numpy(INCOMING="incoming / 2").replace(
    "chunks[rank][sent_by(rank)])", "2 * chunks[rank][sent_by(rank)])").replace(
    "= incoming\n", "= incoming / 2\n")  # right results, but messages that are not what a ring sends

RING_NUMPY_LOCAL_SUM_WITH_DUMMY_MESSAGES = '''
def ring_all_reduce_numpy(arrays, network):
    n = len(arrays)
    total = np.sum(arrays, axis=0)
    for phase in range(2):
        for step in range(n - 1):
            for rank in range(n):
                network.send(rank, (rank + 1) % n, np.array_split(np.zeros_like(total), n)[(rank - step) % n])
            network.exchange()
    return [total.copy() for _ in range(n)]
'''

RING_NUMPY_WHOLE_ARRAYS = '''
def ring_all_reduce_numpy(arrays, network):
    n = len(arrays)
    totals = [np.array(a, dtype=float) for a in arrays]
    forwarded = [np.array(a, dtype=float) for a in arrays]
    for step in range(n - 1):
        for rank in range(n):
            network.send(rank, (rank + 1) % n, forwarded[rank])
        network.exchange()
        forwarded = [network.receive(rank, (rank - 1) % n) for rank in range(n)]
        for rank in range(n):
            totals[rank] += forwarded[rank]
    return totals
'''

RING_NUMPY_STAR = '''
def ring_all_reduce_numpy(arrays, network):
    n = len(arrays)
    for rank in range(1, n):
        network.send(rank, 0, arrays[rank])
    network.exchange()
    total = np.array(arrays[0], dtype=float)
    for rank in range(1, n):
        total += network.receive(0, rank)
    for rank in range(1, n):
        network.send(0, rank, total)
    network.exchange()
    return [total] + [network.receive(rank, 0) for rank in range(1, n)]
'''


@pytest.mark.parametrize("source, feedback", [
    (ring_numpy(PHASES='("reduce-scatter",)'), "forget the all-gather"),
    (ring_numpy(ALL_GATHER_INDEX="rank - step"), "differs from the reference"),
    (ring_numpy(DTYPE="np.float32"), "dtype float32, expected float64"),
    (ring_numpy(FINISH=".astype(np.float32).astype(np.float64)"), "differs from the reference"),
    (RING_NUMPY_DOUBLED_MESSAGES, "not a partial sum"),
    (ring_numpy(FINISH=" * np.nan"), "NaN"),
    (ring_numpy(FINISH="[:-1]"), "has shape"),
    (RING_NUMPY_LOCAL_SUM_WITH_DUMMY_MESSAGES, "not all of it reached"),
    (RING_NUMPY_WHOLE_ARRAYS, "one chunk of S/n"),
    (RING_NUMPY_STAR, "not its neighbour"),
], ids=["reduce-scatter-only", "off-by-one-chunk", "float32-result", "float32-accumulation", "added-twice", "nan",
        "shape", "np.sum-and-dummy-messages", "whole-arrays", "star"])
def test_ring_numpy_rejects(tmp_notebook, source, feedback):
    result = grade(tmp_notebook("dp", {"ring_all_reduce_numpy": source}), "dp.ring_allreduce_numpy")["dp.ring_allreduce_numpy"]
    assert result.status == "failed", result
    assert feedback in result.feedback
    assert result.points == 0


RING_NUMPY_LEFTWARD_TUPLE = '''
def ring_all_reduce_numpy(arrays, network):
    # Data flows to the left neighbour instead, chunks indexed the other way round; returns a tuple.
    n = len(arrays)
    chunks = [list(np.array_split(np.asarray(a, dtype=np.float64).copy(), n)) for a in arrays]
    for step in range(n - 1):
        for r in range(n):
            network.send(r, (r - 1) % n, chunks[r][(r + step) % n])
        network.exchange()
        for r in range(n):
            chunks[r][(r + 1 + step) % n] = chunks[r][(r + 1 + step) % n] + network.receive(r, (r + 1) % n)
    for step in range(n - 1):
        for r in range(n):
            network.send(r, (r - 1) % n, chunks[r][(r - 1 + step) % n])
        network.exchange()
        for r in range(n):
            chunks[r][(r + step) % n] = network.receive(r, (r + 1) % n)
    return tuple(np.concatenate(c) for c in chunks)
'''


def test_ring_numpy_accepts_a_leftward_ring_returning_a_tuple(tmp_notebook):
    result = grade(tmp_notebook("dp", {"ring_all_reduce_numpy": RING_NUMPY_LEFTWARD_TUPLE}), "dp.ring_allreduce_numpy")
    assert result["dp.ring_allreduce_numpy"].status == "passed", result


# --- exercise 2: the ring on gloo ---

RING_GLOO_TEMPLATE = '''
def ring_all_reduce(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.view(-1).{SPLIT}
    right, left = (rank + 1) % n, (rank - 1) % n
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            if phase == "reduce-scatter":
                send_index, receive_index = (rank - step) % n, (rank - step - 1) % n
            else:
                send_index, receive_index = {ALL_GATHER}
            incoming = torch.empty_like(chunks[receive_index])
            sending = dist.isend(chunks[send_index].contiguous(), right)
            dist.recv(incoming, left)
            sending.wait()
            if phase == "reduce-scatter":
                chunks[receive_index].add_(incoming)
            else:
                chunks[receive_index].copy_(incoming)
'''
RING_GLOO_RIGHT = dict(SPLIT="tensor_split(n)", ALL_GATHER="(rank + 1 - step) % n, (rank - step) % n")


def ring_gloo(**changes) -> str:
    return RING_GLOO_TEMPLATE.format(**{**RING_GLOO_RIGHT, **changes})


RING_GLOO_USES_ALL_REDUCE = '''
def ring_all_reduce(tensor):
    dist.all_reduce(tensor)
'''

RING_GLOO_RANK_NEVER_JOINS = '''
def ring_all_reduce(tensor):
    if dist.get_rank() == 1:
        return
    dist.recv(torch.empty_like(tensor), (dist.get_rank() - 1) % dist.get_world_size())
'''

RING_GLOO_WHOLE_TENSOR = '''
def ring_all_reduce(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    total = tensor.clone()
    for step in range(n - 1):
        incoming = torch.empty_like(tensor)
        sending = dist.isend(tensor if step == 0 else forwarded, (rank + 1) % n)
        dist.recv(incoming, (rank - 1) % n)
        sending.wait()
        forwarded = incoming
        total += incoming
    tensor.copy_(total)
'''

RING_GLOO_ALL_GATHER_AND_DUMMY_SENDS = '''
def ring_all_reduce(tensor):
    # dist.all_gather and a local sum, with sends of the right sizes to the right neighbour.
    rank, n = dist.get_rank(), dist.get_world_size()
    gathered = [torch.empty_like(tensor) for _ in range(n)]
    dist.all_gather(gathered, tensor)
    for phase in range(2):
        for step in range(n - 1):
            index = (rank - step) % n
            piece = tensor.tensor_split(n)[index]
            sending = dist.isend(torch.zeros_like(piece), (rank + 1) % n)
            dist.recv(torch.empty_like(tensor.tensor_split(n)[(index - 1) % n]), (rank - 1) % n)
            sending.wait()
    tensor.copy_(torch.stack(gathered).sum(0))
'''

RING_GLOO_STORE_SIDE_CHANNEL = '''
import io

def ring_all_reduce(tensor):
    # Data exchanged through the process group's store (no recorded collective), dummy ring sends.
    rank, n = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    buffer = io.BytesIO()
    torch.save(tensor.clone(), buffer)
    calls = store.add("calls", 1)
    generation = (calls - 1) // n
    store.set(f"x{generation}_{rank}", buffer.getvalue())
    parts = [torch.load(io.BytesIO(store.get(f"x{generation}_{r}"))) for r in range(n)]
    for phase in range(2):
        for step in range(n - 1):
            index = (rank - step) % n
            sending = dist.isend(torch.zeros_like(tensor.tensor_split(n)[index]), (rank + 1) % n)
            dist.recv(torch.empty_like(tensor.tensor_split(n)[(index - 1) % n]), (rank - 1) % n)
            sending.wait()
    tensor.copy_(torch.stack(parts).sum(0))
'''

RING_GLOO_STAR = '''
def ring_all_reduce(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        for other in range(1, n):
            incoming = torch.empty_like(tensor)
            dist.recv(incoming, other)
            tensor += incoming
        for other in range(1, n):
            dist.send(tensor, other)
    else:
        dist.send(tensor, 0)
        dist.recv(tensor, 0)
'''

RING_GLOO_HALVING_DOUBLING = '''
def ring_all_reduce(tensor):
    # Recursive doubling: exchange with rank XOR 1, 2, 4, ... (powers of two only).
    rank, n = dist.get_rank(), dist.get_world_size()
    distance = 1
    while distance < n:
        peer = rank ^ distance
        incoming = torch.empty_like(tensor)
        sending = dist.isend(tensor.clone(), peer)
        dist.recv(incoming, peer)
        sending.wait()
        tensor += incoming
        distance *= 2
'''

RING_GLOO_NOT_IN_PLACE = '''
def ring_all_reduce(tensor):
    return tensor * dist.get_world_size()  # a new tensor: the caller's is left unchanged
'''


@pytest.mark.parametrize("source, status, feedback", [
    (RING_GLOO_USES_ALL_REDUCE, "failed", "called all_reduce"),
    (ring_gloo(ALL_GATHER="(rank - step) % n, (rank - step - 1) % n"), "failed", "differs from the reference"),
    (RING_GLOO_RANK_NEVER_JOINS, "timeout", "never joined"),
    (RING_GLOO_WHOLE_TENSOR, "failed", "one chunk of S/n"),
    (RING_GLOO_ALL_GATHER_AND_DUMMY_SENDS, "failed", "called all_gather"),
    (RING_GLOO_STORE_SIDE_CHANNEL, "failed", "not all of it reached"),
    (RING_GLOO_STAR, "failed", "not its neighbour"),
    (RING_GLOO_HALVING_DOUBLING, "failed", "one chunk of S/n"),
    (RING_GLOO_NOT_IN_PLACE, "failed", "in place"),
    (ring_gloo(SPLIT="chunk(n)"), "error", "IndexError"),
], ids=["uses-all-reduce", "off-by-one", "rank-never-joins", "whole-tensor", "all-gather-and-dummy-sends",
        "store-side-channel", "star", "halving-doubling", "not-in-place", "torch.chunk"])
def test_ring_gloo_rejects(tmp_notebook, source, status, feedback):
    result = grade(tmp_notebook("dp", {"ring_all_reduce": source}), "dp.ring_allreduce_gloo")["dp.ring_allreduce_gloo"]
    assert result.status == status, result
    assert feedback in result.feedback


RING_GLOO_BATCHED = '''
def ring_all_reduce(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.tensor_split(n)
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            send_index = (rank - step) % n if phase == "reduce-scatter" else (rank + 1 - step) % n
            receive_index = (send_index - 1) % n
            incoming = torch.empty_like(chunks[receive_index])
            ops = [dist.P2POp(dist.isend, chunks[send_index].clone(), (rank + 1) % n),
                   dist.P2POp(dist.irecv, incoming, (rank - 1) % n)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
            if phase == "reduce-scatter":
                chunks[receive_index].add_(incoming)
            else:
                chunks[receive_index].copy_(incoming)
'''

RING_GLOO_EVEN_ODD_IMPORTED_NAMES = '''
from torch.distributed import get_rank, get_world_size, recv, send

def ring_all_reduce(tensor):
    rank, n = get_rank(), get_world_size()
    chunks = list(tensor.tensor_split(n))
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            send_index = (rank - step) % n if phase == "reduce-scatter" else (rank + 1 - step) % n
            receive_index = (send_index - 1) % n
            incoming = torch.empty_like(chunks[receive_index])
            # Blocking calls, ordered so that neighbours never both wait to send.
            if rank % 2 == 0:
                send(chunks[send_index].contiguous(), (rank + 1) % n)
                recv(incoming, (rank - 1) % n)
            else:
                recv(incoming, (rank - 1) % n)
                send(chunks[send_index].contiguous(), (rank + 1) % n)
            if phase == "reduce-scatter":
                chunks[receive_index] += incoming
            else:
                chunks[receive_index].copy_(incoming)
'''


@pytest.mark.parametrize("source", [RING_GLOO_BATCHED, RING_GLOO_EVEN_ODD_IMPORTED_NAMES],
                         ids=["batch_isend_irecv", "even-odd-blocking-imported-names"])
def test_ring_gloo_accepts_other_correct_rings(tmp_notebook, source):
    result = grade(tmp_notebook("dp", {"ring_all_reduce": source}), "dp.ring_allreduce_gloo")
    assert result["dp.ring_allreduce_gloo"].status == "passed", result


# --- exercise 3: data parallelism by hand ---

BY_HAND_TEMPLATE = '''
def broadcast_parameters(model):
    for tensor in {BROADCAST}:
        dist.broadcast(tensor.data, src=0)


def average_gradients(model):
    for name, parameter in model.named_parameters():
        if {WHICH}:
            dist.all_reduce(parameter.grad)
            parameter.grad /= {DIVISOR}
'''
BY_HAND_RIGHT = dict(BROADCAST="[*model.parameters(), *model.buffers()]", WHICH="True", DIVISOR="dist.get_world_size()")


def by_hand(**changes) -> str:
    return BY_HAND_TEMPLATE.format(**{**BY_HAND_RIGHT, **changes})


BY_HAND_TORCH_DDP = '''
def broadcast_parameters(model):
    torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's state


def average_gradients(model):
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)
        parameter.grad /= dist.get_world_size()
'''


@pytest.mark.parametrize("source, feedback", [
    (by_hand(DIVISOR="1"), "you summed the gradients"),
    (by_hand(DIVISOR="dist.get_world_size() ** 2"), "divided by the world size twice"),
    (by_hand(WHICH="name.endswith('weight')"), "differs from the reference"),
    (by_hand(BROADCAST="[]"), "Every rank must start from rank 0's"),
    (by_hand(BROADCAST="model.parameters()"), "DDP broadcasts buffers too"),
    (by_hand(WHICH="False"), "differs from the reference"),
    (BY_HAND_TORCH_DDP, "uses the course's reference"),
], ids=["sum-without-divide", "divide-twice", "biases-forgotten", "no-broadcast", "buffers-forgotten",
        "no-communication", "torch-ddp"])
def test_ddp_by_hand_rejects(tmp_notebook, source, feedback):
    result = grade(tmp_notebook("dp", {"broadcast_parameters": source}), "dp.ddp_by_hand")["dp.ddp_by_hand"]
    assert result.status == "failed", result
    assert feedback in result.feedback


BY_HAND_OWN_RING_AND_IMPORTS = '''
from torch.distributed import all_reduce, broadcast, get_world_size

def broadcast_parameters(model):
    for tensor in model.state_dict().values():
        broadcast(tensor, 0)


def average_gradients(model):
    for parameter in model.parameters():
        ring_all_reduce(parameter.grad)  # the learner's exercise-2 ring
        parameter.grad.div_(get_world_size())
'''


def test_ddp_by_hand_accepts_the_learners_own_ring_and_imported_names(tmp_notebook):
    result = grade(tmp_notebook("dp", {"broadcast_parameters": BY_HAND_OWN_RING_AND_IMPORTS}), "dp.ddp_by_hand")
    assert result["dp.ddp_by_hand"].status == "passed", result
