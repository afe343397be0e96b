"""Which statements of a learner's notebook the grader runs: definitions and what they need,
never the experiments around them."""
import nbformat

from grader.notebook import extract_definitions
from grader.student import StudentCode


def definitions_of(*cells, answers=()):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    return extract_definitions(notebook, answers)


def kept_sources(*cells, answers=()):
    import ast
    return [ast.unparse(d.node) for d in definitions_of(*cells, answers=answers).statements]


def test_definitions_and_the_globals_they_read_are_kept():
    kept = kept_sources("import numpy as np", "chunks = 4\nprint(chunks)", "def f(x):\n    return np.ones(chunks) * x")
    assert kept == ["import numpy as np", "chunks = 4", "def f(x):\n    return np.ones(chunks) * x"]


def test_a_demo_assigning_a_name_that_is_only_a_local_elsewhere_is_not_run():
    kept = kept_sources("import numpy as np", "def train(x):\n    losses = [x]\n    return losses",
                        "losses = train(np.arange(3))", "plot(losses)")
    assert kept == ["import numpy as np", "def train(x):\n    losses = [x]\n    return losses"]


def test_statements_that_fill_or_change_a_needed_name_are_kept():
    kept = kept_sources("TABLE = {}", "for k in ('a', 'b'):\n    TABLE[k] = len(k)", "TABLE.update(c=3)",
                        "answer = 2.0", "answer *= 1000", "print(answer)", answers=("answer",))
    assert kept == ["TABLE = {}", "for k in ('a', 'b'):\n    TABLE[k] = len(k)", "TABLE.update(c=3)",
                    "answer = 2.0", "answer *= 1000"]
    student = StudentCode.from_definitions(definitions_of(*[
        "TABLE = {}", "for k in ('a', 'b'):\n    TABLE[k] = len(k)", "answer = 2.0", "answer *= 1000"], answers=("answer",)))
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
