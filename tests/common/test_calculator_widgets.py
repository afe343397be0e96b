"""The notebooks' calculators show one figure, replaced (not appended to) on every redraw, and
they show it through the Output widget's state: nothing is captured, so a front end without a
browser has nothing to answer (see dtp.common.widgets; the first-run test checks the same in a
real kernel)."""
import pytest

from dtp.memory.widgets import memory_calculator
from dtp.pp.widgets import schedule_explorer
from dtp.zero.widgets import zero_calculator


def _controls(box):
    children = getattr(box, "children", ())
    return [box] if hasattr(box, "value") and not children else [c for child in children for c in _controls(child)]


@pytest.mark.parametrize("make, control, value", [
    (memory_calculator, "layers L", 64), (schedule_explorer, "micro-batches m", 16), (zero_calculator, "Nd GPUs", 8)],
    ids=["memory", "pp", "zero"])
def test_a_calculator_shows_one_figure_and_replaces_it(make, control, value):
    calculator = make()
    output = calculator.children[-1]
    first = output.outputs  # outside a kernel a figure's only format is its text (the PNG: test_first_run)
    assert len(first) == 1 and first[0]["data"]["text/plain"].startswith("<Figure size")
    assert output.msg_id == ""  # never set: the widget did not capture the cell's displays
    next(c for c in _controls(calculator) if getattr(c, "description", "") == control).value = value
    assert len(output.outputs) == 1 and output.outputs[0] is not first[0]
