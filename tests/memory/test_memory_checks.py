"""Every check of the memory chapter rejects plausible wrong answers, naming the mistake."""
import numpy as np
import pytest

from conftest import assert_verdict, grade
from grader.checks.memory import ActivationMemory

PARAM_COUNT = '''
def gpt_parameter_count(config):
    h, bias = config.hidden, {BIAS}
    width = config.mlp_ratio * h
    layer_norm = h + bias * h
    attention = (h * 3 * h + bias * 3 * h) + (h * h + bias * h)
    mlp = (h * width + bias * width) + (width * h + bias * h)
    block = 2 * layer_norm + attention + mlp
    embeddings = config.vocab_size * h + {POSITIONS}
    output = {OUTPUT}
    return {TOTAL}
'''
RIGHT_COUNT = dict(BIAS="int(config.bias)", POSITIONS="config.n_positions * h",
                   OUTPUT="0 if config.tied_embeddings else config.vocab_size * h",
                   TOTAL="embeddings + config.n_layers * block + layer_norm + output")


def count_variant(**changes):
    return PARAM_COUNT.format(**{**RIGHT_COUNT, **changes})


def test_param_count_template_passes(tmp_notebook):
    result = grade(tmp_notebook("memory", {"gpt_parameter_count": count_variant()}), "memory.param_count")
    assert result["memory.param_count"].status == "passed"


@pytest.mark.parametrize("changes, feedback", [
    (dict(POSITIONS="0"), "position embeddings"),
    (dict(OUTPUT="config.vocab_size * h"), "count the token embedding once"),
    (dict(OUTPUT="0"), "has its own vocab_size × hidden matrix"),
    (dict(BIAS="1"), "with bias=False no Linear or LayerNorm has a bias"),
    (dict(TOTAL="embeddings + config.n_layers * block + output"), "final LayerNorm"),
    (dict(TOTAL="float(embeddings + config.n_layers * block + layer_norm + output)"), "should return an int"),
    (dict(TOTAL="count_parameters(GPT(config))"), "uses the course's reference"),
], ids=["no-positions", "tied-counted-twice", "untied-head-missing", "biases-always", "no-final-norm", "float",
        "counts-the-torch-model"])
def test_param_count_rejects(tmp_notebook, changes, feedback):
    result = grade(tmp_notebook("memory", {"gpt_parameter_count": count_variant(**changes)}), "memory.param_count")
    assert result["memory.param_count"].status == "failed"
    assert feedback in result["memory.param_count"].feedback


MODEL_STATES = '''
def model_state_memory(n_params, recipe, unit):
    bytes_per_parameter = {BYTES}
    units = {UNITS}
    return n_params * bytes_per_parameter[recipe] / units[unit]
'''
RIGHT_BYTES = '{"fp32_adam": 16, "mixed_adam": 16, "mixed_adam_fp32_grad_accum": 20, "mixed_sgd_momentum": 12}'
RIGHT_UNITS = '{"B": 1, "MB": 1e6, "GB": 1e9, "TB": 1e12, "GiB": 2**30, "TiB": 2**40}'


@pytest.mark.parametrize("bytes_table, units, feedback", [
    (RIGHT_BYTES, '{"B": 1, "MB": 1e6, "GB": 1e9, "TB": 1e12, "GiB": 1e9, "TiB": 1e12}', "is in GB, not GiB"),
    (RIGHT_BYTES, '{"B": 1, "MB": 2**20, "GB": 2**30, "TB": 2**40, "GiB": 2**30, "TiB": 2**40}', "is in MiB, not MB"),
    ('{"fp32_adam": 16, "mixed_adam": 16, "mixed_adam_fp32_grad_accum": 16, "mixed_sgd_momentum": 16}', RIGHT_UNITS, "expected"),
    ('{"fp32_adam": 16, "mixed_adam": 16, "mixed_adam_fp32_grad_accum": 18, "mixed_sgd_momentum": 12}', RIGHT_UNITS, "mixed_adam_fp32_grad_accum"),
], ids=["gb-for-gib", "gib-for-gb", "always-16", "grad-accum-18"])
def test_model_states_reject(tmp_notebook, bytes_table, units, feedback):
    source = MODEL_STATES.format(BYTES=bytes_table, UNITS=units)
    result = grade(tmp_notebook("memory", {"model_state_memory": source}), "memory.model_states")["memory.model_states"]
    assert result.status == "failed" and feedback in result.feedback


