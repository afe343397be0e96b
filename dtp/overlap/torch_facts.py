"""What the pinned torch does about overlap, established by running it or by reading its own
source and documentation at build time, so that the page's statements follow the installed torch.

On a CPU there are no CUDA streams, so what torch does with them on a GPU is read from the
installed code (which streams FSDP2 creates, whether it calls `record_stream`) and from the
documentation torch ships (`Work.wait`); the rest runs (FSDP2's order of all-gathers, waits and
products; which module's gather backward skips).
"""
from __future__ import annotations

import inspect
import io
import re
import tokenize
from pathlib import Path

import torch
import torch.distributed as dist

from dtp.common.traffic import CommunicationLog
from dtp.common.world import run_world
from dtp.overlap.runs import ComputeRecorder, plain_events
from dtp.zero.measure import FullTensorTracker


def wait_blocks_the_stream_not_the_cpu() -> bool:
    """torch's own documentation of `Work.wait()`: under NCCL it makes the current CUDA stream
    wait for the collective (the CPU goes on), unless a timeout is given."""
    doc = " ".join((dist.Work.wait.__doc__ or "").split())
    return "Letting the current stream block on the completion of the NCCL work" in doc


def _fully_shard_sources() -> list[Path]:
    from torch.distributed.fsdp import _fully_shard

    return sorted(Path(_fully_shard.__file__).parent.glob("*.py"))


def _flat_param_sources() -> list[Path]:
    from torch.distributed.fsdp import _flat_param, _runtime_utils

    return [Path(_flat_param.__file__), Path(_runtime_utils.__file__)]


def _calls(paths, name: str) -> int:
    """Calls of `name(` in code (not in comments or strings) of the given files."""
    count = 0
    for path in paths:
        tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
        for token, following in zip(tokens, tokens[1:]):
            count += token.type == tokenize.NAME and token.string == name and following.string == "("
    return count


def record_stream_calls() -> dict[str, int]:
    """`record_stream(` calls in FSDP2 (`fully_shard`) and in FSDP1's flat-parameter runtime."""
    return {"fsdp2": _calls(_fully_shard_sources(), "record_stream"),
            "fsdp1": _calls(_flat_param_sources(), "_no_dispatch_record_stream")}


def fsdp2_streams() -> list[str]:
    """The CUDA streams FSDP2's communication context creates (attribute names)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPCommContext

    source = inspect.getsource(FSDPCommContext.lazy_init)
    return re.findall(r"self\.(\w+_stream) = self\.device_handle\.Stream\(", source)


def fsdp1_rate_limiter_default() -> bool:
    """FSDP1's `limit_all_gathers` default: the rate limiter that stops the CPU from issuing more
    all-gathers than two units' memory allows."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return inspect.signature(FullyShardedDataParallel.__init__).parameters["limit_all_gathers"].default


def ddp_bucket_cap_mb() -> int:
    """DDP's default bucket cap in MiB (`bucket_cap_mb=None` means this)."""
    from torch.nn.parallel import distributed

    return distributed._DEFAULT_BUCKET_CAP_MB


def async_tp() -> dict:
    """PyTorch's asynchronous tensor parallelism on the pinned torch: the compiler switch (off by
    default), the call that gives a group symmetric memory, and the two decomposed operations it
    rewrites a TP layer's collectives into (all-gather then matmul, matmul then reduce-scatter)."""
    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory

    fused = [name.lstrip("_") for name in dir(_symmetric_memory)
             if name in ("_fused_all_gather_matmul", "_fused_matmul_reduce_scatter")]
    return {"switch_default": inductor_config._micro_pipeline_tp,
            "enable_symm_mem_for_group": hasattr(_symmetric_memory, "enable_symm_mem_for_group"), "fused": fused}


# --- what FSDP2 issues, and when, on the pinned torch ------------------------------------------

def _fsdp2_rank(rank, world_size, forward_prefetch, root_layer):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    children = list(model)[:-1] if root_layer else list(model)  # with root_layer, the last is the root's own
    for layer in children:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if forward_prefetch:
        for layer, following in zip(children, children[1:]):
            layer.set_modules_to_forward_prefetch([following])
    x = torch.randn(4, 16)
    model(x).sum().backward()  # FSDP2 initialises lazily, on the first forward
    tracker = FullTensorTracker()  # tags each product with the all-gathers its operands came from
    with CommunicationLog() as log, tracker, ComputeRecorder(log.events, tracker):
        log.mark("forward")
        loss = model(x).sum()
        log.mark("backward")
        loss.backward()
        log.mark("end")
    return plain_events(log.events)


def fsdp2_events(forward_prefetch: bool = False, world_size: int = 2, root_layer: bool = False) -> list[dict]:
    """Rank 0's ordered all-gathers, waits and products in one step of FSDP2 (`fully_shard` per
    Linear of a 4-layer model, then on the model), with or without
    `set_modules_to_forward_prefetch`; with `root_layer`, the last Linear is left to the root."""
    return run_world(_fsdp2_rank, world_size, (forward_prefetch, root_layer))[0]


def gathers_per_phase(events: list[dict]) -> dict[str, int]:
    """All-gathers issued in forward and in backward."""
    labels = [e.get("label") for e in events]
    begin, middle, end = labels.index("forward"), labels.index("backward"), labels.index("end")
    count = lambda a, b: sum(e["op"] == "all_gather" for e in events[a:b])  # noqa: E731
    return {"forward": count(begin, middle), "backward": count(middle, end)}


def gathers_issued_ahead(events: list[dict], phase: str, stop: str) -> tuple[int, int]:
    """(all-gathers of the phase issued before the first product that uses the previous
    all-gather's weights, all-gathers of the phase after the first): issued ahead means the
    gather could run under the previous unit's compute. Products carry the numbers of the
    gathers their operands came from (`ComputeRecorder` with a tracker)."""
    labels = [e.get("label") for e in events]
    begin, end = labels.index(phase), labels.index(stop)
    numbered = {i: n for n, i in enumerate((i for i, e in enumerate(events) if e["op"] == "all_gather"), 1)}
    gathers = [i for i in range(begin, end) if i in numbered]
    ahead = 0
    for previous, current in zip(gathers, gathers[1:]):
        first_use = next((i for i in range(previous, end) if events[i]["op"] == "compute"
                          and numbered[previous] in events[i].get("gathers", [])), end)
        ahead += current < first_use
    return ahead, max(0, len(gathers) - 1)
