"""Every check of the data-parallelism chapter rejects plausible wrong answers, with feedback
that names the mistake; and the course's solutions pass."""
import pytest

from conftest import grade

RING_NUMPY_REDUCE_SCATTER_ONLY = '''
def ring_all_reduce_numpy(arrays):
    n = len(arrays)
    chunks = [np.array_split(np.array(a, dtype=float), n) for a in arrays]
    sent = [0] * n
    for step in range(n - 1):
        messages = [((r + 1) % n, (r - step) % n, chunks[r][(r - step) % n].copy()) for r in range(n)]
        for r in range(n):
            sent[r] += chunks[r][(r - step) % n].nbytes
        for receiver, index, payload in messages:
            chunks[receiver][index] += payload
    return [np.concatenate(c) for c in chunks], [2 * s for s in sent]
'''

RING_NUMPY_OFF_BY_ONE = '''
def ring_all_reduce_numpy(arrays):
    n = len(arrays)
    chunks = [np.array_split(np.array(a, dtype=float), n) for a in arrays]
    sent = [0] * n
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            messages = []
            for rank in range(n):
                index = (rank - step) % n if phase == "reduce-scatter" else (rank - step) % n  # should be rank+1-step
                messages.append(((rank + 1) % n, index, chunks[rank][index].copy()))
                sent[rank] += chunks[rank][index].nbytes
            for receiver, index, payload in messages:
                if phase == "reduce-scatter":
                    chunks[receiver][index] += payload
                else:
                    chunks[receiver][index] = payload
    return [np.concatenate(c) for c in chunks], sent
'''

RING_NUMPY_NAIVE = '''
def ring_all_reduce_numpy(arrays):
    n = len(arrays)
    total = np.sum(arrays, axis=0)
    return [total.copy() for _ in range(n)], [(n - 1) * arrays[0].nbytes for _ in range(n)]
'''

RING_NUMPY_ONE_PHASE_BYTES = '''
def ring_all_reduce_numpy(arrays):
    n = len(arrays)
    total = np.sum(arrays, axis=0)
    return [total.copy() for _ in range(n)], [(n - 1) * arrays[0].nbytes // n for _ in range(n)]
'''

RING_NUMPY_WRONG_DTYPE = '''
def ring_all_reduce_numpy(arrays):
    n = len(arrays)
    total = np.sum(arrays, axis=0).astype(np.float32)
    return [total for _ in range(n)], [2 * (n - 1) * arrays[0].nbytes // n for _ in range(n)]
'''

RING_NUMPY_NAN = '''
def ring_all_reduce_numpy(arrays):
    n = len(arrays)
    total = np.sum(arrays, axis=0)
    total[0] = np.nan
    return [total for _ in range(n)], [2 * (n - 1) * arrays[0].nbytes // n for _ in range(n)]
'''

RING_NUMPY_WRONG_SHAPE = '''
def ring_all_reduce_numpy(arrays):
    n = len(arrays)
    total = np.sum(arrays, axis=0)
    return [total[:-1] for _ in range(n)], [2 * (n - 1) * arrays[0].nbytes // n for _ in range(n)]
'''


@pytest.mark.parametrize("source, feedback", [
    (RING_NUMPY_REDUCE_SCATTER_ONLY, "forget the all-gather"),
    (RING_NUMPY_OFF_BY_ONE, "differs from the reference"),
    (RING_NUMPY_NAIVE, "(n-1)·S"),
    (RING_NUMPY_ONE_PHASE_BYTES, "one phase only"),
    (RING_NUMPY_WRONG_DTYPE, "dtype float32, expected float64"),
    (RING_NUMPY_NAN, "NaN"),
    (RING_NUMPY_WRONG_SHAPE, "has shape"),
], ids=["reduce-scatter-only", "off-by-one-chunk", "naive-bytes", "one-phase-bytes", "dtype", "nan", "shape"])
def test_ring_numpy_rejects(tmp_notebook, source, feedback):
    result = grade(tmp_notebook("dp", {"ring_all_reduce_numpy": source}), "dp.ring_allreduce_numpy")["dp.ring_allreduce_numpy"]
    assert result.status == "failed", result
    assert feedback in result.feedback
    assert result.points == 0


