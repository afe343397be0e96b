"""Exercise 7 and the interview: message sizes, ring traffic, and what they cost on a link."""
from __future__ import annotations

from dtp.tp import tensor_parallel as tp

from ...compare import expect, expect_answer
from ...registry import Check, exercise
from ..common import InterviewQuestions, describe_call

# Slips of the ring's traffic that give the same number (a ring sends 2(t-1)/t·S per all-reduce, 4 per layer).
FORWARD_ONLY = "that is the forward pass only; backward all-reduces twice more (f's gradients)"
NO_RING_FACTOR = ("that counts (t-1)/t·S per all-reduce, one half of the ring; an all-reduce is a reduce-scatter and an "
                  "all-gather, 2(t-1)/t·S per GPU")
FOUR_MESSAGES = "that counts 4·S, the messages; in a ring each GPU sends 2(t-1)/t·S per all-reduce"
NOTES_TWO_MESSAGES = ("that counts 2 all-reduces of S: the source notes' 2 per layer are the forward pass only, and each "
                      "costs 2(t-1)/t·S per GPU in a ring")


def traffic_slips(traffic: float, message: float, t: int) -> dict[str, float]:
    """What the usual mistakes give for a layer's ring traffic per GPU (`traffic`, any unit)."""
    return {FORWARD_ONLY: traffic / 2, NO_RING_FACTOR: traffic / 2, FOUR_MESSAGES: 4 * message,
            NOTES_TWO_MESSAGES: 2 * message}


# --- 7. message sizes, traffic and what a link makes of them --------------------------------------------

@exercise("tp.costs", points=2)
class Costs(Check):
    """Verifies: the bytes of one tensor-parallel all-reduce (b·s·h·e), each GPU's ring traffic
    per layer in forward and backward (4 all-reduces of 2(t-1)/t·S), and the ratio of that
    traffic's time on a link to the time of the GPU's share of the layer's matrix multiplies,
    which the learner derives (the statement prints neither the layer's FLOPs nor the ratio), on
    random inputs. Fakes: dtp's closed forms trip when called; a table cannot match fresh draws.
    """

    reads = ("allreduce_message_bytes", "ring_traffic_per_gpu_per_layer", "communication_to_compute_ratio")
    references = ("dtp.tp.tensor_parallel.all_reduce_message_bytes", "dtp.tp.tensor_parallel.ring_bytes_per_gpu_per_layer",
                  "dtp.tp.tensor_parallel.communication_to_compute_ratio", "dtp.tp.tensor_parallel.layer_training_flops",
                  "dtp.tp.tensor_parallel.layer_communication_time_s", "dtp.memory.formulas.transformer_training_flops",
                  "dtp.memory.formulas.model_flops_per_token", "dtp.dp.costs.ring_all_reduce_bytes_per_rank")
    timeout_s = 15

    def prepare(self, rng):
        cases = []
        # At t = 2 a ring's 2·2(t-1)/t·S per all-reduce pair equals the 4·S of counting messages: two
        # cases with t > 2 in every grading (with free draws all five were 2 in 1 grading of 243).
        for t_choices in ([4, 8], [4, 8], [2, 4, 8], [2, 4, 8], [2, 4, 8]):
            heads = int(rng.choice([16, 32, 64]))
            cases.append({"tokens": int(rng.integers(1, 64)) * 512, "seq": int(rng.choice([1024, 2048, 4096, 8192])),
                          "hidden": heads * int(rng.choice([64, 128])), "t": int(rng.choice(t_choices)),
                          "bytes": int(rng.choice([2, 4])), "link": float(rng.choice([450e9, 50e9, 25e9])),
                          "flops": float(rng.choice([989.4e12, 312e12, 60e12]))})
        return cases

    def collect(self, student, cases):
        return [[student.allreduce_message_bytes(c["tokens"], c["hidden"], c["bytes"]),
                 student.ring_traffic_per_gpu_per_layer(c["tokens"], c["hidden"], c["t"], c["bytes"]),
                 student.communication_to_compute_ratio(c["seq"], c["hidden"], c["t"], c["bytes"], c["link"], c["flops"])]
                for c in cases]

    def judge(self, cases, answers) -> str:
        expect(len(answers) == len(cases), "the grader's calls did not all return")
        for c, (message, traffic, ratio) in zip(cases, answers):
            size = tp.all_reduce_message_bytes(c["tokens"], c["hidden"], c["bytes"])
            expect_answer(message, size, describe_call("allreduce_message_bytes", (c["tokens"], c["hidden"], c["bytes"]), {}),
                          slips={"that counts elements; multiply by the bytes per element": size / c["bytes"]})
            t, ring = c["t"], tp.ring_bytes_per_gpu_per_layer(c["tokens"], c["hidden"], c["t"], c["bytes"])
            expect_answer(traffic, ring, describe_call("ring_traffic_per_gpu_per_layer",
                                                       (c["tokens"], c["hidden"], t, c["bytes"]), {}),
                          slips=traffic_slips(ring, size, t))
            args = (c["seq"], c["hidden"], t, c["bytes"], c["link"], c["flops"])
            expected = tp.communication_to_compute_ratio(*args)
            expect_answer(ratio, expected, describe_call("communication_to_compute_ratio", args, {}),
                          slips=self._ratio_slips(expected, *args))
        return ("message bytes b·s·h·e, ring traffic 4·2(t-1)/t·S per layer, and the ratio of its link time to the GPU's "
                "share of the layer's compute are right")

    @staticmethod
    def _ratio_slips(expected, seq, hidden, t, bytes_per_element, link, flops) -> dict[str, float]:
        weights = 72 * hidden**2  # 6 FLOPs per token per weight, 12h² weights; attention adds 12·s·h per token
        attention = 12 * seq * hidden
        slips = {"that leaves out attention's QKᵀ and AV, 12·s·h FLOPs per token forward and backward":
                 expected * (weights + attention) / weights,
                 "that divides by the whole layer's compute; each GPU multiplies 1/t of it": expected / t,
                 "that counts the forward pass's compute only (2 FLOPs per weight and token); backward doubles it":
                 3 * expected}
        slips.update(traffic_slips(expected, expected * t / (8 * (t - 1)), t))
        return slips


