"""The notebook's memory calculator redraws its bars when a control changes."""
import dtp.widgets


def test_memory_calculator_redraws_on_every_change(monkeypatch):
    drawn = []
    monkeypatch.setattr(dtp.widgets, "memory_breakdown_figure", lambda breakdowns: drawn.append(breakdowns))
    calculator = dtp.widgets.memory_calculator()
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
