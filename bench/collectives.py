"""Collectives on this machine against its physical limit, for the book's appendix.

    python bench/collectives.py [--quick]      # writes book/appendix/benchmarks.json

Measures, on gloo processes of this machine (median over repeats of the slowest rank):
- bus bandwidth of all_reduce, reduce_scatter, all_gather and all_to_all against message size,
  for worlds of 2, 4 and 8 processes, beside the machine's memory-copy bandwidth (for processes
  on one host, every byte a collective moves is copied through memory at least once);
- the course's send/recv ring all-reduce as a ratio of gloo's built-in one at 64 MiB;
- data-parallel gradient synchronisation on a model of many small parameters: one all-reduce per
  parameter against buckets, and bucketed with overlap against averaging after backward;
- how the time and memory of a gloo world grow with its size (2, 4, 8 processes).
The book's appendix (book/appendix_benchmarks.md) draws its tables and figures from the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dtp.dp import costs  # noqa: E402
from dtp.dp.ddp_observed import exposed_communication  # noqa: E402
from dtp.common.measure import all_reduce_times  # noqa: E402
from dtp.common.world import run_world  # noqa: E402

OUTPUT = REPO / "book" / "appendix" / "benchmarks.json"
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    memory_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal"))
    return {"cpu": model, "cores": os.cpu_count(), "memory_gib": round(memory_kib / 2**20, 1),
            "python": platform.python_version(), "torch": torch.__version__, "kernel": platform.release()}


def memory_copy_bandwidth(size_bytes: int = 256 * 2**20, repeats: int = 7) -> float:
    """Bytes copied per second by one core (numpy copy of a large array: read once, write once)."""
    source, target = np.ones(size_bytes // 8), np.empty(size_bytes // 8)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - started)
    return size_bytes / statistics.median(times)


def _collective_times(rank, world_size, op, sizes, repeats):
    times = []
    for size in sizes:
        elements = size // 4 // world_size * world_size
        full, piece = torch.ones(elements), torch.ones(elements // world_size)

        def once():
            if op == "all_reduce":
                dist.all_reduce(full)
            elif op == "reduce_scatter":
                dist.reduce_scatter_single(piece, full)  # S = the full input, as nccl-tests counts it
            elif op == "all_gather":
                dist.all_gather_single(full, piece)
            else:
                dist.all_to_all_single(torch.empty_like(full), full)
        once()
        samples = []
        for _ in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            once()
            samples.append(time.perf_counter() - started)
        times.append(samples)
    return times


def collective_bandwidth(world_size: int, sizes: list[int], repeats: int) -> dict:
    table = {}
    for op in COLLECTIVES:
        per_rank = np.array(run_world(_collective_times, world_size, (op, sizes, repeats), timeout_s=1800,
                                      collective_timeout_s=600))
        medians = np.median(per_rank.max(axis=0), axis=1)
        table[op] = [{"size_bytes": size, "time_s": float(t), "busbw_bytes_per_s": costs.bus_bandwidth(size, t, world_size, op)}
                     for size, t in zip(sizes, medians)]
    return table


def ring_against_gloo(world_size: int, size: int, repeats: int) -> dict:
    from grader.student import StudentCode

    course = StudentCode.from_notebook(str(REPO / "solutions" / "02_data_parallel.ipynb"))
    times = {label: float(all_reduce_times(all_reduce, world_size, [size], repeats)[0])
             for label, all_reduce in (("course ring", course.ring_all_reduce), ("gloo all_reduce", dist.all_reduce))}
    return {"world_size": world_size, "size_bytes": size, "times_s": times,
            "ratio": times["gloo all_reduce"] / times["course ring"]}


def _per_parameter_on_rank(rank, world_size, widths, steps, average):
    from dtp.common.models import tiny_mlp

    model = tiny_mlp(widths, seed=0)
    inputs = torch.randn(16, widths[0])
    samples = []
    for _ in range(steps):
        model.zero_grad()
        model(inputs).square().mean().backward()
        dist.barrier()
        started = time.perf_counter()
        average(model)
        samples.append(time.perf_counter() - started)
    return samples


def data_parallel_variants(world_size: int, steps: int) -> dict:
    """Many small parameters (40 layers of 32 × 32): synchronisation time per step."""
    from grader.student import StudentCode

    course = StudentCode.from_notebook(str(REPO / "solutions" / "02_data_parallel.ipynb"))
    widths = (32,) * 41
    per_rank = np.array(run_world(_per_parameter_on_rank, world_size, (widths, steps, course.average_gradients)))
    per_parameter = float(np.median(per_rank.max(axis=0)[1:]))
    after = exposed_communication("after_backward", course.average_gradients, widths, batch=16, steps=steps)
    bucketed = exposed_communication("bucketed", course.BucketedDDP, widths, batch=16, steps=steps,
                                     bucket_cap_bytes=64 * 2**10)
    return {"world_size": world_size, "parameters": 2 * (len(widths) - 1),
            "per_parameter_sync_s": per_parameter, "after_backward": after, "bucketed_64KiB": bucketed}


def _world_cost_on_rank(rank, world_size, size):
    tensor = torch.ones(size // 4)
    dist.all_reduce(tensor)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB


def world_growth(sizes=(2, 4, 8), repeats: int = 3) -> list[dict]:
    """Wall time to start a gloo world, all-reduce 4 MiB and end it, and the memory of its ranks."""
    rows = []
    for world_size in sizes:
        times, peaks = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            peaks.append(run_world(_world_cost_on_rank, world_size, (4 * 2**20,)))
            times.append(time.perf_counter() - started)
        rows.append({"world_size": world_size, "wall_s": statistics.median(times),
                     "max_rss_per_rank_mib": max(max(p) for p in peaks) / 1024,
                     "sum_rss_mib": max(sum(p) for p in peaks) / 1024})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats (a smoke test)")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else 7
    sizes = [1 << k for k in (range(12, 27, 2) if not args.quick else (12, 20))]  # 4 KiB to 64 MiB
    results = {"machine": machine(), "generated": time.strftime("%Y-%m-%d"), "quick": args.quick,
               "memory_copy_bytes_per_s": memory_copy_bandwidth(), "collectives": {}}
    for world_size in (2, 4, 8):
        print(f"collectives, {world_size} processes", flush=True)
        results["collectives"][str(world_size)] = collective_bandwidth(world_size, sizes, repeats)
    print("course ring against gloo", flush=True)
    results["ring_against_gloo"] = [ring_against_gloo(n, 64 * 2**20 if not args.quick else 2**20, repeats)
                                    for n in (2, 4)]
    print("data-parallel variants", flush=True)
    results["data_parallel"] = data_parallel_variants(2, 5 if args.quick else 11)
    print("world growth", flush=True)
    results["world_growth"] = world_growth(repeats=repeats)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.output.relative_to(REPO) if args.output.is_relative_to(REPO) else args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
