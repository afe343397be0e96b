"""The data-parallelism chapter's checks of exercises 4 to 6 (bucketed, overlapped DDP, gradient
accumulation, costs and the interview) reject plausible wrong answers with feedback that names the
mistake, and accept correct answers written differently from the course's."""
import pytest
from conftest import assert_verdict, grade


# --- exercise 4: bucketed, overlapped DDP ---

BUCKETED_TEMPLATE = '''
class BucketedDDP(nn.Module):
    def __init__(self, model, bucket_cap_bytes):
        super().__init__()
        self.model = model
        self.world_size = dist.get_world_size()
        {BROADCAST}
        parameters = [p for p in model.parameters() if p.requires_grad]
        self.buckets, current, current_bytes = [], [], 0
        for parameter in {ORDER}(parameters):
            current.append(parameter)
            current_bytes += parameter.numel() * parameter.element_size()
            if {CLOSE}:
                self.buckets.append(current)
                current, current_bytes = [], 0
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
        for position, (handle, flat, index) in enumerate(self.in_flight):
            if handle is not None and {WAIT_FOR}:
                handle.wait()
            flat /= {DIVISOR}
            offset = 0
            for parameter in self.buckets[index]:
                parameter.grad.copy_(flat[offset:offset + parameter.numel()].view_as(parameter.grad))
                offset += parameter.numel()
        self.in_flight.clear()
        self.ready = {RESET}
'''
BUCKETED_RIGHT = dict(BROADCAST="broadcast_parameters(model)", ORDER="reversed", CLOSE="current_bytes >= bucket_cap_bytes",
                      LAUNCH_IN_HOOK="True", ALL_REDUCE="dist.all_reduce(flat, async_op=True)", WAIT_FOR="True",
                      DIVISOR="self.world_size", RESET="[0] * len(self.buckets)")


def bucketed(**changes) -> str:
    return BUCKETED_TEMPLATE.format(**{**BUCKETED_RIGHT, **changes})


BUCKETED_WRAPS_TORCH_DDP = '''
class BucketedDDP(nn.Module):
    def __init__(self, model, bucket_cap_bytes):
        super().__init__()
        self.ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_bytes / 2**20)

    def forward(self, *args):
        return self.ddp(*args)

    def finish_gradient_sync(self):
        pass
'''


def test_bucketed_template_is_correct_when_unchanged(tmp_notebook):
    """The template the wrong variants below are made from passes, so each failure is its change's."""
    result = grade(tmp_notebook("dp", {"BucketedDDP": bucketed()}), "dp.bucketed_ddp")["dp.bucketed_ddp"]
    assert result.status == "passed", result


@pytest.mark.parametrize("changes, feedback", [
    (dict(LAUNCH_IN_HOOK="False"), "only after backward reached the first layer"),
    (dict(ALL_REDUCE="dist.all_reduce(flat)"), "waited for an all-reduce inside backward"),
    (dict(WAIT_FOR="position == len(self.in_flight) - 1"), "never waited"),
    (dict(CLOSE="True"), "all-reduces per step"),
    (dict(CLOSE="False"), "all-reduces per step"),
    (dict(CLOSE="current_bytes > bucket_cap_bytes"), "buckets"),
    (dict(ORDER="list"), "buckets"),
    (dict(DIVISOR="1"), "you summed the gradients"),
    (dict(RESET="self.ready"), "all-reduces per step"),
    (dict(BROADCAST="pass"), "Every rank must start from rank 0's"),
], ids=["launch-after-backward", "synchronous", "waits-only-for-the-last", "bucket-per-parameter", "one-bucket",
        "closes-past-the-cap", "forward-order", "no-average", "counters-not-reset", "no-broadcast"])
def test_bucketed_ddp_rejects(tmp_notebook, changes, feedback):
    result = grade(tmp_notebook("dp", {"BucketedDDP": bucketed(**changes)}), "dp.bucketed_ddp")["dp.bucketed_ddp"]
    assert result.status == "failed", result
    assert feedback in result.feedback


# The previous bucket rule: close the open bucket before a parameter would take it past the cap.
BUCKETED_NEVER_PAST_THE_CAP = bucketed().replace(
    """            current.append(parameter)
            current_bytes += parameter.numel() * parameter.element_size()
            if current_bytes >= bucket_cap_bytes:
                self.buckets.append(current)
                current, current_bytes = [], 0
""", """            size = parameter.numel() * parameter.element_size()
            if current and current_bytes + size > bucket_cap_bytes:
                self.buckets.append(current)
                current, current_bytes = [], 0
            current.append(parameter)
            current_bytes += size
""")


