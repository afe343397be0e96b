"""Measuring what a rank of a sharded training run holds, from the tensors that exist, and what
it sends, on the process group.

- `held_bytes`: bytes of weights, gradients, optimizer states and anything else reachable from
  the objects a run keeps (a model, an optimizer, a ZeRO wrapper), each storage counted once
  (a view counts its whole storage: that memory exists) and scalars left out (Adam's step count).
- `FullTensorTracker`: a dispatch mode that follows full (unsharded) weights through a run: the
  outputs of gathering collectives (all-gather, broadcast, ...), and every tensor copied from
  them (cat, clone, copy_, ...), are "full"; it records how many bytes of them are alive after
  every operation, per phase ("forward", "backward", ...). It can also follow gradients: the
  storages that ever were the `.grad` of given parameters.
- `bytes_written`: bytes this process has written to files and sockets (`/proc/self/io`), which
  for a rank of a gloo world is what gloo itself sent.
The chapter's training runs, which use these tools, are in `dtp.zero_runs`; the closed forms the
measurements are compared with, in `dtp.zero`.
"""
from __future__ import annotations

import time
import types

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves



# --- bytes held -------------------------------------------------------------------------------


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds), any other tensor itself."""
    return getattr(tensor, "_local_tensor", tensor)


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = _local(tensor).untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _walk(root, path: str, found: dict, seen: set, depth: int = 0) -> None:
    """Every tensor reachable from `root` through containers, modules, optimizers and the
    attributes of plain objects, as found[id(tensor)] = (path, tensor)."""
    if depth > 12 or id(root) in seen:
        return
    seen.add(id(root))
    if isinstance(root, torch.Tensor):
        found.setdefault(id(root), (path, root))
        return
    if isinstance(root, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                         str, bytes, int, float, complex, bool)) or root is None:
        return
    if isinstance(root, dict):
        for key, value in root.items():
            _walk(key, f"{path}[key]", found, seen, depth + 1)
            _walk(value, f"{path}[{key!r}]" if isinstance(key, (str, int)) else f"{path}[...]", found, seen, depth + 1)
        return
    if isinstance(root, (list, tuple, set, frozenset)):
        for index, value in enumerate(root):
            _walk(value, f"{path}[{index}]", found, seen, depth + 1)
        return
    if isinstance(root, torch.optim.Optimizer):
        _walk(root.state, f"{path}.state", found, seen, depth + 1)
        _walk(root.param_groups, f"{path}.param_groups", found, seen, depth + 1)
        return
    attributes = getattr(root, "__dict__", None)
    if isinstance(attributes, dict):
        for name, value in attributes.items():
            _walk(value, f"{path}.{name}", found, seen, depth + 1)


def reachable_tensors(**roots) -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor reachable from the named roots (`model=..., zero=...`)."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    seen: set[int] = set()
    for name, root in roots.items():
        _walk(root, name, found, seen)
    return list(found.values())


def optimizers_in(**roots) -> list[torch.optim.Optimizer]:
    """The torch optimizers reachable from the roots (a ZeRO wrapper's inner Adam)."""
    found, seen, pending = [], set(), list(roots.values())
    while pending:
        value = pending.pop()
        if id(value) in seen or isinstance(value, (torch.Tensor, types.ModuleType, type, str, bytes)):
            continue
        seen.add(id(value))
        if isinstance(value, torch.optim.Optimizer):
            found.append(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple, set)):
            pending.extend(value)
        elif isinstance(getattr(value, "__dict__", None), dict):
            pending.extend(vars(value).values())
    return found


def clear_gradients(parameters, **roots) -> None:
    """What a training loop's zero_grad does, for a ZeRO wrapper too: drop the gradients of
    `parameters` and of every torch optimizer's parameters (the pieces) reachable from `roots`."""
    for optimizer in optimizers_in(**roots):
        optimizer.zero_grad(set_to_none=True)
    for parameter in parameters:
        parameter.grad = None


