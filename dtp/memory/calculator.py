"""One GPU's memory when a GPT is trained with a given layout: tensor, context, pipeline and data
parallelism, a ZeRO stage, sequence parallelism and recomputation. Built from the memory and
ZeRO chapters' closed forms; the notebook's calculator, the book's static calculator
(book/_static/calculators/memory.js, which tests/book/test_browser.py compares with this module) and
the topology chapter's planner all use it."""
from __future__ import annotations

import math
from dataclasses import dataclass

from dtp.common.gpt import GPTConfig
from dtp.memory import formulas as memory
from dtp.zero import formulas as zero


@dataclass(frozen=True)
class Layout:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    recompute: str = "none"
    micro_batch: int = 1  # sequences per micro-batch
    context_parallel: int = 1  # c: each sequence split over c ranks (last, so positional uses stay valid)


def memory_per_gpu(config: GPTConfig, recipe: str, layout: Layout, stage: str = "first") -> dict[str, float]:
    """Bytes by component on one GPU of the `stage` ("first" or "last") pipeline stage.

    - Model states: the parameters split evenly over the t·p tensor- and pipeline-parallel ranks
      (embeddings included), then each component divided by Nd·c where the ZeRO stage shards it.
      The c context-parallel ranks of a sequence hold the same parameters, and their gradients
      are reduced over the Nd·c ranks that hold the same shard, so ZeRO shards over all Nd·c
      (as Megatron-Core does: its gradient buffers and distributed optimizer use the
      data-parallel group with context parallelism).
    - Activations: the stage's ceil(L/p) layers, for the micro-batches it holds at once under
      1F1B: p on the first stage (Narayanan et al. 2021), one on the last; each layer's bytes
      divided by c (`dtp.memory.formulas.activation_bytes_per_layer`).
    - Logits: kept in fp32 for the loss on the last stage only, 4·s·b·V/(t·c) bytes.
    """
    if stage not in ("first", "last"):
        raise ValueError(f"stage must be 'first' or 'last', got {stage!r}")
    t, p, c = layout.tensor_parallel, layout.pipeline_parallel, layout.context_parallel
    shard = memory.gpt_parameter_count(config) / (t * p)
    activations = memory.activation_bytes_per_layer(
        config.n_positions, layout.micro_batch, config.hidden, config.n_heads, tensor_parallel=t,
        sequence_parallel=layout.sequence_parallel, recompute=layout.recompute, context_parallel=c)
    breakdown = zero.model_state_breakdown_per_gpu(shard, layout.data_parallel * c, layout.zero_stage, recipe)
    layers = math.ceil(config.n_layers / p)
    in_flight = p if stage == "first" else 1
    breakdown["activations"] = layers * in_flight * activations
    is_last = stage == "last" or p == 1
    breakdown["logits"] = memory.logits_bytes(config.n_positions, layout.micro_batch, config.vocab_size, t, c) \
        if is_last else 0.0
    return breakdown


def peak_memory_per_gpu(config: GPTConfig, recipe: str, layout: Layout) -> tuple[str, dict[str, float]]:
    """The pipeline stage ("first" or "last") whose GPUs need the most memory, and its breakdown."""
    stages = {stage: memory_per_gpu(config, recipe, layout, stage) for stage in ("first", "last")}
    worst = max(stages, key=lambda stage: sum(stages[stage].values()))
    return worst, stages[worst]


def _preset_name(shape: str, sizes: dict) -> str:
    """A preset named by the parameter count the calculator computes for it (this library's GPT
    layout: a 4h MLP, biases, tied embeddings), so that its label never promises another size."""
    count = memory.gpt_parameter_count(GPTConfig(vocab_size=sizes["vocab"], n_positions=sizes["seq"],
                                                 n_layers=sizes["layers"], hidden=sizes["hidden"], n_heads=sizes["heads"]))
    size = f"{count / 1e6:.0f}M" if count < 1e9 else f"{count / 1e9:.3g}B"
    return f"{shape} ({size} parameters)"


_SHAPES = {
    "GPT-2 small": dict(layers=12, hidden=768, heads=12, seq=1024, vocab=50257),
    "GPT-3 175B": dict(layers=96, hidden=12288, heads=96, seq=2048, vocab=50257),
    # Llama's 70B shape with a GPT MLP of 4h (no SwiGLU, no grouped-query attention) is a 65B model.
    "80 layers, h = 8192, 4h MLP": dict(layers=80, hidden=8192, heads=64, seq=4096, vocab=32000),
}
PRESETS = {_preset_name(shape, sizes): sizes for shape, sizes in _SHAPES.items()}
DEFAULT_PRESET = _preset_name("GPT-3 175B", _SHAPES["GPT-3 175B"])


