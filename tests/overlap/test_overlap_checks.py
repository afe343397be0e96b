"""Every check of the overlap chapter rejects plausible wrong answers with feedback that names the
mistake, and accepts correct answers written differently from the course's (prefetch from hooks
instead of an explicit loop, batch_isend_irecv instead of isend/irecv, a table-free DDP
simulation)."""
import pytest

from conftest import assert_fails, changed, graded, solution_cell

MODEL_CELL = solution_cell("overlap", "ddp_exposed_time")
ZERO3_CELL = solution_cell("overlap", "PrefetchZeRO3Module")
RING_CELL = solution_cell("overlap", "collective_matmul")
DDP_CELL = solution_cell("overlap", "OverlappingDDP")
INTERVIEW_CELL = solution_cell("overlap", "interview_ddp_exposed_ms")


# --- exercise 1: the exposure model ---

@pytest.mark.parametrize("old, new, feedback", [
    ("return max(allreduce_time / buckets, allreduce_time - backward_time * (buckets - 1) / buckets)",
     "return max(0.0, allreduce_time - backward_time)", "the last bucket is ready only when backward ends"),
    ("return max(allreduce_time / buckets, allreduce_time - backward_time * (buckets - 1) / buckets)",
     "return allreduce_time", "only what sticks out of it is exposed"),
    ("return gather_time + (units - 1) * max(0.0, gather_time - compute_time)",
     "return (units - 1) * max(0.0, gather_time - compute_time)", "leaves out the first unit's gather"),
    ("return (chunks - 1) * max(0.0, allgather_time / (chunks - 1) - gemm_time / chunks)",
     "return max(0.0, allgather_time - gemm_time)", "the last chunk's GEMM (G/t) has no transfer left"),
    ("return forward + 2 * max(0.0, allreduce_time - weight_gradient_time)",
     "return 4 * max(0.0, allreduce_time - weight_gradient_time)", "the next product needs their result"),
    ("    return 2 * max(0.0, all_to_all_time - compute_time)",
     "    return max(0.0, all_to_all_time - compute_time)", "counts one micro-batch"),
])
def test_exposure_model_names_the_slip(tmp_notebook, old, new, feedback):
    result = graded(tmp_notebook, "overlap.exposure_model", {"ddp_exposed_time": changed(MODEL_CELL, (old, new))})
    assert_fails(result, feedback)


def test_exposure_model_accepts_a_simulated_bucket_engine(tmp_notebook):
    simulated = changed(MODEL_CELL, (
        "    return max(allreduce_time / buckets, allreduce_time - backward_time * (buckets - 1) / buckets)",
        "    free = 0.0\n"
        "    for k in range(1, buckets + 1):\n"
        "        free = max(free, k * backward_time / buckets) + allreduce_time / buckets\n"
        "    return max(0.0, free - backward_time)"))
    assert graded(tmp_notebook, "overlap.exposure_model", {"ddp_exposed_time": simulated}).status == "passed"


# --- exercise 2: ZeRO-3 with prefetch ---

def test_zero3_rejects_waiting_right_after_issuing(tmp_notebook):
    # every handle waited on as soon as it is issued: the gathers run while the rank sits idle
    blocking = changed(ZERO3_CELL, ("        self.start(index)\n        full, handle = self.pending.pop(index)",
                                    "        self.start(index)\n        self.pending[index][1].wait()\n"
                                    "        full, handle = self.pending.pop(index)"),
                       ("self.pending[index] = (full, dist.all_gather_single(full, piece, async_op=True))",
                        "self.pending[index] = (full, dist.all_gather_single(full, piece, async_op=True))\n"
                        "            self.pending[index][1].wait()"))
    assert_fails(graded(tmp_notebook, "overlap.zero3_prefetch", {"PrefetchZeRO3Module": blocking}),
                 "nothing overlapped")


def test_zero3_rejects_prefetching_everything_at_once(tmp_notebook):
    everything = changed(ZERO3_CELL, ("        for kind, *what in self.steps:\n            if kind == \"linear\":",
                                      "        for index in range(len(self.pieces)):\n"
                                      "            self.prefetcher.start(index)  # all in flight at once\n"
                                      "        for kind, *what in self.steps:\n            if kind == \"linear\":"))
    assert_fails(graded(tmp_notebook, "overlap.zero3_prefetch", {"PrefetchZeRO3Module": everything}),
                 "Prefetch one unit ahead")


