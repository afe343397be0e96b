"""Exercise 7 and the interview: message sizes, ring traffic, link times."""
from __future__ import annotations


from dtp import tensor_parallel as tp

from ...compare import expect, expect_answer
from ...registry import Check, exercise
from ..common import FixedAnswers, describe_call

# --- 7. message sizes, traffic and memory -------------------------------------------------------------

@exercise("tp.costs", points=2)
class Costs(Check):
    """Verifies: the bytes of one tensor-parallel all-reduce (b·s·h·e), each GPU's ring traffic
    per layer in forward and backward (4 all-reduces of 2(t-1)/t·S), and the activation bytes
    sequence parallelism saves per layer (10sbh(1 - 1/t) from the memory chapter's formula), on
    random inputs. Fakes: dtp's closed forms and the memory formula trip when called.
    """

    reads = ("allreduce_message_bytes", "ring_traffic_per_gpu_per_layer", "sequence_parallel_saving")
    references = ("dtp.tensor_parallel.all_reduce_message_bytes", "dtp.tensor_parallel.ring_bytes_per_gpu_per_layer",
                  "dtp.tensor_parallel.sequence_parallel_saving_bytes", "dtp.memory.activation_bytes_per_layer",
                  "dtp.costs.ring_all_reduce_bytes_per_rank")
    timeout_s = 15

    def prepare(self, rng):
        cases = []
        for _ in range(5):
            heads = int(rng.choice([16, 32, 64]))
            cases.append({"tokens": int(rng.integers(1, 64)) * 512, "seq": int(rng.choice([1024, 2048, 4096])),
                          "batch": int(rng.integers(1, 9)), "hidden": heads * int(rng.choice([64, 128])),
                          "heads": heads, "t": int(rng.choice([2, 4, 8])), "bytes": int(rng.choice([2, 4]))})
        return cases

    def collect(self, student, cases):
        return [[student.allreduce_message_bytes(c["tokens"], c["hidden"], c["bytes"]),
                 student.ring_traffic_per_gpu_per_layer(c["tokens"], c["hidden"], c["t"], c["bytes"]),
                 student.sequence_parallel_saving(c["seq"], c["batch"], c["hidden"], c["heads"], c["t"])] for c in cases]

    def judge(self, cases, answers) -> str:
        expect(len(answers) == len(cases), "the grader's calls did not all return")
        for c, (message, traffic, saving) in zip(cases, answers):
            size = tp.all_reduce_message_bytes(c["tokens"], c["hidden"], c["bytes"])
            expect_answer(message, size, describe_call("allreduce_message_bytes", (c["tokens"], c["hidden"], c["bytes"]), {}),
                          slips={"that counts elements; multiply by the bytes per element": size / c["bytes"]})
            n = c["t"]
            expect_answer(traffic, tp.ring_bytes_per_gpu_per_layer(c["tokens"], c["hidden"], n, c["bytes"]),
                          describe_call("ring_traffic_per_gpu_per_layer", (c["tokens"], c["hidden"], n, c["bytes"]), {}),
                          # first the slip that covers both readings of 2·S (at t = 2 it is also the forward pass)
                          slips={"that counts 2 all-reduces of S: the source notes' 2 per layer are the forward pass "
                                 "only, and each costs 2(t-1)/t·S per GPU in a ring": 2 * size,
                                 "that is the forward pass only; backward all-reduces twice more (f's gradients)":
                                 tp.ring_bytes_per_gpu_per_layer(c["tokens"], c["hidden"], n, c["bytes"], ("forward",)),
                                 "that counts 4·S; in a ring each GPU sends 2(t-1)/t·S per all-reduce": 4 * size})
            s, b, h, t = c["seq"], c["batch"], c["hidden"], c["t"]
            expect_answer(saving, tp.sequence_parallel_saving_bytes(s, b, h, c["heads"], t),
                          describe_call("sequence_parallel_saving", (s, b, h, c["heads"], t), {}),
                          slips={"that is 10sbh/t, what remains of the 10sbh; the saving is 10sbh(1 - 1/t)": 10 * s * b * h / t,
                                 "that is all of 10sbh; each GPU still keeps its 1/t of it": 10 * s * b * h})
        return "message bytes b·s·h·e, ring traffic 4·2(t-1)/t·S per layer and the saving 10sbh(1 - 1/t) are right"


INTERVIEW_ANSWERS = ("interview_allreduce_mib", "interview_traffic_per_gpu_mib", "interview_nvlink_ms",
                     "interview_infiniband_ms")
# The source notes' example: 4096 tokens, hidden 8192, fp16 activations, TP = 8.
INTERVIEW = dict(tokens=4096, hidden=8192, bytes_per_element=2, t=8)


@exercise("tp.interview", points=2)
class Interview(FixedAnswers):
    """Verifies: four fixed answers about the source notes' example: MiB per all-reduce, MiB each
    GPU sends per layer (forward and backward, ring), and that traffic's time at NVLink-4's 450
    GB/s per direction and at InfiniBand NDR's 400 Gb/s. Fakes: a fixed question, so a copied
    number passes; it is worth two points for that reason."""

    reads = INTERVIEW_ANSWERS

    def judge(self, inputs, answers) -> str:
        q = INTERVIEW
        size = tp.all_reduce_message_bytes(q["tokens"], q["hidden"], q["bytes_per_element"])
        traffic = tp.ring_bytes_per_gpu_per_layer(q["tokens"], q["hidden"], q["t"], q["bytes_per_element"])
        mib_answer, traffic_answer, nvlink_ms, infiniband_ms = answers
        expect_answer(mib_answer, size / 2**20, "interview_allreduce_mib", rel=1e-3,
                      slips={"that is in MB (10⁶ bytes); 1 MiB = 2²⁰ bytes": size / 1e6})
        expect_answer(traffic_answer, traffic / 2**20, "interview_traffic_per_gpu_mib", rel=1e-3, slips={
            "that is the forward pass only; backward has 2 all-reduces too": traffic / 2 / 2**20,
            "that adds the messages (4·S); in a ring each GPU sends 2(t-1)/t of each": 4 * size / 2**20,
            "that is 2·64 MiB, the notes' 128 MB per layer: forward only, and not what a GPU sends": 2 * size / 2**20})
        nvlink = tp.NVLINK4_PER_DIRECTION_BYTES_PER_S
        expect_answer(nvlink_ms, traffic / nvlink * 1e3, "interview_nvlink_ms", rel=1e-3, slips={
            "that uses 900 GB/s, NVLink's total over both directions; a GPU sends at 450 GB/s":
                traffic / tp.NVLINK4_BIDIRECTIONAL_BYTES_PER_S * 1e3,
            "that is in seconds; answer in milliseconds": traffic / nvlink})
        infiniband = tp.gigabits_to_bytes_per_s(tp.INFINIBAND_NDR_GBIT_PER_S)
        expect_answer(infiniband_ms, traffic / infiniband * 1e3, "interview_infiniband_ms", rel=1e-3, slips={
            "that reads 400 Gb/s as 400 GB/s; a network's Gb/s are gigabits: 400 Gb/s = 50 GB/s":
                traffic / 400e9 * 1e3,
            "that is in seconds; answer in milliseconds": traffic / infiniband})
        return "all four answers are right: 64 MiB, 448 MiB per GPU per layer, about 1 ms on NVLink and 9 ms on InfiniBand"