def test_model_states_accepts_a_unit_table_filled_by_a_helper_called_at_top_level(tmp_notebook):
    """The grader keeps `fill_units(UNITS)`: it fills the table `model_state_memory` reads."""
    source = (f"BYTES = {RIGHT_BYTES}\nUNITS = {{}}\n\n"
              "def fill_units(table):\n"
              "    table['B'] = 1\n"
              "    for prefix, power in (('M', 6), ('G', 9), ('T', 12)):\n"
              "        table[prefix + 'B'] = 10 ** power\n"
              "    table.update(GiB=2 ** 30, TiB=2 ** 40)\n\n"
              "fill_units(UNITS)\n\n"
              "def model_state_memory(n_params, recipe, unit):\n"
              "    return n_params * BYTES[recipe] / UNITS[unit]\n")
    result = grade(tmp_notebook("memory", {"model_state_memory": source},
                                extra_cells=["model_state_memory(7e9, 'mixed_adam', 'GB')"]),
                   "memory.model_states")["memory.model_states"]
    assert result.status == "passed", result.feedback


ACTIVATIONS = '''
def activation_bytes_per_layer(seq, batch, hidden, heads, tensor_parallel=1, sequence_parallel=False, recompute="none"):
    s, b, h, a, t = seq, batch, hidden, heads, tensor_parallel
    if recompute == "full":
        return {FULL}
    unsplit = {UNSPLIT}
    attention = {ATTENTION}
    return s * b * h * (unsplit + attention)
'''
RIGHT_ACTIVATIONS = dict(FULL="2 * s * b * h", UNSPLIT="34 / t if sequence_parallel else 10 + 24 / t",
                         ATTENTION='0 if recompute == "selective" else 5 * a * s / (h * t)')


@pytest.mark.parametrize("changes, feedback", [
    (dict(ATTENTION="0"), "attention's 5as/(ht)·sbh bytes"),
    (dict(UNSPLIT="34 / t"), "not divided by t"),
    (dict(ATTENTION='0 if recompute == "selective" else 5 * a * s / (h * t) * (h / a / 128)'), "expected"),
    (dict(ATTENTION='0 if recompute == "selective" else 5 * a * s / h'), "expected"),
    (dict(FULL="2 * s * b * h / t"), "expected"),
], ids=["no-attention-term", "sequence-parallel-always", "assumes-head-size-128", "attention-not-split", "full-divided"])
def test_activations_reject(tmp_notebook, changes, feedback):
    source = ACTIVATIONS.format(**{**RIGHT_ACTIVATIONS, **changes})
    result = grade(tmp_notebook("memory", {"activation_bytes_per_layer": source}), "memory.activations")["memory.activations"]
    assert result.status == "failed" and feedback in result.feedback


TIME = '''
def training_days(n_params, n_tokens, n_gpus, peak_flops_per_gpu, mfu):
    return {DAYS}


def mfu(n_params, n_layers, hidden, seq, tokens_per_s, n_gpus, peak_flops_per_gpu):
    return ({MODEL_FLOPS}) * tokens_per_s / ({MFU_GPUS}peak_flops_per_gpu)


def hfu(n_params, n_layers, hidden, seq, tokens_per_s, n_gpus, peak_flops_per_gpu):
    return ({HARDWARE_FLOPS}) * tokens_per_s / (n_gpus * peak_flops_per_gpu)
'''
RIGHT_TIME = dict(DAYS="6 * n_params * n_tokens / (n_gpus * peak_flops_per_gpu * mfu) / 86400",
                  MODEL_FLOPS="6 * n_params + 12 * n_layers * hidden * seq", MFU_GPUS="n_gpus * ",
                  HARDWARE_FLOPS="8 * n_params + 16 * n_layers * hidden * seq")