def test_zero3_rejects_a_backward_without_prefetch(tmp_notebook):
    forward_only = changed(ZERO3_CELL, ("        ctx.prefetcher.start(ctx.index - 1)  # the layer before: its gather runs under this backward\n", ""))
    result = graded(tmp_notebook, "overlap.zero3_prefetch", {"PrefetchZeRO3Module": forward_only})
    assert_fails(result, "in backward of step 1")
    assert "nothing overlapped" in result.feedback


def test_zero3_rejects_keeping_the_gathered_weight_for_backward(tmp_notebook):
    saving = changed(ZERO3_CELL, ("ctx.save_for_backward(inputs)  # not", "ctx.save_for_backward(inputs, layer)  # not"),
                     ("(inputs,) = ctx.saved_tensors", "inputs, _ = ctx.saved_tensors"))
    assert_fails(graded(tmp_notebook, "overlap.zero3_prefetch", {"PrefetchZeRO3Module": saving}), "units alive")


HOOKED_ZERO3 = ZERO3_CELL[:ZERO3_CELL.index("class PrefetchZeRO3Module")] + '''
class GatheredLayer(nn.Module):
    """One linear layer as a piece; a forward pre-hook hands it its gathered weights."""

    def __init__(self, piece, index, shape, prefetcher):
        super().__init__()
        self.piece, self.index, self.shape, self.prefetcher, self.layer = piece, index, shape, prefetcher, None

    def forward(self, x):
        layer, self.layer = self.layer, None
        return PrefetchedLinear.apply(x, self.piece, layer, self.index, self.shape, self.prefetcher)


def gather_before_forward(module, args):
    module.layer = module.prefetcher.take(module.index)
    module.prefetcher.start(module.index + 1)


class PrefetchZeRO3Module(nn.Module):
    def __init__(self, model):
        super().__init__()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        pieces, shapes = [], []
        for layer in model:
            if isinstance(layer, nn.Linear):
                flat = torch.cat([layer.weight.detach().reshape(-1), layer.bias.detach()])
                pieces.append(nn.Parameter(piece_of(flat, rank, world_size)))
                shapes.append((layer.out_features, layer.in_features))
        prefetcher = Prefetcher(pieces)
        layers, index = [], 0
        for layer in model:
            if isinstance(layer, nn.Linear):
                layers.append(GatheredLayer(pieces[index], index, shapes[index], prefetcher))
                layers[-1].register_forward_pre_hook(gather_before_forward)
                index += 1
            else:
                layers.append(layer)
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x)
'''


def test_zero3_accepts_prefetch_from_forward_pre_hooks(tmp_notebook):
    result = graded(tmp_notebook, "overlap.zero3_prefetch", {"PrefetchZeRO3Module": HOOKED_ZERO3})
    assert result.status == "passed", result.feedback


# --- exercise 3: collective matmul ---

def test_collective_matmul_rejects_waiting_before_the_gemm(tmp_notebook):
    early = changed(RING_CELL, (
        "        out[owner * rows:(owner + 1) * rows] = chunk @ w_piece  # the transfer runs under this product\n"
        "        if step < t - 1:\n            for handle in handles:\n                handle.wait()\n            chunk = incoming\n",
        "        if step < t - 1:\n            for handle in handles:\n                handle.wait()\n"
        "        out[owner * rows:(owner + 1) * rows] = chunk @ w_piece\n"
        "        if step < t - 1:\n            chunk = incoming\n"))
    assert_fails(graded(tmp_notebook, "overlap.collective_matmul", {"collective_matmul": early}), "sat idle")


def test_collective_matmul_rejects_a_wrong_chunk_order(tmp_notebook):
    wrong = changed(RING_CELL, ("owner = (rank - step) % t", "owner = (rank + step) % t"))
    assert_fails(graded(tmp_notebook, "overlap.collective_matmul", {"collective_matmul": wrong}), "in the wrong rows")


def test_collective_matmul_rejects_an_all_gather(tmp_notebook):
    gathered = '''
def collective_matmul(x_piece, w_piece):
    t = dist.get_world_size()
    pieces = [torch.empty_like(x_piece) for _ in range(t)]
    handle = dist.all_gather(pieces, x_piece, async_op=True)
    first = x_piece @ w_piece
    handle.wait()
    return torch.cat([first if r == dist.get_rank() else p @ w_piece for r, p in enumerate(pieces)])
'''
    assert_fails(graded(tmp_notebook, "overlap.collective_matmul", {"collective_matmul": gathered}), "called all_gather")


