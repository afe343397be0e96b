"""What the pinned torch does with a pipeline: the activations autograd keeps for backward
while a real pipeline step runs, and the schedules torch.distributed.pipelining ships (their
per-rank plans as dtp.pp.schedules schedules, and real runs on gloo to compare with the course's).

Separate from dtp.pp.schedules, whose generators, simulator and closed forms the notebook and the
grader use: this module is for the book and the tests.
"""
from __future__ import annotations

import torch
from torch import nn

from dtp.pp.schedules import BACKWARD, FORWARD, WEIGHT, Op, Schedule, pipeline_stages, virtual_stage

# --- activations kept for backward -------------------------------------------------------------

class SavedActivations:
    """Bytes autograd keeps for backward while it is active (torch.autograd.graph's
    saved_tensors_hooks), now and at the peak: a saved tensor counts from when a forward saves
    it until autograd frees it after the backward; a storage saved twice (Tanh's output is also
    the next Linear's input) counts once, and the module's parameters (held anyway) not at all."""

    def __init__(self, parameters=()):
        self.excluded = {parameter.untyped_storage().data_ptr() for parameter in parameters}
        self.references: dict[tuple, int] = {}  # (address, bytes) -> saved tensors that use it
        self.live = self.peak = 0

    def pack(self, tensor):
        if tensor.untyped_storage().data_ptr() in self.excluded:  # a parameter, or a view of one (W.t())
            return tensor
        # a view counts its own bytes, not its storage's (stage 0's micro-batch is a slice of the batch)
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if not self.references.get(key):
            self.live += key[1]
            self.peak = max(self.peak, self.live)
        self.references[key] = self.references.get(key, 0) + 1
        return _Held(tensor, self, key)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: tuple) -> None:
        self.references[key] -= 1
        if not self.references[key]:
            self.live -= key[1]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    """A saved tensor as autograd keeps it; when autograd drops it (after the backward), the
    meter stops counting its bytes."""
    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor, meter: SavedActivations, key: tuple):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter.release(self.key)