@pytest.mark.parametrize("changes, feedback", [
    (dict(), None),
    (dict(DAYS="2 * n_params * n_tokens / (n_gpus * peak_flops_per_gpu * mfu) / 86400"), "not 2N"),
    (dict(DAYS="6 * n_params * n_tokens / (n_gpus * peak_flops_per_gpu * mfu)"), "in seconds"),
    (dict(DAYS="6 * n_params * n_tokens / (n_gpus * peak_flops_per_gpu) / 86400"), "expected"),
    (dict(MODEL_FLOPS="6 * n_params"), "PaLM's model FLOPs add attention"),
    (dict(MODEL_FLOPS="8 * n_params + 16 * n_layers * hidden * seq"), "recomputation does not change"),
    (dict(MFU_GPUS=""), "mfu("),
    (dict(HARDWARE_FLOPS="6 * n_params + 12 * n_layers * hidden * seq"), "runs every forward twice"),
    (dict(HARDWARE_FLOPS="8 * n_params + 12 * n_layers * hidden * seq"), "but not its attention"),
], ids=["right", "2N", "seconds", "no-mfu", "mfu-without-attention", "mfu-with-recompute", "mfu-one-gpu",
        "hfu-is-mfu", "hfu-without-attention-recompute"])
def test_training_time(tmp_notebook, changes, feedback):
    source = TIME.format(**{**RIGHT_TIME, **changes})
    result = grade(tmp_notebook("memory", {"training_days": source}), "memory.training_time")["memory.training_time"]
    assert_verdict(result, feedback)


INTERVIEW = """
def interview_model_states_tb(n_params):
    return {TB}


def interview_largest_model(gpu_memory_mib):
    return {LARGEST}


def interview_training_days(n_params, n_tokens, n_gpus, peak_flops_per_gpu, mfu):
    return {DAYS}
"""
INTERVIEW_RIGHT = dict(TB="n_params * 16 / 1e12", LARGEST="gpu_memory_mib * 2**20 / 16",
                       DAYS="6 * n_params * n_tokens / (n_gpus * peak_flops_per_gpu * mfu) / 86400")


def graded_interview(tmp_notebook, **changes):
    source = INTERVIEW.format(**{**INTERVIEW_RIGHT, **changes})
    return grade(tmp_notebook("memory", {"interview_model_states_tb": source}), "memory.interview")["memory.interview"]


@pytest.mark.parametrize("changes, feedback", [
    (dict(), None),
    (dict(LARGEST="int(gpu_memory_mib * 2**20 // 16)"), None),
    (dict(TB="n_params * 16 / 2**40"), "that is in TiB"),
    (dict(TB="n_params * 20 / 1e12"), "interview_model_states_tb("),
    (dict(LARGEST="gpu_memory_mib * 1e6 / 16"), "takes a MiB as 10⁶ bytes"),
    (dict(LARGEST="gpu_memory_mib * 2**20 / 16 / 1e9"), "in billions"),
    (dict(LARGEST="gpu_memory_mib * 2**20 / 20"), "interview_largest_model("),
    (dict(DAYS="2 * n_params * n_tokens / (n_gpus * peak_flops_per_gpu * mfu) / 86400"), "not 2N"),
    (dict(DAYS="6 * n_params * n_tokens / (n_gpus * peak_flops_per_gpu * mfu)"), "in seconds"),
], ids=["right", "right-as-int", "tib-for-tb", "20-bytes", "mib-as-10-6", "billions", "20-bytes-largest", "2N-days",
        "seconds"])
def test_interview(tmp_notebook, changes, feedback):
    result = graded_interview(tmp_notebook, **changes)
    assert_verdict(result, feedback)


@pytest.mark.parametrize("changes", [
    dict(TB="1.12"), dict(LARGEST="5368709120.0"), dict(DAYS="22.822975093482906"),
], ids=["tb", "largest", "days"])
def test_interview_refuses_the_asked_answer_copied_as_a_constant(tmp_notebook, changes):
    """A number copied from the page answers the question asked, never the drawn ones."""
    result = graded_interview(tmp_notebook, **changes)
    assert result.status == "failed", result


def test_interview_refuses_the_courses_functions(tmp_notebook):
    result = graded_interview(tmp_notebook, TB='__import__("dtp.memory.formulas").memory.formulas.model_state_memory(n_params, '
                                               '"mixed_adam", "TB")')
    assert result.status == "failed" and "uses the course's reference" in result.feedback, result


def test_every_activation_draw_can_tell_a_formula_that_assumes_head_size_128():
    """A slip that is right when h/a = 128 must meet, on every draw, a case that keeps attention's
    scores (no recomputation) with another head size."""
    for seed in range(500):
        cases = ActivationMemory().cases(np.random.default_rng(seed))
        kept = [args[2] // args[3] for args, kwargs in cases if kwargs.get("recompute", "none") == "none"]
        assert any(size != 128 for size in kept), (seed, kept)
