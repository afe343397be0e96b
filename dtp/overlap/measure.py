"""Wall-clock measurements of the overlap chapter, each beside the model's prediction (for the
page, never for a verdict).

Every measurement runs, on a gloo world, the program that `dtp.overlap.model` simulates (the
same builder: `model.ddp_program`, `model.fsdp_forward_program`, `model.collective_matmul_program`,
with the sizes of the collectives in place of their times; `dtp.overlap.timing` runs it), and
fits alpha and beta of its collective on the same world first. The model's prediction is then
the closed form with those alpha and beta·bytes, and no measured step time goes into it. Each
row is (label, measured exposed seconds, model exposed seconds). The computation is a sleep:
no contention, so the model's contention is 0 here.
"""
from __future__ import annotations

import statistics
import time

from dtp.common.world import run_world
from dtp.overlap import model
from dtp.overlap.timing import (FIRST_ESTIMATE_ROUNDS, REPEATS, bandwidth_time, exposed_summary,
                                fit_alpha_beta, fit_from, fit_programs, one_link, own_core, synchronized_time)
from dtp.zero.measure import FullTensorTracker

FLOAT_BYTES = 4
# Backward lengths, over one all-reduce of all gradients, among which the page finds the one where
# a row's exposure would be most sensitive (the chain of its all-reduces just outlasting backward)
COVERING_BACKWARDS = tuple(round(0.5 + 0.05 * k, 2) for k in range(51))


def on_gloo(program, op: str) -> list:
    """A model program whose issue steps carry a size (numel per rank) as a program to run:
    ("issue", name, numel) -> ("issue", name, op, numel)."""
    return [("issue", step[1], op, int(step[2])) if step[0] == "issue" else step for step in program]


def _row(label, measured, predicted, middle=None):
    """One table row; `middle` the first and third quartiles of the measured rounds."""
    return {"label": label, "measured_s": measured, "model_s": predicted, "middle": middle}


# --- DDP: buckets all-reduced during a backward of B seconds ----------------------------------