class MeteredStage(nn.Module):
    """A stage whose forwards run under a SavedActivations meter (`.meter`): what a pipeline
    step keeps alive for its backwards, measured while the real step runs."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage
        self.meter = SavedActivations(stage.parameters())

    def forward(self, x):
        with self.meter.hooks():
            return self.stage(x)


def _metered_rank(rank, world_size, step, m, micro_batch, width):
    stage = MeteredStage(pipeline_stages(world_size, 0, width, width, width)[rank])
    generator = torch.Generator().manual_seed(0)
    batch = torch.randn(m * micro_batch, width, generator=generator)
    targets = torch.randn(m * micro_batch, width, generator=generator)
    step(stage, batch, targets, m, (micro_batch, width))
    return stage.meter.peak


def measure_saved_activations(step, p: int, m: int, micro_batch: int = 2, width: int = 8, **world_options) -> dict:
    """Run a pipeline step (exercise 4's signature) on p gloo ranks whose stages are p equal
    slices of one model (`pipeline_stages` with every width equal), and measure on each rank
    the most bytes autograd kept for backward at once. Also measured, on this process: one
    micro-batch through the whole model, and through one stage. Returns
    {"per_rank": [bytes], "whole_model_one_micro_batch": bytes, "one_stage_one_micro_batch": bytes}."""
    from dtp.common.world import run_world

    per_rank = run_world(_metered_rank, p, (step, m, micro_batch, width), **world_options)
    stages = pipeline_stages(p, 0, width, width, width)
    single = {}
    for name, module in (("whole_model_one_micro_batch", nn.Sequential(*stages)), ("one_stage_one_micro_batch", stages[0])):
        metered = MeteredStage(module)
        output = metered(torch.randn(micro_batch, width))
        single[name] = metered.meter.peak
        output.sum().backward()
    return {"per_rank": per_rank, **single}


# --- torch.distributed.pipelining, for comparison ---------------------------------------------

def torch_schedule_names() -> list[str]:
    """The schedule classes the installed torch.distributed.pipelining exports."""
    from torch.distributed import pipelining

    return sorted(name for name in dir(pipelining) if name.startswith("Schedule"))


# torch's computation types as this module's kinds (its input-gradient backward is our B)
TORCH_KINDS = {"FORWARD": FORWARD, "BACKWARD_INPUT": BACKWARD, "BACKWARD_WEIGHT": WEIGHT}


def torch_schedule_order(class_name: str, p: int, m: int) -> Schedule:
    """The order of ops a two-chunk torch schedule (ScheduleZBVZeroBubble, ScheduleDualPipeV,
    ScheduleInterleaved1F1B with v = 2) gives each rank, as this module's schedule: computed by
    the class's own per-rank planner on an instance that never starts (it needs no process
    group). Private torch API, read for the pinned version; V-shaped classes put the chunks as
    placement "V". A full backward is this module's whole-backward B when the plan has no split
    backward; a plan that mixes both (DualPipeV's) is refused, as are overlapped pairs (an F of
    one micro-batch beside the B of another, whose gain, computation under communication, the
    simulator does not model)."""
    from torch.distributed.pipelining import schedules

    planner = object.__new__(getattr(schedules, class_name))
    planner.pp_group_size, planner._n_microbatches, planner.num_stages, planner.n_local_stages = p, m, 2 * p, 2
    planner.number_of_rounds = max(1, m // p)
    planner.microbatches_per_round = m // planner.number_of_rounds
    v_shaped = class_name != "ScheduleInterleaved1F1B"

    def chunk(stage_index: int) -> int:
        return int(stage_index >= p) if v_shaped else stage_index // p

    plans = [[action for action in planner._calculate_single_rank_operations(rank) if action is not None]
             for rank in range(p)]
    kinds = {action.computation_type.name for plan in plans for action in plan}
    if "FULL_BACKWARD" in kinds:
        if kinds & {"BACKWARD_INPUT", "BACKWARD_WEIGHT", "OVERLAP_F_B"}:
            raise ValueError(f"{class_name} mixes whole and split backwards or overlaps ops ({', '.join(sorted(kinds))}), "
                             "which this simulator does not model")
        kinds_here = {**TORCH_KINDS, "FULL_BACKWARD": BACKWARD}
    else:
        kinds_here = TORCH_KINDS

    def converted(action) -> Op:
        kind = action.computation_type.name
        if kind not in kinds_here:
            raise ValueError(f"{class_name} plans an op of kind {kind}, which this simulator does not model")
        return Op(kinds_here[kind], action.microbatch_index, chunk(action.stage_index))

    return [[converted(action) for action in plan] for plan in plans]


# torch's schedule classes the course runs on gloo, and where each places a rank's chunks
TORCH_CHUNKS = {"GPipe": (1, "interleaved"), "1F1B": (1, "interleaved"), "Interleaved1F1B": (2, "interleaved"),
                "ZBVZeroBubble": (2, "V"), "DualPipeV": (2, "V")}


def _torch_schedule_rank(rank, world_size, schedule_name, m, seed, micro_batch):
    from torch.distributed import pipelining

    chunks, placement = TORCH_CHUNKS[schedule_name]
    last = chunks * world_size - 1
    model = pipeline_stages(chunks * world_size, seed)
    virtual = [virtual_stage(chunk, rank, world_size, placement) for chunk in range(chunks)]
    order: list[tuple[str, int, int]] = []  # what this rank computed, in order: (kind, micro-batch, chunk)
    recording = False

    def forward_hook(chunk):
        def hook(module, inputs, output):
            if recording:
                micro_batch_index = sum(op == (FORWARD, chunk) for op in ((k, c) for k, _, c in order))
                order.append((FORWARD, micro_batch_index, chunk))
                # fires when the gradient of the output arrives: in the backward, or its
                # input-gradient part; a split schedule's weight-gradient pass fires it again
                def backward_hook(grad):
                    again = (BACKWARD, micro_batch_index, chunk) in order
                    order.append((WEIGHT if again else BACKWARD, micro_batch_index, chunk))
                output.register_hook(backward_hook)
        return hook

    stages = []
    for chunk, index in enumerate(virtual):
        model[index].register_forward_hook(forward_hook(chunk))
        stages.append(pipelining.PipelineStage(model[index], index, chunks * world_size, torch.device("cpu")))
    schedule_class = getattr(pipelining, f"Schedule{schedule_name}")
    schedule = schedule_class(stages if chunks > 1 else stages[0], n_microbatches=m, loss_fn=nn.functional.mse_loss)
    generator = torch.Generator().manual_seed(seed)
    batch = torch.randn(m * micro_batch, 6, generator=generator)
    targets = torch.randn(m * micro_batch, 3, generator=generator)
    losses: list = []
    # Two steps on the same batch, without an optimizer: the first also infers the shapes that
    # cross each boundary (a forward and backward of its own), the second is the one recorded.
    for step in range(2):
        recording = step == 1
        for index in virtual:
            model[index].zero_grad()
        losses.clear()
        inputs = (batch,) if 0 in virtual else ()
        if last in virtual:
            schedule.step(*inputs, target=targets, losses=losses)
        else:
            schedule.step(*inputs)
    return {"losses": [loss.item() for loss in losses], "order": order,
            "grads": {f"{index}.{name}": parameter.grad.clone()
                      for index in virtual for name, parameter in model[index].named_parameters()}}


def run_torch_schedule(schedule_name: str, p: int, m: int, seed: int = 0, micro_batch: int = 2,
                       timeout_s: float = 60.0) -> dict:
    """Train one step of `pipeline_stages(p·v, seed)` (v chunks per rank, TORCH_CHUNKS) with
    torch.distributed.pipelining's Schedule<schedule_name> on p gloo processes (inputs of 6
    features, targets of 3, as `torch.randn` draws from a generator seeded with `seed`),
    recording each rank's order of forwards, backwards (or their input-gradient part) and
    weight-gradient passes of split backwards as (kind, micro-batch, chunk). Gradients are keyed "<virtual stage>.<parameter>". Time-boxed: the
    processes are killed after `timeout_s` (gloo pipelining has had hangs). Returns
    {"status": "ok", "ranks": [per-rank result]} or {"status": "failed", "symptom": ...}."""
    import torch.distributed.pipelining  # noqa: F401 - imported once here, not in every forked rank

    from dtp.common.world import WorldError, run_world

    try:
        return {"status": "ok", "ranks": run_world(_torch_schedule_rank, p, (schedule_name, m, seed, micro_batch),
                                                   timeout_s=timeout_s, collective_timeout_s=timeout_s / 3)}
    except WorldError as error:
        return {"status": "failed", "symptom": f"{error.kind}: {error}"}
