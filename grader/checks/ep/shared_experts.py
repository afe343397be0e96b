"""Exercise 8: shared and fine-grained experts: parameters, active parameters and FLOPs per
token of one MoE feed-forward (DeepSeekMoE, DeepSeek-V3)."""
from __future__ import annotations

from dtp.ep import experts as moe_experts  # noqa: F401  imported before the sandbox is confined

from ...registry import exercise
from ..references import refuses_library
from .shared import MOE
from ..common import InterviewQuestions

FUNCTIONS = ("moe_total_parameters", "moe_active_parameters", "moe_flops_per_token")
PER_ROUTED = ("that counts the shared experts once per routed expert; they are separate experts, `shared` of them in "
              "the layer, each used by every token once: (routed + shared) experts in all, (k + shared) per token")
DEEPSEEK_V3_LAYER = (7168, 2048, 256, 1, 8)  # hidden, expert_hidden, routed, shared, k


@exercise("ep.shared_experts", points=2)
@refuses_library("dtp.ep.experts", MOE)
class SharedExperts(InterviewQuestions):
    """Verifies: the total parameters, the parameters one token uses, and the forward FLOPs per
    token of an MoE feed-forward of SwiGLU experts with shared and routed experts (router over the
    routed ones only), on DeepSeek-V3's layer and on random widths, expert counts, 1 to 3 shared
    experts and top-k (shared experts always nonzero in the random ones, so that counting them as
    routed, or leaving them out, fails). Shared experts counted once per routed expert are named.
    Fakes: dtp.ep.experts' counts trip; numbers copied from the page fail the random layers."""

    reads = FUNCTIONS
    asked = {name: DEEPSEEK_V3_LAYER for name in FUNCTIONS}
    rel = 1e-9
    summary = ("total and active parameters and FLOPs per token are right for DeepSeek-V3's layer and for random "
               "layers with 1 to 3 shared experts")

    def drawn(self, name, rng):
        routed = int(rng.choice([8, 16, 64, 160, 256]))
        return (128 * int(rng.integers(4, 64)), 128 * int(rng.integers(2, 32)), routed, int(rng.integers(1, 4)),
                int(rng.integers(1, min(routed, 9))))

    def expected(self, name, *args):
        if name == "moe_flops_per_token":
            return moe_experts.moe_ffn_flops_per_token(*args)
        return moe_experts.moe_ffn_parameters(*args)[name.split("_")[1]]

    def slips(self, name, hidden, expert_hidden, routed, shared, k):
        expert, router = 3 * hidden * expert_hidden, hidden * routed
        if name == "moe_total_parameters":
            return {"the router scores only the routed experts (a shared expert is used by every token, never "
                    "chosen): it is hidden × routed": (routed + shared) * expert + hidden * (routed + shared),
                    "the shared experts are missing: they hold parameters too": routed * expert + router,
                    "a SwiGLU expert has three h×f matrices (gate, up, down), not two":
                        (routed + shared) * 2 * hidden * expert_hidden + router,
                    "the router's h×E_routed parameters are missing": (routed + shared) * expert,
                    PER_ROUTED: routed * (1 + shared) * expert + router}
        active = (k + shared) * expert + router
        slips = {"a token uses every shared expert besides its k routed ones: (k + shared) experts": k * expert + router,
                 PER_ROUTED: k * (1 + shared) * expert + router,
                 "every token uses the router (it scores all routed experts)": (k + shared) * expert,
                 "a SwiGLU expert has three h×f matrices (gate, up, down), not two":
                     (k + shared) * 2 * hidden * expert_hidden + router}
        if name == "moe_active_parameters":
            slips["that counts every expert; a token uses k routed and the shared ones"] = \
                (routed + shared) * expert + router
            return slips
        return {"a multiply-add is 2 FLOPs: twice the active parameters": active,
                "that is forward and backward (6 per parameter); the question is the forward pass": 6 * active,
                "that counts every expert's FLOPs; a token runs only its k routed and the shared ones":
                    2 * ((routed + shared) * expert + router),
                **{feedback: 2 * value for feedback, value in slips.items()}}
