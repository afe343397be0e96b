"""The ZeRO chapter's interview questions: answers as functions of the question's numbers."""
from __future__ import annotations

from dtp.memory import formulas as memory
from dtp.zero import formulas as zero

from ...registry import exercise
from ..common import InterviewQuestions, clear_of_integers
from .memory import _stage_slips

ASKED_PARAMETERS = 70e9


@exercise("zero.interview", points=2)
class Interview(InterviewQuestions):
    """Verifies: five interview answers as functions of the question's numbers (GB per GPU with
    ZeRO-3 and ZeRO-2, the fewest GPUs that fit ZeRO-3 with room reserved, ZeRO-1's saving, the
    GB ZeRO-3 sends per step), on the questions the notebook asks (the source notes' 70B
    examples) and on random ones.
    Fakes: a number copied from the page answers the asked question only, not the drawn ones;
    dtp.zero.formulas's functions trip."""

    reads = ("interview_zero3_gb_per_gpu", "interview_fewest_gpus_zero3", "interview_zero1_saving",
             "interview_zero2_gb_per_gpu", "interview_zero3_gb_sent_per_gpu")
    references = ("dtp.zero.formulas.model_state_bytes_per_gpu", "dtp.zero.formulas.model_state_breakdown_per_gpu",
                  "dtp.zero.formulas.memory_saving_factor", "dtp.zero.formulas.fewest_gpus_to_fit",
                  "dtp.zero.formulas.communication_bytes_per_gpu", "dtp.zero.formulas.communication_elements_per_gpu")
    asked = {"interview_zero3_gb_per_gpu": (ASKED_PARAMETERS, 8),
             "interview_fewest_gpus_zero3": (ASKED_PARAMETERS, memory.GPU_MEMORY_MIB["H100 80GB"], 16),
             "interview_zero1_saving": (8,),
             "interview_zero2_gb_per_gpu": (ASKED_PARAMETERS, 1024),
             "interview_zero3_gb_sent_per_gpu": (ASKED_PARAMETERS, 64)}
    rel = 1e-9
    summary = "all five interview answers are right for the questions asked and for random numbers"

    def drawn(self, name, rng):
        n_params, n_gpus = float(rng.integers(1, 5000)) * 1e8, int(rng.integers(2, 4097))
        if name == "interview_fewest_gpus_zero3":
            while True:  # ZeRO-3's states over the room per GPU, clear of an integer (see clear_of_integers)
                gpu_mib = int(rng.integers(16, 200)) * 1024 - int(rng.integers(0, 1000))
                question = n_params, gpu_mib, int(rng.integers(0, gpu_mib // 2048))  # reserve under half the memory
                if all(clear_of_integers(zero.model_state_bytes_per_gpu(n_params, 1, 3) / room)
                       for room in _rooms(*question)):
                    return question
        if name == "interview_zero1_saving":
            return (int(rng.integers(2, 65)),)  # where the saving is still far from its limit of 4
        return n_params, n_gpus

    def expected(self, name, *args):
        if name == "interview_fewest_gpus_zero3":
            n_params, gpu_mib, reserved_gib = args
            return zero.fewest_gpus_to_fit(n_params, gpu_mib * 2**20, 3, reserved_bytes=reserved_gib * 2**30)
        if name == "interview_zero1_saving":
            return zero.memory_saving_factor(args[0], 1)
        n_params, n_gpus = args
        if name == "interview_zero3_gb_sent_per_gpu":
            return zero.communication_bytes_per_gpu(n_params, n_gpus, 3) / 1e9
        return zero.model_state_bytes_per_gpu(n_params, n_gpus, 3 if name == "interview_zero3_gb_per_gpu" else 2) / 1e9

    def slips(self, name, *args):
        if name == "interview_fewest_gpus_zero3":
            n_params, gpu_mib, reserved_gib = args
            return {"that takes MiB and GiB as 10⁶ and 10⁹ bytes; 1 MiB = 2²⁰ bytes, 1 GiB = 2³⁰":
                    zero.fewest_gpus_to_fit(n_params, gpu_mib * 1e6, 3, reserved_bytes=reserved_gib * 1e9),
                    "that leaves no room for activations": zero.fewest_gpus_to_fit(n_params, gpu_mib * 2**20, 3)}
        if name == "interview_zero1_saving":
            return {"4x is the limit as Nd grows, not the saving at this Nd": 4.0}
        n_params, n_gpus = args
        if name == "interview_zero3_gb_sent_per_gpu":
            return {"that is plain data parallelism's 2(n-1)/n·2Ψ; ZeRO-3 also gathers the weights again for "
                    "backward: 3(n-1)/n·2Ψ": zero.communication_bytes_per_gpu(n_params, n_gpus, 0) / 1e9,
                    "that counts 4 bytes per element; the weights and gradients sent are 16-bit":
                        zero.communication_bytes_per_gpu(n_params, n_gpus, 3, bytes_per_element=4) / 1e9}
        stage = 3 if name == "interview_zero3_gb_per_gpu" else 2
        right = zero.model_state_bytes_per_gpu(n_params, n_gpus, stage)
        return {"that is in GiB; GB = 10⁹ bytes": right / 2**30,
                **{feedback: value / 1e9 for feedback, value in _stage_slips(n_params, n_gpus, stage).items()}}


def _rooms(n_params, gpu_mib, reserved_gib) -> tuple[float, ...]:
    """Bytes per GPU for model states: as asked, as the slips read the units, without the reserve."""
    return gpu_mib * 2**20 - reserved_gib * 2**30, gpu_mib * 1e6 - reserved_gib * 1e9, gpu_mib * 2**20
