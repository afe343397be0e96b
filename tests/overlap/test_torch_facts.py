"""What the overlap pages say torch does, established on the pinned torch (dtp.overlap.torch_facts)."""
from dtp.overlap import torch_facts


def test_wait_makes_the_stream_wait_under_nccl():
    assert torch_facts.wait_blocks_the_stream_not_the_cpu()


def test_fsdp2_avoids_record_stream_and_fsdp1_uses_it():
    calls = torch_facts.record_stream_calls()
    assert calls["fsdp2"] == 0 and calls["fsdp1"] > 0


def test_fsdp2_gathers_and_reduce_scatters_on_streams_of_their_own():
    streams = torch_facts.fsdp2_streams()
    assert {"all_gather_stream", "reduce_scatter_stream"} <= set(streams)


def test_fsdp1_rate_limiter_and_ddp_bucket_cap_defaults():
    assert torch_facts.fsdp1_rate_limiter_default() is True
    assert torch_facts.ddp_bucket_cap_mb() == 25


def test_async_tp_is_a_switch_off_by_default_with_both_decompositions():
    facts = torch_facts.async_tp()
    assert facts["switch_default"] is False and facts["enable_symm_mem_for_group"]
    assert sorted(facts["fused"]) == ["fused_all_gather_matmul", "fused_matmul_reduce_scatter"]


def test_fsdp2_does_not_gather_the_root_again_at_the_start_of_backward():
    """With the last Linear left to the root, forward gathers the root and three layers, backward
    only the three layers: the root stays gathered from forward (not resharded)."""
    counts = torch_facts.gathers_per_phase(torch_facts.fsdp2_events(root_layer=True))
    assert counts == {"forward": 4, "backward": 3}
    plain = torch_facts.gathers_per_phase(torch_facts.fsdp2_events())
    assert plain == {"forward": 4, "backward": 4}  # every layer a child: each gathered again
