"""Mixture of experts and expert parallelism: the reference code the book runs and the grader's
oracles, the closed forms (capacity, all-to-all bytes, parameters and FLOPs of MoE against dense
models), a recorder of all-to-all split sizes, a small Mixtral-shaped model, and the figures.

Conventions (the chapter's, stated once):
- `x` holds T tokens of width h; the router is a bias-free linear map, logits = x @ router (h×E).
- `indices[t, j]` is token t's j-th choice, in order of falling probability (ties, which random
  inputs never produce, go to the lower expert index); `weights[t, j]` its gate weight.
- A token's slot is its position in its expert's buffer; priority goes to all first choices in
  token order, then all second choices, ... (Switch's "by position", extended to k > 1 as GShard
  does); an assignment whose slot would reach the capacity is dropped (slot -1).
- Experts are two-layer ReLU MLPs without biases: relu(x @ w_in[e]) @ w_out[e].
- With expert parallelism over n ranks, rank r owns the E/n experts r·E/n ... (r+1)·E/n - 1.

tests/ep/test_ep_moe.py checks every function here against a brute-force loop, torch, or a measurement.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
from torch import nn
from torch._C._distributed_c10d import ProcessGroup

# --- routing (numpy) --------------------------------------------------------------------------


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, shifted by the maximum so that large logits do not overflow."""
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def top_k_routing(logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """(indices, weights), each (T, k): every token's k most probable experts, best first, and
    their softmax probabilities, divided by their sum when `renormalize` (Mixtral) or as they
    are (Switch, k = 1)."""
    probabilities = softmax(logits)
    indices = np.argsort(-probabilities, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probabilities, indices, axis=-1)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return indices, weights


# --- capacity, slots, dispatch and combine ----------------------------------------------------


def expert_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """ceil(capacity_factor · T · k / E): the buffer size of each expert, in exact rational
    arithmetic on the factor's decimal value (1.1 is 11/10, not the binary double just above it,
    which would make ceil(1.1 · 80 · 2 / 8) 23 instead of 22)."""
    return math.ceil(Fraction(str(capacity_factor)) * num_tokens * k / num_experts)


def assign_slots(indices: np.ndarray, num_experts: int, capacity: int | None = None) -> np.ndarray:
    """(T, k) slot of every assignment in its expert's buffer, -1 where it is dropped; `capacity`
    None routes dropless. Priority: choice rank first, then token position."""
    tokens, k = indices.shape
    choice_major = indices.T.reshape(-1)  # all first choices in token order, then all second ...
    arrivals = np.cumsum(np.eye(num_experts, dtype=np.int64)[choice_major], axis=0)
    slots = arrivals[np.arange(tokens * k), choice_major] - 1
    if capacity is not None:
        slots = np.where(slots < capacity, slots, -1)
    return slots.reshape(k, tokens).T


def dispatch_and_combine(indices: np.ndarray, weights: np.ndarray, slots: np.ndarray, num_experts: int,
                         capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """GShard's one-hot form: dispatch (T, E, C), 1 where token t fills slot c of expert e, and
    combine (T, E, C), the gate weight there. Buffers are einsum('tec,td->ecd', dispatch, x)."""
    tokens = indices.shape[0]
    dispatch = np.zeros((tokens, num_experts, capacity))
    combine = np.zeros((tokens, num_experts, capacity))
    token, choice = np.nonzero(slots >= 0)
    dispatch[token, indices[token, choice], slots[token, choice]] = 1.0
    combine[token, indices[token, choice], slots[token, choice]] = weights[token, choice]
    return dispatch, combine


def expert_mlp(x: np.ndarray, w_in: np.ndarray, w_out: np.ndarray) -> np.ndarray:
    return np.maximum(x @ w_in, 0.0) @ w_out


def moe_layer(x, router_weight, w_in, w_out, k: int, capacity: int | None = None, renormalize: bool = True):
    """The single-process MoE layer in numpy, through one-hot dispatch and combine tensors. A
    dropped assignment contributes nothing (the block's residual carries the token on); the
    weights of the kept ones are not renormalised."""
    num_experts = router_weight.shape[1]
    indices, weights = top_k_routing(x @ router_weight, k, renormalize)
    slots = assign_slots(indices, num_experts, capacity)
    buffer_size = capacity if capacity is not None else int(slots.max()) + 1
    dispatch, combine = dispatch_and_combine(indices, weights, slots, num_experts, buffer_size)
    buffers = np.einsum("tec,td->ecd", dispatch, x)
    outputs = np.einsum("ecf,efd->ecd", np.maximum(np.einsum("ecd,edf->ecf", buffers, w_in), 0.0), w_out)
    return np.einsum("tec,ecd->td", combine, outputs)


def moe_layer_torch(x: torch.Tensor, router_weight: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                    k: int, capacity: int | None = None, renormalize: bool = True) -> torch.Tensor:
    """The same layer in torch through index maps, differentiable in x, the router and the
    experts: the grader's single-process oracle for expert parallelism (run it once per rank's
    tokens, capacity being per rank)."""
    logits = x @ router_weight
    indices, _ = top_k_routing(logits.detach().numpy(), k, renormalize)
    slots = assign_slots(indices, router_weight.shape[1], capacity)
    probabilities = torch.softmax(logits, dim=-1)
    weights = probabilities.gather(1, torch.from_numpy(indices))
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    output = torch.zeros_like(x)
    for expert in range(router_weight.shape[1]):
        token, choice = np.nonzero((indices == expert) & (slots >= 0))
        if token.size:
            hidden = torch.relu(x[token] @ w_in[expert]) @ w_out[expert]
            output = output.index_add(0, torch.from_numpy(token), weights[token, choice].unsqueeze(1) * hidden)
    return output


# --- balancing losses (torch) -----------------------------------------------------------------


def dispatched_fractions(indices, num_experts: int) -> np.ndarray:
    """f: the fraction of the T·k assignments each expert receives (before any dropping)."""
    counts = np.bincount(np.asarray(indices).reshape(-1), minlength=num_experts)
    return counts / counts.sum()


def load_balancing_loss(router_logits: torch.Tensor, indices, alpha: float = 1e-2) -> torch.Tensor:
    """Switch Transformer's auxiliary loss alpha·E·Σ f_i·P_i (Fedus et al. 2022, section 2.2),
    with f_i counted over all T·k assignments (so it is alpha at perfect balance for any k) and
    P_i the mean router probability. f is a count: only P carries gradient."""
    num_experts = router_logits.shape[-1]
    f = torch.as_tensor(dispatched_fractions(indices, num_experts), dtype=router_logits.dtype)
    mean_probability = torch.softmax(router_logits, dim=-1).mean(dim=0)
    return alpha * num_experts * (f * mean_probability).sum()


def router_z_loss(router_logits: torch.Tensor, coefficient: float = 1e-3) -> torch.Tensor:
    """ST-MoE's router z-loss c_z · mean over tokens of logsumexp(logits)² (Zoph et al. 2022)."""
    return coefficient * torch.logsumexp(router_logits, dim=-1).square().mean()


def load_balancing_loss_and_gradient(logits: np.ndarray, indices, alpha: float = 1e-2) -> tuple[float, np.ndarray]:
    """The balancing loss and its gradient with respect to the logits in closed form: with
    p = softmax(logits), dL/dl[t, j] = (alpha·E/T) · p[t, j] · (f_j - Σ_i f_i·p[t, i]); f is constant."""
    tokens, num_experts = logits.shape
    f = dispatched_fractions(indices, num_experts)
    probabilities = softmax(logits)
    value = alpha * num_experts * float(f @ probabilities.mean(axis=0))
    gradient = alpha * num_experts / tokens * probabilities * (f - probabilities @ f[:, None])
    return value, gradient


def router_z_loss_and_gradient(logits: np.ndarray, coefficient: float = 1e-3) -> tuple[float, np.ndarray]:
    """The z-loss and its gradient: dL/dl[t, j] = (2·c_z/T) · logsumexp(l[t]) · p[t, j]."""
    largest = logits.max(axis=1, keepdims=True)
    log_sum_exp = largest + np.log(np.exp(logits - largest).sum(axis=1, keepdims=True))
    value = coefficient * float(np.mean(log_sum_exp ** 2))
    return value, 2 * coefficient / logits.shape[0] * log_sum_exp * softmax(logits)


# --- expert parallelism: who owns what, and the bytes moved ------------------------------------


def expert_owner(expert, num_experts: int, world_size: int):
    """The rank holding `expert` (works on arrays): experts are split into contiguous blocks."""
    return np.asarray(expert) // (num_experts // world_size)


def capacity_all_to_all_bytes(world_size: int, num_experts: int, capacity: int, hidden: int,
                              bytes_per_element: int) -> int:
    """Bytes each rank sends to other ranks in one forward and backward pass of an MoE layer with
    fixed capacity: four all-to-alls (dispatch, combine, and their two in backward) of E·C rows of
    h elements of w bytes, of which the (E/n)·C rows for its own experts stay: 4(n-1)/n · E·C·h·w."""
    return 4 * (world_size - 1) * (num_experts // world_size) * capacity * hidden * bytes_per_element


def dropless_all_to_all_bytes(indices_by_rank, num_experts: int, hidden: int, bytes_per_element: int) -> list[int]:
    """Bytes each rank sends to other ranks in one forward and backward pass of a dropless MoE
    layer: its rows to other ranks' experts (dispatch, and the combine's gradients in backward)
    plus the rows other ranks sent it (combine, and the dispatch's gradients): 2(out + in)·h·w.
    The exchange of token counts that precedes the dispatch is not counted."""
    world_size = len(indices_by_rank)
    sent = np.zeros((world_size, world_size), dtype=np.int64)  # [source, destination] rows
    for source, indices in enumerate(indices_by_rank):
        sent[source] = np.bincount(expert_owner(np.asarray(indices).reshape(-1), num_experts, world_size),
                                   minlength=world_size)
    off_rank = sent - np.diag(np.diag(sent))
    return [int(2 * (off_rank[r].sum() + off_rank[:, r].sum()) * hidden * bytes_per_element)
            for r in range(world_size)]


class AllToAllLog:
    """Inside one rank: `with CommunicationLog() as log, AllToAllLog() as splits:` records, for
    every all-to-all (`all_to_all_single` or the list `all_to_all`), the bytes and rows this rank
    sends to each rank (its own included) and, with `payloads=True`, a copy of each piece. Opened
    inside a CommunicationLog it calls through the log's recording, so both see every call."""

    METHODS = ("all_to_all_single", "alltoall_base", "alltoall")

    def __init__(self, payloads: bool = False):
        self.payloads = payloads
        self.calls: list[dict] = []

    def _record(self, method: str, group, args) -> None:
        if method == "alltoall":  # (outputs, inputs, options): one tensor per destination
            pieces = list(args[1])
        else:  # (output, input, output_split_sizes, input_split_sizes, options); no sizes: even
            sent, splits = args[1], list(args[3]) if len(args) > 3 and len(args[3]) else None
            if splits and sum(splits) != sent.shape[0]:
                return  # torch refuses this call itself, with its own message
            pieces = list(sent.split(splits if splits else max(sent.shape[0] // group.size(), 1)))
        call = {"bytes_to": [p.numel() * p.element_size() for p in pieces],
                "rows_to": [p.shape[0] if p.dim() else 1 for p in pieces],
                "dtype": str(pieces[0].dtype).replace("torch.", "") if pieces else ""}
        if self.payloads:
            call["payload"] = [p.detach().clone() for p in pieces]
        self.calls.append(call)

    def __enter__(self):
        self._saved = {name: vars(ProcessGroup)[name] for name in self.METHODS if name in vars(ProcessGroup)}
        log = self

        def wrap(method, current):
            def recorded(group, *args, **kwargs):
                log._record(method, group, args)
                return current(group, *args, **kwargs)
            return recorded

        for method, current in self._saved.items():
            setattr(ProcessGroup, method, wrap(method, current))
        return self

    def __exit__(self, *exc):
        for method, current in self._saved.items():
            setattr(ProcessGroup, method, current)


# --- parameters and FLOPs of an MoE model against a dense one -----------------------------------


@dataclass(frozen=True)
class MoEConfig:
    """A Mixtral-shaped decoder: RMSNorm, grouped-query attention with rotary positions (no
    parameters), and in every block an MoE feed-forward of SwiGLU experts (three matrices each)."""
    vocab_size: int = 32000
    hidden: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    expert_hidden: int = 14336
    n_experts: int = 8
    top_k: int = 2


MIXTRAL_8X7B = MoEConfig()  # Jiang et al. 2024, table 1


def moe_parameter_counts(config: MoEConfig) -> dict[str, int]:
    """Parameters of `MoETransformer(config)`: in all, and active for one token (k of the E
    experts in every block, everything else), and those of one expert."""
    h, kv = config.hidden, config.hidden // config.n_heads * config.n_kv_heads
    attention = 2 * h * h + 2 * h * kv
    expert = 3 * h * config.expert_hidden
    router, norms = h * config.n_experts, 2 * h
    outside = 2 * config.vocab_size * h + h  # token embedding, output layer, final norm
    total = outside + config.n_layers * (attention + config.n_experts * expert + router + norms)
    active = outside + config.n_layers * (attention + config.top_k * expert + router + norms)
    return {"total": total, "active": active, "expert": expert}


def moe_ffn_forward_flops(tokens: int, hidden: int, expert_hidden: int, num_experts: int, k: int) -> int:
    """Matrix-multiply FLOPs of one dropless MoE feed-forward forward pass: the router, 2·T·h·E,
    and k SwiGLU experts per token, 3 matrices of h×f at 2 FLOPs per multiply-add. A dense SwiGLU
    feed-forward of width k·f costs the same but the router."""
    return 2 * tokens * hidden * num_experts + 2 * tokens * k * 3 * hidden * expert_hidden


# --- a Mixtral-shaped model: counted on the meta device, trained small by the book -----------------


class SwiGLUExpert(nn.Module):
    def __init__(self, hidden: int, expert_hidden: int):
        super().__init__()
        self.gate = nn.Linear(hidden, expert_hidden, bias=False)
        self.up = nn.Linear(hidden, expert_hidden, bias=False)
        self.down = nn.Linear(expert_hidden, hidden, bias=False)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class MoEFeedForward(nn.Module):
    """Dropless top-k routing with Mixtral's renormalised gates; keeps its last routing in
    `self.last_logits` and `self.last_indices` for balancing losses and measurements. The
    experts are chosen by probability + `choice_bias` (zero unless auxiliary-loss-free balancing
    moves it, dtp.ep.routing), the gates are the probabilities alone."""

    def __init__(self, hidden: int, expert_hidden: int, n_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLUExpert(hidden, expert_hidden) for _ in range(n_experts))
        self.register_buffer("choice_bias", torch.zeros(n_experts), persistent=False)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.router(tokens)
        probabilities = torch.softmax(logits, dim=-1)
        indices = (probabilities.detach() + self.choice_bias).topk(self.top_k, dim=-1).indices
        weights = probabilities.gather(1, indices)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        self.last_logits, self.last_indices = logits, indices.detach()
        output = torch.zeros_like(tokens)
        for expert_index, expert in enumerate(self.experts):
            token, choice = torch.nonzero(indices == expert_index, as_tuple=True)
            if token.numel():
                output = output.index_add(0, token, weights[token, choice, None] * expert(tokens[token]))
        return output.reshape(x.shape)


def _rotate(x, positions):
    """Rotary position embedding (Su et al. 2021) on the last axis of (batch, heads, seq, size)."""
    half = x.shape[-1] // 2
    frequencies = 10000.0 ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = positions[:, None].float() * frequencies
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class MoEBlock(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        h, self.heads, self.kv_heads = config.hidden, config.n_heads, config.n_kv_heads
        head = h // config.n_heads
        self.attention_norm = nn.RMSNorm(h)
        self.q, self.k = nn.Linear(h, h, bias=False), nn.Linear(h, head * config.n_kv_heads, bias=False)
        self.v, self.o = nn.Linear(h, head * config.n_kv_heads, bias=False), nn.Linear(h, h, bias=False)
        self.ffn_norm = nn.RMSNorm(h)
        self.moe = MoEFeedForward(h, config.expert_hidden, config.n_experts, config.top_k)

    def forward(self, x):
        batch, seq, h = x.shape
        normed = self.attention_norm(x)
        positions = torch.arange(seq, device=x.device)
        q = _rotate(self.q(normed).view(batch, seq, self.heads, -1).transpose(1, 2), positions)
        k = _rotate(self.k(normed).view(batch, seq, self.kv_heads, -1).transpose(1, 2), positions)
        v = self.v(normed).view(batch, seq, self.kv_heads, -1).transpose(1, 2)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(attended.transpose(1, 2).reshape(batch, seq, h))
        return x + self.moe(self.ffn_norm(x))


class MoETransformer(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.embedding = nn.Embedding(config.vocab_size, config.hidden)
        self.blocks = nn.ModuleList(MoEBlock(config) for _ in range(config.n_layers))
        self.final_norm = nn.RMSNorm(config.hidden)
        self.output = nn.Linear(config.hidden, config.vocab_size, bias=False)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.output(self.final_norm(x))

    def moe_layers(self) -> list[MoEFeedForward]:
        return [block.moe for block in self.blocks]


# --- expert parallelism inside data parallelism ------------------------------------------------


def parameters_per_gpu(config: MoEConfig, expert_parallel: int) -> dict[str, float]:
    """Parameters one GPU holds when the data-parallel ranks of a model replica split every
    block's experts `expert_parallel` ways (no tensor or pipeline parallelism): all dense weights
    (attention, router, norms, embeddings), and E/ep experts per block."""
    counts = moe_parameter_counts(config)
    experts = config.n_layers * config.n_experts * counts["expert"]
    dense = counts["total"] - experts
    return {"dense": dense, "experts": experts / expert_parallel, "total": dense + experts / expert_parallel}
