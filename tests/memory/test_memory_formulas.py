"""The memory chapter's formulas (dtp.memory.formulas) against real torch models and PyTorch's own counters."""
import numpy as np
import pytest
import torch

from dtp.memory import formulas as memory
from dtp.memory.activations import saved_activation_bytes
from dtp.common.gpt import GPT, GPT2_SMALL, GPT3_175B, Block, GPTConfig, build_on_meta, count_parameters
from dtp.common.measure import training_flops_counted


@pytest.mark.parametrize("seed", range(6))
def test_exact_parameter_count_matches_numel(seed):
    rng = np.random.default_rng(seed)
    heads = int(rng.choice([1, 2, 4]))
    config = GPTConfig(vocab_size=int(rng.integers(10, 500)), n_positions=int(rng.integers(4, 300)),
                       n_layers=int(rng.integers(1, 4)), hidden=heads * int(rng.integers(2, 16)), n_heads=heads,
                       mlp_ratio=int(rng.choice([1, 4])), tied_embeddings=bool(seed % 2), bias=bool(seed % 3))
    assert memory.gpt_parameter_count(config) == count_parameters(GPT(config))


@pytest.mark.parametrize("config", [GPT2_SMALL, GPT3_175B], ids=["gpt2-small", "gpt3-175b"])
def test_megatron_formula_is_exact_but_for_the_final_layernorm(config):
    exact = count_parameters(build_on_meta(config))
    formula = memory.megatron_parameter_formula(config.n_layers, config.hidden, config.vocab_size, config.n_positions)
    assert exact == memory.gpt_parameter_count(config)
    assert exact - formula == pytest.approx(2 * config.hidden, abs=1e-3 * exact * 1e-9 + 1)


def test_gpt2_small_has_its_famous_124m_parameters():
    assert count_parameters(build_on_meta(GPT2_SMALL)) == 124_439_808


def test_fp32_adam_keeps_16_bytes_per_parameter():
    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    n = sum(p.numel() for p in model.parameters())
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    tensors += [v for state in optimizer.state.values() for k, v in state.items() if k != "step"]
    assert sum(t.numel() * t.element_size() for t in tensors) == memory.model_state_memory(n, "fp32_adam")


@pytest.mark.parametrize("s, b, h, a", [(64, 2, 128, 4), (128, 1, 256, 8)])
def test_saved_activations_are_the_formula_plus_the_explained_extras(s, b, h, a):
    block = Block(GPTConfig(hidden=h, n_heads=a, dropout=0.1)).to(torch.bfloat16).train()
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    extras = (a * s * s * b + 2 * s * b * h) + s * s + 2 * 2 * s * b * 2  # bf16 dropout masks, causal mask, LN stats
    assert saved_activation_bytes(block, x) == memory.activation_bytes_per_layer(s, b, h, a) + extras
    assert saved_activation_bytes(block, x, recompute_fully=True) == memory.activation_bytes_per_layer(s, b, h, a, recompute="full")


def test_activation_variants_agree_when_nothing_is_parallel():
    args = (2048, 2, 4096, 32)
    baseline = 2048 * 2 * 4096 * (34 + 5 * 32 * 2048 / 4096)
    assert memory.activation_bytes_per_layer(*args) == baseline
    assert memory.activation_bytes_per_layer(*args, tensor_parallel=1, sequence_parallel=True) == baseline
    assert memory.activation_bytes(24, *args) == 24 * baseline
    with pytest.raises(ValueError):
        memory.activation_bytes_per_layer(*args, recompute="some")


@pytest.mark.parametrize("config, seq", [(GPT2_SMALL, 1024), (GPTConfig(n_layers=3, hidden=64, n_heads=4, mlp_ratio=2), 50)])
def test_training_flops_formula_matches_pytorchs_flop_counter(config, seq):
    assert training_flops_counted(build_on_meta(config), 2, seq) == memory.transformer_training_flops(config, 2, seq)


def _counted_flops(config, batch, seq, recompute_fully=False) -> int:
    from torch.utils.checkpoint import checkpoint
    from torch.utils.flop_counter import FlopCounterMode

    model = GPT(config)
    if recompute_fully:
        for block in model.blocks:
            block.forward = lambda x, forward=block.forward: checkpoint(forward, x, use_reentrant=False)
    with FlopCounterMode(display=False) as counter:
        model(torch.zeros(batch, seq, dtype=torch.long)).sum().backward()
    return counter.get_total_flops()


SMALL = GPTConfig(n_layers=2, hidden=64, n_heads=4, vocab_size=100, n_positions=32)


def _matrix_weights(config, blocks_only=False) -> int:
    """Weights that multiply something (the embeddings are look-ups; the tied output layer multiplies)."""
    blocks = config.n_layers * (4 + 2 * config.mlp_ratio) * config.hidden ** 2
    return blocks if blocks_only else blocks + config.vocab_size * config.hidden