def held_bytes(parameters, **roots) -> dict:
    """Bytes this rank holds, by role, each storage counted once in the first role it has:
    "weights" (the storages of `parameters` and of the optimizers' parameters), "gradients"
    (their `.grad`), "optimizer states" (non-scalar tensors in the optimizers' state), and
    "other" (any other non-scalar tensor reachable from `roots`, with "other paths" naming the
    largest). Scalars (Adam's step counter) are left out."""
    optimizers = optimizers_in(**roots)
    weights = list(parameters) + [p for o in optimizers for group in o.param_groups for p in group["params"]]
    roles = {
        "weights": [("weights", t) for t in weights],
        "gradients": [("gradients", t.grad) for t in weights if t.grad is not None],
        "optimizer states": [("optimizer", t) for o in optimizers for state in o.state.values()
                             for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0],
        "other": [(path, t) for path, t in reachable_tensors(**roots) if t.dim() > 0],
    }
    counted: set[tuple[int, int]] = set()
    result: dict = {}
    other_paths: list[tuple[int, str]] = []
    for role, tensors in roles.items():
        total = 0
        for path, tensor in tensors:
            key = _storage_key(tensor)
            if key in counted:
                continue
            counted.add(key)
            total += key[1]
            if role == "other" and key[1]:
                other_paths.append((key[1], path))
        result[role] = total
    result["other paths"] = [f"{path} ({nbytes} bytes)" for nbytes, path in sorted(other_paths, reverse=True)[:3]]
    return result


# --- full weights and gradients over time -----------------------------------------------------

_SETTLE_ATTEMPTS, _SETTLE_PAUSE_S = 50, 0.001

# c10d operations whose first argument receives data from other ranks.
_RECEIVING = {"allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_", "allgather_coalesced_",
              "broadcast_", "allreduce_", "allreduce_coalesced_", "recv_", "recv_any_source_", "alltoall_",
              "alltoall_base_", "gather_", "scatter_"}
# aten operations that move values without computing new ones: their outputs are copies of inputs.
# (Composite operations such as reshape, contiguous or pad reach a dispatch mode as these.)
_MOVING = {"cat", "stack", "clone", "_to_copy", "copy", "copy_", "index_select", "index", "constant_pad_nd",
           "repeat", "flip", "roll", "gather", "take", "masked_select", "narrow_copy", "index_put", "index_put_",
           "index_copy", "index_copy_", "masked_scatter", "masked_scatter_", "view_copy", "t_copy", "transpose_copy",
           "permute_copy", "expand_copy", "slice_copy", "select_copy", "unbind_copy", "split_copy",
           "split_with_sizes_copy", "slice_scatter", "select_scatter", "as_strided_scatter", "diagonal_scatter",
           "where", "lift_fresh_copy", "set_"}
# FSDP2's own operations that copy gathered values out, into the unsharded parameters (out=...).
_MOVING_ELSEWHERE = {("fsdp", "split_with_sizes_copy")}


