"""The ZeRO notebook's calculator (ipywidgets): move a slider, the bars of one GPU's model states
per ZeRO stage redraw. It computes with dtp.zero.formulas."""
from __future__ import annotations

import ipywidgets as widgets

from dtp.common.widgets import show_only
from dtp.memory import formulas as memory
from dtp.memory.plots import memory_breakdown_figure
from dtp.zero import formulas as zero


def zero_calculator():
    """Sliders for Ψ (billions), Nd and the recipe; bars of one GPU's model states per stage."""
    controls = {
        "billions": widgets.FloatLogSlider(value=70, base=10, min=-1, max=3, step=0.05, description="Ψ (billions)"),
        "n_gpus": widgets.IntSlider(value=64, min=1, max=1024, description="Nd GPUs"),
        "recipe": widgets.Dropdown(options=list(memory.RECIPES), value="mixed_adam", description="recipe"),
    }
    output = widgets.Output()

    def redraw(_change=None):
        psi, n, recipe = controls["billions"].value * 1e9, controls["n_gpus"].value, controls["recipe"].value
        bars = {zero.STAGE_NAMES[stage]: zero.model_state_breakdown_per_gpu(psi, n, stage, recipe)
                for stage in zero.STAGES}
        show_only(output, memory_breakdown_figure(bars))

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox(list(controls.values())), output])