def static_calculator_html(static_path: str = "../_static") -> str:
    """The book's calculator: a form, the constants it needs from this library (recipes, GPUs,
    what each ZeRO stage shards) and the script that computes in the reader's browser."""
    import json

    constants = {
        "recipes": {name: zero.bytes_per_parameter_by_component(name) for name in memory.RECIPES},
        "components": list(zero.COMPONENTS),
        "zeroSharded": {str(stage): list(components) for stage, components in zero.SHARDED.items()},
        "gpus": memory.GPU_MEMORY_MIB,
        "presets": PRESETS,
    }

    def number(name, label, value, minimum=1, maximum=None, step=1):
        top = f' max="{maximum}"' if maximum else ""
        return (f'<label>{label} <input type="number" name="{name}" value="{value}" min="{minimum}"{top} '
                f'step="{step}"></label>')

    def select(name, label, options, chosen):
        items = "".join(f'<option value="{value}"{" selected" if value == chosen else ""}>{text}</option>'
                        for value, text in options)
        return f'<label>{label} <select name="{name}">{items}</select></label>'

    default = PRESETS[DEFAULT_PRESET]
    rows = "".join(f'<tr><th scope="row">{component}</th><td data-stage="first" data-component="{component}"></td>'
                   f'<td data-stage="last" data-component="{component}"></td></tr>'
                   for component in (*zero.COMPONENTS, "activations", "logits"))
    legend = " ".join(f'<span><i class="calculator-bar-{"-".join(component.split())}"></i>{component}</span>'
                      for component in (*zero.COMPONENTS, "activations", "logits"))
    return f"""
<div class="course-memory-calculator">
<script>window.COURSE_MEMORY_CONSTANTS = {json.dumps(constants)};</script>
<form onsubmit="return false">
<fieldset><legend>model</legend>
{select("preset", "preset", [("", "(choose)"), *((name, name) for name in PRESETS)], "")}
{number("layers", "layers L", default["layers"])} {number("hidden", "hidden h", default["hidden"], 64, step=64)}
{number("heads", "heads a", default["heads"])} {number("seq", "sequence s", default["seq"], 16, step=16)}
{number("vocab", "vocabulary V", default["vocab"], 2)}
{select("recipe", "recipe", [(name, f"{name} ({memory.bytes_per_parameter(name)} B/param)") for name in memory.RECIPES],
        "mixed_adam")}
</fieldset>
<fieldset><legend>layout</legend>
{number("micro_batch", "micro-batch b", 1)} {number("tp", "tensor parallel t", 8)}
{number("cp", "context parallel c", 1)} {number("pp", "pipeline parallel p", 8)} {number("dp", "data parallel N<sub>d</sub>", 16)}
{select("zero", "ZeRO stage", [(str(stage), zero.STAGE_NAMES[stage]) for stage in zero.STAGES], "1")}
<label><input type="checkbox" name="sp" checked> sequence parallel</label>
{select("recompute", "recomputation", [(mode, mode) for mode in memory.RECOMPUTE], "selective")}
{select("gpu", "GPU", [(name, f"{name} ({mib:,} MiB)") for name, mib in memory.GPU_MEMORY_MIB.items()], "A100 80GB")}
</fieldset>
</form>
<p>Parameters: <strong data-output="parameters"></strong>. <span class="calculator-problems"></span></p>
<table class="calculator-table"><thead><tr><th>GB per GPU (10<sup>9</sup> bytes)</th><th>first pipeline stage</th>
<th>last pipeline stage</th></tr></thead><tbody>{rows}
<tr><th scope="row">total</th><td data-stage="first" data-component="total"></td>
<td data-stage="last" data-component="total"></td></tr>
<tr><th scope="row">on the chosen GPU</th><td data-stage="first" data-output="fits"></td>
<td data-stage="last" data-output="fits"></td></tr></tbody></table>
<div class="calculator-bars"><div>first stage</div><div class="calculator-bar" data-stage="first" data-output="bar"></div>
<div>last stage</div><div class="calculator-bar" data-stage="last" data-output="bar"></div></div>
<p class="calculator-legend">{legend} <span><i class="calculator-capacity-key"></i>the GPU's memory</span></p>
<script src="{static_path}/calculators/memory.js"></script>
</div>
"""
