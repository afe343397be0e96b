"""Interactive calculators for the notebooks (ipywidgets): move a slider, the bars redraw. The
book has the same calculator in JavaScript (book/_static/calculators/memory.js), for readers
without a kernel; both compute with dtp.memory.calculator."""
from __future__ import annotations

import ipywidgets as widgets

from dtp.common.gpt import GPTConfig
from dtp.common.widgets import show_only
from dtp.memory import formulas as memory
from dtp.memory.calculator import Layout, memory_per_gpu
from dtp.memory.plots import memory_breakdown_figure
from dtp.zero import formulas as zero


def memory_calculator() -> widgets.VBox:
    """Memory of one GPU while training a GPT: shape, recipe, micro-batch and layout (tensor,
    context, pipeline and data parallelism, ZeRO). The sequence slider moves in steps of 256, so
    every context-parallel size offered divides it."""
    controls = {
        "n_layers": widgets.IntSlider(value=32, min=1, max=128, description="layers L"),
        "hidden": widgets.IntSlider(value=4096, min=512, max=16384, step=512, description="hidden h"),
        "n_positions": widgets.IntSlider(value=2048, min=256, max=32768, step=256, description="sequence s"),
        "vocab_size": widgets.IntSlider(value=50257, min=1000, max=256000, step=1000, description="vocab V"),
        "micro_batch": widgets.IntSlider(value=1, min=1, max=32, description="micro-batch b"),
        "recipe": widgets.Dropdown(options=list(memory.RECIPES), value="mixed_adam", description="recipe"),
        "tensor_parallel": widgets.Dropdown(options=[1, 2, 4, 8], value=1, description="TP t"),
        "context_parallel": widgets.Dropdown(options=[1, 2, 4, 8, 16, 32], value=1, description="CP c"),
        "pipeline_parallel": widgets.Dropdown(options=[1, 2, 4, 8, 16], value=1, description="PP p"),
        "data_parallel": widgets.Dropdown(options=[1, 2, 4, 8, 16, 64, 256, 1024], value=1, description="DP Nd"),
        "zero_stage": widgets.Dropdown(options=[(zero.STAGE_NAMES[s], s) for s in zero.STAGES], value=0,
                                       description="ZeRO"),
        "sequence_parallel": widgets.Checkbox(value=False, description="sequence parallel"),
        "recompute": widgets.Dropdown(options=list(memory.RECOMPUTE), value="none", description="recompute"),
    }
    output = widgets.Output()

    def redraw(_change=None):
        values = {name: control.value for name, control in controls.items()}
        config = GPTConfig(vocab_size=values["vocab_size"], n_positions=values["n_positions"],
                           n_layers=values["n_layers"], hidden=values["hidden"], n_heads=max(values["hidden"] // 128, 1))
        layout = Layout(values["tensor_parallel"], values["pipeline_parallel"], values["data_parallel"],
                        values["zero_stage"], values["sequence_parallel"], values["recompute"], values["micro_batch"],
                        context_parallel=values["context_parallel"])
        label = f"{memory.gpt_parameter_count(config) / 1e9:.2f}B params, first stage"
        show_only(output, memory_breakdown_figure({label: memory_per_gpu(config, values["recipe"], layout)}))

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    names = list(controls.values())
    return widgets.VBox([widgets.HBox([widgets.VBox(names[:6]), widgets.VBox(names[6:])]), output])