def _ddp_rank(rank, world_size, numel, backward_over_allreduce, bucket_counts, after_buckets, rounds):
    own_core(rank)
    link = one_link()
    sizes = sorted({numel // b for b in (*bucket_counts, after_buckets)})
    first = fit_alpha_beta(link, "all_reduce", sizes, FIRST_ESTIMATE_ROUNDS)
    backward_s = backward_over_allreduce * (first["alpha"] + bandwidth_time(first, numel))  # the same on every rank
    programs = fit_programs("all_reduce", sizes)
    programs.update({b: on_gloo(model.ddp_program(numel, backward_s, b), "all_reduce") for b in bucket_counts})
    programs["after"] = on_gloo(model.after_backward_program(model.ddp_program(numel, backward_s, after_buckets)),
                                "all_reduce")
    exposed, middle = exposed_summary(programs, link, rounds)
    return {"fit": fit_from(exposed, "all_reduce", sizes), "measured": exposed, "middle": middle,
            "backward_s": backward_s}


def measure_ddp(world_size=2, numel=2**23, backward_over_allreduce=0.5, bucket_counts=(1, 2, 4, 8, 16, 32),
                after_buckets=4, rounds=REPEATS) -> dict:
    """DDP's backward over `numel` float32 gradients in b equal buckets, each all-reduced as soon
    as backward has produced it, for every b; and `after_buckets` buckets all-reduced after
    backward. Backward lasts `backward_over_allreduce` times one all-reduce of all gradients as
    first estimated, so that in every row the chain of all-reduces outlasts backward by a good
    part of its length: the exposure is then the chain less what backward hid, and an error in
    the all-reduces' time passes to it about once, where a backward that nearly covers the chain
    would multiply it ("covering": the backward among `COVERING_BACKWARDS` and the bucket count
    with the largest error gain, for the page). Model:
    `model.ddp_exposed(C, B, b, alpha, launch=...)` with the fitted alpha less the measured
    launch, C = beta·bytes of all gradients; after backward, the model's program of that,
    simulated. Each row's "gain" is the model's `error_gain`: how much an error in each
    all-reduce's time grows in that row, "middle" the first and third quartiles of its measured
    rounds; "fit_miss" is the most that one size's own all-reduce time lies off the fitted line,
    relatively."""
    result = run_world(_ddp_rank, world_size,
                       (numel, backward_over_allreduce, tuple(bucket_counts), after_buckets, rounds))[0]
    fit, measured, middle, backward_s = result["fit"], result["measured"], result["middle"], result["backward_s"]
    c, launch = bandwidth_time(fit, numel), fit["launch"]
    alpha = max(0.0, fit["alpha"] - launch)  # the fitted alpha includes one launch; the rest is the link's
    after = model.after_backward_program(model.ddp_program(c, backward_s, after_buckets, alpha))
    rows = [_row(f"{after_buckets} buckets, all-reduced after backward", measured["after"],
                 model.program_exposed(after, launch=launch), middle["after"])
            | {"gain": model.error_gain(after, launch=launch)}]
    rows += [_row(f"{b} bucket{'s' if b > 1 else ''} during backward", measured[b],
                  model.ddp_exposed(c, backward_s, b, alpha, launch=launch), middle[b])
             | {"gain": model.error_gain(model.ddp_program(c, backward_s, b, alpha), launch=launch)}
             for b in bucket_counts]
    best = model.ddp_best_buckets(c, backward_s, alpha, launch=launch)
    covering_gains = {(factor, b): model.error_gain(model.ddp_program(c, factor * (fit["alpha"] + c), b, alpha),
                                                    launch=launch)
                      for factor in COVERING_BACKWARDS for b in bucket_counts}
    (factor, buckets), gain = max(covering_gains.items(), key=lambda item: item[1])
    line = [fit["alpha"] + bandwidth_time(fit, n) for n in fit["numel"]]
    return {"rows": rows, "rounds": rounds, "fit": fit, "allreduce_s": c, "backward_s": backward_s,
            "model_best_buckets": best,
            "measured_best_buckets": min(bucket_counts, key=lambda b: measured[b]), "numel": numel,
            "fit_miss": max(abs(t - f) / f for t, f in zip(fit["times"], line)),
            "covering": {"backward_s": factor * (fit["alpha"] + c), "over_allreduce": factor, "buckets": buckets,
                         "gain": gain}}


# --- ZeRO-3's forward: units all-gathered before a compute of f seconds -----------------------

def _zero3_rank(rank, world_size, layouts, compute_over_gather, rounds):
    own_core(rank)
    link = one_link()
    pieces = {n // world_size for units, _, _ in layouts.values() for n in units}
    sizes = sorted(pieces | {min(pieces) // 2, min(pieces) * 2})  # the sizes it gathers, and around them
    first = fit_alpha_beta(link, "all_gather", sizes, FIRST_ESTIMATE_ROUNDS)
    compute_s = compute_over_gather * (first["alpha"] + bandwidth_time(first, min(pieces)))
    programs = fit_programs("all_gather", sizes)
    for key, (units, depth, computes) in layouts.items():
        program = model.fsdp_forward_program([n // world_size for n in units], [c * compute_s for c in computes], depth)
        programs[key] = on_gloo(program, "all_gather")
    measured, middle = exposed_summary(programs, link, rounds)
    fit = fit_from(measured, "all_gather", sizes)
    peaks = {key: _gathered_peak([n // world_size for n in units], depth, compute_s)
             for key, (units, depth, _) in layouts.items()}
    even = next(units for units, _, _ in layouts.values())
    kept = _gathered_peak([n // world_size for n in even], 0, compute_s, keep_handles=True)
    return {"fit": fit, "compute_s": compute_s, "measured": measured, "middle": middle, "peak_bytes": peaks,
            "peak_bytes_handle_kept": kept}


def _gathered_peak(pieces, depth, compute_s, keep_handles=False) -> int:
    """The most bytes of gathered weights alive after any operation, in one forward with prefetch
    `depth` on the default group (counted by dtp.zero.measure.FullTensorTracker). A finished
    collective's handle keeps its output alive: it is dropped with the buffer, unless
    `keep_handles` (the handle then lives until the next unit's is taken, as in a loop that
    only deletes the buffer). Gloo's worker lets go of a finished gather's buffers a moment after
    the wait returns: the tracker counts more than the 1 + depth units the schedule keeps only
    once that excess outlives gloo's letting go (its `unit_limit`), never because gloo was slow."""
    import torch
    import torch.distributed as dist

    def gather(index):
        full = torch.empty(pieces[index] * dist.get_world_size())
        return full, dist.all_gather_into_tensor(full, torch.ones(pieces[index]), async_op=True)

    tracker = FullTensorTracker(unit_limit=1 + depth)
    with tracker:  # the same program, with the buffers allocated when issued and freed after use
        in_flight = {}
        for index in range(len(pieces)):
            for ahead in range(index, min(len(pieces), index + depth + 1)):
                if ahead not in in_flight:
                    in_flight[ahead] = gather(ahead)
                if ahead == index:
                    full, handle = in_flight.pop(index)
                    handle.wait()
            time.sleep(compute_s)  # the unit's compute
            del full
            if not keep_handles:
                del handle
    return tracker.peaks.get("start", 0)


def measure_zero3_forward(world_size=2, units=6, numel=2**20, compute_over_gather=2.5, depths=(0, 1, 2),
                          big_unit=3, big_factor=2.5, short_over_gather=0.6, uneven_depths=(1, 2),
                          rounds=REPEATS) -> dict:
    """ZeRO-3's forward on gloo, every unit's gather waited on before the next is issued, with
    prefetch depth 0 (gather, wait, compute), 1 and 2; and, at `uneven_depths`, the case deeper
    prefetch is for: unit `big_unit` gathers `big_factor` times the bytes (an embedding, an uneven
    wrapping) behind a short compute (the unit before it computes `short_over_gather` gathers).
    Each other unit computes `compute_over_gather` times the fitted gather g of an ordinary unit,
    so that equal units hide all but the first gather. The big gather G sticks out at depth 1 by
    G - short; at depth 2, issued one unit earlier, it has f + short to hide under. Both margins
    are more than a gather: one gather's time moves by a third from one round to the next here,
    and a row that is a small difference of two times (2.5 times the bytes under two equal
    computes of 2 gathers stuck out by 0.1-0.15 f) swings with it; a built page measured that
    row at 0.61 of the model. Per row: measured and modelled exposed time, and the peak bytes of
    gathered weights."""
    even = [numel] * units
    uneven = [int(numel * big_factor) if i == big_unit else numel for i in range(units)]
    short = short_over_gather / compute_over_gather  # in computes of an ordinary unit
    uneven_computes = [short if i == big_unit - 1 else 1.0 for i in range(units)]
    layouts = {("even", d): (even, d, [1.0] * units) for d in depths}
    layouts.update({("uneven", d): (uneven, d, uneven_computes) for d in uneven_depths})
    result = run_world(_zero3_rank, world_size, (layouts, compute_over_gather, rounds))[0]
    fit, compute_s = result["fit"], result["compute_s"]
    launch = fit["launch"]
    alpha = max(0.0, fit["alpha"] - launch)  # the fitted alpha includes one launch

    def gather_s(n):
        return bandwidth_time(fit, n // world_size)

    rows = []
    for key, (sizes, depth, computes) in layouts.items():
        if key[0] == "even":
            predicted = model.fsdp_forward_exposed(units, gather_s(numel), compute_s, depth > 0, alpha, launch=launch)
            label = f"depth {depth}" + (", equal units" if depth == 0 else "")
        else:
            predicted = model.fsdp_forward_exposed_units([alpha + gather_s(n) for n in sizes],
                                                         [c * compute_s for c in computes], depth, launch=launch)
            label = f"depth {depth}, unit {big_unit} {big_factor}x larger"
        row = _row(label, result["measured"][key], predicted, result["middle"][key])
        row.update(depth=depth, peak_bytes=result["peak_bytes"][key], unit_bytes=numel * FLOAT_BYTES,
                   units_alive=model.fsdp_gathered_units_alive(depth, units))
        rows.append(row)
    return {"rows": rows, "rounds": rounds, "fit": fit, "units": units, "compute_s": compute_s,
            "gather_s": fit["alpha"] + gather_s(numel), "short_s": short * compute_s,
            "peak_bytes_handle_kept": result["peak_bytes_handle_kept"],
            "unit_bytes": numel * FLOAT_BYTES, "big_unit": big_unit, "big_factor": big_factor}


# --- collective matmul: t ring steps, each transfer under a piece's product --------------------

def _ring_rank(rank, world_size, numel, gemm_over_transfer, rounds):
    own_core(rank)
    link = one_link()
    sizes = [numel // 4, numel // 2, numel]
    first = fit_alpha_beta(link, "exchange", sizes, FIRST_ESTIMATE_ROUNDS)
    gemm_s = gemm_over_transfer * (first["alpha"] + bandwidth_time(first, numel)) * world_size  # per piece: that share
    programs = {**fit_programs("exchange", sizes), **fit_programs("all_gather", sizes)}
    programs["plain"] = [("issue", "all", "all_gather", numel), ("wait", "all"), ("compute", gemm_s)]
    programs["ring"] = on_gloo(model.collective_matmul_program(numel * (world_size - 1), gemm_s, world_size), "exchange")
    measured, middle = exposed_summary(programs, link, rounds)
    return {"exchange": fit_from(measured, "exchange", sizes), "gather": fit_from(measured, "all_gather", sizes),
            "gemm_s": gemm_s, "measured": measured, "middle": middle}


def measure_collective_matmul(world_size=4, numel=2**20, gemm_over_transfer=0.3, rounds=REPEATS) -> dict:
    """All-gather then product, and collective matmul, on `world_size` ranks each holding `numel`
    float32 of X. The product's length is set from the fitted ring step, so that each piece's
    product covers `gemm_over_transfer` of a transfer and the model predicts something to
    measure on any machine. Model: `model.collective_matmul_exposed` with the fitted alphas."""
    result = run_world(_ring_rank, world_size, (numel, gemm_over_transfer, rounds))[0]
    t, gemm_s = world_size, result["gemm_s"]
    exchange, gather, measured, middle = result["exchange"], result["gather"], result["measured"], result["middle"]
    rows = [_row("all-gather, then the product", measured["plain"],
                 model.collective_matmul_exposed(bandwidth_time(gather, numel), gemm_s, 1, gather["alpha"]),
                 middle["plain"]),
            _row(f"collective matmul, t = {t}", measured["ring"],
                 model.collective_matmul_exposed((t - 1) * bandwidth_time(exchange, numel), gemm_s, t,
                                                 exchange["alpha"]), middle["ring"])]
    return {"rows": rows, "rounds": rounds, "exchange": exchange, "gather": gather, "gemm_s": gemm_s, "chunks": t,
            "transfer_s": exchange["alpha"] + bandwidth_time(exchange, numel)}


# --- TP and EP: a collective the next op needs, and two micro-batches -------------------------

def tp_programs(numel, compute_s) -> dict:
    forward = [("issue", "a", "all_reduce", numel), ("wait", "a"), ("compute", compute_s)]
    backward = [("issue", "a", "all_reduce", numel), ("compute", compute_s), ("wait", "a")]
    return {"forward": forward, "backward": backward}


def ep_programs(numel, compute_s) -> dict:
    """Per micro-batch a dispatch and a combine all-to-all, then its compute; overlapped, micro-
    batch A's pair runs under B's compute and then B's under A's."""
    def pair(tag):
        return [("issue", f"{tag}1", "all_to_all", numel), ("issue", f"{tag}2", "all_to_all", numel)]

    def waits(tag):
        return [("wait", f"{tag}1"), ("wait", f"{tag}2")]

    serial = pair("a") + waits("a") + [("compute", compute_s)] + pair("b") + waits("b") + [("compute", compute_s)]
    overlapped = pair("a") + [("compute", compute_s)] + waits("a") + pair("b") + [("compute", compute_s)] + waits("b")
    return {"serial": serial, "overlapped": overlapped}


def _tp_ep_rank(rank, world_size, numel, compute_over_comm, rounds):
    own_core(rank)
    link = one_link()
    sizes, ops = [numel // 4, numel // 2, numel], ("all_reduce", "all_to_all")
    first = {op: fit_alpha_beta(link, op, sizes, FIRST_ESTIMATE_ROUNDS) for op in ops}
    a = first["all_reduce"]["alpha"] + bandwidth_time(first["all_reduce"], numel)
    c = 2 * (first["all_to_all"]["alpha"] + bandwidth_time(first["all_to_all"], numel))
    tp_compute, ep_compute = compute_over_comm * a, compute_over_comm * c
    programs = {key: program for op in ops for key, program in fit_programs(op, sizes).items()}
    programs.update({("tp", k): p for k, p in tp_programs(numel, tp_compute).items()})
    programs.update({("ep", k): p for k, p in ep_programs(numel, ep_compute).items()})
    measured, middle = exposed_summary(programs, link, rounds)
    return {"fits": {op: fit_from(measured, op, sizes) for op in ops}, "tp_compute_s": tp_compute,
            "ep_compute_s": ep_compute, "measured": measured, "middle": middle}


def measure_tp_and_ep(world_size=2, numel=2**21, compute_over_comm=0.4, rounds=REPEATS) -> dict:
    """A TP all-reduce waited on before the product that needs it, and one under a product that
    does not (the weight gradient); a MoE layer's two micro-batches serial and overlapped. The
    computation is `compute_over_comm` of the fitted communication, so the overlapped rows leave
    something exposed to predict. Model: `tp_layer_exposed`'s phases and `ep_exposed`."""
    result = run_world(_tp_ep_rank, world_size, (numel, compute_over_comm, rounds))[0]
    fits, measured, middle = result["fits"], result["measured"], result["middle"]
    ar, a2a = fits["all_reduce"], fits["all_to_all"]
    a, alpha = bandwidth_time(ar, numel), ar["alpha"]
    c, w, f = 2 * bandwidth_time(a2a, numel), result["tp_compute_s"], result["ep_compute_s"]
    tp_rows = [_row("forward: the next product needs it", measured[("tp", "forward")], a + alpha,
                    middle[("tp", "forward")]),
               _row("backward: under the weight-gradient product", measured[("tp", "backward")],
                    model.exposed(a + alpha, w), middle[("tp", "backward")])]
    ep_rows = [_row("one micro-batch after the other", measured[("ep", "serial")],
                    model.ep_exposed(c, f, False, a2a["alpha"]), middle[("ep", "serial")]),
               _row("two micro-batches, overlapped", measured[("ep", "overlapped")],
                    model.ep_exposed(c, f, True, a2a["alpha"]), middle[("ep", "overlapped")])]
    return {"tp_rows": tp_rows, "ep_rows": ep_rows, "rounds": rounds, "fits": fits, "tp_compute_s": w,
            "ep_compute_s": f, "compute_over_comm": compute_over_comm}


# --- why the measuring ranks place gloo's threads as they do ---------------------------------

def _pause_then_allreduce_rank(rank, world_size, numel, pauses, count, event_loops_elsewhere):
    import torch

    own_core(rank, event_loops_elsewhere)
    link = one_link()
    data = torch.ones(numel)
    times = {}
    for pause in pauses:
        samples = []
        for index in range(count + 2):  # the first two: a warm-up
            time.sleep(pause)  # the previous all-reduce has just ended on every rank: the pauses line up
            start = time.perf_counter()
            link.allreduce([data]).wait()
            samples.append(time.perf_counter() - start)
        times[pause] = samples[2:]
    return times


EVENT_LOOP_NUMEL, EVENT_LOOP_PAUSES, EVENT_LOOP_COUNT = 2**18, (0.0005, 0.005, 0.02), 24


def measure_event_loop_placement(world_size=2, numel=EVENT_LOOP_NUMEL, pauses=EVENT_LOOP_PAUSES,
                                 count=EVENT_LOOP_COUNT) -> list[dict]:
    """One all-reduce of `numel` float32 after a pause, on the measuring ranks' one-thread gloo
    group, with gloo's TCP event loop on the rank's own core and on the next core (as the page's
    measurements run). Per placement and pause: the median and quartiles of `count` all-reduces,
    as rank 0 timed them from its call to the end of its wait."""
    rows = []
    for label, elsewhere in (("on the rank's core", False), ("on the next core", True)):
        times = run_world(_pause_then_allreduce_rank, world_size, (numel, tuple(pauses), count, elsewhere))[0]
        for pause in pauses:
            low, median, high = statistics.quantiles(times[pause], n=4)
            rows.append({"event_loop": label, "pause_s": pause, "median_s": median, "middle": (low, high)})
    return rows
