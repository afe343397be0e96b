"""The chapter's 3D run (dtp.topology.training): a tiny GPT trained on DP × PP × TP gloo processes
gives the losses of single-process training, and what each rank sends is what the tensor,
pipeline and data-parallel formulas say."""
import pytest

from dtp.dp import costs
from dtp.pp import schedules as pipeline
from dtp.tp import tensor_parallel
from dtp.topology import mesh as topology
from dtp.zero import formulas as zero
from dtp.topology import planner
from dtp.topology.training import TINY_GPT, run_3d

SIZES = {"dp": 2, "pp": 2, "tp": 2}
BATCH, MICRO_BATCHES, STEPS = 8, 2, 6


@pytest.fixture(scope="module")
def run():
    return run_3d(SIZES, n_steps=STEPS, batch=BATCH, micro_batches=MICRO_BATCHES, timeout_s=120)


def test_the_2x2x2_run_trains_like_one_process(run):
    assert len(run["losses"]) == STEPS
    assert run["losses"] == pytest.approx(run["reference"], rel=1e-5)
    assert run["reference"][-1] < run["reference"][0]  # it learns


def test_every_rank_sits_where_the_layout_puts_it(run):
    for rank, result in enumerate(run["ranks"]):
        assert result["coordinates"] == topology.rank_coordinates(rank, SIZES, ("tp", "pp", "dp"))
        last = result["coordinates"]["pp"] == SIZES["pp"] - 1
        assert all((loss is not None) == last for loss in result["losses"])


def _sent(result, op, ranks):
    return [b for entry in result["sent"] if entry["op"] == op and entry["ranks"] == ranks for b in entry["bytes"]]


def test_each_dimension_sends_what_its_formula_says(run):
    groups = topology.parallel_groups(SIZES, ("tp", "pp", "dp"))
    rows, s, h = BATCH // SIZES["dp"] // MICRO_BATCHES, TINY_GPT.n_positions, TINY_GPT.hidden
    layers = TINY_GPT.n_layers // SIZES["pp"]
    for rank, result in enumerate(run["ranks"]):
        mine = {name: next(g for g in grp if rank in g) for name, grp in groups.items()}
        # TP: 2 all-reduces per layer forward (g) and 2 backward (f), per micro-batch, of b·s·h fp32 values
        tp = _sent(result, "all_reduce", mine["tp"])
        assert tp == [rows * s * h * 4] * (4 * layers * MICRO_BATCHES * STEPS)
        ring = sum(costs.ring_all_reduce_bytes_per_rank(SIZES["tp"], b) for b in tp) / STEPS
        assert ring == layers * MICRO_BATCHES * tensor_parallel.ring_bytes_per_gpu_per_layer(rows * s, h, SIZES["tp"], 4)
        # the planner's TP term for this layout is the same number
        shape = planner.ModelShape(TINY_GPT.n_layers, h, TINY_GPT.n_heads, TINY_GPT.vocab_size, s)
        training = planner.Training(global_batch=BATCH, micro_batch=rows, bytes_per_value=4, recompute="none")
        layout = planner.PlannedLayout(SIZES["tp"], SIZES["pp"], SIZES["dp"], 1, 0, MICRO_BATCHES)
        cluster = planner.Cluster(2, 4, 1e9, 1e9, 1e9, 1e12)
        traffic = planner.traffic_per_gpu(shape, cluster, training, layout)
        assert traffic["tp"]["bytes"] == ring
        # PP: two stages, so each stage sends one way: activations forward, or gradients backward. Without
        # sequence parallelism every TP rank sends the whole activation: t times the planner's per-GPU share.
        pp = _sent(result, "send", mine["pp"])
        assert sum(pp) == pipeline.boundary_bytes_per_step(MICRO_BATCHES, rows, s, h, 4) / 2 * STEPS
        assert sum(pp) / STEPS == traffic["pp"]["bytes"] * SIZES["tp"]
        # DP: one all-reduce of the rank's gradients per step
        dp = _sent(result, "all_reduce", mine["dp"])
        assert len(dp) == STEPS and len(set(dp)) == 1
        assert sum(costs.ring_all_reduce_bytes_per_rank(SIZES["dp"], b) for b in dp) / STEPS == \
            pytest.approx(zero.communication_bytes_per_gpu(dp[0] / 4, SIZES["dp"], 0, 4))
        assert {tuple(entry["ranks"]) for entry in result["sent"]} == {tuple(mine["tp"]), tuple(mine["pp"]),
                                                                       tuple(mine["dp"])}


def test_other_layouts_of_the_same_model_train_alike():
    for sizes in ({"dp": 1, "pp": 2, "tp": 2}, {"dp": 2, "pp": 1, "tp": 1}):
        result = run_3d(sizes, n_steps=3, batch=BATCH, micro_batches=MICRO_BATCHES, timeout_s=120)
        assert result["losses"] == pytest.approx(result["reference"], rel=1e-5)
