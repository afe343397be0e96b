"""dtp.common.timeline: one ordered record of what a rank computed and communicated, and its
replay on a logical clock."""
import pytest
import torch
import torch.distributed as dist

from dtp.common.timeline import Deadlock, Timeline, replay
from dtp.common.world import run_world


def tagged_exchange(rank, world_size):
    """Rank 0 sends two tagged messages and multiplies between them; rank 1 receives them in
    the other order of tags."""
    log = Timeline()
    x = torch.ones(2, 3)
    with log, log.matrix_products():
        if rank == 0:
            first = dist.isend(x, 1, tag=7)
            log.computed("F", micro_batch=0)
            x @ x.T
            second = dist.isend(x, 1, tag=9)
            first.wait()
            second.wait()
        else:
            dist.recv(x, 0, tag=7)
            dist.recv(x, 0, tag=9)
    return log.kept(("op", "peer", "tag", "of", "micro_batch", "rows"))


def test_a_timeline_keeps_compute_messages_tags_and_waits_in_issue_order():
    sender, receiver = run_world(tagged_exchange, 2)
    assert sender == [{"op": "send", "peer": 1, "tag": 7}, {"op": "F", "micro_batch": 0},
                      {"op": "compute", "rows": 2}, {"op": "send", "peer": 1, "tag": 9},
                      {"op": "wait", "of": 0}, {"op": "wait", "of": 3}]
    assert [(e["op"], e.get("tag")) for e in receiver if e["op"] == "recv"] == [("recv", 7), ("recv", 9)]


def test_the_replay_waits_a_receive_until_its_send_is_issued():
    sender = [{"op": "F"}, {"op": "send", "peer": 1, "tag": 0}]
    receiver = [{"op": "recv", "peer": 0, "tag": 0}, {"op": "wait", "of": 0}, {"op": "F"}]
    replayed = replay([sender, receiver], {"F": 2.0})
    assert replayed["intervals"] == [[(0.0, 2.0, "F")], [(2.0, 4.0, "F")]]
    assert replayed["delays"] == [(1, 0.0, 2.0, 0, 1)]


def test_the_replay_names_the_waits_of_a_deadlock():
    # each rank waits for the other's message before sending its own
    first = [{"op": "recv", "peer": 1, "tag": 0}, {"op": "wait", "of": 0}, {"op": "send", "peer": 1, "tag": 0}]
    second = [{"op": "recv", "peer": 0, "tag": 0}, {"op": "wait", "of": 0}, {"op": "send", "peer": 0, "tag": 0}]
    with pytest.raises(Deadlock) as raised:
        replay([first, second], {})
    assert raised.value.stuck == {0: 1, 1: 1}


def test_the_replay_matches_messages_by_tag():
    # the receiver waits for tag 1 first; the sender issues tag 1 only after a long compute
    sender = [{"op": "send", "peer": 1, "tag": 0}, {"op": "F"}, {"op": "send", "peer": 1, "tag": 1}]
    receiver = [{"op": "recv", "peer": 0, "tag": 1}, {"op": "wait", "of": 0}, {"op": "F"}]
    assert replay([sender, receiver], {"F": 3.0})["intervals"][1] == [(3.0, 6.0, "F")]
