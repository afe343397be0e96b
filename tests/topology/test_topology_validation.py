"""The practised planner against published runs: one constant fitted on one table, every other row
held out, the ratio without a trend in the GPU count, every miss with a stated cause, and the
sources' own figures as the page quotes them."""
import dataclasses
import math

import pytest

from dtp.topology import published, search, validation
from dtp.tp import tensor_parallel


@pytest.fixture(scope="module")
def results():
    share = validation.calibrated_gemm_share()
    return [validation.predict(run, share) for run in published.published_runs()]


def test_one_constant_fitted_on_one_table(results):
    """The GEMM share is fitted on Megatron-LM 2021's Table 1 (geometric mean of its ratios 1) and
    nowhere else; with the measured constants alone every Table 1 row is predicted too fast."""
    share = validation.calibrated_gemm_share()
    assert 0.6 < share < 0.9
    fitted = [result for result in results if result["run"].fitted]
    assert {result["run"].source for result in fitted} == {"narayanan2021efficient"}
    assert len(fitted) == 10 and not any(run.fitted for run in validation.held_out_runs())
    assert math.exp(sum(math.log(result["ratio"]) for result in fitted) / len(fitted)) == pytest.approx(1, abs=1e-3)
    assert all(abs(result["ratio"] - 1) < 0.1 for result in fitted)
    assert all(validation.predict(run)["ratio"] > 1 for run in validation.fitted_runs())


def test_the_ratio_has_no_trend_with_the_gpu_count(results):
    """The held-out ratio against log10(GPUs): under 5 % per tenfold GPUs, over runs of 64 to 16,384
    GPUs (an earlier version erred more the larger the run)."""
    held_out = [result for result in results if not result["run"].fitted]
    trend = validation.ratio_trend(held_out)
    assert abs(trend["slope"]) < 0.05, trend
    gpus = [result["run"].cluster.gpus for result in held_out]
    assert min(gpus) <= 64 and max(gpus) >= 16384
    assert sum(validation.within(result) for result in held_out) >= 0.7 * len(held_out)


def test_every_miss_has_a_stated_cause(results):
    """A held-out row outside ±10 % must have its cause in validation.MISS_CAUSES (the page explains
    each with what the planner computes); and a stated cause must name a row that misses."""
    held_out = [result for result in results if not result["run"].fitted]
    for result in held_out:
        if not validation.within(result):
            assert validation.miss_cause(result["run"]), f"{result['run'].name}: {result['ratio']:.2f} unexplained"
    for start in validation.MISS_CAUSES:
        assert any(r["run"].name.startswith(start) and not validation.within(r) for r in held_out), start


def test_unstated_choices_are_searched_stated_ones_kept():
    """Table 1's micro-batch size and v are the authors' script's; MT-NLG's micro-batch size and ZeRO
    stage are searched; no choice a framework refuses is offered (DeepSpeed: v = 1, ZeRO <= 1)."""
    run = next(run for run in published.megatron_table_1() if run.name == "GPT 145.6B")
    assert {(b, v, recompute) for b, _, v, recompute, *_ in validation.choices(run)} == {(2, 2, "full")}
    mt_nlg = published.mt_nlg()[0]
    found = list(validation.choices(mt_nlg))
    assert {b for b, *_ in found} == {1, 2, 4, 8} and {v for _, _, v, *_ in found} == {1}
    assert {stage for *_, stage, _ in found} == {0, 1}


def test_the_fit_uses_the_layouts_the_authors_ran():
    """The review's item: 76.1B and 529.6B ran with v = 3 (15 and 3 layers per stage), never v = 2."""
    share = validation.calibrated_gemm_share()
    rows = {run.name: validation.predict(run, share)["row"] for run in published.megatron_table_1()}
    assert rows["GPT 76.1B"]["chunks"] == 3 and rows["GPT 529.6B"]["chunks"] == 3
    assert rows["GPT 1.7B"]["micro_batch"] == 16


def test_llama_3_s_mfu_column_against_its_tflops():
    """Table 4's 400 TFLOP/s is 40.4 % of the H100's 989.4, where the table prints 41 %: the page
    shows 40.4 % and says so (the two others round to their printed 43 % and 38 %)."""
    mfu = [tflops / (tensor_parallel.H100_BF16_DENSE_FLOPS / 1e12) for tflops in (430, 400, 380)]
    assert f"{mfu[1]:.1%}" == "40.4%" and round(mfu[1], 2) == 0.40
    assert round(mfu[0], 2) == 0.43 and round(mfu[2], 2) == 0.38


