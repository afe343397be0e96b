"""Tensor parallelism: the closed forms the book prints and the grader holds answers to, the link
figures they use, and the measuring tools that the book, the notebook and the checks share.

Conventions: t is the tensor-parallel degree, T = b·s the tokens of a micro-batch, h the hidden
size, e the bytes per activation element (2 for fp16/bf16). Bandwidths are in bytes per second
per direction unless a name says otherwise; tests/tp/test_tp_formulas.py checks every formula
against a count on a real gloo world or against dtp.memory.formulas.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

# backward(gradient) imports this lazily, about 2 s on this machine; imported here, before any
# gloo world forks, every rank inherits it instead of importing it again.
import torch.fx.experimental.symbolic_shapes  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtp.common.gpt import Block, GPTConfig
from dtp.dp import costs
from dtp.memory import formulas as memory

# --- links and chips (vendors' figures, with the direction they count) -------------------------

# NVIDIA H100 SXM5 datasheet: "NVLink 900GB/s", the sum over 18 NVLink-4 links of both
# directions; each link carries 25 GB/s each way, so 450 GB/s leave (and 450 GB/s enter) a GPU.
NVLINK4_BIDIRECTIONAL_BYTES_PER_S = 900e9
NVLINK4_PER_DIRECTION_BYTES_PER_S = NVLINK4_BIDIRECTIONAL_BYTES_PER_S / 2
# InfiniBand NDR: 400 Gb/s (gigabits) per port and direction, one ConnectX-7 port per GPU.
INFINIBAND_NDR_GBIT_PER_S = 400
# H100 SXM5 datasheet: 989 TFLOP/s of dense bf16 (the 1,979 printed beside it assumes 2:4 sparsity).
H100_BF16_DENSE_FLOPS = 989.4e12


def gigabits_to_bytes_per_s(gigabits_per_s: float) -> float:
    """A network's Gb/s (10⁹ bits) as bytes per second: 8 bits to a byte."""
    return gigabits_per_s * 1e9 / 8


# --- messages and traffic ----------------------------------------------------------------------

ALL_REDUCES_PER_LAYER = {"forward": 2, "backward": 2}  # Shoeybi et al. 2019, figure 4


def all_reduces_per_layer(full_recomputation: bool = False) -> dict[str, int]:
    """The all-reduces of one layer in each pass. Full recomputation (activation checkpointing of
    the whole layer) runs the layer's forward again in backward, and with it g's two
    all-reduces: 2 + 4 = 6 per layer instead of 4. (Selective recomputation re-runs only the
    attention core, between the all-reduces, and adds none.)"""
    backward = ALL_REDUCES_PER_LAYER["backward"] + (ALL_REDUCES_PER_LAYER["forward"] if full_recomputation else 0)
    return {"forward": ALL_REDUCES_PER_LAYER["forward"], "backward": backward}


def all_reduce_message_bytes(tokens: int, hidden: int, bytes_per_element: int = 2) -> int:
    """S = b·s·h·e: one all-reduce of tensor parallelism sums an activation of every token."""
    return tokens * hidden * bytes_per_element


def ring_bytes_per_gpu_per_layer(tokens: int, hidden: int, t: int, bytes_per_element: int = 2,
                                 passes: tuple[str, ...] = ("forward", "backward")) -> float:
    """Bytes each GPU sends per transformer layer in the given passes: 2 all-reduces per pass,
    each 2(t-1)/t·S in a ring. Sequence parallelism: see sequence_parallel_ring_bytes_per_gpu_per_layer."""
    size = all_reduce_message_bytes(tokens, hidden, bytes_per_element)
    count = sum(ALL_REDUCES_PER_LAYER[p] for p in passes)
    return count * costs.ring_all_reduce_bytes_per_rank(t, size)


