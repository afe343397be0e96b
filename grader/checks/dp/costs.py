"""The data-parallel cost exercises: the alpha-beta time of a ring all-reduce, bus bandwidth,
and the interview question, all compared with the closed forms of `dtp.dp.costs`."""
from __future__ import annotations

from dtp.dp import costs

from ...registry import exercise
from ..common import FormulaCheck, InterviewQuestions


@exercise("dp.ring_time", points=1)
class RingTime(FormulaCheck):
    """Verifies: T = 2(n-1)·alpha + 2(n-1)/n·S/bandwidth on random n, S, alpha and bandwidth.
    Fakes: calling dtp.dp.costs.ring_all_reduce_time trips."""

    function = "ring_allreduce_time"
    references = ("dtp.dp.costs.ring_all_reduce_time",)
    rel = 1e-6
    summary = "matches T = 2(n-1)·alpha + 2(n-1)/n·S/bandwidth on random inputs"

    def cases(self, rng):
        return [((int(rng.integers(2, 1025)), float(rng.uniform(1e3, 1e10)), float(rng.uniform(1e-6, 5e-5)),
                  float(rng.uniform(1e9, 5e11))), {}) for _ in range(6)]

    def expected(self, n, size, alpha, bandwidth):
        return costs.ring_all_reduce_time(n, size, alpha, bandwidth)

    def slips(self, n, size, alpha, bandwidth):
        transfer = costs.ring_all_reduce_bytes_per_rank(n, size) / bandwidth
        return {f"the latency term 2(n-1)·alpha = {2 * (n - 1) * alpha:.4g} s is missing": transfer,
                "that counts n-1 latencies; the ring takes 2(n-1) steps (reduce-scatter + all-gather)":
                    (n - 1) * alpha + transfer}


@exercise("dp.bus_bandwidth", points=1)
class BusBandwidth(FormulaCheck):
    """Verifies: busbw = S/t · 2(n-1)/n on random S, t and n (n = 2, where busbw = algbw, included).
    Fakes: calling dtp.dp.costs.bus_bandwidth trips."""

    function = "bus_bandwidth"
    references = ("dtp.dp.costs.bus_bandwidth",)
    rel = 1e-6
    summary = "matches busbw = S/t · 2(n-1)/n on random inputs (n = 2 included)"

    def cases(self, rng):
        ns = [2] + [int(rng.integers(3, 513)) for _ in range(4)]
        return [((float(rng.uniform(1e6, 1e10)), float(rng.uniform(1e-4, 1.0)), n), {}) for n in ns]

    def expected(self, size, seconds, n):
        return costs.bus_bandwidth(size, seconds, n)

    def slips(self, size, seconds, n):
        return {"that is the algorithm bandwidth S/t; bus bandwidth scales it by 2(n-1)/n": size / seconds}


# --- 7. interview question ------------------------------------------------------------------

@exercise("dp.interview", points=1)
class Interview(InterviewQuestions):
    """Verifies: the bytes each GPU sends in a ring all-reduce of the gradients, and the time it
    takes on links of a given bandwidth, as functions of the question's numbers: on the question
    the notebook asks (1.3B parameters, fp16, 64 GPUs, 100 GB/s) and on random ones.
    Fakes: a number copied from the page answers the asked question only, not the drawn ones;
    dtp.dp.costs's ring functions trip."""

    reads = ("interview_bytes_sent_per_gpu", "interview_allreduce_ms")
    references = ("dtp.dp.costs.ring_all_reduce_bytes_per_rank", "dtp.dp.costs.ring_all_reduce_time")
    asked = {"interview_bytes_sent_per_gpu": (1.3e9, 2, 64),
             "interview_allreduce_ms": (1.3e9, 2, 64, 100e9)}
    summary = "bytes sent per GPU and all-reduce time are right for the question asked and for random numbers"

    def drawn(self, name, rng):
        question = (float(rng.integers(1, 2000)) * 1e8, int(rng.choice([2, 4])), int(rng.integers(2, 2049)))
        if name == "interview_allreduce_ms":
            question += (float(rng.integers(10, 900)) * 1e9,)
        return question

    def expected(self, name, n_params, bytes_per_gradient, n_gpus, link_bytes_per_s=None):
        sent = costs.ring_all_reduce_bytes_per_rank(n_gpus, n_params * bytes_per_gradient)
        return sent if link_bytes_per_s is None else sent / link_bytes_per_s * 1e3

    def slips(self, name, n_params, bytes_per_gradient, n_gpus, link_bytes_per_s=None):
        size = n_params * bytes_per_gradient
        sent = costs.ring_all_reduce_bytes_per_rank(n_gpus, size)
        if link_bytes_per_s is None:
            return {"that is the gradient size S; a ring sends 2(n-1)/n·S per GPU": size,
                    "that counts parameters, not bytes: multiply by the bytes per gradient":
                        costs.ring_all_reduce_bytes_per_rank(n_gpus, n_params)}
        return {"that uses S, not the 2(n-1)/n·S each GPU sends": size / link_bytes_per_s * 1e3,
                "that is in seconds; the question asks for milliseconds": sent / link_bytes_per_s}
