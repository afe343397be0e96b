"""The notebook's memory calculator redraws its bars when a control changes."""
import pytest

import dtp.memory.widgets


def test_memory_calculator_redraws_on_every_change(monkeypatch):
    drawn = []
    monkeypatch.setattr(dtp.memory.widgets, "memory_breakdown_figure", lambda breakdowns: drawn.append(breakdowns))
    calculator = dtp.memory.widgets.memory_calculator()
    assert len(drawn) == 1
    sliders = {child.description: child for box in calculator.children[0].children for child in box.children}
    before = next(iter(drawn[-1].values()))
    sliders["layers L"].value = 64
    sliders["TP t"].value = 8
    assert len(drawn) == 3
    after = next(iter(drawn[-1].values()))
    # twice the layers split 8 ways: a quarter of the weights per GPU (the embeddings shrink only 8-fold)
    assert after["weights"] < before["weights"] / 3
    assert after["activations"] < before["activations"]
    sliders["CP c"].value = 4  # the sequence split 4 ways: a quarter of the activations, the same weights
    split = next(iter(drawn[-1].values()))
    assert len(drawn) == 4
    assert split["activations"] == pytest.approx(after["activations"] / 4, rel=1e-12)
    assert split["weights"] == after["weights"]


def test_memory_bars_share_one_scale_and_the_legend_names_only_what_is_drawn():
    """Bars of different set-ups are drawn to one scale (a 157 GB bar looked as long as a 1133 GB
    one when each had its own axis), and the legend lists no part that no bar has."""
    from dtp.memory.plots import memory_breakdown_figure

    small = {"weights": 20e9, "gradients": 20e9, "optimizer states": 117e9}
    large = {"weights": 140e9, "gradients": 140e9, "optimizer states": 853e9}
    figure = memory_breakdown_figure({"ZeRO-3": small, "plain DP": large})
    axes = figure.axes
    assert len({axis.get_xlim() for axis in axes}) == 1
    widths = [sum(patch.get_width() for patch in axis.patches) for axis in axes]
    assert widths[1] / widths[0] == pytest.approx(1133 / 157, rel=1e-6)
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert len(legend) == 3 and not any("activation" in name or "logit" in name for name in legend), legend
