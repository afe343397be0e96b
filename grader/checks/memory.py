"""Checks of the memory and compute chapter (notebook 01_memory).

Oracles: `numel` of a real torch GPT built from the same random config (on the meta device, so
even large configs cost nothing), and the closed forms of `dtp.memory`."""
from __future__ import annotations

import numpy as np

from dtp import memory
from dtp.gpt import GPTConfig, build_on_meta, count_parameters

from ..compare import CheckFailed, expect_number
from ..registry import exercise


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


@exercise("memory.param_count", points=3, reads=("gpt_parameter_count",), timeout_s=30)
def check_param_count(student) -> str:
    count = student.gpt_parameter_count
    for config in _random_configs(np.random.default_rng()):
        expected = count_parameters(build_on_meta(config))
        answer = count(config)
        if not isinstance(answer, (int, np.integer)):
            raise CheckFailed(f"gpt_parameter_count should return an int, got {type(answer).__name__} for {config}")
        if answer != expected:
            raise CheckFailed(f"for {config} you counted {int(answer):,} parameters, the torch model has {expected:,} "
                              f"({int(answer) - expected:+,}): {_explain_count(int(answer) - expected, config)}")
    return "exact on 8 random configs (tied and untied, with and without biases), checked against torch's numel"


RECIPE_NAMES = tuple(memory.RECIPES)
UNIT_NAMES = ("B", "MB", "GB", "GiB", "TB", "TiB")
UNIT_TWINS = {"MB": "MiB", "GB": "GiB", "TB": "TiB", "GiB": "GB", "TiB": "TB"}  # the unit a slip gives instead
UNIT_POWERS = {"MB": "10^6", "GB": "10^9", "TB": "10^12", "MiB": "2^20", "GiB": "2^30", "TiB": "2^40"}


@exercise("memory.model_states", points=2, reads=("model_state_memory",), timeout_s=15)
def check_model_states(student) -> str:
    model_states = student.model_state_memory
    rng = np.random.default_rng()
    for recipe in RECIPE_NAMES:
        for unit in UNIT_NAMES:
            n_params = float(rng.integers(10**6, 10**12))
            expected = memory.model_state_memory(n_params, recipe, unit)
            answer = model_states(n_params, recipe, unit)
            what = f"model_state_memory({n_params:.4g}, {recipe!r}, {unit!r})"
            twin = UNIT_TWINS.get(unit)
            if twin and isinstance(answer, (int, float)) and \
                    np.isclose(answer, memory.model_state_memory(n_params, recipe, twin), rtol=1e-9):
                raise CheckFailed(f"{what} is in {twin}, not {unit}: 1 {unit} = {UNIT_POWERS[unit]} bytes, "
                                  f"1 {twin} = {UNIT_POWERS[twin]} bytes")
            expect_number(answer, expected, what, rel=1e-9)
    per_parameter = ", ".join(str(memory.bytes_per_parameter(recipe)) for recipe in RECIPE_NAMES)
    return f"right for all {len(RECIPE_NAMES)} recipes ({per_parameter} bytes per parameter) in bytes, GB, GiB, TB and TiB"


