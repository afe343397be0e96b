"""Every closed form of dtp.tp.tensor_parallel (the numbers the tensor-parallelism page prints)
against a count on a real gloo world running the course's solution, a FLOP counter, or the
memory chapter's formula; and the measuring tools the checks rely on."""
import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from conftest import REPO, solution_path
from dtp.memory import formulas as memory
from dtp.tp import tensor_parallel as tp
from dtp.memory.activations import saved_activation_bytes
from dtp.common.gpt import Block, GPTConfig
from dtp.common.traffic import CommunicationLog
from dtp.common.world import run_world
from grader.checks.common import events_as_data
from grader.student import StudentCode


@pytest.fixture(scope="module")
def course():
    return StudentCode.from_notebook(str(solution_path("tp")))


@pytest.fixture(scope="module")
def course_ring():
    return StudentCode.from_notebook(str(solution_path("dp"))).ring_all_reduce


def test_shard_bounds_follow_tensor_split():
    for size in range(0, 23):
        for parts in range(1, 7):
            pieces = torch.arange(size).tensor_split(parts)
            for index, piece in enumerate(pieces):
                start, stop = tp.shard_bounds(size, parts, index)
                assert list(range(start, stop)) == piece.tolist()


def test_gelu_numpy_is_torchs_exact_gelu():
    x = np.linspace(-6, 6, 241)
    assert np.allclose(tp.gelu_numpy(x), torch.nn.functional.gelu(torch.from_numpy(x)).numpy(), rtol=1e-12, atol=1e-14)


def test_random_block_values_say_where_they_sit():
    block = tp.random_block(hidden=16, heads=4, seed=3)
    vectors = torch.cat([p.detach() for p in block.parameters() if p.dim() == 1])
    assert len(torch.unique(vectors)) == len(vectors)  # LayerNorms included: no ones, no zeros
    for matrix in (p.detach() for p in block.parameters() if p.dim() == 2):
        assert torch.unique(matrix, dim=0).shape == torch.unique(matrix, dim=1).shape == matrix.shape
    assert tp.random_block(hidden=64, heads=4, seed=0) is not None  # large blocks too (their matrices do repeat values)
    assert all(torch.equal(a, b) for a, b in zip(block.parameters(), tp.random_block(16, 4, 3).parameters()))


def _block_traffic(rank, world_size, block_class, ring, x, sequence_parallel):
    block = tp.random_block(x.shape[-1], 4, 0)
    parallel = block_class(block)
    if ring is not None:
        dist.all_reduce = ring  # the data-parallel chapter's ring (send/recv), so every sent byte is counted
    if sequence_parallel:
        x = x.chunk(world_size, dim=1)[rank]
    x = x.clone().requires_grad_()
    with CommunicationLog() as log:
        log.mark("forward")
        out = parallel(x)
        log.mark("backward")
        out.backward(torch.ones_like(out))
        log.mark("done")
    events = events_as_data(log)
    return {"forward": tp.summarize(tp.events_between(events, "forward", "backward")),
            "backward": tp.summarize(tp.events_between(events, "backward", "done")), "sent": log.bytes_sent}


@pytest.mark.parametrize("t", [2, 4])
def test_two_all_reduces_of_bsh_values_per_pass(course, t):
    batch, seq, hidden = 2, 3, 16
    x = torch.randn(batch, seq, hidden)
    size = tp.all_reduce_message_bytes(batch * seq, hidden, bytes_per_element=4)
    for outcome in run_world(_block_traffic, t, (course.TensorParallelBlock, None, x, False)):
        for phase, count in tp.ALL_REDUCES_PER_LAYER.items():
            assert outcome[phase] == {"all_reduce": [size] * count}


@pytest.mark.parametrize("t", [2, 4])
def test_ring_traffic_per_gpu_is_what_a_ring_sends(course, course_ring, t):
    batch, seq, hidden = 2, 4, 16  # b·s·h divisible by t: equal chunks
    x = torch.randn(batch, seq, hidden)
    sent = [o["sent"] for o in run_world(_block_traffic, t, (course.TensorParallelBlock, course_ring, x, False))]
    assert sent == [tp.ring_bytes_per_gpu_per_layer(batch * seq, hidden, t, bytes_per_element=4)] * t
    forward_only = tp.ring_bytes_per_gpu_per_layer(batch * seq, hidden, t, 4, passes=("forward",))
    assert forward_only * 2 == sent[0]