RING_GLOO_USES_ALL_REDUCE = '''
def ring_all_reduce(tensor):
    dist.all_reduce(tensor)
'''

RING_GLOO_OFF_BY_ONE = '''
def ring_all_reduce(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.view(-1).tensor_split(n)
    right, left = (rank + 1) % n, (rank - 1) % n
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            send_index = (rank - step) % n
            receive_index = (rank - step - 1) % n if phase == "reduce-scatter" else (rank - step - 1) % n
            incoming = torch.empty_like(chunks[receive_index])
            sending = dist.isend(chunks[send_index].contiguous(), right)
            dist.recv(incoming, left)
            sending.wait()
            if phase == "reduce-scatter":
                chunks[receive_index].add_(incoming)
            else:
                chunks[receive_index].copy_(incoming)
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


@pytest.mark.parametrize("source, status, feedback", [
    (RING_GLOO_USES_ALL_REDUCE, "failed", "called dist.all_reduce"),
    (RING_GLOO_OFF_BY_ONE, "failed", "differs from the reference"),
    (RING_GLOO_RANK_NEVER_JOINS, "timeout", "never joined"),
    (RING_GLOO_WHOLE_TENSOR, "failed", "2(n-1)·S"),
], ids=["uses-all-reduce", "off-by-one", "rank-never-joins", "whole-tensor-bytes"])
def test_ring_gloo_rejects(tmp_notebook, source, status, feedback):
    result = grade(tmp_notebook("dp", {"ring_all_reduce": source}), "dp.ring_allreduce_gloo")["dp.ring_allreduce_gloo"]
    assert result.status == status, result
    assert feedback in result.feedback


DDP_SUM_ONLY = '''
def average_gradients(model):
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)
'''

DDP_DIVIDE_TWICE = '''
def average_gradients(model):
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)
        parameter.grad /= dist.get_world_size() ** 2
'''

DDP_NO_COMMUNICATION = '''
def average_gradients(model):
    for parameter in model.parameters():
        parameter.grad /= 1
'''

DDP_ONLY_WEIGHTS = '''
def average_gradients(model):
    for name, parameter in model.named_parameters():
        if name.endswith("weight"):
            dist.all_reduce(parameter.grad)
            parameter.grad /= dist.get_world_size()
'''


@pytest.mark.parametrize("source, feedback", [
    (DDP_SUM_ONLY, "you summed the gradients"),
    (DDP_DIVIDE_TWICE, "divided by the world size twice"),
    (DDP_NO_COMMUNICATION, "communicated nothing"),
    (DDP_ONLY_WEIGHTS, "differs from the reference"),
], ids=["sum-without-divide", "divide-twice", "no-communication", "biases-forgotten"])
def test_ddp_by_hand_rejects(tmp_notebook, source, feedback):
    result = grade(tmp_notebook("dp", {"average_gradients": source}), "dp.ddp_by_hand")["dp.ddp_by_hand"]
    assert result.status == "failed", result
    assert feedback in result.feedback


BUCKETED_TEMPLATE = '''
class BucketedDDP(nn.Module):
    def __init__(self, model, bucket_cap_bytes):
        super().__init__()
        self.model = model
        self.world_size = dist.get_world_size()
        parameters = [p for p in model.parameters() if p.requires_grad]
        self.buckets, current, current_bytes = [], [], 0
        for parameter in {ORDER}(parameters):
            size = parameter.numel() * parameter.element_size()
            if current and ({SPLIT}):
                self.buckets.append(current)
                current, current_bytes = [], 0
            current.append(parameter)
            current_bytes += size
        if current:
            self.buckets.append(current)
        self.bucket_of = {{id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}}
        self.ready = [0] * len(self.buckets)
        self.in_flight = []
        for parameter in parameters:
            parameter.register_post_accumulate_grad_hook(self.gradient_ready)

    def forward(self, *args):
        return self.model(*args)

    def gradient_ready(self, parameter):
        index = self.bucket_of[id(parameter)]
        self.ready[index] += 1
        if {LAUNCH_IN_HOOK} and self.ready[index] == len(self.buckets[index]):
            self.launch(index)

    def launch(self, index):
        flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[index]])
        self.in_flight.append(({ALL_REDUCE}, flat, index))

    def finish_gradient_sync(self):
        if not {LAUNCH_IN_HOOK}:
            for index in range(len(self.buckets)):
                self.launch(index)
        for handle, flat, index in self.in_flight:
            if handle is not None:
                handle.wait()
            flat /= {DIVISOR}
            offset = 0
            for parameter in self.buckets[index]:
                parameter.grad.copy_(flat[offset:offset + parameter.numel()].view_as(parameter.grad))
                offset += parameter.numel()
        self.in_flight.clear()
        self.ready = {RESET}
