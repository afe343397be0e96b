"""Which statements of a learner's notebook the grader runs: definitions and what they need,
never the experiments around them."""
import ast

import nbformat

from grader.notebook import extract_definitions
from grader.student import StudentCode


def definitions_of(*cells, graded=()):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    return extract_definitions(notebook, graded)


def kept_sources(*cells, graded=()):
    import ast
    return [ast.unparse(d.node) for d in definitions_of(*cells, graded=graded).statements]


def test_definitions_and_the_globals_they_read_are_kept():
    kept = kept_sources("import numpy as np", "chunks = 4\nprint(chunks)", "def f(x):\n    return np.ones(chunks) * x")
    assert kept == ["import numpy as np", "chunks = 4", "def f(x):\n    return np.ones(chunks) * x"]


def test_a_demo_assigning_a_name_that_is_only_a_local_elsewhere_is_not_run():
    kept = kept_sources("import numpy as np", "def train(x):\n    losses = [x]\n    return losses",
                        "losses = train(np.arange(3))", "plot(losses)")
    assert kept == ["import numpy as np", "def train(x):\n    losses = [x]\n    return losses"]


def test_statements_that_fill_or_change_a_needed_name_are_kept():
    kept = kept_sources("TABLE = {}", "for k in ('a', 'b'):\n    TABLE[k] = len(k)", "TABLE.update(c=3)",
                        "answer = 2.0", "answer *= 1000", "print(answer)", graded=("TABLE", "answer"))
    assert kept == ["TABLE = {}", "for k in ('a', 'b'):\n    TABLE[k] = len(k)", "TABLE.update(c=3)",
                    "answer = 2.0", "answer *= 1000"]
    student = StudentCode.from_definitions(definitions_of(*[
        "TABLE = {}", "for k in ('a', 'b'):\n    TABLE[k] = len(k)", "answer = 2.0", "answer *= 1000"], graded=("TABLE", "answer")))
    assert student.TABLE == {"a": 1, "b": 1} and student.answer == 2000.0


def test_class_bodies_read_globals_but_not_their_own_attributes():
    kept = kept_sources("scale = 3", "size = 9", "class C:\n    size = 2\n    def f(self):\n        return scale * self.size")
    assert kept == ["scale = 3", "class C:\n    size = 2\n\n    def f(self):\n        return scale * self.size"]


def test_definitions_inside_transparent_cell_magics_count_and_other_magics_are_harmless():
    kept = kept_sources("%%time\ndef f():\n    return 1", "%matplotlib inline\ndef g():\n    return 2", "!ls")
    assert kept == ["def f():\n    return 1", "def g():\n    return 2"]


def test_a_syntax_error_costs_only_its_cell():
    found = definitions_of("def f(:\n    pass", "def g():\n    return 2")
    assert list(found.syntax_errors) == [0] and "line 1" in found.syntax_errors[0]
    assert [d.names for d in found.statements] == [("g",)]


def test_graded_names_bound_by_assignment_or_inside_blocks_are_kept():
    kept = kept_sources("import functools", "try:\n    import numpy as np\nexcept ImportError:\n    np = None",
                        "if True:\n    def f(x):\n        return np.ones(x)\nelse:\n    def f(x):\n        return None",
                        "g = lambda x: 2 * x", "h = functools.partial(max, 0)", "%time answer = g(21)",
                        graded=("f", "g", "h", "answer"))
    assert len(kept) == 6


def test_experiments_on_imported_modules_and_loops_are_not_run():
    kept = kept_sources("import matplotlib.pyplot as plt", "def f():\n    return plt.figure()",
                        "plt.plot([1, 2])", "for N in (2, 4):\n    print(N)", "RESULTS = f()", graded=("f",))
    assert kept == ["import matplotlib.pyplot as plt", "def f():\n    return plt.figure()"]


def test_learner_code_runs_as_a_real_module_without_the_graders_future_imports():
    student = StudentCode.from_definitions(definitions_of(
        "from dataclasses import dataclass\nfrom typing import NamedTuple",
        "@dataclass\nclass Link:\n    alpha: float\n    beta: float",
        "class Pair(NamedTuple):\n    a: int\n    b: int",
        graded=("Link", "Pair")))
    import pickle
    assert student.Link(1.0, 2.0).beta == 2.0
    assert isinstance(student.Link.__annotations__["alpha"], type)  # not the string "float"
    assert pickle.loads(pickle.dumps(student.Pair(1, 2))) == (1, 2)


def test_a_top_level_call_of_a_helper_that_fills_its_argument_is_kept():
    cells = ("UNITS = {}",
             "def fill_units(table):\n    for name, power in (('MB', 6), ('GB', 9)):\n        table[name] = 10 ** power",
             "def add_binary(table):\n    table.update(GiB=2 ** 30)",
             "def fill_all(t):\n    fill_units(table=t)\n    add_binary(t)",
             "fill_all(UNITS)",
             "def in_units(n, unit):\n    return n / UNITS[unit]")
    assert "fill_all(UNITS)" in kept_sources(*cells, graded=("in_units",))
    student = StudentCode.from_definitions(definitions_of(*cells, graded=("in_units",)))
    assert student.in_units(2e9, "GB") == 2.0 and student.in_units(2**31, "GiB") == 2.0


def test_a_call_that_mutates_only_what_nothing_reads_is_still_left_out():
    kept = kept_sources("import matplotlib.pyplot as plt", "def draw(ax, xs):\n    ax.plot(xs)",
                        "fig, ax = plt.subplots()", "draw(ax, [1, 2])",
                        "RESULTS = {}", "def record(table, key):\n    table[key] = 1", "record(RESULTS, 'run')",
                        "def f(x):\n    return 2 * x", graded=("f",))
    assert kept == ["import matplotlib.pyplot as plt", "def draw(ax, xs):\n    ax.plot(xs)",
                    "def record(table, key):\n    table[key] = 1", "def f(x):\n    return 2 * x"]


def test_an_answer_of_another_exercise_is_not_run_for_this_one():
    """Each exercise's sandbox runs only what its own graded names reach: the topology notebook's
    interview answer runs the whole planner (through the learner's parallel_groups, on worlds of
    thousands of ranks), and once made the rank-layout exercise time out."""
    cells = ("def groups(n):\n    return [list(range(n))]",
             "def ratio(n):\n    if not hasattr(ratio, 'best'):\n        ratio.best = len(groups(n * 1000))\n    return n / ratio.best",
             "print(ratio(8))", "answer = ratio(4)")
    assert kept_sources(*cells, graded=("groups",)) == [cells[0], ast.unparse(ast.parse(cells[1]))]
    assert kept_sources(*cells, graded=("answer",))[-1] == "answer = ratio(4)"
    assert "print(ratio(8))" in kept_sources(*cells, graded=("ratio",))  # it fills ratio.best, which ratio reads
