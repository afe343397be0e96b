"""What the notebooks' calculators share: how a redraw reaches the Output widget below the sliders."""
from __future__ import annotations


def show_only(output, figure) -> None:
    """Make `figure` the only thing `output` (an ipywidgets Output) shows, by setting the widget's
    state rather than capturing displays in it (`with output: display(...)`).

    Why: capturing asks the front end to route the cell's displays into the widget, and a front
    end without a browser (nbclient, under nbval, the CI's first-run test) answers that by sending
    comm messages to the kernel on the shell socket while it waits on the same socket for the
    cell's reply. That race (jupyter/nbclient#312) sometimes leaves the reply unread until the
    cell's time limit runs out: measured here, 3 of 20 capturing cells waited the whole limit on an
    idle machine. Setting the state sends nothing back, and a saved notebook still records the
    figure in its widget state."""
    output.outputs = ()
    if figure is not None:
        output.append_display_data(figure)