'''
CORRECT = dict(ORDER="reversed", SPLIT="current_bytes + size > bucket_cap_bytes", LAUNCH_IN_HOOK="True",
               ALL_REDUCE="dist.all_reduce(flat, async_op=True)", DIVISOR="self.world_size",
               RESET="[0] * len(self.buckets)")


def bucketed(**changes) -> str:
    return BUCKETED_TEMPLATE.format(**{**CORRECT, **changes})


def test_bucketed_template_is_correct_when_unchanged(tmp_notebook):
    """The template the wrong variants below are made from passes, so each failure is its change's."""
    result = grade(tmp_notebook("dp", {"BucketedDDP": bucketed()}), "dp.bucketed_ddp")["dp.bucketed_ddp"]
    assert result.status == "passed", result


@pytest.mark.parametrize("changes, feedback", [
    (dict(LAUNCH_IN_HOOK="False"), "during backward"),
    (dict(ALL_REDUCE="dist.all_reduce(flat)"), "async_op=True"),
    (dict(SPLIT="True"), "all-reduces per step"),
    (dict(SPLIT="False"), "all-reduces per step"),
    (dict(DIVISOR="1"), "differs from the reference"),
    (dict(RESET="self.ready"), "all-reduces per step"),
], ids=["launch-after-backward", "synchronous", "bucket-per-parameter", "one-bucket", "no-average", "counters-not-reset"])
def test_bucketed_ddp_rejects(tmp_notebook, changes, feedback):
    result = grade(tmp_notebook("dp", {"BucketedDDP": bucketed(**changes)}), "dp.bucketed_ddp")["dp.bucketed_ddp"]
    assert result.status == "failed", result
    assert feedback in result.feedback


COSTS_TEMPLATE = '''
def ring_allreduce_time(n, size_bytes, alpha_s, bandwidth_bytes_per_s):
    return {TIME}


def bus_bandwidth(size_bytes, time_s, n):
    return {BUS}
'''
RIGHT_TIME = "2 * (n - 1) * alpha_s + 2 * (n - 1) / n * size_bytes / bandwidth_bytes_per_s"
RIGHT_BUS = "size_bytes / time_s * 2 * (n - 1) / n"


@pytest.mark.parametrize("time, feedback", [
    ("2 * (n - 1) / n * size_bytes / bandwidth_bytes_per_s", "latency term"),
    ("(n - 1) * alpha_s + 2 * (n - 1) / n * size_bytes / bandwidth_bytes_per_s", "n-1 latencies"),
    ("2 * (n - 1) * alpha_s + size_bytes / bandwidth_bytes_per_s", "expected"),
    ("str(2 * (n - 1) * alpha_s)", "should be a number"),
], ids=["no-latency", "half-latency", "whole-message", "string"])
def test_ring_time_rejects(tmp_notebook, time, feedback):
    notebook = tmp_notebook("dp", {"ring_allreduce_time": COSTS_TEMPLATE.format(TIME=time, BUS=RIGHT_BUS)})
    results = grade(notebook, "dp.ring_time", "dp.bus_bandwidth")
    assert results["dp.ring_time"].status == "failed" and feedback in results["dp.ring_time"].feedback
    assert results["dp.bus_bandwidth"].status == "passed"


@pytest.mark.parametrize("bus, feedback", [
    ("size_bytes / time_s", "algorithm bandwidth"),
    ("size_bytes / time_s * (n - 1) / n", "expected"),
    ("float('nan')", "not a finite number"),
], ids=["algbw", "half", "nan"])
def test_bus_bandwidth_rejects(tmp_notebook, bus, feedback):
    notebook = tmp_notebook("dp", {"bus_bandwidth": COSTS_TEMPLATE.format(TIME=RIGHT_TIME, BUS=bus)})
    result = grade(notebook, "dp.bus_bandwidth")["dp.bus_bandwidth"]
    assert result.status == "failed" and feedback in result.feedback


@pytest.mark.parametrize("answers, feedback", [
    ("interview_bytes_sent_per_gpu = 2.6e9\ninterview_allreduce_ms = 26.0", "2(n-1)/n·S"),
    ("interview_bytes_sent_per_gpu = 2 * 63 / 64 * 2.6e9\ninterview_allreduce_ms = 0.0512", "interview_allreduce_ms"),
    ("interview_bytes_sent_per_gpu = 2 * 63 / 64 * 1.3e9\ninterview_allreduce_ms = 25.6", "interview_bytes_sent_per_gpu"),
], ids=["sent-S", "seconds-not-ms", "forgot-2-bytes"])
def test_interview_rejects(tmp_notebook, answers, feedback):
    result = grade(tmp_notebook("dp", {"interview_bytes_sent_per_gpu": answers}), "dp.interview")["dp.interview"]
    assert result.status == "failed" and feedback in result.feedback


# Correct solutions written differently from the course's must pass: the checks test behaviour.

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

DDP_IMPORTED_ALL_REDUCE = '''
from torch.distributed import all_reduce, get_world_size

