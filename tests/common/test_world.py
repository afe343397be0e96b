"""dtp.common.world: a real gloo world whose failures come back as one WorldError, leaving no process."""
import os

import pytest
import torch
import torch.distributed as dist

from dtp.common.world import WorldError, run_world


def live_children() -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] not in ("Z", "X"):
            children.append(int(entry))
    return children


def sum_of_ranks(rank, world_size, scale):
    tensor = torch.tensor([float(rank) * scale])
    dist.all_reduce(tensor)
    return rank, tensor.item()


def test_results_come_back_in_rank_order():
    assert run_world(sum_of_ranks, 3, (2.0,)) == [(0, 6.0), (1, 6.0), (2, 6.0)]
    assert live_children() == []


def store_kind(rank, world_size):
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return type(store).__name__


def test_the_ranks_meet_through_a_file_not_a_tcp_server():
    """torch's TCPStore server looks up the host name of every rank that connects, one after
    another, and a dropped DNS query stalls them all for the resolver's 5 s (a 64-rank world took
    11 s instead of 1; a 12-rank world sometimes timed out in grading). A FileStore asks no one."""
    assert run_world(store_kind, 2) == ["FileStore", "FileStore"]


def raises_on_rank_one(rank, world_size):
    if rank == 1:
        raise KeyError("lost")
    dist.barrier()


def raises_where_source_may_not_be_read(rank, world_size):
    """As in the grader's sandbox, where reading a guarded module's source raises a BaseException:
    the rank must still report its own error, not die formatting it."""
    import traceback

    def refuse(*args, **kwargs):
        raise BaseException("reading that source is refused")

    traceback.format_exception = refuse
    if rank == 1:
        raise NotImplementedError("write your solution here")
    dist.barrier()


def skips_the_collective(rank, world_size):
    if rank:
        dist.all_reduce(torch.ones(1))


def exits_silently(rank, world_size):
    if rank == 0:
        os._exit(0)
    dist.barrier()


def spins(rank, world_size):
    while True:
        pass


@pytest.mark.parametrize("fn, kind, fragment", [
    (raises_on_rank_one, "raised", "rank 1 raised KeyError"),
    (raises_where_source_may_not_be_read, "raised", "rank 1 raised NotImplementedError"),
    (skips_the_collective, "collective_timeout", "never joined"),
    (exits_silently, "exited", "rank 0 ended without returning"),
    (spins, "timeout", "ran past 2s"),
])
def test_failures_are_reported_and_cleaned_up(fn, kind, fragment):
    # How long it took is not asserted (a busy machine starts processes slowly); that it ended in
    # the kind of failure it is, and not in the world's own time limit, is.
    with pytest.raises(WorldError) as caught:
        run_world(fn, 3, timeout_s=2, collective_timeout_s=1.5)
    assert caught.value.kind == kind and fragment in str(caught.value)
    assert live_children() == []


def test_a_process_group_already_initialized_here_gets_an_actionable_error(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="destroy_process_group"):
            run_world(sum_of_ranks, 2, (1.0,))
    finally:
        dist.destroy_process_group()
    assert run_world(sum_of_ranks, 2, (1.0,)) == [(0, 1.0), (1, 1.0)]