def test_collective_matmul_accepts_batch_isend_irecv(tmp_notebook):
    batched = changed(RING_CELL, (
        "handles = [dist.isend(chunk, (rank + 1) % t), dist.irecv(incoming, (rank - 1) % t)]",
        "handles = dist.batch_isend_irecv([dist.P2POp(dist.isend, chunk, (rank + 1) % t),\n"
        "                                             dist.P2POp(dist.irecv, incoming, (rank - 1) % t)])"))
    result = graded(tmp_notebook, "overlap.collective_matmul", {"collective_matmul": batched})
    assert result.status == "passed", result.feedback


# --- exercise 4: DDP buckets ---

def test_buckets_reject_waiting_in_the_hook(tmp_notebook):
    waiting = changed(DDP_CELL, ("self.in_flight.append((index, flat, dist.all_reduce(flat, async_op=True)))",
                                 "handle = dist.all_reduce(flat, async_op=True)\n"
                                 "            handle.wait()\n"
                                 "            self.in_flight.append((index, flat, handle))"))
    assert_fails(graded(tmp_notebook, "overlap.bucket_overlap", {"OverlappingDDP": waiting}), "during backward")


def test_buckets_reject_all_reducing_after_backward(tmp_notebook):
    late = changed(DDP_CELL, ("        for index, flat, handle in self.in_flight:",
                              "        self.in_flight = [(index, torch.cat([p.grad.reshape(-1) for p in bucket]), None)\n"
                              "                          for index, bucket in enumerate(self.buckets)]\n"
                              "        self.in_flight = [(i, f, dist.all_reduce(f, async_op=True)) for i, f, _ in self.in_flight]\n"
                              "        for index, flat, handle in self.in_flight:"),
                   ("        if self.missing[index] == 0:", "        if False:"))
    assert_fails(graded(tmp_notebook, "overlap.bucket_overlap", {"OverlappingDDP": late}), "after backward")


def test_buckets_reject_issuing_every_bucket_at_the_end_of_backward(tmp_notebook):
    at_end = changed(DDP_CELL, (
        "        if self.missing[index] == 0:  # the bucket's last gradient: all-reduce it now, under the rest of backward\n"
        "            flat = torch.cat([parameter.grad.reshape(-1) for parameter in self.buckets[index]])\n"
        "            self.in_flight.append((index, flat, dist.all_reduce(flat, async_op=True)))",
        "        if not any(self.missing):  # every bucket at once, when backward is done\n"
        "            for index, bucket in enumerate(self.buckets):\n"
        "                flat = torch.cat([parameter.grad.reshape(-1) for parameter in bucket])\n"
        "                self.in_flight.append((index, flat, dist.all_reduce(flat, async_op=True)))"))
    assert_fails(graded(tmp_notebook, "overlap.bucket_overlap", {"OverlappingDDP": at_end}), "the bucket was ready after")


# --- exercise 5: interview ---

def test_interview_rejects_numbers_copied_from_the_page(tmp_notebook):
    copied = INTERVIEW_CELL + "\n\ninterview_fewest_chunks = 3\n"
    assert_fails(graded(tmp_notebook, "overlap.interview", {"interview_ddp_exposed_ms": copied}),
                 "it should be a function")


def test_interview_names_the_no_prefetch_slip(tmp_notebook):
    slip = changed(INTERVIEW_CELL, ("return fsdp_forward_exposed_time(layers, gather_ms, layer_forward_ms, True)",
                                    "return layers * gather_ms"))
    assert_fails(graded(tmp_notebook, "overlap.interview", {"interview_ddp_exposed_ms": slip}), "without prefetch")


def test_collective_matmul_accepts_the_ring_turning_the_other_way(tmp_notebook):
    other_way = changed(RING_CELL, ("owner = (rank - step) % t", "owner = (rank + step) % t"),
                        ("handles = [dist.isend(chunk, (rank + 1) % t), dist.irecv(incoming, (rank - 1) % t)]",
                         "handles = [dist.irecv(incoming, (rank + 1) % t), dist.isend(chunk, (rank - 1) % t)]"))
    result = graded(tmp_notebook, "overlap.collective_matmul", {"collective_matmul": other_way})
    assert result.status == "passed", result.feedback


def test_buckets_accept_flattening_helpers_and_waits_in_reverse(tmp_notebook):
    flattened = changed(DDP_CELL, (
        "flat = torch.cat([parameter.grad.reshape(-1) for parameter in self.buckets[index]])",
        "flat = torch._utils._flatten_dense_tensors([parameter.grad for parameter in self.buckets[index]])"),
        ("for index, flat, handle in self.in_flight:", "for index, flat, handle in reversed(self.in_flight):"))
    result = graded(tmp_notebook, "overlap.bucket_overlap", {"OverlappingDDP": flattened})
    assert result.status == "passed", result.feedback
