"""Checks of the memory and compute chapter (notebook 01_memory).

Oracles, computed in the grader: `numel` of a real torch GPT built from the same random config
(on the meta device, so even large configs cost nothing), and the closed forms of `dtp.memory.formulas`,
which tests/memory/test_memory_formulas.py checks against measurements of real models."""
from __future__ import annotations

from dtp.common.gpt import GPTConfig, build_on_meta, count_parameters
from dtp.memory import formulas as memory

from ..compare import CheckFailed, expect_answer
from ..registry import Check, exercise
from .common import FormulaCheck, InterviewQuestions, describe_call


def _random_configs(rng, count: int = 8) -> list[GPTConfig]:
    configs = []
    for i in range(count):
        heads = int(rng.choice([1, 2, 4, 8]))
        configs.append(GPTConfig(
            vocab_size=int(rng.integers(50, 5000)), n_positions=int(rng.integers(16, 2048)),
            n_layers=int(rng.integers(1, 6)), hidden=heads * int(rng.integers(4, 24)), n_heads=heads,
            mlp_ratio=int(rng.choice([2, 4, 8])), tied_embeddings=bool(i % 2), bias=bool((i // 2) % 2)))
    return configs


def _explain_count(difference: int, config: GPTConfig) -> str:
    h, bias = config.hidden, int(config.bias)
    causes = {
        -config.n_positions * h: "did you forget the learned position embeddings (n_positions × hidden)?",
        config.vocab_size * h: "tied embeddings share one matrix: count the token embedding once",
        -config.vocab_size * h: "with untied embeddings the output layer has its own vocab_size × hidden matrix",
        -(h + bias * h): "did you forget the final LayerNorm after the last block?",
        -config.n_layers * 2 * (h + bias * h): "each block has two LayerNorms (h weights, plus h biases when bias=True)",
    }
    if bias:
        per_layer_bias = 3 * h + h + config.mlp_ratio * h + h + 2 * h
        causes[-config.n_layers * per_layer_bias - h] = "with bias=True every Linear and LayerNorm has a bias vector"
    else:
        causes[config.n_layers * (3 * h + h + config.mlp_ratio * h + h + 2 * h) + h] = \
            "with bias=False no Linear or LayerNorm has a bias"
    return causes.get(difference, "compare your count layer by layer with the model's modules")


@exercise("memory.param_count", points=3)
class ParameterCount(Check):
    """Verifies: the exact count on 8 random configs (tied and untied, with and without biases)
    against `numel` of the real torch model. Fakes: building the model and counting its
    parameters inside the answer trips (dtp.common.gpt's counter and the course's formula are guarded)."""

    reads = ("gpt_parameter_count",)
    references = ("dtp.memory.formulas.gpt_parameter_count", "dtp.common.gpt.count_parameters")
    timeout_s = 30

    def prepare(self, rng):
        return _random_configs(rng)

    def collect(self, student, configs):
        return [student.gpt_parameter_count(config) for config in configs]

    def judge(self, configs, answers) -> str:
        for config, answer in zip(configs, answers):
            expected = count_parameters(build_on_meta(config))
            if not isinstance(answer, int) or isinstance(answer, bool):
                raise CheckFailed(f"gpt_parameter_count should return an int, got {type(answer).__name__} for {config}")
            if answer != expected:
                raise CheckFailed(f"for {config} you counted {answer:,} parameters, the torch model has {expected:,} "
                                  f"({answer - expected:+,}): {_explain_count(answer - expected, config)}")
        return "exact on 8 random configs (tied and untied, with and without biases), checked against torch's numel"


RECIPE_NAMES = tuple(memory.RECIPES)
UNIT_NAMES = ("B", "MB", "GB", "GiB", "TB", "TiB")
UNIT_TWINS = {"MB": "MiB", "GB": "GiB", "TB": "TiB", "GiB": "GB", "TiB": "TB"}  # the unit a slip gives instead
UNIT_POWERS = {"MB": "10^6", "GB": "10^9", "TB": "10^12", "MiB": "2^20", "GiB": "2^30", "TiB": "2^40"}


@exercise("memory.model_states", points=2)
class ModelStates(FormulaCheck):
    """Verifies: bytes of weights, gradients and optimizer state for every recipe in every unit,
    on random parameter counts. Fakes: dtp.memory.formulas's function trips."""

    function = "model_state_memory"
    references = ("dtp.memory.formulas.model_state_memory", "dtp.memory.formulas.bytes_per_parameter")
    summary = (f"right for all {len(RECIPE_NAMES)} recipes "
               f"({', '.join(str(memory.bytes_per_parameter(r)) for r in RECIPE_NAMES)} bytes per parameter) "
               "in bytes, MB, GB, GiB, TB and TiB")

    def cases(self, rng):
        return [((float(rng.integers(10**6, 10**12)), recipe, unit), {})
                for recipe in RECIPE_NAMES for unit in UNIT_NAMES]

    def expected(self, n_params, recipe, unit):
        return memory.model_state_memory(n_params, recipe, unit)

    def slips(self, n_params, recipe, unit):
        twin = UNIT_TWINS.get(unit)
        if not twin:
            return {}
        return {f"that is in {twin}, not {unit}: 1 {unit} = {UNIT_POWERS[unit]} bytes, 1 {twin} = {UNIT_POWERS[twin]} bytes":
                memory.model_state_memory(n_params, recipe, twin)}


@exercise("memory.activations", points=2)
class ActivationMemory(FormulaCheck):
    """Verifies: Korthikanti et al.'s per-layer activation bytes for no, selective and full
    recomputation, with and without sequence parallelism, on random shapes whose head size
    varies (64 to 256), plus the unparallelised baseline. Fakes: dtp.memory.formulas's function trips."""

    function = "activation_bytes_per_layer"
    references = ("dtp.memory.formulas.activation_bytes_per_layer", "dtp.memory.formulas.activation_bytes")
    summary = ("matches Korthikanti et al.'s table for no, selective and full recomputation, with and without "
               "sequence parallelism, on random shapes with head sizes from 64 to 256")

    def cases(self, rng):
        cases = []
        # head sizes without repeats (drawn independently, both cases that keep attention's
        # scores drew 128 one time in 25, and a formula assuming h/a = 128 passed)
        head_sizes = iter(int(size) for size in rng.permutation([64, 80, 96, 128, 256, 112]))
        for recompute in memory.RECOMPUTE:
            for sequence_parallel in (False, True):
                heads = int(rng.choice([8, 12, 16, 32, 64]))
                head_size = next(head_sizes)
                args = (int(rng.choice([512, 1024, 2048, 4096])), int(rng.integers(1, 9)), heads * head_size, heads)
                kwargs = dict(tensor_parallel=int(rng.choice([2, 4, 8])), sequence_parallel=sequence_parallel,
                              recompute=recompute)
                cases.append((args, kwargs))
        heads = int(rng.choice([16, 32, 40]))
        cases.append(((2048, int(rng.integers(1, 5)), heads * int(rng.choice([64, 128])), heads), {}))
        return cases

    def expected(self, *args, **kwargs):
        return memory.activation_bytes_per_layer(*args, **kwargs)

    def slips(self, *args, **kwargs):
        slips = {}
        if kwargs.get("recompute", "none") == "none":
            slips["attention's 5as/(ht)·sbh bytes (softmax, its dropout mask and output) are missing"] = \
                memory.activation_bytes_per_layer(*args, **{**kwargs, "recompute": "selective"})
        if not kwargs.get("sequence_parallel") and kwargs.get("recompute", "none") != "full" and kwargs:
            slips["without sequence parallelism the 10sbh of LayerNorm inputs, QKV and MLP inputs and dropout masks "
                  "are replicated on every tensor-parallel rank, not divided by t"] = \
                memory.activation_bytes_per_layer(*args, **{**kwargs, "sequence_parallel": True})
        return slips


def _flops_cases(rng, count: int = 4):
    cases = []
    for _ in range(count):
        layers = int(rng.integers(4, 128))
        hidden = int(rng.choice([64, 128])) * int(rng.integers(8, 128))
        cases.append(dict(n_params=float(12 * layers * hidden**2 * rng.uniform(1.0, 1.3)), n_layers=layers,
                          hidden=hidden, seq=int(rng.choice([1024, 2048, 4096, 8192])),
                          tokens_per_s=float(rng.uniform(1e3, 1e7)), n_gpus=int(rng.integers(1, 20000)),
                          peak_flops_per_gpu=float(rng.uniform(1e14, 2e15))))
    return cases


@exercise("memory.training_time", points=2)
class TrainingTime(Check):
    """Verifies: training_days with 6N per token, MFU with PaLM's model FLOPs (6N + 12·L·h·s per
    token), and HFU with full recomputation (8N + 16·L·h·s), on random inputs.
    Fakes: dtp.memory.formulas's functions trip."""

    reads = ("training_days", "mfu", "hfu")
    references = ("dtp.memory.formulas.training_time_s", "dtp.memory.formulas.model_flops_utilization",
                  "dtp.memory.formulas.hardware_flops_utilization", "dtp.memory.formulas.model_flops_per_token",
                  "dtp.memory.formulas.hardware_flops_per_token", "dtp.memory.formulas.training_flops")
    timeout_s = 15

    def prepare(self, rng):
        days = [(float(rng.uniform(1e8, 1e12)), float(rng.uniform(1e9, 1e13)), int(rng.integers(1, 20000)),
                 float(rng.uniform(1e14, 2e15)), float(rng.uniform(0.2, 0.6))) for _ in range(5)]
        return {"days": days, "utilization": _flops_cases(rng)}

    def collect(self, student, inputs):
        return {"days": [student.training_days(*args) for args in inputs["days"]],
                "mfu": [student.mfu(**case) for case in inputs["utilization"]],
                "hfu": [student.hfu(**case) for case in inputs["utilization"]]}

    def judge(self, inputs, answers) -> str:
        for args, answer in zip(inputs["days"], answers["days"]):
            expected = memory.training_time_s(*args) / 86400
            expect_answer(answer, expected, describe_call("training_days", args, {}), rel=1e-6, slips={
                "training costs 6N FLOPs per token (2N forward, 4N backward), not 2N": expected / 3,
                "that is in seconds; return days": expected * 86400})
        for case, mfu, hfu in zip(inputs["utilization"], answers["mfu"], answers["hfu"]):
            n, L, h, s = case["n_params"], case["n_layers"], case["hidden"], case["seq"]
            rate = case["tokens_per_s"] / (case["n_gpus"] * case["peak_flops_per_gpu"])
            expected_mfu = memory.model_flops_per_token(n, L, h, s) * rate
            expect_answer(mfu, expected_mfu, describe_call("mfu", (), case), rel=1e-6, slips={
                "that counts 6N per token only; PaLM's model FLOPs add attention's 12·L·h·s": 6 * n * rate,
                "that counts the recomputed forward: MFU uses model FLOPs, which recomputation does not change":
                    memory.hardware_flops_per_token(n, L, h, s, "full") * rate})
            expect_answer(hfu, memory.hardware_flops_per_token(n, L, h, s, "full") * rate,
                          describe_call("hfu", (), case), rel=1e-6, slips={
                              "that is the MFU: with full recomputation the hardware runs every forward twice, "
                              "8N + 16·L·h·s per token": expected_mfu,
                              "that adds 2N for the recomputed forward but not its attention, 4·L·h·s":
                                  (8 * n + 12 * L * h * s) * rate})
        return "training_days (6N per token), mfu (6N + 12·L·h·s) and hfu (8N + 16·L·h·s) match on random inputs"


@exercise("memory.interview", points=2)
class Interview(InterviewQuestions):
    """Verifies: three interview answers as functions of the question's numbers (TB of mixed-Adam
    model states, the largest model whose states fit a GPU of so many MiB, the days a training
    run takes with 6N FLOPs per token), on the questions the notebook asks (70B parameters, the
    A100 80GB's 81920 MiB, GPT-3's 175B parameters on 300B tokens) and on random ones.
    Fakes: a number copied from the page answers the asked question only, not the drawn ones;
    dtp.memory.formulas's functions trip."""

    reads = ("interview_model_states_tb", "interview_largest_model", "interview_training_days")
    references = ("dtp.memory.formulas.model_state_memory", "dtp.memory.formulas.bytes_per_parameter",
                  "dtp.memory.formulas.largest_trainable_model", "dtp.memory.formulas.training_time_s", "dtp.memory.formulas.training_flops")
    asked = {"interview_model_states_tb": (70e9,),
             "interview_largest_model": (memory.GPU_MEMORY_MIB["A100 80GB"],),
             "interview_training_days": (175e9, 300e9, 1024, 312e12, 0.5)}
    rel = 1e-9
    summary = "all three interview answers are right for the questions asked and for random numbers"

    def drawn(self, name, rng):
        if name == "interview_model_states_tb":
            return (float(rng.integers(1, 5000)) * 1e8,)
        if name == "interview_largest_model":
            return (int(rng.integers(8, 200)) * 1024 - int(rng.integers(0, 1000)),)
        return (float(rng.integers(1, 5000)) * 1e8, float(rng.integers(1, 200)) * 1e10, int(rng.integers(8, 16385)),
                float(rng.integers(50, 2000)) * 1e12, float(rng.integers(20, 65)) / 100)

    def expected(self, name, *args):
        if name == "interview_model_states_tb":
            return memory.model_state_memory(args[0], "mixed_adam", "TB")
        if name == "interview_largest_model":
            return memory.largest_trainable_model(args[0] * 2**20, "mixed_adam")
        return memory.training_time_s(*args) / 86400

    def slips(self, name, *args):
        if name == "interview_model_states_tb":
            return {"that is in TiB; 1 TB = 10¹² bytes": memory.model_state_memory(args[0], "mixed_adam", "TiB")}
        if name == "interview_largest_model":
            right = self.expected(name, *args)
            return {"that takes a MiB as 10⁶ bytes; nvidia-smi's MiB are 2²⁰ bytes":
                        memory.largest_trainable_model(args[0] * 1e6, "mixed_adam"),
                    "that is in billions; give the number of parameters": right / 1e9}
        days = memory.training_time_s(*args) / 86400
        return {"training costs 6N FLOPs per token (2N forward, 4N backward), not 2N": days / 3,
                "that is in seconds; answer in days": days * 86400}