def test_palm_model_flops_per_token_match_pytorchs_flop_counter():
    """PaLM's 6N + 12·L·h·s, with N the weights that multiply, is exactly what PyTorch counts."""
    batch, seq = 2, 32
    per_token = memory.model_flops_per_token(_matrix_weights(SMALL), SMALL.n_layers, SMALL.hidden, seq)
    assert _counted_flops(SMALL, batch, seq) == per_token * batch * seq


def test_full_recomputation_adds_one_forward_of_every_block():
    """HFU's hardware FLOPs: the recomputed forward adds 2N + 4·L·h·s per token for the blocks'
    N weights, which makes 8N + 16·L·h·s when the blocks hold the weights."""
    batch, seq = 2, 32
    extra = _counted_flops(SMALL, batch, seq, recompute_fully=True) - _counted_flops(SMALL, batch, seq)
    n = _matrix_weights(SMALL, blocks_only=True)
    args = (n, SMALL.n_layers, SMALL.hidden, seq)
    assert extra == (memory.hardware_flops_per_token(*args, "full") - memory.model_flops_per_token(*args)) * batch * seq
    assert memory.hardware_flops_per_token(*args, "full") == 8 * n + 16 * SMALL.n_layers * SMALL.hidden * seq


def test_training_time_mfu_and_hfu_are_consistent():
    n, layers, hidden, seq, tokens, gpus, peak, mfu = 7e9, 32, 4096, 4096, 1e12, 256, 9.89e14, 0.41
    seconds = memory.training_time_s(n, tokens, gpus, peak, mfu)
    assert memory.training_flops(n, tokens) == 6 * n * tokens
    measured = memory.model_flops_utilization(n, layers, hidden, seq, tokens / seconds, gpus, peak)
    assert measured == pytest.approx(mfu * (1 + 12 * layers * hidden * seq / (6 * n)))  # PaLM adds attention
    hfu = memory.hardware_flops_utilization(n, layers, hidden, seq, tokens / seconds, gpus, peak)
    assert hfu / measured == pytest.approx((8 * n + 16 * layers * hidden * seq) / (6 * n + 12 * layers * hidden * seq))


def test_the_10sbh_tensor_parallelism_leaves_whole_are_these_tensors():
    """Korthikanti et al. 2022, 4.2.1: LayerNorm inputs 4sbh + QKV and h->4h inputs 4sbh + two
    1-byte dropout masks 2sbh. Measured per module on a real block (bf16 masks on this CPU)."""
    from dtp.memory.activations import saved_activation_breakdown

    s, b, h, a = 64, 2, 128, 4
    block = Block(GPTConfig(hidden=h, n_heads=a, dropout=0.1)).to(torch.bfloat16).train()
    saved = saved_activation_breakdown(block, torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True))
    sbh, layer_norm_statistics = s * b * h, 2 * s * b * 2
    assert saved["norm1"] + saved["norm2"] == 4 * sbh + 2 * layer_norm_statistics
    assert saved["attention.qkv"] + saved["mlp.up"] == 4 * sbh
    assert saved["attention.output_dropout"] + saved["mlp.dropout"] == 2 * sbh * 2  # 2 bytes a mask element here
    assert sum(saved.values()) == saved_activation_bytes(block, torch.randn(b, s, h, dtype=torch.bfloat16))


def test_the_memory_breakdown_includes_the_fp32_logits():
    """Korthikanti et al. 2022, 4.3: the output layer's logits, 4·s·b·V/t bytes in fp32."""
    breakdown = memory.memory_breakdown(GPT2_SMALL, "mixed_adam", 8, tensor_parallel=2)
    assert breakdown["logits"] == 4 * GPT2_SMALL.n_positions * 8 * GPT2_SMALL.vocab_size / 2
    model = GPT(GPTConfig(n_layers=1, hidden=32, n_heads=2, vocab_size=300, n_positions=16))
    logits = model(torch.zeros(3, 16, dtype=torch.long)).float()
    assert logits.numel() * logits.element_size() == memory.logits_bytes(16, 3, 300)


def test_gpu_memory_per_product_is_what_nvidia_smi_reports():
    assert memory.A100_80GB_BYTES == 80 * 2**30  # the A100 80GB holds exactly 80 GiB
    assert memory.GPU_MEMORY_MIB["H100 80GB"] * 2**20 < 80 * 2**30 < memory.GPU_MEMORY_MIB["H200"] * 2**20


def test_adam_hides_a_sum_that_should_have_been_an_average():
    """Summing gradients over n ranks without dividing makes an SGD step n times too large, but
    Adam's step is nearly unchanged: the missing division goes unnoticed with Adam."""
    steps = {}
    for optimizer_class in (torch.optim.SGD, torch.optim.Adam):
        for scale in (1.0, 8.0):
            weight = torch.nn.Parameter(torch.ones(16))
            optimizer = optimizer_class([weight], lr=0.1)
            weight.grad = torch.linspace(-1, 1, 16) * scale
            optimizer.step()
            steps[optimizer_class.__name__, scale] = (weight.detach() - 1).norm().item()
    assert steps["SGD", 8.0] / steps["SGD", 1.0] == pytest.approx(8.0)
    assert steps["Adam", 8.0] / steps["Adam", 1.0] == pytest.approx(1.0, abs=1e-3)