def keeping_gathered_inputs(course):
    """The tensor-parallel block with the sequence-parallel operators and nothing else: autograd
    keeps the column-parallel layers' gathered inputs, and backward does not gather again."""
    return functools.partial(course.TensorParallelBlock, enter=course.gather_sequence, leave=course.reduce_scatter_sequence)


@pytest.mark.parametrize("t", [2, 4])
def test_sequence_parallelism_sends_what_tensor_parallelism_sends_plus_the_regather(course, t):
    """An all-gather of S/t per rank forwards t-1 pieces: (t-1)/t·S; a reduce-scatter of S sends
    (t-1)/t·S in a ring: together the 2(t-1)/t·S of the all-reduce they replace. Gathering the
    kept piece again in backward (exercise 5) adds 2 all-gathers to the backward: 10(t-1)/t·S,
    a quarter more than tensor parallelism (issue 21, 3)."""
    batch, seq, hidden = 2, 4, 16
    x = torch.randn(batch, seq, hidden)
    tensor_parallel = tp.ring_bytes_per_gpu_per_layer(batch * seq, hidden, t, 4)
    for block, regather in ((keeping_gathered_inputs(course), False), (course.SequenceParallelBlock, True)):
        for outcome in run_world(_block_traffic, t, (block, None, x, True)):
            ring_bytes = 0.0
            for phase in ("forward", "backward"):
                assert sorted(outcome[phase]) == ["all_gather", "reduce_scatter"]
                ring_bytes += sum((t - 1) * size for size in outcome[phase]["all_gather"])
                ring_bytes += sum((t - 1) / t * size for size in outcome[phase]["reduce_scatter"])
            assert len(outcome["backward"]["all_gather"]) == (4 if regather else 2)
            assert ring_bytes == pytest.approx(tp.sequence_parallel_ring_bytes_per_gpu_per_layer(
                batch * seq, hidden, t, 4, regather=regather))
            assert ring_bytes == pytest.approx(tensor_parallel * (1.25 if regather else 1))


