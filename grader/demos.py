"""The course's multi-process programs as command-line demos, one per chapter. Each runs the
course's own solutions on a real process group and prints what it checked:

    python -m grader.demos dp                          # forks the ranks on this machine (gloo)
    torchrun --nproc-per-node 4 -m grader.demos dp     # the same program, ranks started by torchrun
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m grader.demos dp

Under torchrun each process is one rank (dtp.common.world.run_world joins the launcher's world through
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

from dtp.common.models import regression_batch, state_as_numpy, tiny_mlp
from dtp.common.world import launched_by_torchrun, run_world

SOLUTIONS = Path(__file__).resolve().parent.parent / "solutions"


def course_solutions(notebook: str):
    """The course's solution of a chapter, as importable definitions (trusted code)."""
    from .student import StudentCode

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


def _tensor_parallel_rank(rank, world_size, hidden=32, heads=4, batch=2, seq=8):
    from dtp.tp.tensor_parallel import random_block

    course = course_solutions("03_tensor_parallel.ipynb")
    dense = random_block(hidden, heads, seed=0)  # the same dense block on every rank
    split = course.TensorParallelBlock(dense)
    x = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x_split = x.detach().clone().requires_grad_()
    upstream = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(2))
    (dense(x) * upstream).sum().backward()
    output = split(x_split)
    (output * upstream).sum().backward()
    return float((output - dense(x)).abs().max()), float((x_split.grad - x.grad).abs().max())


def tensor_parallel(world_size: int) -> str:
    results = run_world(_tensor_parallel_rank, world_size)
    return (f"{world_size} ranks: a transformer block split by heads and MLP columns/rows equals the dense block "
            f"(output {max(r[0] for r in results):.1e}, input gradient {max(r[1] for r in results):.1e})")


def pipeline_parallel(world_size: int, micro_batches: int = 8) -> str:
    from dtp.pp.schedules import bubble_fraction, idle_fraction, run_sleeping_pipeline

    course = course_solutions("04_pipeline_parallel.ipynb")
    logs = run_sleeping_pipeline(course.one_f_one_b_step, world_size, micro_batches, 0.02, 0.04)
    measured = idle_fraction([[(start, end) for _, _, start, end in log] for log in logs])
    return (f"{world_size} ranks: 1F1B with {micro_batches} micro-batches (stages sleeping instead of computing) idled "
            f"{measured:.1%} of the step, against (p-1)/(m+p-1) = {bubble_fraction(world_size, micro_batches):.1%}")


def _expert_parallel_rank(rank, world_size, local_experts=2, tokens=24, width=8, hidden=16):
    from dtp.ep.moe import moe_layer_torch

    course = course_solutions("05_expert_parallel.ipynb")
    weights = np.random.default_rng(5)
    experts = local_experts * world_size
    router = weights.standard_normal((width, experts)).astype(np.float32)
    w_in = weights.standard_normal((experts, width, hidden)).astype(np.float32)
    w_out = weights.standard_normal((experts, hidden, width)).astype(np.float32)
    x = np.random.default_rng(50 + rank).standard_normal((tokens, width)).astype(np.float32)
    mine = slice(rank * local_experts, (rank + 1) * local_experts)
    output = course.expert_parallel_moe(torch.from_numpy(x), torch.from_numpy(router), torch.from_numpy(w_in[mine]),
                                        torch.from_numpy(w_out[mine]), 2, None, True)
    single = moe_layer_torch(torch.from_numpy(x), torch.from_numpy(router), torch.from_numpy(w_in),
                             torch.from_numpy(w_out), 2, None, True)
    return float((output - single).abs().max() / single.abs().max())


def expert_parallel(world_size: int) -> str:
    worst = max(run_world(_expert_parallel_rank, world_size))
    return (f"{world_size} ranks: a dropless top-2 mixture-of-experts layer, experts spread over the ranks with "
            f"all-to-alls, equals the single-process layer (relative difference {worst:.1e})")


def _zero_rank(rank, world_size, sizes=(8, 30, 29, 4)):
    from dtp.zero import runs as zero_runs

    course = course_solutions("06_zero.ipynb")
    return [zero_runs.train_zero_rank(rank, world_size, stage, make, sizes, 0, 100)["states"][-1]
            for stage, make in ((1, course.ZeRO1Adam), (2, course.ZeRO2Adam), (3, course.ZeRO3Module))]


def zero_redundancy(world_size: int, sizes=(8, 30, 29, 4)) -> str:
    from dtp.common.models import tiny_mlp
    from dtp.zero import formulas as zero
    from dtp.zero import runs as zero_runs

    reference = zero_runs.single_process_adam(sizes, 0, zero_runs.batches(sizes, 100, world_size), world_size)
    expected = np.concatenate([np.ravel(t) for t in reference["states"][-1].values()])
    by_rank = run_world(_zero_rank, world_size, (sizes,))
    worst = 0.0
    for stage in range(3):
        states = [rank[stage] for rank in by_rank]
        if stage < 2:  # ZeRO-1 and -2 keep the whole model on every rank
            for state in states:
                worst = max(worst, float(np.abs(np.concatenate([np.ravel(t) for t in state.values()]) - expected).max()))
        else:  # ZeRO-3 keeps one piece of each unit per rank: reassemble them
            parameter_sizes = [p.numel() for p in tiny_mlp(sizes).parameters()]
            units = zero.units_from_pieces([np.size(piece) for piece in states[0]], parameter_sizes, world_size, ordered=True)
            full = np.concatenate(zero.unshard(states, units))
            worst = max(worst, float(np.abs(full - expected).max()))
    return (f"{world_size} ranks: ZeRO-1, ZeRO-2 and ZeRO-3 trained with Adam equal single-process Adam "
            f"(largest difference {worst:.1e})")


def three_dimensional(world_size: int) -> str:
    from dtp.topology.training import run_3d

    if world_size != 8:
        raise ValueError("the topology demo is a DP × PP × TP = 2 × 2 × 2 layout: 8 processes")
    run = run_3d({"dp": 2, "pp": 2, "tp": 2}, n_steps=4)
    worst = max(abs(a - b) for a, b in zip(run["losses"], run["reference"]))
    return (f"{world_size} ranks: a tiny GPT trained with DP × PP × TP = 2 × 2 × 2 has the losses of single-process "
            f"training (largest difference {worst:.1e}; {run['losses'][0]:.3f} to {run['losses'][-1]:.3f})")


DEMOS = {"dp": (4, data_parallel), "tp": (2, tensor_parallel), "pp": (4, pipeline_parallel), "ep": (2, expert_parallel),
         "zero": (4, zero_redundancy), "topology": (8, three_dimensional)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grader.demos", description=__doc__.splitlines()[0])
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
