"""The course's multi-process programs as command-line demos, one per chapter. Each runs the
course's own solutions on a real process group and prints what it checked:

    python -m dtp.demos dp                          # forks the ranks on this machine (gloo)
    torchrun --nproc-per-node 4 -m dtp.demos dp     # the same program, ranks started by torchrun
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m dtp.demos dp

Under torchrun each process is one rank (dtp.world.run_world joins the launcher's world through
env://, with NCCL for CUDA tensors when the machine has GPUs); only the global rank 0 prints.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .models import regression_batch, state_as_numpy, tiny_mlp
from .world import launched_by_torchrun, run_world

SOLUTIONS = Path(__file__).resolve().parent.parent / "solutions"


def course_solutions(notebook: str):
    """The course's solution of a chapter, as importable definitions (trusted code)."""
    from grader.student import StudentCode

    return StudentCode.from_notebook(str(SOLUTIONS / notebook))


def _data_parallel_rank(rank, world_size, steps=3):
    course = course_solutions("02_data_parallel.ipynb")
    tensor = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    expected = tensor.clone()
    dist.all_reduce(expected)
    course.ring_all_reduce(tensor)
    ring_error = float((tensor - expected).abs().max())
    model, reference = tiny_mlp(seed=rank, input_scaling=True), tiny_mlp(seed=0, input_scaling=True)
    course.broadcast_parameters(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(steps):
        inputs, targets = regression_batch(8 * world_size, 8, 4, seed=step)
        shard = slice(rank * 8, (rank + 1) * 8)
        for m, x, y in ((model, inputs[shard], targets[shard]), (reference, inputs, targets)):
            torch.nn.functional.mse_loss(m(x), y).backward()
        course.average_gradients(model)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    mine, single = state_as_numpy(model), state_as_numpy(reference)
    return ring_error, max(float(np.abs(mine[k] - single[k]).max()) for k in single)


def data_parallel(world_size: int) -> str:
    results = run_world(_data_parallel_rank, world_size)
    ring, training = max(r[0] for r in results), max(r[1] for r in results)
    return (f"{world_size} ranks: the course's ring all-reduce equals dist.all_reduce (largest difference {ring:.1e}); "
            f"data-parallel SGD equals single-process training (largest difference {training:.1e})")


DEMOS = {"dp": (4, data_parallel)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtp.demos", description=__doc__.splitlines()[0])
    parser.add_argument("chapter", choices=sorted(DEMOS))
    parser.add_argument("--processes", type=int, help="world size (default: the demo's own; under torchrun: "
                                                      "the launcher's)")
    args = parser.parse_args(argv)
    default, demo = DEMOS[args.chapter]
    world_size = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else (args.processes or default)
    summary = demo(world_size)
    if not launched_by_torchrun() or dist.get_rank() == 0:
        print(f"{args.chapter}: {summary}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
