"""Exercise 1 of the overlap chapter: the exposure model as functions, on random sizes, against
the closed forms of `dtp.overlap.model`."""
from __future__ import annotations

from dtp.overlap import model as overlap

from ...compare import CheckFailed, expect_answer
from ...registry import Check, exercise
from ..references import refuses_library
from ..common import describe_call


def _regime(rng, hidden: bool) -> tuple[float, float]:
    """(communication, compute) with communication hidden or not, so that every grading has
    cases on both sides of every max(0, ...)."""
    compute = float(rng.uniform(1.0, 20.0))
    communication = compute * float(rng.uniform(0.1, 0.9) if hidden else rng.uniform(1.2, 4.0))
    return communication, compute


@exercise("overlap.exposure_model", points=3)
@refuses_library("dtp.overlap.model")
class ExposureModel(Check):
    """Verifies: the exposed communication of DDP with b buckets, of ZeRO-3's forward with and
    without prefetch, of collective matmul with t chunks, of a Megatron TP layer (forward and
    backward) and of a MoE layer's two micro-batches with and without overlap, on random times
    where communication is hidden and where it is not, b = 1 and t = 1 among them; known slips
    named.
    Fakes: dtp.overlap.model's functions trip; the times are drawn each grading."""

    reads = ("ddp_exposed_time", "fsdp_forward_exposed_time", "collective_matmul_exposed_time", "tp_layer_exposed_time",
             "ep_exposed_time")
    timeout_s = 15

    def prepare(self, rng):
        ddp, fsdp, matmul, tp, ep = [], [], [], [], []
        for case, hidden in enumerate((True, False, True, False)):
            # DDP: "hidden" means the all-reduces fit in backward after the first bucket
            communication, backward = _regime(rng, hidden)
            ddp.append((communication, backward, int(rng.integers(2, 9))))
            gather, compute = _regime(rng, hidden)
            fsdp.append((int(rng.integers(2, 13)), gather, compute, hidden or case == 1 or bool(rng.integers(2))))
            allgather, gemm = _regime(rng, hidden)
            matmul.append((allgather, gemm, int(rng.integers(2, 9))))
            tp.append(_regime(rng, hidden))
            ep.append((*_regime(rng, hidden), hidden or case == 1 or bool(rng.integers(2))))
        ddp.append((*_regime(rng, False), 1))
        fsdp.append((int(rng.integers(2, 13)), *_regime(rng, False), False))
        matmul.append((*_regime(rng, True), 1))
        ep.append((*_regime(rng, False), False))
        return {"ddp_exposed_time": ddp, "fsdp_forward_exposed_time": fsdp, "collective_matmul_exposed_time": matmul,
                "tp_layer_exposed_time": tp, "ep_exposed_time": ep}

    def collect(self, student, cases):
        return {name: [getattr(student, name)(*args) for args in calls] for name, calls in cases.items()}

    @staticmethod
    def expected(name, *args):
        return {"ddp_exposed_time": overlap.ddp_exposed, "fsdp_forward_exposed_time": overlap.fsdp_forward_exposed,
                "collective_matmul_exposed_time": overlap.collective_matmul_exposed,
                "tp_layer_exposed_time": overlap.tp_layer_exposed, "ep_exposed_time": overlap.ep_exposed}[name](*args)

    @staticmethod
    def slips(name, *args):
        if name == "ddp_exposed_time":
            c, b, k = args
            return {"that is the whole all-reduce time: the buckets' all-reduces run during backward, only what "
                    "sticks out of it is exposed": c,
                    "that is max(0, C - B): the last bucket is ready only when backward ends, so at least C/b is "
                    "exposed, and the first bucket cannot start before B/b": max(0.0, c - b),
                    "that counts only the last bucket: when the all-reduces together take longer than backward after "
                    "the first bucket, C - B(b-1)/b sticks out": c / k}
        if name == "fsdp_forward_exposed_time":
            units, g, f, prefetch = args
            if not prefetch:
                return {"that is the prefetched forward; without prefetch every unit waits for its gather, L·g":
                        overlap.fsdp_forward_exposed(units, g, f)}
            return {"that is the forward without prefetch (L·g); with prefetch only the first gather waits in full":
                    units * g,
                    "that leaves out the first unit's gather, which nothing can hide": (units - 1) * max(0.0, g - f),
                    "that charges max(0, g - f) to every unit; the first unit's gather is exposed in full":
                    units * max(0.0, g - f)}
        if name == "tp_layer_exposed_time":
            a, w = args
            return {"that counts all four all-reduces as exposed: backward's run under the weight-gradient product": 4 * a,
                    "that hides the forward all-reduces too; the next product needs their result, so both are exposed":
                    4 * max(0.0, a - w),
                    "that leaves out the forward: its two all-reduces are on the critical path": 2 * max(0.0, a - w)}
        if name == "ep_exposed_time":
            c, f, overlapped = args
            if not overlapped:
                return {"that is the overlapped layer; one micro-batch after the other exposes both all-to-alls":
                        2 * max(0.0, c - f)}
            return {"that is without overlap: each micro-batch's all-to-alls run under the other's compute": 2 * c,
                    "that counts one micro-batch; both have all-to-alls": max(0.0, c - f)}
        a, g, t = args
        if t == 1:
            return {}
        return {"that hides the all-gather under the whole GEMM; the last chunk's GEMM (G/t) has no transfer left "
                "to hide": max(0.0, a - g),
                "that is the plain all-gather then GEMM: with t chunks each transfer runs under a chunk's GEMM": a,
                "that splits the all-gather into t transfers; a ring of t ranks passes t - 1 chunks":
                t * max(0.0, a / t - g / t)}

    def judge(self, cases, answers) -> str:
        for name, calls in cases.items():
            given = answers.get(name) if isinstance(answers, dict) else None
            if not isinstance(given, list) or len(given) != len(calls):
                raise CheckFailed(f"the grader's calls of {name} did not all return")
            for args, answer in zip(calls, given):
                expect_answer(answer, self.expected(name, *args), describe_call(name, args, {}), rel=1e-9,
                              slips=self.slips(name, *args))
        return ("exposed time of DDP buckets, ZeRO-3's forward, collective matmul, a TP layer and a MoE layer's two "
                "micro-batches match max(0, communication - independent compute) phase by phase, hidden and exposed "
                "cases alike")