class FullTensorTracker(TorchDispatchMode):
    """Follows full weights (and optionally gradients) through a run; see the module docstring.

    `tracker.phase = "forward"` labels what follows; `peaks` maps each phase to the most bytes of
    full weights alive after any one operation in it; `grad_peaks` the same for the gradients of
    `watched` parameters (storages that were ever their `.grad`, alive wherever they are kept);
    with `keep_history`, `history` lists (phase, bytes of full weights alive) after every operation."""

    def __init__(self, watched_parameters=(), keep_history: bool = False):
        super().__init__()
        self.history: list[tuple[str, int]] | None = [] if keep_history else None  # (phase, full bytes) per operation
        self.phase = "start"
        self.full: dict[StorageWeakRef, None] = {}
        self.grads: dict[StorageWeakRef, None] = {}
        self.watched = list(watched_parameters)
        self.peaks: dict[str, int] = {}
        self.grad_peaks: dict[str, int] = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No torch.compile runs under this mode, so its __torch_dispatch__ need not be wrapped to
        keep Dynamo out (TorchDispatchMode's documented opt-out); that wrapper would import
        torch._dynamo in every rank on first use, 1 to 2 s each."""
        return False

    # --- bookkeeping ---
    @staticmethod
    def _alive_bytes(refs: dict) -> int:
        total = 0
        for ref in list(refs):
            if ref.expired():
                del refs[ref]
                continue
            total += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        return total

    def _is_full(self, tensor) -> bool:
        return isinstance(tensor, torch.Tensor) and StorageWeakRef(_local(tensor).untyped_storage()) in self.full

    def _mark_full(self, value) -> None:
        for tensor in tree_leaves(value):
            if isinstance(tensor, torch.Tensor):
                self.full[StorageWeakRef(_local(tensor).untyped_storage())] = None

    def sample(self) -> None:
        """Record the bytes alive now under the current phase."""
        for parameter in self.watched:
            if parameter.grad is not None:
                self.grads[StorageWeakRef(parameter.grad.untyped_storage())] = None
        alive = self._alive_bytes(self.full)
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), alive)
        if self.history is not None:
            self.history.append((self.phase, alive))
        if self.watched:
            self.grad_peaks[self.phase] = max(self.grad_peaks.get(self.phase, 0), self._alive_bytes(self.grads))

    def _settled_bytes(self, refs: dict) -> int:
        """Bytes alive once gloo has let go: its worker thread drops its reference to a finished
        collective's tensors a moment after the caller's wait returns, so a rank that kept
        nothing can show a few bytes for some microseconds; a rank that kept them shows them
        for good."""
        alive = self._alive_bytes(refs)
        for _ in range(_SETTLE_ATTEMPTS):
            if alive == 0:
                break
            time.sleep(_SETTLE_PAUSE_S)
            alive = self._alive_bytes(refs)
        return alive

    def sample_settled(self) -> None:
        """Record, under the current phase, the bytes of full weights alive once gloo has let go
        (the end of a phase, where a buffer gloo has not yet dropped would be counted as kept)."""
        if self.history is not None:
            self.history.append((self.phase, self._settled_bytes(self.full)))

    def full_bytes_alive(self) -> int:
        """Bytes of full weights alive now (after any collective has settled)."""
        return self._settled_bytes(self.full)

    def grad_bytes_alive(self) -> int:
        """Bytes of the watched parameters' gradients alive now, wherever they are kept."""
        self.sample()
        return self._settled_bytes(self.grads)

    # --- the dispatch hook ---
    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        namespace, name = func.namespace, func.overloadpacket.__name__
        if namespace == "c10d" and name in _RECEIVING and args:
            self._mark_full(args[0])
        elif (namespace == "aten" and name in _MOVING) or (namespace, name) in _MOVING_ELSEWHERE:
            in_place = name.endswith("_")
            sources = tree_leaves((args[1:] if in_place else args, {k: v for k, v in kwargs.items() if k != "out"}))
            if any(self._is_full(t) for t in sources):
                self._mark_full(out)
                self._mark_full(kwargs.get("out"))  # split_with_sizes_copy(..., out=[...]) and the like
                if in_place and args:
                    self._mark_full(args[0])  # copy_(destination, source): the destination now holds it
        self.sample()
        return out


# --- bytes gloo itself sent -------------------------------------------------------------------

def bytes_written() -> int:
    """Bytes this process has passed to write() and send() so far (Linux `/proc/self/io`,
    wchar): around a collective of a gloo rank, what gloo sent over its sockets."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


def saving_gathered_weights(course):
    """A variant of the course's ZeRO-3 module (`course` holds the chapter's solution) whose
    layers save each gathered weight for backward, as `nn.functional.linear` would: the book
    shows how much that keeps alive. (Kept out of the page's source, which the book publishes,
    because it shares most of its lines with the exercise's solution.)"""
    import torch
    from torch import nn

    class SavesGatheredLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inputs, piece, out_features, in_features):
            layer = course.all_gather_full(piece, out_features * (in_features + 1))
            weight = layer[:out_features * in_features].view(out_features, in_features)
            ctx.save_for_backward(inputs, weight)
            return nn.functional.linear(inputs, weight, layer[out_features * in_features:])

        @staticmethod
        def backward(ctx, grad_output):
            inputs, weight = ctx.saved_tensors
            grad_layer = torch.cat([(grad_output.T @ inputs).reshape(-1), grad_output.sum(0)])
            return grad_output @ weight, course.reduce_scatter_mean(grad_layer), None, None

    class SavesGathered(course.ZeRO3Module):
        def forward(self, x):
            for kind, *what in self.steps:
                x = SavesGatheredLinear.apply(x, self.pieces[what[0]], *what[1:]) if kind == "linear" else what[0](x)
            return x

    return SavesGathered
