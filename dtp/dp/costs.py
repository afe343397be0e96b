"""Closed-form communication costs. The book prints these numbers and the grader uses them as
oracles; tests/dp/test_costs.py checks each one against a count or a measurement.

Conventions: S is the message size in bytes (the whole tensor each rank contributes), n the
number of ranks, alpha the latency of one message in seconds, bandwidth in bytes per second.
"""
from __future__ import annotations

import math


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


def tree_all_reduce_time(n: int, size_bytes: float, alpha_s: float, bandwidth_bytes_per_s: float) -> float:
    """A simple model of a tree all-reduce: reduce up a binary tree, then broadcast down, with
    the message pipelined in chunks so that each byte crosses each link once per direction:
    T = 2⌈log2 n⌉·alpha + 2·S/bandwidth. Fewer latency steps than the ring's 2(n-1), slightly more
    bytes than its 2(n-1)/n·S (two-tree schemes such as NCCL's double binary tree recover the
    ring's bandwidth term; Sanders, Speck and Träff 2009)."""
    if n == 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * alpha_s + 2 * size_bytes / bandwidth_bytes_per_s


def algorithm_bandwidth(size_bytes: float, time_s: float) -> float:
    """algbw = S / t, what a user sees: bytes reduced per second."""
    return size_bytes / time_s


# nccl-tests' bus-bandwidth correction factors (doc/PERFORMANCE.md): busbw = algbw · factor(n).
# Each is the ratio between the best time of the collective on n ranks whose links carry B bytes/s
# and S/B, assuming algorithms built from point-to-point transfers (in-network reduction, where
# switches add, has a factor of its own).
BUS_BANDWIDTH_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_reduce_in_network": lambda n: (n - 1) / (n + 1),
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def bus_bandwidth(size_bytes: float, time_s: float, n: int, collective: str = "all_reduce") -> float:
    """busbw = algbw · factor(n), nccl-tests' fixed correction of the algorithm bandwidth
    (2(n-1)/n for an all-reduce). It is applied whatever algorithm really ran, to give a figure
    that can be compared with the bottleneck link's peak bandwidth for any n; it is not a
    measurement of what each link carried."""
    return algorithm_bandwidth(size_bytes, time_s) * BUS_BANDWIDTH_FACTORS[collective](n)


def ddp_bucket_sizes(parameter_bytes: list[int], bucket_cap_bytes: int, first_bucket_cap_bytes: int | None = None) -> list[int]:
    """Bytes of each gradient bucket, in the order they fill, by the rule of torch's DDP
    (`_compute_bucket_assignment_by_size`): walk the parameters in reverse registration order (the
    order backward produces their gradients in a sequential model), add each to the open bucket,
    and close the bucket once it holds at least the cap. A bucket can therefore exceed the cap by
    up to one parameter. One all-reduce per bucket per step. `first_bucket_cap_bytes` is the
    smaller cap DDP gives its first bucket when its default cap is used (1 MiB); DDP also puts
    everything in one bucket in the first iteration (see the book)."""
    buckets: list[int] = []
    current = 0
    for size in reversed(parameter_bytes):
        current += size
        cap = first_bucket_cap_bytes if first_bucket_cap_bytes is not None and not buckets else bucket_cap_bytes
        if current >= cap:
            buckets.append(current)
            current = 0
    if current:
        buckets.append(current)
    return buckets


def ddp_bucket_count(parameter_bytes: list[int], bucket_cap_bytes: int) -> int:
    """All-reduces per step of bucketed data parallelism (see ddp_bucket_sizes)."""
    return len(ddp_bucket_sizes(parameter_bytes, bucket_cap_bytes))