# --- context parallelism in dtp.memory.calculator ---------------------------------------------------------

CP_MODEL = GPTConfig(vocab_size=128256, n_positions=131072, n_layers=126, hidden=16384, n_heads=128)


def _cp_layout(c, **changes):
    from dtp.memory.calculator import Layout

    return Layout(**{**dict(tensor_parallel=8, pipeline_parallel=1, data_parallel=4, zero_stage=1,
                            sequence_parallel=True, recompute="selective"), **changes, "context_parallel": c})


def test_context_parallelism_of_one_changes_nothing():
    from dtp.zero import formulas as zero
    from dtp.memory.calculator import Layout, memory_per_gpu

    assert Layout().context_parallel == 1
    t, d, s = 8, 4, CP_MODEL.n_positions
    breakdown = memory_per_gpu(CP_MODEL, "mixed_adam", _cp_layout(1))
    shard = memory.gpt_parameter_count(CP_MODEL) / t
    expected = {**zero.model_state_breakdown_per_gpu(shard, d, 1, "mixed_adam"),
                "activations": CP_MODEL.n_layers * s * CP_MODEL.hidden * 34 / t,  # sbh·34/t per layer, b = 1
                "logits": 4 * s * CP_MODEL.vocab_size / t}
    assert breakdown == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("recompute", memory.RECOMPUTE)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_context_parallelism_divides_activations_and_logits_by_c(recompute, sequence_parallel):
    """Every saved tensor is per token, and attention's s x s terms are kept for the rank's s/c
    queries only: the activations and the last stage's logits are 1/c of c = 1's, exactly."""
    from dtp.memory.calculator import memory_per_gpu

    for stage, pipeline in (("first", 1), ("first", 4), ("last", 4)):
        changes = dict(recompute=recompute, sequence_parallel=sequence_parallel, pipeline_parallel=pipeline)
        one = memory_per_gpu(CP_MODEL, "mixed_adam", _cp_layout(1, **changes), stage)
        for c in (2, 4, 16):
            split = memory_per_gpu(CP_MODEL, "mixed_adam", _cp_layout(c, **changes), stage)
            assert split["activations"] == pytest.approx(one["activations"] / c, rel=1e-12)
            assert split["logits"] == pytest.approx(one["logits"] / c, rel=1e-12)
    with pytest.raises(ValueError, match="context_parallel"):
        memory.activation_bytes_per_layer(4096, 1, 4096, 32, context_parallel=0)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_zero_shards_over_the_data_and_context_parallel_ranks(zero_stage):
    """CP ranks hold the same parameters and reduce gradients with the DP ranks (Megatron-Core's
    data-parallel group with context parallelism): model states on d x c ranks are those on d·c
    data-parallel ranks; without ZeRO they do not shrink with c at all."""
    from dtp.memory.calculator import memory_per_gpu

    states = ("weights", "gradients", "optimizer states")
    for d, c in ((4, 2), (2, 8), (1, 4)):
        with_cp = memory_per_gpu(CP_MODEL, "mixed_adam", _cp_layout(c, data_parallel=d, zero_stage=zero_stage))
        data_only = memory_per_gpu(CP_MODEL, "mixed_adam", _cp_layout(1, data_parallel=d * c, zero_stage=zero_stage))
        assert {k: with_cp[k] for k in states} == pytest.approx({k: data_only[k] for k in states}, rel=1e-12)
        if zero_stage == 0:
            alone = memory_per_gpu(CP_MODEL, "mixed_adam", _cp_layout(1, data_parallel=d, zero_stage=0))
            assert {k: with_cp[k] for k in states} == {k: alone[k] for k in states}


def test_the_calculator_and_the_cp_chapter_share_one_activation_formula():
    from dtp.cp import context_parallel as cp
    from dtp.memory.calculator import memory_per_gpu

    for c in (1, 2, 4, 16):
        shown = memory_per_gpu(CP_MODEL, "mixed_adam", _cp_layout(c))["activations"]
        assert shown == pytest.approx(cp.activation_bytes_per_rank(131072, 1, 16384, 128, 126, 8, c), rel=1e-12)


def test_context_parallel_activations_are_what_a_block_saves_on_its_share_of_tokens():
    """Full recomputation keeps each layer's input only: a real block run on s/c tokens saves
    2·(s/c)·b·h bytes, the formula's 2sbh/c."""
    s, b, h, a, c = 64, 2, 32, 4, 4
    block = Block(GPTConfig(hidden=h, n_heads=a)).to(torch.bfloat16).train()
    share = torch.randn(b, s // c, h, dtype=torch.bfloat16, requires_grad=True)
    assert saved_activation_bytes(block, share, recompute_fully=True) == \
        memory.activation_bytes_per_layer(s, b, h, a, recompute="full", context_parallel=c)