@exercise("memory.activations", points=2, reads=("activation_bytes_per_layer",), timeout_s=15)
def check_activations(student) -> str:
    per_layer = student.activation_bytes_per_layer
    rng = np.random.default_rng()
    for recompute in memory.RECOMPUTE:
        for sequence_parallel in (False, True):
            heads = int(rng.choice([8, 16, 32, 64]))
            args = (int(rng.choice([512, 1024, 2048, 4096])), int(rng.integers(1, 9)), heads * 128, heads)
            tp = int(rng.choice([2, 4, 8]))
            kwargs = dict(tensor_parallel=tp, sequence_parallel=sequence_parallel, recompute=recompute)
            what = f"activation_bytes_per_layer(s={args[0]}, b={args[1]}, h={args[2]}, a={args[3]}, t={tp}, sp={sequence_parallel}, recompute={recompute!r})"
            answer = per_layer(*args, **kwargs)
            s, b, h, a = args
            no_attention = memory.activation_bytes_per_layer(*args, **{**kwargs, "recompute": "selective"})
            if recompute == "none" and isinstance(answer, (int, float)) and np.isclose(answer, no_attention, rtol=1e-9):
                raise CheckFailed(f"{what} leaves out attention's 5as/(ht)·sbh bytes (softmax, its dropout mask and output)")
            if not sequence_parallel and recompute != "full" and isinstance(answer, (int, float)) and \
                    np.isclose(answer, memory.activation_bytes_per_layer(*args, **{**kwargs, "sequence_parallel": True}), rtol=1e-9):
                raise CheckFailed(f"{what}: without sequence parallelism the 10sbh of LayerNorm and dropout "
                                  "inputs are replicated on every tensor-parallel rank, not divided by t")
            expect_number(answer, memory.activation_bytes_per_layer(*args, **kwargs), what, rel=1e-9)
        # The unparallelised baseline too: sbh(34 + 5as/h).
    base = (2048, 1, 4096, 32)
    expect_number(per_layer(*base), memory.activation_bytes_per_layer(*base), "activation_bytes_per_layer(2048, 1, 4096, 32)")
    return "matches Korthikanti et al.'s table for no recompute, selective and full recompute, with and without sequence parallelism"


@exercise("memory.training_time", points=2, reads=("training_days", "mfu"), timeout_s=15)
def check_training_time(student) -> str:
    days, utilization = student.training_days, student.mfu
    rng = np.random.default_rng()
    for _ in range(5):
        n, tokens, gpus = float(rng.uniform(1e8, 1e12)), float(rng.uniform(1e9, 1e13)), int(rng.integers(1, 20000))
        peak, mfu = float(rng.uniform(1e14, 2e15)), float(rng.uniform(0.2, 0.6))
        expected = memory.training_time_s(n, tokens, gpus, peak, mfu) / 86400
        answer = days(n, tokens, gpus, peak, mfu)
        what = f"training_days(N={n:.3g}, tokens={tokens:.3g}, gpus={gpus}, peak={peak:.3g}, mfu={mfu:.2f})"
        if isinstance(answer, float) and np.isclose(answer * 3, expected, rtol=1e-6):
            raise CheckFailed(f"{what} is 1/3 of the answer: training costs 6N FLOPs per token (2N forward, 4N backward), not 2N")
        if isinstance(answer, float) and np.isclose(answer, expected * 86400, rtol=1e-6):
            raise CheckFailed(f"{what} is in seconds; return days")
        expect_number(answer, expected, what)
        tokens_per_s = float(rng.uniform(1e3, 1e7))
        expect_number(utilization(n, tokens_per_s, gpus, peak), memory.model_flops_utilization(n, tokens_per_s, gpus, peak),
                      f"mfu(N={n:.3g}, tokens_per_s={tokens_per_s:.3g}, gpus={gpus}, peak={peak:.3g})")
    return "training_days and mfu match 6N FLOPs per token on random inputs"


INTERVIEW_ANSWERS = ("interview_70b_model_states_tb", "interview_largest_model_on_80gib", "interview_gpt3_days")


@exercise("memory.interview", points=2, reads=INTERVIEW_ANSWERS, timeout_s=15)
def check_interview(student) -> str:
    expect_number(student.interview_70b_model_states_tb, memory.model_state_memory(70e9, "mixed_adam", "TB"),
                  "interview_70b_model_states_tb", rel=1e-3)
    largest = memory.largest_trainable_model(memory.GPU_80GB_BYTES, "mixed_adam")
    if isinstance(student.interview_largest_model_on_80gib, (int, float)) and \
            np.isclose(student.interview_largest_model_on_80gib, largest * 1e9 / 2**30, rtol=1e-3):
        raise CheckFailed("interview_largest_model_on_80gib took 80 GiB as 80·10⁹ bytes; 1 GiB = 2^30 bytes")
    expect_number(student.interview_largest_model_on_80gib, largest, "interview_largest_model_on_80gib (parameters)", rel=1e-3)
    expect_number(student.interview_gpt3_days, memory.training_time_s(175e9, 300e9, 1024, 312e12, 0.5) / 86400,
                  "interview_gpt3_days", rel=1e-2)
    return "all three interview answers are right"
