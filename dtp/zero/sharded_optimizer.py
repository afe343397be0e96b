"""ZeRO-1 and ZeRO-2 for a reader's own model: `ShardedOptimizer(params, torch.optim.AdamW,
stage=1 or 2, lr=..., weight_decay=...)`, a `torch.optim.Optimizer` (re-exported by
dtp.zero.sharded, where the chapter's wrappers are described)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from dtp.zero.mixed_precision import MixedPrecision
from dtp.zero.pieces import clip_to_norm, gather_pieces, piece_of, real_elements, reduce_scatter_mean


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 (stage=1) or ZeRO-2 (stage=2) around `optimizer_class(pieces, **defaults)`.

    Every rank keeps the whole model (in `mixed_precision.param_dtype` if given) and an fp32 master
    piece of each parameter, which the inner optimizer (`.optimizer`) steps; `step()` then
    all-gathers the pieces back into the model. Stage 1 reduce-scatters each gradient in `step()`;
    stage 2 as soon as backward has produced it (a post-accumulate-grad hook), keeping only the
    averaged piece.

    A `torch.optim.Optimizer`: `param_groups` are the inner optimizer's groups (the same dicts:
    their "params" are this rank's fp32 pieces, their options what a torch LR scheduler changes),
    `state` its state; `step(closure)`, `zero_grad()`, `add_param_group()`, and `state_dict()` /
    `load_state_dict()` in torch's own format with whole tensors (a collective: every rank calls
    it), so a single-process optimizer's state loads here and back. Load the model's weights first:
    `load_state_dict` takes the masters from the model (or from the "master_weights" that
    `state_dict` adds under mixed precision). `clip_grad_norm_(max_norm)` clips by the global norm
    of the averaged gradients: torch's own on the model's parameters would see, with stage 1, a
    rank's own unaveraged gradients, with stage 2, none.

    A parameter with no gradient on any rank in a step is not stepped (as torch's optimizers skip
    it); with stage 1, one missing on some ranks only counts as zero there (as DDP does). Stage 2
    reduces in backward, so, as DDP without `find_unused_parameters`, it needs every parameter used
    on all ranks or on none. A parameter listed twice (tied) is one parameter: one owner, one update."""

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                 stage: int = 1, mixed_precision: MixedPrecision | None = None, **defaults):
        if stage not in (1, 2):
            raise ValueError(f"ShardedOptimizer is ZeRO-1 or ZeRO-2 (stage 1 or 2), got stage={stage!r}; "
                             "for ZeRO-3 wrap the model with ZeRO3")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer class, got {optimizer_class!r}")
        if mixed_precision is not None and mixed_precision.full_precision:
            raise ValueError("ShardedOptimizer casts every parameter it is given; keep modules in fp32 by leaving "
                             "their parameters out of the cast model, or use ZeRO3's per-module mixed precision")
        groups = list(params)
        if not groups:
            raise ValueError("ShardedOptimizer got an empty parameter list")
        self.stage, self.mixed_precision = stage, mixed_precision
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._optimizer_class, self._inner_defaults = optimizer_class, defaults
        self.optimizer: torch.optim.Optimizer | None = None
        self.parameters: list[nn.Parameter] = []
        self.pieces: list[torch.Tensor] = []
        self._syncing = True
        self._reduced: set[int] = set()  # parameters whose averaged piece gradient is ready for this step
        self._stage1_reduced = False  # stage 1 reduces once per step (in clip_grad_norm_ or step)
        super().__init__(groups, defaults)  # builds the groups through add_param_group
        self.defaults, self.state = self.optimizer.defaults, self.optimizer.state

    def add_param_group(self, param_group: dict) -> None:
        """Add model parameters (a group with its options); their pieces join the inner optimizer."""
        members = param_group["params"]
        members = [members] if torch.is_tensor(members) else list(members)
        seen = {id(p) for p in self.parameters}
        pieces = []
        for p in members:
            if id(p) in seen:  # tied: the same Parameter listed again is the same parameter
                continue
            seen.add(id(p))
            index = len(self.parameters)
            self.parameters.append(p)
            piece = piece_of(p.detach().float(), self.rank, self.world_size)
            self.pieces.append(piece)
            pieces.append(piece)
            if self.mixed_precision is not None:  # the model computes in 16 bits; the pieces are the fp32 masters
                with torch.no_grad():
                    p.data = p.data.to(self.mixed_precision.param_dtype)
            if self.stage == 2 and p.requires_grad:
                p.register_post_accumulate_grad_hook(self._reduce_hook(index))
        inner_group = {**{k: v for k, v in param_group.items() if k != "params"}, "params": pieces}
        if self.optimizer is None:
            self.optimizer = self._optimizer_class([inner_group], **self._inner_defaults)
        else:
            self.optimizer.add_param_group(inner_group)
        self.param_groups.append(self.optimizer.param_groups[-1])  # one dict, shared with the inner optimizer

    # --- gradients: averaged into the pieces ---

    def _gradient_dtype(self, p) -> torch.dtype:
        return self.mixed_precision.gradient_dtype if self.mixed_precision else p.dtype

    def _accumulate_piece(self, index: int, gradient: torch.Tensor) -> None:
        piece = self.pieces[index]
        averaged = reduce_scatter_mean([gradient.reshape(-1)], self._gradient_dtype(gradient))[0].float()
        piece.grad = averaged if piece.grad is None else piece.grad.add_(averaged)

    def _reduce_hook(self, index: int):
        def hook(p):
            if not self._syncing:
                return  # no_sync: the full gradient accumulates in p.grad, reduced after the last micro-batch
            self._accumulate_piece(index, p.grad)
            self._reduced.add(index)
            p.grad = None  # the full gradient is gone as soon as its piece is averaged
        return hook

    def _reduce_pending(self) -> None:
        """Stage 1: reduce-scatter the gradients backward left whole (once per step)."""
        if self.stage != 1 or self._stage1_reduced:
            return
        self._stage1_reduced = True
        # Which parameters got a gradient on some rank: one small all-reduce, so that the ranks
        # issue the same reduce-scatters and a parameter no rank used is skipped, as torch does.
        has_grad = torch.tensor([float(p.grad is not None) for p in self.parameters])
        dist.all_reduce(has_grad)
        for i, flag in enumerate(has_grad.tolist()):
            if flag > 0 and i not in self._reduced:
                p = self.parameters[i]
                self._accumulate_piece(i, p.grad if p.grad is not None else torch.zeros_like(p))
                self._reduced.add(i)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate full gradients over micro-batches and reduce once (only stage 2 reduces in
        backward; stage 1 always reduces once, in step())."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the averaged gradients so that their global norm is at most `max_norm`, as
        `torch.nn.utils.clip_grad_norm_` on one process; returns the norm before clipping."""
        self._reduce_pending()
        reduced = sorted(self._reduced)
        return clip_to_norm([(self.pieces[i].grad, self.pieces[i].grad[:real_elements(self.parameters[i].numel(), self.rank,
                                                                                        self.world_size)])
                             for i in reduced], [], max_norm, norm_type)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reduce_pending()
        stepped, self._reduced, self._stage1_reduced = sorted(self._reduced), set(), False
        self.optimizer.step()  # its groups are self.param_groups: what a scheduler set on them applies
        fulls = gather_pieces([self.pieces[i] for i in stepped], [self.parameters[i].numel() for i in stepped],
                              self.mixed_precision.param_dtype if self.mixed_precision else self.pieces[0].dtype)
        with torch.no_grad():
            for i, full in zip(stepped, fulls):
                self.parameters[i].copy_(full.view_as(self.parameters[i]))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # --- checkpoints: whole tensors, whatever the world size ---

    def state_dict(self) -> dict:
        """torch's optimizer format with whole tensors: {"state": {index: {name: tensor}},
        "param_groups": [{options, "params": [indices]}]}, indices in the order the parameters
        were given (as a single-process optimizer numbers them); under mixed precision also
        "master_weights", the fp32 weights (the 16-bit model holds them rounded)."""
        state = {}
        for i, (p, piece) in enumerate(zip(self.parameters, self.pieces)):
            entry = self.optimizer.state.get(piece, {})
            sharded = [k for k, v in entry.items() if torch.is_tensor(v) and v.shape == piece.shape and v.dim() > 0]
            fulls = dict(zip(sharded, gather_pieces([entry[k] for k in sharded], [p.numel()] * len(sharded), torch.float32)))
            if entry:
                state[i] = {k: fulls[k].view(p.shape) if k in fulls else (v.clone() if torch.is_tensor(v) else v)
                            for k, v in entry.items()}
        indices = {id(piece): i for i, piece in enumerate(self.pieces)}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [indices[id(p)] for p in g["params"]]}
                  for g in self.optimizer.param_groups]
        saved = {"state": state, "param_groups": groups}
        if self.mixed_precision is not None:
            masters = gather_pieces(self.pieces, [p.numel() for p in self.parameters], torch.float32)
            saved["master_weights"] = [m.view(p.shape) for m, p in zip(masters, self.parameters)]
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.optimizer.param_groups]:
            raise ValueError(f"the saved state has groups of {[len(g['params']) for g in groups]} parameters, "
                             f"this optimizer {[len(g['params']) for g in self.optimizer.param_groups]}")
        masters = state_dict.get("master_weights") or [p.detach() for p in self.parameters]
        with torch.no_grad():
            for p, piece, master in zip(self.parameters, self.pieces, masters):
                piece.copy_(piece_of(master.float(), self.rank, self.world_size))
                p.copy_(master.to(p.dtype))
        for group, saved in zip(self.optimizer.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        piece_index = {id(piece): i for i, piece in enumerate(self.pieces)}
        position = {saved: piece_index[id(piece)] for g_saved, g in zip(groups, self.optimizer.param_groups)
                    for saved, piece in zip(g_saved["params"], g["params"])}
        self.optimizer.state.clear()
        for index, entry in state_dict["state"].items():
            i = position[int(index)]
            p = self.parameters[i]
            # Shaped like the parameter: sharded (Adam's "step" is a scalar per parameter, even of a scalar one).
            self.optimizer.state[self.pieces[i]] = {
                k: piece_of(v.float(), self.rank, self.world_size) if torch.is_tensor(v) and v.shape == p.shape
                and (p.dim() > 0 or k != "step") else (v.clone() if torch.is_tensor(v) else v) for k, v in entry.items()}

    def full_state_dict(self) -> dict:
        """fp32 weights (whole) and `state_dict()`: a checkpoint that resumes on any world size."""
        weights = gather_pieces(self.pieces, [p.numel() for p in self.parameters], torch.float32)
        return {"weights": [w.view(p.shape) for w, p in zip(weights, self.parameters)], "optimizer": self.state_dict()}

    def load_full_state_dict(self, saved: dict) -> None:
        if len(saved["weights"]) != len(self.parameters):
            raise ValueError(f"checkpoint has {len(saved['weights'])} parameters, this optimizer {len(self.parameters)}")
        for p, full in zip(self.parameters, saved["weights"]):
            if full.shape != p.shape:
                raise ValueError(f"checkpoint weight of shape {tuple(full.shape)} for a parameter of {tuple(p.shape)}")
        self.load_state_dict({**saved["optimizer"], "master_weights": saved["weights"]})