def test_every_bucketed_grading_tests_a_cap_where_the_near_misses_differ():
    """At some caps equal to a cumulative size (2384 bytes here) a bucket that never grows past the cap, or that
    closes only past it, forms DDP's buckets; every grading must draw a cap where both differ."""
    import numpy as np

    from grader.checks.dp import training
    from grader.registry import find_exercise
    check = find_exercise("dp.bucketed_ddp").check
    sizes = [p.numel() * 4 for p in training.tiny_mlp(training.MLP_SIZES).parameters()]
    assert training._buckets_never_past_the_cap(sizes, 2384) == training.costs.ddp_bucket_sizes(sizes, 2384)
    for seed in range(300):
        caps = [cap for _, cap, _, _ in check.prepare(np.random.default_rng(seed))]
        right = [training.costs.ddp_bucket_sizes(sizes, cap) for cap in caps]
        assert right != [training._buckets_never_past_the_cap(sizes, cap) for cap in caps], seed
        assert right != [training._buckets_past_the_cap(sizes, cap) for cap in caps], seed


def test_bucketed_ddp_refuses_buckets_that_never_grow_past_the_cap(tmp_notebook):
    assert BUCKETED_NEVER_PAST_THE_CAP != bucketed()
    for _ in range(2):  # each grading draws its caps afresh
        result = grade(tmp_notebook("dp", {"BucketedDDP": BUCKETED_NEVER_PAST_THE_CAP}),
                       "dp.bucketed_ddp")["dp.bucketed_ddp"]
        assert result.status == "failed" and "yours never grow past the cap" in result.feedback, result


def test_bucketed_ddp_that_wraps_torch_ddp_is_told_so(tmp_notebook):
    result = grade(tmp_notebook("dp", {"BucketedDDP": BUCKETED_WRAPS_TORCH_DDP}), "dp.bucketed_ddp")["dp.bucketed_ddp"]
    assert result.status == "failed" and "uses the course's reference" in result.feedback, result


def test_bucketed_ddp_accepts_an_imported_all_reduce(tmp_notebook):
    source = "from torch.distributed import all_reduce\n" + bucketed(ALL_REDUCE="all_reduce(flat, async_op=True)")
    result = grade(tmp_notebook("dp", {"BucketedDDP": source}), "dp.bucketed_ddp")["dp.bucketed_ddp"]
    assert result.status == "passed", result


# --- exercise 5: gradient accumulation ---

ACCUMULATION_TEMPLATE = '''
import contextlib

def accumulation_step(ddp_model, optimizer, micro_batches):
    for index, (inputs, targets) in enumerate(micro_batches):
        with ddp_model.no_sync() if {SKIP_SYNC} else contextlib.nullcontext():
            loss = nn.functional.mse_loss(ddp_model(inputs), targets){SCALE}
            loss.backward()
    optimizer.step()
'''
ACCUMULATION_RIGHT = dict(SCALE=" / len(micro_batches)", SKIP_SYNC="index < len(micro_batches) - 1")

ACCUMULATION_FORWARD_OUTSIDE_NO_SYNC = '''
def accumulation_step(ddp_model, optimizer, micro_batches):
    for index, (inputs, targets) in enumerate(micro_batches):
        loss = nn.functional.mse_loss(ddp_model(inputs), targets) / len(micro_batches)
        if index < len(micro_batches) - 1:
            with ddp_model.no_sync():
                loss.backward()
        else:
            loss.backward()
    optimizer.step()
'''


def accumulation(**changes) -> str:
    return ACCUMULATION_TEMPLATE.format(**{**ACCUMULATION_RIGHT, **changes})


@pytest.mark.parametrize("source, feedback", [
    (accumulation(), None),
    (accumulation(SCALE=""), "divide each micro-batch's loss"),
    (accumulation(SKIP_SYNC="False"), "all-reduced [3, 3] times per step"),
    (ACCUMULATION_FORWARD_OUTSIDE_NO_SYNC, "run the forward inside no_sync() too"),
    (accumulation(SKIP_SYNC="True"), "never all-reduced"),
], ids=["right", "loss-not-scaled", "syncs-every-micro-batch", "forward-outside-no-sync", "never-syncs"])
def test_gradient_accumulation(tmp_notebook, source, feedback):
    result = grade(tmp_notebook("dp", {"accumulation_step": source}), "dp.gradient_accumulation")["dp.gradient_accumulation"]
    assert_verdict(result, feedback)


# --- exercise 6: costs, and the interview question ---

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
    ("__import__('dtp.dp.costs').dp.costs.ring_all_reduce_time(n, size_bytes, alpha_s, bandwidth_bytes_per_s)",
     "uses the course's reference"),
], ids=["no-latency", "half-latency", "whole-message", "string", "course-reference"])
def test_ring_time_rejects(tmp_notebook, time, feedback):
    notebook = tmp_notebook("dp", {"ring_allreduce_time": COSTS_TEMPLATE.format(TIME=time, BUS=RIGHT_BUS)})
    results = grade(notebook, "dp.ring_time", "dp.bus_bandwidth")
    assert results["dp.ring_time"].status == "failed" and feedback in results["dp.ring_time"].feedback, results
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


