"""`python -m dtp.topology.plan`: a preset or a shape, a cluster, a table or JSON; bad input and a
model that fits nowhere end in one line on stderr and exit status 2, never a traceback."""
import io
import json
import subprocess
import sys

import pytest

from dtp.topology import plan


def run(*arguments):
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        status = plan.run(list(arguments), stdout=stdout, stderr=stderr)
    except plan.PlanError as error:
        return 2, stdout.getvalue(), str(error)
    return status, stdout.getvalue(), stderr.getvalue()


@pytest.mark.parametrize("arguments, says", [
    (("--model", "gpt5", "--gpus", "64"), "unknown model preset 'gpt5'"),
    (("--model", "llama3-8b", "--gpus", "0"), "--gpus must be a positive number, got 0"),
    (("--model", "llama3-8b", "--gpus", "-8"), "--gpus must be a positive number, got -8"),
    (("--model", "llama3-8b", "--gpus", "12"), "12 GPUs do not make whole nodes of 8"),
    (("--model", "llama3-8b", "--gpus", "64", "--gpu", "tpu"), "unknown GPU 'tpu'"),
    (("--model", "llama3-8b", "--gpus", "64", "--framework", "jax"), "unknown framework 'jax'"),
    (("--layers", "32", "--gpus", "64"), "--hidden, --heads, --vocab, --seq missing"),
    (("--model", "llama3-8b"), "the following arguments are required: --gpus"),
    (("--model", "llama3-8b", "--gpus", "many"), "invalid int value: 'many'"),
])
def test_bad_input_is_one_line(arguments, says):
    status, out, error = run(*arguments)
    assert status == 2 and says in error and "\n" not in error and not out


def test_a_model_that_fits_nowhere_says_by_how_much():
    status, _, error = run("--model", "llama3-405b", "--gpus", "8")
    assert status == 2 and "fits nowhere" in error and "GiB more than the" in error


def test_the_command_exits_2_with_one_line_and_no_traceback():
    done = subprocess.run([sys.executable, "-m", "dtp.topology.plan", "--model", "nope", "--gpus", "8"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("plan: error: unknown model preset") and done.stderr.count("\n") == 1


def test_a_table_and_json_for_the_409b_question():
    """The JSON's layouts are the table's, fastest first, each with its parts; whole experts say
    their effective EP (t·e: their all-to-all folded over the TP ranks)."""
    status, out, error = run("--model", "moe-409b", "--gpus", "1024", "--top", "3", "--json")
    assert status == 0 and error == ""  # no progress bar when stderr is not a terminal
    found = json.loads(out)
    layouts = found["layouts"]
    assert len(layouts) == 3 and found["fitting"] > 3
    assert [layout["step_time_s"] for layout in layouts] == sorted(layout["step_time_s"] for layout in layouts)
    for layout in layouts:
        assert layout["tp"] * layout["cp"] * layout["pp"] * layout["dp"] == 1024
        assert layout["effective_ep"] == layout["ep"] * layout["tp"] // layout["expert_tp"]
        assert layout["memory_gib"] <= 80 and 0 < layout["mfu"] < 1
        assert sum(layout["seconds"].values()) == pytest.approx(layout["step_time_s"], rel=1e-6)
    shown = [tuple(layout[name] for name in ("tp", "cp", "pp", "dp", "ep", "expert_tp", "micro_batch", "v", "recompute"))
             for layout in layouts]
    for index, layout in enumerate(layouts):  # no ZeRO choice shown that another beats on both time and memory
        assert not any(shown[other] == shown[index] and layouts[other]["step_time_s"] <= layout["step_time_s"]
                       and layouts[other]["memory_gib"] <= layout["memory_gib"] for other in range(index))
    status, table, _ = run("--model", "moe-409b", "--gpus", "1024", "--top", "3")
    lines = table.splitlines()
    assert status == 0 and len(lines) == 5 and lines[1].split()[:4] == ["#", "TP", "CP", "PP"]


def test_a_model_by_its_shape_and_its_own_links():
    status, out, _ = run("--layers", "24", "--hidden", "2048", "--heads", "16", "--vocab", "50304", "--seq", "2048",
                         "--global-batch", "256", "--gpu", "a100-40gb", "--gpus", "32", "--network-gbit", "100",
                         "--json", "--top", "1")
    assert status == 0 and json.loads(out)["layouts"][0]["memory_gib"] <= 40


def test_whole_experts_are_named_with_their_effective_ep():
    """The review's item: "expert TP 1" with TP 8 and EP 1 is an all-to-all over 8 GPUs: say so."""
    from dtp.topology.report import layout_name

    row = {"tp": 8, "pp": 8, "dp": 16, "ep": 1, "expert_tp": 1, "cp": 1}
    assert layout_name(row) == "TP 8 · PP 8 · DP 16 (EP 1, experts whole: effective EP 8)"
    assert layout_name(dict(row, ep=2, expert_tp=8)) == "TP 8 · PP 8 · DP 16 (EP 2)"
    assert layout_name(dict(row, ep=1, expert_tp=8)) == "TP 8 · PP 8 · DP 16"