# --- the interview: the source notes' example, as functions of its numbers ----------------------------

@exercise("tp.interview", points=2)
class Interview(InterviewQuestions):
    """Verifies: four functions of the source notes' question, called on its numbers (4096 tokens,
    hidden 8192, fp16, t = 8, NVLink's "900 GB/s", InfiniBand's "400 Gb/s") and on random ones:
    MiB per all-reduce, MiB each GPU sends per layer (forward and backward, ring), and that
    traffic's time in ms on NVLink from its bidirectional datasheet figure and on InfiniBand from
    its Gb/s. Fakes: a number copied from the page matches the asked question only, not the drawn
    ones; the course's functions trip when called."""

    reads = ("interview_allreduce_mib", "interview_traffic_per_gpu_mib", "interview_nvlink_ms",
             "interview_infiniband_ms")
    references = ("dtp.tp.tensor_parallel.all_reduce_message_bytes", "dtp.tp.tensor_parallel.ring_bytes_per_gpu_per_layer",
                  "dtp.tp.tensor_parallel.layer_communication_time_s", "dtp.tp.tensor_parallel.gigabits_to_bytes_per_s",
                  "dtp.dp.costs.ring_all_reduce_bytes_per_rank")
    asked = {"interview_allreduce_mib": (4096, 8192, 2), "interview_traffic_per_gpu_mib": (4096, 8192, 2, 8),
             "interview_nvlink_ms": (448, 900), "interview_infiniband_ms": (448, 400)}
    rel = 1e-3
    summary = ("every answer is right for the notes' question (64 MiB, 448 MiB per GPU per layer, about 1 ms on NVLink "
               "and 9 ms on InfiniBand) and for random numbers")

    def drawn(self, name, rng) -> tuple:
        tokens, hidden, element = int(rng.integers(1, 33)) * 512, int(rng.choice([1024, 2048, 4096, 5120, 12288])), \
            int(rng.choice([2, 4]))
        return {"interview_allreduce_mib": (tokens, hidden, element),
                "interview_traffic_per_gpu_mib": (tokens, hidden, element, int(rng.choice([2, 4, 8, 16]))),
                "interview_nvlink_ms": (float(rng.integers(10, 2000)), int(rng.choice([600, 900, 1800]))),
                "interview_infiniband_ms": (float(rng.integers(10, 2000)), int(rng.choice([100, 200, 400, 800])))}[name]

    def expected(self, name, *args) -> float:
        if name == "interview_allreduce_mib":
            return tp.all_reduce_message_bytes(*args) / 2**20
        if name == "interview_traffic_per_gpu_mib":
            tokens, hidden, element, t = args
            return tp.ring_bytes_per_gpu_per_layer(tokens, hidden, t, element) / 2**20
        traffic_mib, link = args
        per_direction = link * 1e9 / 2 if name == "interview_nvlink_ms" else tp.gigabits_to_bytes_per_s(link)
        return traffic_mib * 2**20 / per_direction * 1e3

    def slips(self, name, *args) -> dict[str, float]:
        right = self.expected(name, *args)
        seconds = {"that is in seconds; answer in milliseconds": right / 1e3}
        if name == "interview_allreduce_mib":
            return {"that is in MB (10⁶ bytes); 1 MiB = 2²⁰ bytes": right * 2**20 / 1e6}
        if name == "interview_traffic_per_gpu_mib":
            message = tp.all_reduce_message_bytes(*args[:3]) / 2**20
            return {**traffic_slips(right, message, args[3]),
                    "that is in MB (10⁶ bytes); 1 MiB = 2²⁰ bytes": right * 2**20 / 1e6}
        if name == "interview_nvlink_ms":
            return {**seconds, "that uses the datasheet's figure, the total over both directions; a GPU sends at half "
                               "of it": right / 2}
        return {**seconds, "that reads Gb/s as GB/s; a network's Gb/s are gigabits, 8 to a byte": right / 8}