def test_bloom_fits_and_ranks_behind_layouts_that_recompute_less():
    run = published.bloom()[0]
    share = validation.calibrated_gemm_share()
    published_row = validation.predict(run, share)["row"]
    rows = search.plan(run.model, validation.calibrated(run.cluster, share),
                       dataclasses.replace(run.training, balanced_stages=False))["rows"]
    rank = 1 + sum(row["step_time_s"] < published_row["step_time_s"] for row in rows)
    assert 1 < rank <= len(rows) + 1
    same = [row for row in rows if (row["tp"], row["pp"], row["dp"], row["micro_batch"]) == (4, 12, 8, 2)]
    assert same and same[0]["recompute"] != "full" and same[0]["step_time_s"] < published_row["step_time_s"]
    assert all(row["chunks"] == 1 and row["zero_stage"] <= 1 for row in rows if row["pp"] > 1)


def test_a_step_line_splits_a_step_into_a_time_per_sequence_and_a_cost_per_step(results):
    """The page's reading of MT-NLG's and MegaScale's rows: the planner's time per sequence is
    within 6 % of the published one, and the miss is paid per step; MT-NLG's per-step cost is what
    a micro-batch of 2 gives the planner (within 10 %), at b = 1 it has about half of it, and
    MegaScale's is short by a third or more even with b = 2."""
    share = validation.calibrated_gemm_share()

    def group(start, batch=None):
        return [r for r in results if r["run"].name.startswith(start)
                and (batch is None or r["run"].training.global_batch == batch)]

    mt_nlg, megascale = group("MT-NLG 530B"), group("MegaScale's Megatron-LM", 6144)
    for rows in (mt_nlg, megascale):
        line = validation.step_line(rows)
        assert line["predicted"]["per_sequence"] == pytest.approx(line["published"]["per_sequence"], rel=0.06)
        assert line["predicted"]["per_step"] < 0.6 * line["published"]["per_step"]
    with_two = [validation.predict_with(r["run"], share, micro_batch=2) for r in mt_nlg]
    published_step = validation.step_line(mt_nlg)["published"]["per_step"]
    assert validation.step_line(with_two)["predicted"]["per_step"] == pytest.approx(published_step, rel=0.1)
    with_two = [validation.predict_with(r["run"], share, micro_batch=2) for r in megascale]
    assert validation.step_line(with_two)["predicted"]["per_step"] < 0.67 * validation.step_line(megascale)[
        "published"]["per_step"]
    # a line needs rows that differ in sequences per pipeline (NeMo's rows grow the batch with the GPUs)
    with pytest.raises(ValueError, match="different sequences per pipeline"):
        validation.step_line(mt_nlg[:1] * 2)


def test_megatron_core_rows_count_flops_as_megatron_logs_them():
    """Megatron-Core's README table prints the TFLOP/s Megatron-LM logs: per token 6 x (the layers'
    matrices + the output layer, h·V) + attention's 12·L·h·s, the input embedding not counted (it is
    a lookup). For the 1.7B row PaLM's 6N + 12Lhs with N counting the embedding would be 15 % more
    FLOPs, enough to move its ratio by as much; a Llama shape's grouped K/V and three SwiGLU matrices
    count as their parameters do."""
    run = published.megatron_core()[0]
    model, batch = run.model, run.training.global_batch
    l, h, s, v = model.layers, model.hidden, model.seq, model.vocab
    per_token = validation.megatron_core_flops_per_step(model, batch) / (batch * s)
    assert per_token == pytest.approx(6 * (12 * l * h * h + h * v) + 12 * l * h * s, rel=1e-12)
    assert run.metric == "megatron_core_tflops"
    palm = validation.throughput(run, 1.0, "model_tflops") / validation.throughput(run, 1.0)
    assert palm > 1.14
    llama = published.LLAMA3_405B
    l, h, s, v, f, kv = llama.layers, llama.hidden, llama.seq, llama.vocab, llama.mlp_width, llama.kv_hidden
    per_token = validation.megatron_core_flops_per_step(llama, 1) / s
    assert per_token == pytest.approx(6 * (l * (2 * h * h + 2 * h * kv + 3 * h * f) + h * v) + 12 * l * h * s)