def average_gradients(model):
    for parameter in model.parameters():
        all_reduce(parameter.grad)
        parameter.grad.div_(get_world_size())
'''

RING_NUMPY_AS_LIST_WITH_FLOAT_BYTES = '''
def ring_all_reduce_numpy(arrays):
    n = len(arrays)
    chunks = [np.array_split(np.asarray(a, dtype=np.float64).copy(), n) for a in arrays]
    sent = [0.0] * n
    for step in range(n - 1):
        outgoing = [chunks[r][(r - step) % n].copy() for r in range(n)]
        for r in range(n):
            sent[r] += outgoing[r].nbytes
            chunks[(r + 1) % n][(r - step) % n] += outgoing[r]
    for step in range(n - 1):
        outgoing = [chunks[r][(r + 1 - step) % n].copy() for r in range(n)]
        for r in range(n):
            sent[r] += outgoing[r].nbytes
            chunks[(r + 1) % n][(r + 1 - step) % n] = outgoing[r]
    return [np.concatenate(c) for c in chunks], sent
'''


DDP_WITH_OWN_RING = '''
def average_gradients(model):
    for parameter in model.parameters():
        ring_all_reduce(parameter.grad)  # the learner's exercise-2 ring
        parameter.grad /= dist.get_world_size()
'''


@pytest.mark.parametrize("name, source, exercise_id", [
    ("average_gradients", DDP_WITH_OWN_RING, "dp.ddp_by_hand"),
    ("BucketedDDP", "from torch.distributed import all_reduce\n" + bucketed(ALL_REDUCE="all_reduce(flat, async_op=True)"),
     "dp.bucketed_ddp"),
    ("ring_all_reduce", RING_GLOO_BATCHED, "dp.ring_allreduce_gloo"),
    ("ring_all_reduce", RING_GLOO_EVEN_ODD_IMPORTED_NAMES, "dp.ring_allreduce_gloo"),
    ("average_gradients", DDP_IMPORTED_ALL_REDUCE, "dp.ddp_by_hand"),
    ("ring_all_reduce_numpy", RING_NUMPY_AS_LIST_WITH_FLOAT_BYTES, "dp.ring_allreduce_numpy"),
], ids=["ddp-with-own-ring", "bucketed-imported-all-reduce", "batch_isend_irecv", "even-odd-imported-names",
        "imported-all-reduce", "list-and-float-bytes"])
def test_correct_alternatives_pass(tmp_notebook, name, source, exercise_id):
    result = grade(tmp_notebook("dp", {name: source}), exercise_id)[exercise_id]
    assert result.status == "passed", result


RING_GLOO_NOT_IN_PLACE = '''
def ring_all_reduce(tensor):
    return tensor * dist.get_world_size()  # a new tensor: the caller's is left unchanged
'''


def test_ring_gloo_asks_for_in_place(tmp_notebook):
    result = grade(tmp_notebook("dp", {"ring_all_reduce": RING_GLOO_NOT_IN_PLACE}), "dp.ring_allreduce_gloo")
    assert "in place" in result["dp.ring_allreduce_gloo"].feedback
