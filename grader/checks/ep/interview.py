"""Exercise 6: the chapter's numeric questions, answered as functions of the question's numbers."""
from __future__ import annotations

import math
from fractions import Fraction

from dtp.ep import moe

from ...registry import exercise
from ..references import refuses_library
from .shared import MOE
from ..common import InterviewQuestions

# Mixtral 8x7B as the question states it, in MoEConfig's order (vocab, h, L, heads, kv heads, f, E, k)
MIXTRAL = (32000, 4096, 32, 32, 8, 14336, 8, 2)


def _config(vocab_size, hidden, n_layers, n_heads, n_kv_heads, expert_hidden, n_experts, top_k=2) -> moe.MoEConfig:
    return moe.MoEConfig(vocab_size, hidden, n_layers, n_heads, n_kv_heads, expert_hidden, n_experts, top_k)


@exercise("ep.interview", points=2)
@refuses_library(MOE)
class Interview(InterviewQuestions):
    """Verifies: five functions of the question's numbers, on the numbers asked and on random
    ones: a capacity (fractional quotients included), a Mixtral-shaped model's total and active
    parameters in billions (dtp.ep.moe's counts, which tests check against a torch model's numel,
    for random widths, depths, heads, grouped key/value heads, experts and top-k), the GPUs of
    the source notes' layout with EP as a fourth factor, and the GPUs holding each expert shard
    with EP carved out of DP.
    Fakes: a number copied from the page fails the random questions; dtp.ep.moe's counts, model and
    capacity trip when called."""

    reads = ("interview_capacity", "interview_total_parameters_b", "interview_active_parameters_b",
             "interview_gpus_if_ep_multiplies", "interview_expert_copies")
    asked = {"interview_capacity": (4096, 64, 2, 1.25),
             "interview_total_parameters_b": MIXTRAL[:7],
             "interview_active_parameters_b": MIXTRAL,
             "interview_gpus_if_ep_multiplies": (8, 8, 8, 16),  # tp, ep, pp, dp
             "interview_expert_copies": (16, 8)}  # dp, ep
    summary = ("all five answers are right for the questions asked and for random ones: capacity, total and active "
               "parameters, GPUs with EP as a factor, GPUs per expert shard with EP inside DP")

    def drawn(self, name, rng):
        if name == "interview_capacity":  # a fractional part below one half: floor and round() are wrong there
            while True:
                args = (int(rng.integers(1, 10000)), int(rng.choice([3, 8, 12, 64, 128])), int(rng.integers(2, 5)),
                        float(rng.choice([0.75, 1.0, 1.25, 1.5, 2.0])))
                if 0 < Fraction(args[3]) * args[0] * args[2] / args[1] % 1 < Fraction(1, 2):
                    return args
        if name in ("interview_total_parameters_b", "interview_active_parameters_b"):
            heads = int(rng.choice([8, 16, 32, 64]))
            kv_heads = int(rng.choice([h for h in (1, 2, 4, 8) if h < heads]))  # grouped: fewer than the heads
            experts = int(rng.choice([4, 8, 16, 64]))
            config = (int(rng.integers(1000, 260000)), heads * int(rng.choice([64, 128])), int(rng.integers(2, 80)),
                      heads, kv_heads, 256 * int(rng.integers(4, 80)), experts, int(rng.integers(2, min(experts, 8) + 1)))
            return config if name == "interview_active_parameters_b" else config[:7]
        if name == "interview_gpus_if_ep_multiplies":
            return tuple(int(rng.choice([2, 4, 8, 16])) for _ in range(4))
        ep = int(rng.choice([2, 4, 8]))
        return ep * int(rng.choice([m for m in (3, 4, 5, 6, 8) if m != ep])), ep  # dp, ep; dp/ep is not ep

    def expected(self, name, *args):
        if name == "interview_capacity":
            return moe.expert_capacity(*args)
        if name == "interview_total_parameters_b":
            return moe.moe_parameter_counts(_config(*args))["total"] / 1e9
        if name == "interview_active_parameters_b":
            return moe.moe_parameter_counts(_config(*args))["active"] / 1e9
        if name == "interview_gpus_if_ep_multiplies":
            return math.prod(args)
        dp, ep = args
        return dp // ep

    def slips(self, name, *args):
        if name == "interview_capacity":
            tokens, experts, k, factor = args
            return {"k is missing: T tokens make T·k assignments": math.ceil(factor * tokens / experts),
                    "the capacity factor is missing: C = ceil(capacity_factor · T·k/E)": math.ceil(tokens * k / experts),
                    "that rounds down; a fractional slot rounds up (the ceiling)": math.floor(factor * tokens * k / experts)}
        if name == "interview_gpus_if_ep_multiplies":
            tp, ep, pp, dp = args
            return {"that leaves EP out (tp·pp·dp, the notes' count); as a fourth dimension it multiplies with the "
                    "others": tp * pp * dp}
        if name == "interview_expert_copies":
            dp, ep = args
            return {"that is every data-parallel rank: without EP all of them would hold every expert; with EP the "
                    "dp ranks form dp/ep groups, each sharing out the experts once": dp,
                    "that is the EP group size; each expert's shard lives once per EP group, and there are dp/ep "
                    "groups": ep}
        config = _config(*args)
        counts = moe.moe_parameter_counts(config)
        value = counts["total" if name == "interview_total_parameters_b" else "active"]
        h, layers, kv = config.hidden, config.n_layers, config.hidden // config.n_heads * config.n_kv_heads
        used = config.n_experts if name == "interview_total_parameters_b" else config.top_k
        slips = {"that is in parameters; answer in billions": value,
                 "each SwiGLU expert has three matrices (gate, up, down), not two":
                     (value - layers * used * h * config.expert_hidden) / 1e9,
                 "keys and values have n_kv_heads heads of hidden/n_heads each (grouped-query attention), not hidden":
                     (value + 2 * layers * h * (h - kv)) / 1e9,
                 "the input embedding and the output matrix are separate matrices: count both":
                     (value - config.vocab_size * h) / 1e9}
        if name == "interview_active_parameters_b":
            slips[f"a token uses top_k = {config.top_k} experts per block, not 1"] = \
                (value - layers * (config.top_k - 1) * counts["expert"]) / 1e9
            slips["that counts every expert; a token uses only top_k of them per block"] = \
                moe.moe_parameter_counts(config)["total"] / 1e9
        return slips