def sequence_parallel_ring_bytes_per_gpu_per_layer(tokens: int, hidden: int, t: int, bytes_per_element: int = 2,
                                                   regather: bool = True) -> float:
    """Bytes each GPU sends per layer, forward and backward, with sequence parallelism in a ring.
    An all-gather or a reduce-scatter sends (t-1)/t·S, half an all-reduce: each all-reduce of
    tensor parallelism becomes one of each, 8(t-1)/t·S as for TP. Re-gathering the QKV and first
    MLP projections' input pieces in backward (which the 4sbh(1-1/t) of the activation saving
    needs) adds 2 all-gathers: 10(t-1)/t·S, 5/4 of tensor parallelism's traffic."""
    halves = 2 * sum(ALL_REDUCES_PER_LAYER.values()) + (2 if regather else 0)
    return halves * costs.ring_all_reduce_bytes_per_rank(t, all_reduce_message_bytes(tokens, hidden, bytes_per_element)) / 2


def layer_communication_time_s(tokens: int, hidden: int, t: int, bandwidth_bytes_per_s: float,
                               bytes_per_element: int = 2, passes=("forward", "backward")) -> float:
    """Time to send a layer's tensor-parallel traffic at a per-direction bandwidth (a GPU sends
    and receives at once on a full-duplex link), with no latency term: a lower bound."""
    return ring_bytes_per_gpu_per_layer(tokens, hidden, t, bytes_per_element, passes) / bandwidth_bytes_per_s


def layer_training_flops(tokens: int, seq: int, hidden: int, mlp_ratio: int = 4) -> float:
    """Matrix FLOPs of one layer's forward and backward pass over `tokens` tokens in sequences of
    `seq`: 6 per token per weight ((4 + 2r)h²) plus attention's QKᵀ and AV, 12·T·s·h
    (as dtp.memory.formulas.transformer_training_flops counts a whole model)."""
    return 6 * tokens * (4 + 2 * mlp_ratio) * hidden**2 + 12 * tokens * seq * hidden


def communication_to_compute_ratio(seq: int, hidden: int, t: int, bytes_per_element: int, link_bytes_per_s: float,
                                   flops_per_s: float, mlp_ratio: int = 4) -> float:
    """Per layer and GPU, forward and backward: the time to send the ring traffic at a
    per-direction bandwidth over the time of the GPU's 1/t of the matrix multiplies at a FLOP
    rate. The tokens cancel: 8(t-1)·h·e·F / (B·((24 + 12r)h² + 12sh)), which for r = 4 is
    2(t-1)·e·F / (3·B·(6h + s)): it grows with t and falls with h (and s)."""
    tokens = 1  # both times grow with the tokens
    communication = layer_communication_time_s(tokens, hidden, t, link_bytes_per_s, bytes_per_element)
    compute = layer_training_flops(tokens, seq, hidden, mlp_ratio) / t / flops_per_s
    return communication / compute


def vocab_parallel_loss_bytes(tokens: int, bytes_per_element: int = 4) -> int:
    """What the vocabulary-parallel cross-entropy all-reduces: the max, the sum of exponentials
    and the target logit, one number per token each."""
    return 3 * tokens * bytes_per_element


def sequence_parallel_saving_bytes(seq: int, batch: int, hidden: int, heads: int, t: int) -> float:
    """Activation bytes per layer that sequence parallelism saves on each GPU, from the memory
    chapter's formula: sbh(10 + 24/t + 5as/(ht)) - sbh(34/t + 5as/(ht)) = 10sbh(1 - 1/t)."""
    def per_layer(sp: bool) -> float:
        return memory.activation_bytes_per_layer(seq, batch, hidden, heads, tensor_parallel=t, sequence_parallel=sp)
    return per_layer(False) - per_layer(True)


