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
The chapter's training runs, which use these tools, are in `dtp.zero.runs`; the closed forms the
measurements are compared with, in `dtp.zero.formulas`.
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

_SETTLE_ATTEMPTS, SETTLE_PAUSE_S = 50, 0.001
# Waiting for gloo to let go before an excess of units or a stale gradient counts: a few ms as a
# rule; the bound is only reached by a rank that really kept them, and only once per run.
CONFIRM_ATTEMPTS = 2000

# c10d operations whose first argument receives data from other ranks.
RECEIVING = {"allgather_", "_allgather_base_", "allgather_into_tensor_coalesced_", "allgather_coalesced_",
              "broadcast_", "allreduce_", "allreduce_coalesced_", "recv_", "recv_any_source_", "alltoall_",
              "alltoall_base_", "gather_", "scatter_"}
# c10d operations that reduce-scatter their input (the second argument on).
_REDUCE_SCATTERING = {"reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"}
# aten operations that move values without computing new ones: their outputs are copies of inputs.
# (Composite operations such as reshape, contiguous or pad reach a dispatch mode as these.)
MOVING = {"cat", "stack", "clone", "_to_copy", "copy", "copy_", "index_select", "index", "constant_pad_nd",
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
    with `keep_history`, `history` lists (phase, bytes of full weights alive) after every operation.

    Per unit, from the order of the operations this rank ran (never from how long they took):
    - every gathering collective is one gathered unit; `unit_peaks` maps each phase to the most
      units whose gathered weights (or copies of them) were alive at once;
    - with `follow_reductions`, every copy of a watched parameter's gradient is followed too, and
      a reduce-scatter of such a copy marks that parameter reduced; `stale` is the first moment
      (phase, parameter indices, bytes) at which gradients of parameters reduced before the latest
      reduce-scatter were still alive: once the next unit is reduce-scattered, the previous
      unit's full gradient must be gone. `new_step()` starts a step afresh.
    Gloo's worker thread lets go of a finished collective's buffers a moment after the caller's
    wait returns; a count above `unit_limit` (when given), or a stale gradient, is therefore confirmed only if
    it is still there once gloo has let go (`_settle`), so that a busy machine cannot fail a rank
    that kept nothing. After one confirmed excess it records without waiting again."""

    def __init__(self, watched_parameters=(), keep_history: bool = False, unit_limit: int | None = None,
                 follow_reductions: bool = False):
        super().__init__()
        self.history: list[tuple[str, int]] | None = [] if keep_history else None  # (phase, full bytes) per operation
        self.phase = "start"
        self.full: dict[StorageWeakRef, frozenset] = {}  # storage -> the gathers (numbered) its values came from
        self.grads: dict[StorageWeakRef, None] = {}
        self.watched = list(watched_parameters)
        self.peaks: dict[str, int] = {}
        self.grad_peaks: dict[str, int] = {}
        self.unit_peaks: dict[str, int] = {}
        self.unit_limit = unit_limit
        self.follow_reductions = follow_reductions
        self.gradient_copies: dict[StorageWeakRef, frozenset] = {}  # storage -> watched parameters it copies
        self.reduced: set[int] = set()
        self.latest_reduced: frozenset = frozenset()
        self.stale: dict | None = None
        self._gathers = 0
        self._confirmed = False  # an excess outlived the settling once: no more waiting

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

    @staticmethod
    def _alive_tags(refs: dict) -> set:
        """The union of the tags of the storages in `refs` still alive."""
        tags: set = set()
        for ref in list(refs):
            if ref.expired():
                del refs[ref]
            else:
                tags |= refs[ref]
        return tags

    @staticmethod
    def _ref(tensor) -> StorageWeakRef:
        return StorageWeakRef(_local(tensor).untyped_storage())

    def _tags(self, refs: dict, tensors) -> frozenset:
        found: frozenset = frozenset()
        for tensor in tensors:
            found |= refs.get(self._ref(tensor), frozenset())
        return found

    def gathers_of(self, tensors) -> list[int]:
        """The gathers (numbered from 1, in issue order) the values of `tensors` came from."""
        return sorted(self._tags(self.full, tensors))

    def _is_full(self, tensor) -> bool:
        return isinstance(tensor, torch.Tensor) and self._ref(tensor) in self.full

    def _mark(self, refs: dict, value, tags: frozenset) -> None:
        for tensor in tree_leaves(value):
            if isinstance(tensor, torch.Tensor):
                ref = self._ref(tensor)
                refs[ref] = refs.get(ref, frozenset()) | tags

    def new_step(self) -> None:
        """Forget the previous step's peaks and reductions (its gradients were cleared)."""
        for record in (self.peaks, self.grad_peaks, self.unit_peaks):
            record.clear()
        self.reduced, self.latest_reduced, self.stale = set(), frozenset(), None

    def _register_gradients(self) -> None:
        for index, parameter in enumerate(self.watched):
            if parameter.grad is not None:
                ref = self._ref(parameter.grad)
                self.grads[ref] = None
                if self.follow_reductions:
                    self.gradient_copies[ref] = self.gradient_copies.get(ref, frozenset()) | {index}

    def _units_alive(self) -> int:
        return len(self._alive_tags(self.full))

    def _stale_parameters(self) -> set:
        return (self.reduced - self.latest_reduced) & self._alive_tags(self.gradient_copies)

    def _settle(self, excess) -> None:
        """Wait for gloo's worker to let go while `excess()` is true; give up for good (and stop
        waiting in later calls) if it outlives the wait."""
        for _ in range(CONFIRM_ATTEMPTS):
            if not excess():
                return
            time.sleep(SETTLE_PAUSE_S)
        self._confirmed = excess()

    def sample(self) -> None:
        """Record the bytes (and units) alive now under the current phase."""
        self._register_gradients()
        if self.unit_limit is not None and not self._confirmed and self._units_alive() > self.unit_limit:
            self._settle(lambda: self._units_alive() > self.unit_limit)
        units = self._units_alive()
        self.unit_peaks[self.phase] = max(self.unit_peaks.get(self.phase, 0), units)
        alive = self._alive_bytes(self.full)
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), alive)
        if self.history is not None:
            self.history.append((self.phase, alive))
        if self.watched:
            self.grad_peaks[self.phase] = max(self.grad_peaks.get(self.phase, 0), self._alive_bytes(self.grads))
        if self.follow_reductions and self.stale is None and self._stale_parameters():
            if not self._confirmed:
                self._settle(lambda: bool(self._stale_parameters()))
            stale = self._stale_parameters()
            if stale:
                self.stale = {"phase": self.phase, "parameters": sorted(stale),
                              "bytes": sum(self.watched[i].numel() * self.watched[i].element_size() for i in stale)}

    def _settled_bytes(self, refs: dict) -> int:
        """Bytes alive once gloo has let go: its worker thread drops its reference to a finished
        collective's tensors a moment after the caller's wait returns, so a rank that kept
        nothing can show a few bytes for some microseconds; a rank that kept them shows them
        for good."""
        alive = self._alive_bytes(refs)
        for _ in range(_SETTLE_ATTEMPTS):
            if alive == 0:
                break
            time.sleep(SETTLE_PAUSE_S)
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
        if self.follow_reductions:
            self._register_gradients()  # a gradient set since the last operation is followed from its first use
        out = func(*args, **kwargs)
        namespace, name = func.namespace, func.overloadpacket.__name__
        if namespace == "c10d" and name in RECEIVING and args:
            self._gathers += 1
            self._mark(self.full, args[0], frozenset([self._gathers]))
        elif (namespace == "aten" and name in MOVING) or (namespace, name) in _MOVING_ELSEWHERE:
            in_place = name.endswith("_")
            sources = tree_leaves((args[1:] if in_place else args, {k: v for k, v in kwargs.items() if k != "out"}))
            tags = self._tags(self.full, [t for t in sources if isinstance(t, torch.Tensor)])
            if tags:
                self._mark(self.full, out, tags)
                self._mark(self.full, kwargs.get("out"), tags)  # split_with_sizes_copy(..., out=[...]) and the like
                if in_place and args:
                    self._mark(self.full, args[0], tags)  # copy_(destination, source): the destination now holds it
        if self.follow_reductions:
            self._follow_gradient_copies(namespace, name, args, kwargs, out)
        self.sample()
        return out

    def _follow_gradient_copies(self, namespace, name, args, kwargs, out) -> None:
        """A tensor made from a watched gradient with at least its elements (a padded copy, a
        scaled one, a concatenation) is a copy of that full gradient; a reduce-scatter of one
        marks its parameters reduced."""
        if namespace == "c10d" and name in _REDUCE_SCATTERING:
            sources = [t for t in tree_leaves(args[1:]) if isinstance(t, torch.Tensor)]
            reduced = self._tags(self.gradient_copies, sources)
            if reduced:
                self.reduced |= reduced
                self.latest_reduced = reduced
            return
        if namespace != "aten":
            return
        in_place = name.endswith("_")
        sources = [t for t in tree_leaves((args[1:] if in_place else args, kwargs)) if isinstance(t, torch.Tensor)]
        tagged = [t for t in sources if self._ref(t) in self.gradient_copies]
        if not tagged:
            return
        tags, smallest = self._tags(self.gradient_copies, tagged), min(t.numel() for t in tagged)
        targets = [args[0]] if in_place and args else tree_leaves((out, kwargs.get("out")))
        for target in targets:
            if isinstance(target, torch.Tensor) and target.numel() >= smallest:
                self._mark(self.gradient_copies, target, tags)


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
    """A variant of the course's ZeRO-3 module (`course` holds the chapter's solution) that runs
    the model without its saved-tensor hooks, so that autograd saves each gathered weight for
    backward, as `nn.functional.linear` does: the book shows how much that keeps alive. (Kept out
    of the page's source, which the book publishes, because it names the exercise's solution.)"""

    class SavesGathered(course.ZeRO3Module):
        def forward(self, *args, **kwargs):
            return self.model(*args, **kwargs)

    return SavesGathered
