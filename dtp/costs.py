"""Closed-form communication costs. The book prints these numbers and the grader uses them as
oracles; tests/test_costs.py checks each one against a count or a measurement.

Conventions: S is the message size in bytes (the whole tensor each rank contributes), n the
number of ranks, alpha the latency of one message in seconds, bandwidth in bytes per second.
"""
from __future__ import annotations


def ring_all_reduce_bytes_per_rank(n: int, size_bytes: float) -> float:
    """Bytes each rank sends in a ring all-reduce: (n-1)/n·S in the reduce-scatter, the same again
    in the all-gather, so 2(n-1)/n·S in all (when S divides evenly into n chunks)."""
    return 2 * (n - 1) / n * size_bytes


def ring_all_reduce_time(n: int, size_bytes: float, alpha_s: float, bandwidth_bytes_per_s: float) -> float:
    """alpha-beta model of a ring all-reduce: 2(n-1) sequential steps, each sending a chunk of
    S/n bytes to the right neighbour: T = 2(n-1)·alpha + 2(n-1)/n · S/bandwidth."""
    if n == 1:
        return 0.0
    return 2 * (n - 1) * alpha_s + ring_all_reduce_bytes_per_rank(n, size_bytes) / bandwidth_bytes_per_s


def algorithm_bandwidth(size_bytes: float, time_s: float) -> float:
    """algbw = S / t, what a user sees: bytes reduced per second."""
    return size_bytes / time_s


def bus_bandwidth(size_bytes: float, time_s: float, n: int) -> float:
    """busbw = algbw · 2(n-1)/n: the bytes each rank's link carried per second during a ring
    all-reduce (the nccl-tests convention), comparable with the link's own bandwidth for any n."""
    return algorithm_bandwidth(size_bytes, time_s) * 2 * (n - 1) / n


def ddp_bucket_sizes(parameter_bytes: list[int], bucket_cap_bytes: int) -> list[int]:
    """Bytes of each gradient bucket, in the order they fill, by the rule of torch's DDP
    (`_compute_bucket_assignment_by_size`): walk the parameters in reverse registration order (the
    order backward produces their gradients in a sequential model), add each to the open bucket,
    and close the bucket once it holds at least the cap. A bucket can therefore exceed the cap by
    up to one parameter. One all-reduce per bucket per step. (DDP also gives its first bucket a
    1 MiB cap when the default cap is used, and puts everything in one bucket in the first
    iteration; see the book.)"""
    buckets: list[int] = []
    current = 0
    for size in reversed(parameter_bytes):
        current += size
        if current >= bucket_cap_bytes:
            buckets.append(current)
            current = 0
    if current:
        buckets.append(current)
    return buckets


def ddp_bucket_count(parameter_bytes: list[int], bucket_cap_bytes: int) -> int:
    """All-reduces per step of bucketed data parallelism (see ddp_bucket_sizes)."""
    return len(ddp_bucket_sizes(parameter_bytes, bucket_cap_bytes))