def sequence_parallel_saving_on_cpu(seq: int, batch: int, hidden: int, t: int, element_bytes: int,
                                    dropout: bool, regather: bool) -> float:
    """What sequence parallelism saves per rank and layer in this course's blocks, as PyTorch on
    the CPU stores it, term by term, each times (1 - 1/t): the two LayerNorms' inputs (2·e·sbh);
    their mean and 1/std (2·2·e·sb); with dropout, the two residual dropouts' masks, which the
    CPU stores in the activation's dtype (2·e·sbh, where the paper counts 1 byte each); and,
    when the QKV and first MLP projections keep only their sequence piece and all-gather it
    again in backward, their gathered inputs (2·e·sbh). In fp16 with 1-byte masks the first,
    third and fourth terms are the 4 + 2 + 4 = 10sbh of Korthikanti et al.'s formula."""
    s, b, h, e = seq, batch, hidden, element_bytes
    saved = 2 * e * s * b * h + 2 * 2 * e * s * b
    saved += 2 * e * s * b * h if dropout else 0
    saved += 2 * e * s * b * h if regather else 0
    return saved * (1 - 1 / t)


# --- splitting -------------------------------------------------------------------------------


def shard_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of piece `index` when `size` is cut into `parts` by torch.tensor_split's rule
    (the first size % parts pieces are one longer)."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def kv_heads_of_rank(query_heads: int, kv_heads: int, t: int, rank: int) -> tuple[range, range]:
    """Grouped-query attention split by heads: (the query heads, the key/value heads) that GPU
    `rank` of t holds. Query head j attends with KV head j // (query_heads / kv_heads); each GPU
    takes query_heads / t consecutive query heads, so t must divide the query heads, and either t
    divides the KV heads (each GPU holds kv_heads / t of them) or the KV heads divide t (each KV
    head is replicated on t / kv_heads GPUs, which hold its weights and compute it alike)."""
    if query_heads % t or query_heads % kv_heads:
        raise ValueError(f"{query_heads} query heads split neither over t = {t} GPUs nor into {kv_heads} groups")
    if kv_heads % t and t % kv_heads:
        raise ValueError(f"{kv_heads} KV heads neither split over t = {t} GPUs nor replicate evenly on them")
    per_rank, group = query_heads // t, query_heads // kv_heads
    queries = range(rank * per_rank, (rank + 1) * per_rank)
    return queries, range(queries[0] // group, queries[-1] // group + 1)


def grouped_query_attention_split(query_heads: int, kv_heads: int, t: int, hidden: int = 32, seq: int = 6,
                                  seed: int = 0) -> dict[str, float]:
    """Runs GQA attention (projections, causal softmax) whole and split over t simulated GPUs by
    kv_heads_of_rank, forward and backward, and returns the largest errors against the whole:
    of the outputs, of the query-projection gradients, of the KV-projection gradients summed over
    the GPUs that share a KV head, and of one replica's KV gradient taken alone (relative to the
    largest whole gradient, as it is not rounding)."""
    generator = torch.Generator().manual_seed(seed)
    head = hidden // query_heads
    x = torch.randn(seq, hidden, generator=generator, dtype=torch.float64)
    upstream = torch.randn(seq, query_heads * head, generator=generator, dtype=torch.float64)
    weights = {name: torch.randn(hidden, heads * head, generator=generator, dtype=torch.float64)
               for name, heads in (("q", query_heads), ("k", kv_heads), ("v", kv_heads))}

    def attention(wq, wk, wv, heads, groups):  # heads query heads over `groups` KV heads
        q, k, v = ((x @ w).view(seq, -1, head).transpose(0, 1) for w in (wq, wk, wv))
        k, v = (z.repeat_interleave(heads // groups, dim=0) for z in (k, v))
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        scores = (q @ k.transpose(1, 2) / math.sqrt(head)).masked_fill(~causal, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(0, 1).reshape(seq, heads * head)

    def columns(heads):
        return [c for j in heads for c in range(j * head, (j + 1) * head)]

    dense = {name: w.clone().requires_grad_() for name, w in weights.items()}
    whole = attention(dense["q"], dense["k"], dense["v"], query_heads, kv_heads)
    (whole * upstream).sum().backward()
    outputs, q_grads, kv_sums, alone = [], [], {"k": torch.zeros_like(weights["k"]), "v": torch.zeros_like(weights["v"])}, 0.0
    for rank in range(t):
        queries, keys = kv_heads_of_rank(query_heads, kv_heads, t, rank)
        mine = {"q": weights["q"][:, columns(queries)].clone().requires_grad_(),
                **{name: weights[name][:, columns(keys)].clone().requires_grad_() for name in ("k", "v")}}
        out = attention(mine["q"], mine["k"], mine["v"], len(queries), len(keys))
        (out * upstream[:, columns(queries)]).sum().backward()
        outputs.append(out)
        q_grads.append(mine["q"].grad)
        for name in ("k", "v"):
            kv_sums[name][:, columns(keys)] += mine[name].grad
            expected = dense[name].grad[:, columns(keys)]
            alone = max(alone, float((mine[name].grad - expected).abs().max() / expected.abs().max()))
    whole = whole.detach()
    return {"output": float((torch.cat(outputs, dim=1).detach() - whole).abs().max()),
            "query_gradient": float((torch.cat(q_grads, dim=1) - dense["q"].grad).abs().max()),
            "kv_gradient_summed": max(float((kv_sums[n] - dense[n].grad).abs().max()) for n in ("k", "v")),
            "kv_gradient_one_replica": alone}


def gelu_numpy(x: np.ndarray) -> np.ndarray:
    """The exact GeLU, x·Φ(x), elementwise (torch.nn.functional.gelu's default)."""
    x = np.asarray(x, dtype=np.float64)
    return x * 0.5 * (1.0 + np.vectorize(math.erf, otypes=[np.float64])(x / math.sqrt(2.0)))


def random_block(hidden: int, heads: int, seed: int, dropout: float = 0.0) -> Block:
    """A dtp.common.gpt Block whose every parameter is random, LayerNorms included (not ones and zeros),
    so that each value says where it sits: a matrix's rows and columns are all different, and no
    value repeats among the vectors (biases, LayerNorm weights). Fan-in scaled, so that
    activations stay near 1."""
    generator = torch.Generator().manual_seed(seed)
    block = Block(GPTConfig(hidden=hidden, n_heads=heads, dropout=dropout))
    while True:  # the 13h vector values collide rarely (float32); draw again until none does
        with torch.no_grad():
            for name, parameter in block.named_parameters():
                noise = torch.randn(parameter.shape, generator=generator)
                if "norm" in name:
                    parameter.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * noise)
                elif name.endswith("weight"):
                    parameter.copy_(noise / math.sqrt(parameter.shape[1]))
                else:
                    parameter.copy_(0.2 * noise)
        vectors = torch.cat([p.detach() for p in block.parameters() if p.dim() == 1])
        if len(torch.unique(vectors)) == len(vectors):
            return block


# --- random numbers: dropout inside and outside the parallel regions ---------------------------


class ModelParallelRNG:
    """Two random streams per rank, after Megatron-LM's RNG tracker
    (`model_parallel_cuda_manual_seed`), on the CPU generator that dropout draws from:

    - outside the parallel regions (LayerNorms, residual dropout), every TP rank holds the same
      whole tensor, so it must draw the same mask: the default generator is seeded with `seed`
      on every rank of the group;
    - inside them (attention dropout on a rank's own heads, anything on its own columns), the
      ranks hold different parts of one tensor, which a single GPU would mask independently: the
      region's generator is seeded with seed + 2718 + tp_rank, different on every rank.

    `with rng.parallel_region(): ...` swaps the region's stream in and out, each continuing where
    it stopped. (Data-parallel replicas take different `seed`s, as they see different data.)"""

    OFFSET = 2718  # Megatron-LM's offset between the two streams' seeds

    def __init__(self, seed: int, tp_rank: int):
        torch.manual_seed(seed + self.OFFSET + tp_rank)
        self._region_state = torch.get_rng_state()
        torch.manual_seed(seed)  # the default stream, the same on every TP rank

    @contextlib.contextmanager
    def parallel_region(self):
        outside = torch.get_rng_state()
        torch.set_rng_state(self._region_state)
        try:
            yield
        finally:
            self._region_state = torch.get_rng_state()
            torch.set_rng_state(outside)


# --- measuring what a rank does ------------------------------------------------------------------


class TensorShapes(TorchDispatchMode):
    """`with TensorShapes() as shapes:` records the shape of every tensor each torch operation
    returns (forward and backward on the CPU, collectives included), so that a tensor a rank
    must never hold (the full logits) is seen if it is ever made."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # By default torch wraps __torch_dispatch__ in dynamo's disable, which imports
        # torch._dynamo (seconds) in every rank that records; nothing here is ever compiled.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        return result


class SavedForBackward:
    """`with SavedForBackward(module) as saved:` records a copy of every floating-point tensor
    that autograd saves for backward while the block runs, parameters excluded: what a rank keeps
    between its forward and its backward. A region under torch.utils.checkpoint saves its inputs
    only (its own saves go to checkpoint's hooks and are recomputed), so they are not recorded."""

    def __init__(self, module: torch.nn.Module):
        self._parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self.tensors: list[np.ndarray] = []

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point() and tensor.untyped_storage().data_ptr() not in self._parameters:
            self.tensors.append(tensor.detach().to(torch.float32).numpy().copy())
        return tensor  # autograd keeps the tensor itself: recording changes nothing

    def __enter__(self) -> "SavedForBackward":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class Dataflow(TorchDispatchMode):
    """`with Dataflow() as flow:` records every torch operation a rank runs (forward and backward)
    as a node (operation name, the earlier nodes whose outputs it read), so that one can ask which
    matrix multiplies a collective could overlap with: those that neither feed it nor read its
    result. Tensors are told apart by their storage (views and in-place results share it); every
    tensor is kept alive meanwhile, so no storage is reused."""

    MATMULS = ("mm", "addmm", "bmm", "baddbmm")
    COLLECTIVES = ("allreduce_", "allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_",
                   "reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_")

    def __init__(self):
        super().__init__()
        self.nodes: list[tuple[str, frozenset[int]]] = []
        self._producer: dict[int, int] = {}
        self._alive: list[torch.Tensor] = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as TensorShapes: never compiled, so skip importing dynamo in every rank

    def mark(self) -> int:
        """The index the next node will get (to cut the record into passes)."""
        return len(self.nodes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        result = func(*args, **(kwargs or {}))
        reads = frozenset(self._producer[key] for key in map(self._storage, inputs) if key in self._producer)
        self.nodes.append((func.overloadpacket.__name__, reads))
        for tensor in tree_leaves(result):
            if isinstance(tensor, torch.Tensor):
                self._producer[self._storage(tensor)] = len(self.nodes) - 1
                self._alive.append(tensor)
        self._alive += inputs
        return result

    @staticmethod
    def _storage(tensor: torch.Tensor) -> int:
        try:
            return tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor without storage
            return id(tensor)

    def overlappable_matmuls(self, start: int, stop: int) -> list[tuple[str, int]]:
        """For each collective among nodes [start, stop): (its name, how many matrix multiplies in
        [start, stop) neither lead to it nor depend on it), i.e. could run while it runs."""
        readers: dict[int, list[int]] = {}
        for index, (_, reads) in enumerate(self.nodes):
            for read in reads:
                readers.setdefault(read, []).append(index)

        def closure(index, edges):
            seen, todo = set(), [index]
            while todo:
                for other in edges(todo.pop()):
                    if other not in seen:
                        seen.add(other)
                        todo.append(other)
            return seen

        found = []
        for index in range(start, stop):
            name = self.nodes[index][0]
            if name not in self.COLLECTIVES:
                continue
            related = closure(index, lambda i: self.nodes[i][1]) | closure(index, lambda i: readers.get(i, ()))
            free = [i for i in range(start, stop) if self.nodes[i][0] in self.MATMULS and i not in related]
            found.append((name, len(free)))
        return found


def rows_found(kept: np.ndarray, rows: np.ndarray, atol: float) -> int:
    """How many of `rows` (shape (R, h)) appear, within atol, among the h-vectors of `kept` (any
    tensor whose size h divides, read as rows of h consecutive values, as (b, s, h) and
    (t·b, s/t, h) layouts store them)."""
    hidden = rows.shape[1]
    if kept.size == 0 or kept.size % hidden:
        return 0
    candidates = kept.reshape(-1, hidden).astype(np.float64)
    distance = np.abs(candidates[:, None, :] - rows[None, :, :]).max(axis=-1)
    return int((distance.min(axis=0) <= atol).sum())


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather",
               "scatter", "send", "recv", "barrier")


def events_between(events: list[dict], start: str, stop: str) -> list[dict]:
    """The communication events (no marks, no waits) between the marks labelled start and stop."""
    labels = [event.get("label") for event in events]
    first, last = labels.index(start), labels.index(stop)
    return [event for event in events[first + 1:last] if event["op"] in COLLECTIVES]


def as_all_reduces(events: list[dict]) -> list[dict]:
    """Events with each reduce-scatter that is directly followed by an all-gather of its result
    (together an all-reduce, the way a ring runs one) merged into one all-reduce of the
    reduce-scatter's size."""
    merged, index = [], 0
    while index < len(events):
        event = events[index]
        following = events[index + 1] if index + 1 < len(events) else None
        if event["op"] == "reduce_scatter" and following is not None and following["op"] == "all_gather":
            merged.append({**event, "op": "all_reduce"})
            index += 2
        else:
            merged.append(event)
            index += 1
    return merged


def summarize(events: list[dict]) -> dict[str, list[int]]:
    """{operation: [bytes of each call]} in order, e.g. {"all_reduce": [8192, 8192]}."""
    summary: dict[str, list[int]] = {}
    for event in events:
        summary.setdefault(event["op"], []).append(event.get("bytes", 0))
    return summary


# --- the book's figure ------------------------------------------------------------------------


def link_time_figure(tokens: int, seq: int, hidden: int, degrees, gpus_per_node: int = 8):
    """Per-layer, per-GPU time against the TP degree: the ring traffic of forward and backward
    on NVLink 4 (drawn only up to one node's GPUs) and on InfiniBand NDR, both per direction,
    and the layer's matrix multiplies at H100's bf16 dense peak."""
    import matplotlib.pyplot as plt

    degrees = np.asarray(degrees)
    infiniband = gigabits_to_bytes_per_s(INFINIBAND_NDR_GBIT_PER_S)
    in_node = degrees[degrees <= gpus_per_node]
    figure, axis = plt.subplots(figsize=(7, 5))
    axis.plot(in_node, [layer_communication_time_s(tokens, hidden, t, NVLINK4_PER_DIRECTION_BYTES_PER_S) * 1e3
                        for t in in_node], marker="o", label="communication, NVLink 4 (450 GB/s per direction)")
    axis.plot(degrees, [layer_communication_time_s(tokens, hidden, t, infiniband) * 1e3 for t in degrees],
              marker="s", label="communication, InfiniBand NDR (400 Gb/s = 50 GB/s per direction)")
    axis.plot(degrees, [layer_training_flops(tokens, seq, hidden) / t / H100_BF16_DENSE_FLOPS * 1e3 for t in degrees],
              marker="^", linestyle="--", color="black", label="compute at the H100 bf16 dense peak")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xticks(degrees, [str(t) for t in degrees])
    axis.set_xlabel("tensor-parallel degree t (GPUs sharing each layer)")
    axis.set_ylabel("time per layer per GPU, forward + backward (ms)")
    axis.set_title(f"{tokens} tokens, hidden {hidden}, fp16 activations")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1, frameon=False)
    figure.tight_layout()
    plt.close(figure)  # glue displays it
    return figure