def test_layer_flops_match_the_flop_counter_and_the_memory_chapter():
    batch, seq, hidden, heads = 2, 64, 128, 4
    block = Block(GPTConfig(hidden=hidden, n_heads=heads, dropout=0.0))
    x = torch.randn(batch, seq, hidden, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        block(x).sum().backward()
    assert counter.get_total_flops() == tp.layer_training_flops(batch * seq, seq, hidden)
    config = GPTConfig(vocab_size=1, n_layers=1, hidden=hidden, n_heads=heads)
    whole_model = memory.transformer_training_flops(config, batch, seq)
    assert whole_model - 6 * batch * seq * hidden == tp.layer_training_flops(batch * seq, seq, hidden)


def test_sequence_parallel_saving_is_10sbh_times_1_minus_1_over_t():
    rng = np.random.default_rng(0)
    for _ in range(20):
        s, b, heads, t = int(rng.integers(1, 5000)), int(rng.integers(1, 9)), int(rng.integers(1, 65)), int(rng.integers(1, 17))
        h = heads * int(rng.integers(1, 257))
        assert tp.sequence_parallel_saving_bytes(s, b, h, heads, t) == pytest.approx(10 * s * b * h * (1 - 1 / t))
    # in fp16 with 1-byte masks, the CPU accounting's LayerNorm inputs, masks and gathered inputs are the paper's 10sbh
    s, b, h, t = 512, 2, 256, 4
    paper_terms = tp.sequence_parallel_saving_on_cpu(s, b, h, t, 2, dropout=False, regather=True) \
        - 2 * 2 * 2 * s * b * (1 - 1 / t) + 1 * s * b * h * 2 * (1 - 1 / t)  # LayerNorm statistics out, 1-byte masks in
    assert paper_terms == pytest.approx(tp.sequence_parallel_saving_bytes(s, b, h, 8, t))


def _saved_bytes(rank, world_size, tensor_parallel_class, keeping_class, sequence_parallel_class, shape, dtype,
                 dropout):
    batch, seq, hidden = shape
    block = tp.random_block(hidden, 4, 0, dropout=dropout).to(dtype).train()
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    piece = x.detach().chunk(world_size, dim=1)[rank].clone().requires_grad_()
    return (saved_activation_bytes(tensor_parallel_class(block).train(), x),
            saved_activation_bytes(keeping_class(block).train(), piece),
            saved_activation_bytes(sequence_parallel_class(block).train(), piece))


@pytest.mark.parametrize("t, dtype, dropout", [(2, torch.bfloat16, 0.1), (4, torch.float32, 0.0)])
def test_measured_sequence_parallel_saving_term_by_term(course, t, dtype, dropout):
    shape = (2, 16, 32)
    element_bytes = torch.finfo(dtype).bits // 8
    tensor_parallel, keeping, regathering = run_world(
        _saved_bytes, t, (course.TensorParallelBlock, keeping_gathered_inputs(course), course.SequenceParallelBlock,
                          shape, dtype, dropout))[0]
    s, b, h = shape[1], shape[0], shape[2]
    assert tensor_parallel - keeping == tp.sequence_parallel_saving_on_cpu(
        s, b, h, t, element_bytes, dropout=dropout > 0, regather=False)
    assert tensor_parallel - regathering == tp.sequence_parallel_saving_on_cpu(
        s, b, h, t, element_bytes, dropout=dropout > 0, regather=True)


def _kept_rows(rank, world_size, block_class, x):
    block = tp.random_block(x.shape[-1], 4, 0)
    parallel = block_class(block)
    piece = x.chunk(world_size, dim=1)[rank].clone().requires_grad_()
    with tp.SavedForBackward(parallel) as saved:
        parallel(piece)
    with torch.no_grad():
        gathered = block.norm1(x)  # what the QKV projection's all-gather produces
    others = torch.cat([p for r, p in enumerate(gathered.chunk(world_size, dim=1)) if r != rank], dim=1)
    rows = others.reshape(-1, x.shape[-1]).double().numpy()
    return max(tp.rows_found(kept, rows, 1e-5) for kept in saved.tensors), len(rows)


def test_saved_for_backward_sees_the_gathered_input_only_where_it_is_kept(course):
    x = torch.randn(2, 4, 16)
    for found, rows in run_world(_kept_rows, 2, (keeping_gathered_inputs(course), x)):
        assert found == rows  # the whole gathered sequence, as a (b·s, h) matrix multiply input
    for found, rows in run_world(_kept_rows, 2, (course.SequenceParallelBlock, x)):
        assert found == 0


def _loss_traffic(rank, world_size, cross_entropy, logits, targets):
    start, stop = tp.shard_bounds(logits.shape[1], world_size, rank)
    with CommunicationLog() as log, tp.TensorShapes() as shapes:
        cross_entropy(logits[:, start:stop].clone().requires_grad_(), targets, start).sum().backward()
    return [event["bytes"] for event in log.of("all_reduce")], shapes.shapes


def test_the_loss_all_reduces_three_numbers_per_token_and_never_the_logits(course):
    tokens, vocab = 5, 37
    logits, targets = torch.randn(tokens, vocab), torch.randint(0, vocab, (tokens,))
    for sizes, shapes in run_world(_loss_traffic, 3, (course.vocab_parallel_cross_entropy, logits, targets)):
        assert sum(sizes) == tp.vocab_parallel_loss_bytes(tokens, 4) and len(sizes) == 3
        assert {(tokens, 12), (tokens, 13)} & set(shapes) and not any(vocab in shape for shape in shapes)


def test_tensor_shapes_sees_backward_and_does_not_import_dynamo():
    x = torch.randn(3, 7, requires_grad=True)
    with tp.TensorShapes() as shapes:
        (x.exp() * 2).sum().backward()
    assert (3, 7) in shapes.shapes and () in shapes.shapes
    assert not hasattr(tp.TensorShapes.__torch_dispatch__, "__wrapped__")  # not wrapped in dynamo's disable


def test_a_reduce_scatter_then_all_gather_counts_as_one_all_reduce():
    events = [{"op": "reduce_scatter", "bytes": 64}, {"op": "all_gather", "bytes": 16}, {"op": "all_gather", "bytes": 8},
              {"op": "all_reduce", "bytes": 4}]
    assert tp.summarize(tp.as_all_reduces(events)) == {"all_reduce": [64, 4], "all_gather": [8]}


def test_link_figures_keep_directions_and_bits_apart():
    assert tp.NVLINK4_PER_DIRECTION_BYTES_PER_S == 450e9
    assert tp.gigabits_to_bytes_per_s(tp.INFINIBAND_NDR_GBIT_PER_S) == 50e9
    traffic = tp.ring_bytes_per_gpu_per_layer(4096, 8192, 8, 2)
    assert traffic == 448 * 2**20  # the source notes' example: 4 all-reduces of 64 MiB, 7/4 of each sent
    assert tp.layer_communication_time_s(4096, 8192, 8, 50e9) == pytest.approx(traffic / 50e9)


def test_communication_to_compute_ratio_is_the_two_times_of_a_layer():
    """The ratio the costs exercise asks for: the link time of the layer's ring traffic over the
    GPU's 1/t of the layer's FLOPs (counted by FlopCounterMode above), whatever the tokens."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        seq, hidden, t = int(rng.integers(1, 8193)), int(rng.integers(1, 200)) * 64, int(rng.integers(2, 17))
        element, link, flops = int(rng.choice([2, 4])), float(rng.uniform(1e10, 1e12)), float(rng.uniform(1e13, 1e15))
        tokens = int(rng.integers(1, 100)) * seq
        communication = tp.layer_communication_time_s(tokens, hidden, t, link, element)
        compute = tp.layer_training_flops(tokens, seq, hidden) / t / flops
        assert tp.communication_to_compute_ratio(seq, hidden, t, element, link, flops) == pytest.approx(communication / compute)


def _overlappable(rank, world_size, block_class, x, sequence_parallel):
    blocks = [block_class(tp.random_block(x.shape[-1], 4, seed)) for seed in (0, 1)]
    x = (x.chunk(world_size, dim=1)[rank] if sequence_parallel else x).clone().requires_grad_()
    with tp.Dataflow() as flow:
        out = blocks[1](blocks[0](x))
        middle = flow.mark()
        out.backward(torch.ones_like(out))
    return flow.overlappable_matmuls(0, middle), flow.overlappable_matmuls(middle, flow.mark())


def test_forward_collectives_feed_the_next_matmul_backward_ones_can_overlap_weight_gradients(course):
    """The page's claim (issue 21, 1): in forward no matrix multiply is independent of g's
    all-reduce (its output feeds the residual, the LayerNorm and the next GEMM); in backward each
    input-gradient all-reduce can run beside weight-gradient GEMMs, and the sequence-parallel
    re-gather beside the input-gradient GEMMs."""
    x = torch.randn(2, 4, 16)
    forward, backward = run_world(_overlappable, 2, (course.TensorParallelBlock, x, False))[0]
    assert [op for op, _ in forward] == ["allreduce_"] * 4 and all(free == 0 for _, free in forward)
    assert [op for op, _ in backward] == ["allreduce_"] * 4 and all(free >= 2 for _, free in backward)
    forward, backward = run_world(_overlappable, 2, (course.SequenceParallelBlock, x, True))[0]
    assert all(free == 0 for _, free in forward)
    assert sum(op == "_allgather_base_" and free > 0 for op, free in backward) >= 4  # the re-gathers, at least


def test_dataflow_follows_views_and_in_place_results():
    a = torch.randn(4, 4)
    with tp.Dataflow() as flow:
        b = a @ a            # independent of the in-place chain below
        c = a.clone()
        c.mul_(2)            # in place: c's producer is now mul_
        d = c.view(16) @ torch.ones(16)
    names = [name for name, _ in flow.nodes]
    assert flow.nodes[names.index("mul_")][1] == {names.index("clone")}
    assert names.index("view") in flow.nodes[names.index("dot")][1]
    assert flow.nodes[names.index("view")][1] == {names.index("mul_")}  # the view reads the in-place result
    assert flow.nodes[names.index("mm")][1] == set()
    assert b.shape == (4, 4) and d.shape == ()


def _dtensor_counts(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mlp = parallelize_module(tp.random_block(16, 4, seed=0).mlp, init_device_mesh("cpu", (world_size,)),
                             {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(2, 3, 16, requires_grad=True)
    with CommDebugMode() as comm, CommunicationLog() as log:
        mlp(x).sum().backward()
    collectives = log.of("all_reduce", "all_gather", "reduce_scatter")
    return comm.get_total_counts(), len(collectives), all(event.get("functional") for event in collectives)


def test_the_communication_log_sees_every_dtensor_collective():
    """The page states how many of DTensor's collectives the log saw (issue 21, 2): on the pinned
    torch, all of them, as functional collectives, one all-reduce per pass."""
    for counted, logged, functional in run_world(_dtensor_counts, 2):
        assert counted == logged == 2 and functional


def _dropout_masks(rank, world_size, seed):
    rng = tp.ModelParallelRNG(seed, rank)
    ones = torch.ones(2, 4, 8, 8)
    with rng.parallel_region():
        inside = [torch.nn.functional.dropout(ones, 0.5) > 0 for _ in range(2)]
    outside = torch.nn.functional.dropout(ones, 0.5) > 0
    with rng.parallel_region():
        inside.append(torch.nn.functional.dropout(ones, 0.5) > 0)
    return inside, outside


def test_model_parallel_rng_draws_the_same_outside_and_different_inside_the_regions():
    """Issue 21, 4: the replicated regions draw one mask on every TP rank, the parallel regions
    independent ones, and each stream continues where it stopped (no mask repeats)."""
    (inside_0, outside_0), (inside_1, outside_1) = run_world(_dropout_masks, 2, (7,))
    assert torch.equal(outside_0, outside_1)
    masks = inside_0 + inside_1 + [outside_0]
    assert all(not torch.equal(a, b) for i, a in enumerate(masks) for b in masks[i + 1:])
    torch.manual_seed(7)  # the default stream is the plain seed: a rank outside TP draws the same
    assert torch.equal(torch.nn.functional.dropout(torch.ones(2, 4, 8, 8), 0.5) > 0, outside_0)


def test_communication_to_compute_ratio_grows_with_t_and_falls_with_h():
    """The page's derivation (issue 21, 5): 2(t-1)·e·F / (3·B·(6h + s)) for the 4h MLP, whatever
    the tokens; the page's example gives about 0.38 on NVLink and 9 times that on InfiniBand."""
    for seq, hidden, t, element, link, flops in [(4096, 8192, 8, 2, 450e9, 989.4e12), (1024, 2048, 2, 4, 50e9, 312e12)]:
        closed_form = 2 * (t - 1) * element * flops / (3 * link * (6 * hidden + seq))
        assert tp.communication_to_compute_ratio(seq, hidden, t, element, link, flops) == pytest.approx(closed_form)
    ratio = functools.partial(tp.communication_to_compute_ratio, bytes_per_element=2, link_bytes_per_s=450e9,
                              flops_per_s=989.4e12)
    by_t = [ratio(4096, 8192, t) for t in (2, 4, 8, 16)]
    by_h = [ratio(4096, h, 8) for h in (2048, 4096, 8192, 16384)]
    assert by_t == sorted(by_t) and by_h == sorted(by_h, reverse=True)
    assert ratio(4096, 8192, 8) == pytest.approx(0.385, abs=1e-3)
    assert ratio(4096, 8192, 8, link_bytes_per_s=50e9) == pytest.approx(9 * ratio(4096, 8192, 8))


def test_grouped_query_attention_splits_by_query_heads_and_replicates_fewer_kv_heads():
    """Issue 21, 6: t divides the query heads; KV heads are split when t divides them and
    replicated on t/k GPUs when k < t, and then the replicas' KV gradients must be summed."""
    assert [tuple(map(list, tp.kv_heads_of_rank(8, 2, 4, r))) for r in range(4)] == \
        [([0, 1], [0]), ([2, 3], [0]), ([4, 5], [1]), ([6, 7], [1])]
    assert [list(tp.kv_heads_of_rank(64, 8, 8, r)[1]) for r in range(8)] == [[r] for r in range(8)]
    for query_heads, kv_heads, t in [(8, 3, 2), (8, 2, 3), (6, 4, 2), (16, 4, 8 * 3)]:
        with pytest.raises(ValueError):
            tp.kv_heads_of_rank(query_heads, kv_heads, t, 0)
    for query_heads, kv_heads, t in [(8, 8, 4), (8, 4, 2), (8, 2, 4), (8, 1, 8), (16, 4, 8)]:
        errors = tp.grouped_query_attention_split(query_heads, kv_heads, t)
        assert max(errors["output"], errors["query_gradient"], errors["kv_gradient_summed"]) < 1e-12
        assert (errors["kv_gradient_one_replica"] > 0.1) == (kv_heads < t)


def _recomputed_traffic(rank, world_size, block_class, x, reentrant, early_stop):
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    parallel = block_class(tp.random_block(x.shape[-1], 4, 0))
    x = x.clone().requires_grad_()
    with CommunicationLog() as log:
        log.mark("forward")
        with set_checkpoint_early_stop(early_stop):
            out = checkpoint(parallel, x, use_reentrant=reentrant)
        log.mark("backward")
        out.backward(torch.ones_like(out))
        log.mark("done")
    events = events_as_data(log)
    return {"forward": tp.summarize(tp.events_between(events, "forward", "backward")),
            "backward": tp.summarize(tp.events_between(events, "backward", "done"))}


@pytest.mark.parametrize("reentrant, early_stop, backward", [(True, True, 4), (False, False, 4), (False, True, 3)])
def test_full_recomputation_issues_the_forward_all_reduces_again(course, reentrant, early_stop, backward):
    """Issue 21, 7: a fully recomputed TP layer all-reduces 2 times in forward and 4 in backward
    (the page's 6 per layer). On the pinned torch, the non-reentrant checkpoint's default early
    stop ends the recomputation once backward has what it needs, before the layer's last g:
    3 in backward. The page measures all three."""
    x = torch.randn(2, 3, 16)
    size = tp.all_reduce_message_bytes(6, 16, bytes_per_element=4)
    full = tp.all_reduces_per_layer(full_recomputation=True)
    assert full == {"forward": 2, "backward": 4} and tp.all_reduces_per_layer() == tp.ALL_REDUCES_PER_LAYER
    for outcome in run_world(_recomputed_traffic, 2, (course.TensorParallelBlock, x, reentrant, early_stop)):
        assert outcome == {"forward": {"all_reduce": [size] * 2}, "backward": {"all_reduce": [size] * backward}}


def test_every_source_the_page_cites_is_in_the_bibliography():
    """The chapter's vendor and paper claims (issue 21, 6 and 8: GQA, the NVLink domains of the H100
    generation) rest on citations; each key must resolve in references.bib. The chapter is two
    pages: the layer-level derivation and its practice (sequences, vocabularies, links)."""
    import re

    root = REPO
    page = "".join((root / "book" / name).read_text() for name in ("tensor_parallel.md", "tensor_parallel_practice.md"))
    keys = {key.strip() for group in re.findall(r"\{cite:[pt]\}`([^`]+)`", page) for key in group.split(",")}
    entries = set(re.findall(r"^@\w+\{([^,]+),", (root / "references.bib").read_text(), re.M))
    assert {"ainslie2023gqa", "nvidia2022nvswitch", "nvidia2023gh200nvl32", "nvidia2024nvlink"} <= keys
    assert keys <= entries, keys - entries