INTERVIEW = '''
def interview_bytes_sent_per_gpu(n_params, bytes_per_gradient, n_gpus):
    return {SENT}


def interview_allreduce_ms(n_params, bytes_per_gradient, n_gpus, link_bytes_per_s):
    return {MS}
'''
RIGHT_INTERVIEW = dict(SENT="2 * (n_gpus - 1) / n_gpus * n_params * bytes_per_gradient",
                       MS="2 * (n_gpus - 1) / n_gpus * n_params * bytes_per_gradient / link_bytes_per_s * 1e3")


def interview(**changes) -> str:
    return INTERVIEW.format(**{**RIGHT_INTERVIEW, **changes})


def test_interview_accepts_functions_of_the_question(tmp_notebook):
    result = grade(tmp_notebook("dp", {"interview_bytes_sent_per_gpu": interview()}), "dp.interview")["dp.interview"]
    assert result.status == "passed", result


@pytest.mark.parametrize("changes, feedback", [
    (dict(SENT="n_params * bytes_per_gradient"), "2(n-1)/n·S"),
    (dict(SENT="2 * (n_gpus - 1) / n_gpus * n_params"), "multiply by the bytes per gradient"),
    (dict(MS="n_params * bytes_per_gradient / link_bytes_per_s * 1e3"), "that uses S"),
    (dict(MS="2 * (n_gpus - 1) / n_gpus * n_params * bytes_per_gradient / link_bytes_per_s"), "in seconds"),
    # The asked question's answers, copied from the page: right for the question, wrong for any other.
    (dict(SENT="2 * 63 / 64 * 1.3e9 * 2"), "interview_bytes_sent_per_gpu("),
    (dict(MS="51.1875"), "interview_allreduce_ms("),
    ("from dtp.dp.costs import ring_all_reduce_bytes_per_rank as sent\n" + INTERVIEW.format(
        SENT="sent(n_gpus, n_params * bytes_per_gradient)", MS=RIGHT_INTERVIEW["MS"]), "uses the course's reference"),
], ids=["sent-S", "forgot-bytes-per-gradient", "time-of-S", "seconds-not-ms", "copied-bytes", "copied-ms",
        "course-function"])
def test_interview_rejects(tmp_notebook, changes, feedback):
    source = changes if isinstance(changes, str) else interview(**changes)
    result = grade(tmp_notebook("dp", {"interview_bytes_sent_per_gpu": source}), "dp.interview")["dp.interview"]
    assert result.status == "failed" and feedback in result.feedback, result


def test_interview_asks_the_notebooks_question():
    """The question the notebook states is the one the grader asks (with random ones besides)."""
    import nbformat

    from conftest import solution_path
    from grader.checks.dp.costs import Interview
    statement = next(cell.source for cell in nbformat.read(solution_path("dp"), as_version=4).cells
                     if cell.source.startswith("## Interview question"))
    assert Interview.asked == {"interview_bytes_sent_per_gpu": (1.3e9, 2, 64),
                               "interview_allreduce_ms": (1.3e9, 2, 64, 100e9)}
    assert all(number in statement for number in ("1.3B", "fp16 (2 bytes", "64 GPUs", "100 GB/s"))


def test_ring_replay_takes_the_closest_partial_sum_when_a_short_payload_matches_two():
    """One element of a small chunk can fall within float32's tolerance of another rank's element
    by chance; the replay must not then credit the message to a rank whose data it is not."""
    import numpy as np

    from grader.dataflow import check_ring_dataflow

    inputs = [np.array([1.0, 5.0]), np.array([1.000004, 6.0])]  # rank 1's element 0 is within 1e-5 of rank 0's
    logs = [[("send", 1, np.array([5.0])), ("recv", 1), ("send", 1, np.array([2.000004])), ("recv", 1)],
            [("send", 0, np.array([1.000004])), ("recv", 0), ("send", 0, np.array([11.0])), ("recv", 0)]]
    check_ring_dataflow(inputs, logs, rtol=1e-5, atol=1e-5, what="a correct ring on 2 ranks")


def test_the_summed_gradients_diagnosis_needs_an_update_along_the_right_one():
    """A rank that stepped with its own shard's gradient can move about n times as far as the
    right update by chance; it did not sum anything, so it must not be told it did."""
    import numpy as np

    from grader.checks.dp.training import _update_ratio

    initial, right = {"w": np.zeros(3)}, {"w": np.array([1.0, 0.0, 0.0])}
    assert _update_ratio({"w": np.array([2.0, 0.0, 0.0])}, initial, right) == 2.0  # summed: along it, twice as far
    assert _update_ratio({"w": np.array([2.0, 1.5, 0.0])}, initial, right) is None  # its own shard's direction
