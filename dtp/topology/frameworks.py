"""How each training framework runs a layout: the practised model's switches (`Training` fields)
as a framework's code and papers describe them, and the layouts it refuses. The planner's search
and the validation both take these, so that neither proposes a layout the framework would not run.

- "megatron-core" (Megatron-Core and NeMo, 2024; its README's benchmarks run with
  `--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap`): sequence parallelism, flash
  attention, TP's collectives under the GEMMs, DP's under backward, the distributed optimizer's
  weight gather under the next forward; interleaved 1F1B with each chunk's sends and receives under
  the next chunk's compute (`overlap_p2p_comm`); ranks ordered TP, CP, EP, DP, PP (PP outermost).
- "megatron-2021" (Megatron-LM as Narayanan et al. 2021 ran it): full recomputation, no sequence
  parallelism (Korthikanti et al. 2022 brought it), no flash attention (2022), TP's collectives on
  the critical path, the gradient buffer all-reduced in one call after backward (its "local" DDP;
  torch's DDP, bucketed under backward, for its smaller runs), interleaved 1F1B; PP outermost.
- "deepspeed" (Megatron-DeepSpeed with DeepSpeed's PipelineEngine, as MT-NLG and BLOOM ran it):
  Megatron's TP; a pipeline without interleaving whose instructions run one after another
  (`deepspeed/runtime/pipe/engine.py`: each send and receive waits), each TP rank sending its
  1/t share of an activation (`is_pipe_partitioned`); the gradients reduced after the last
  micro-batch (`_exec_reduce_grads`); ZeRO stage 1 at most with PP (the engine refuses 2 and 3);
  ranks ordered TP (model), DP (data), PP (pipe) outermost.

Rules every framework shares (Narayanan et al. 2021, section 2.2.2): interleaving needs v to
divide each stage's layers and m to be a multiple of p; the global batch must split into whole
micro-batches on every DP rank.
"""
from __future__ import annotations

import dataclasses

from dtp.topology import stages

FRAMEWORKS = {
    "megatron-core": dict(sequence_parallel=True, flash_attention=True, tp_overlap=True, dp_overlap=True,
                          overlap_param_gather=True, pp_overlap=True, pp_outermost=True, pipeline_schedule="1f1b"),
    "megatron-2021": dict(sequence_parallel=False, flash_attention=False, tp_overlap=False, dp_overlap=False,
                          overlap_param_gather=False, pp_overlap=False, pp_outermost=True, pipeline_schedule="1f1b"),
    "deepspeed": dict(sequence_parallel=False, flash_attention=False, tp_overlap=False, dp_overlap=False,
                      overlap_param_gather=False, pp_overlap=False, pp_outermost=True, pipeline_schedule="deepspeed",
                      max_zero_stage_with_pp=1),
}


def practised(training, framework: str, **changes):
    """`training` run as `framework` runs it (FRAMEWORKS), then `changes` on top."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}: one of {', '.join(FRAMEWORKS)}")
    return dataclasses.replace(training, cost_model="roofline", **{**FRAMEWORKS[framework], **changes})


def zero_stages(training, pp: int) -> tuple[int, ...]:
    """The ZeRO stages the framework runs with this pipeline depth."""
    return tuple(range(4 if pp == 1 else training.max_zero_stage_with_pp + 1))


def interleaving(training) -> bool:
    """Whether the framework's pipeline can interleave chunks (DeepSpeed's and DualPipe cannot)."""
    return training.pipeline_schedule == "1f1b"


def chunk_choices(training, stage_layers: tuple[int, ...]) -> tuple[int, ...]:
    """Every v the framework could interleave these stages with: the common divisors of the
    stages' units (1 only without interleaving, or with one stage)."""
    if not interleaving(training) or len(stage_layers) == 1:
        return (1,)
    units = stages.stage_units(stage_layers, training.balanced_stages)
    return tuple(v for v in range(1, min(units) + 1) if all(n % v == 0 for n in units))


def accepts(training, stage_layers: tuple[int, ...], micro_batches: int, chunks: int) -> bool:
    """Whether the framework runs this pipeline: interleaving where it has one, with v dividing
    every stage's layers (the embedding and output layer counted where they were split as layers)
    and m a multiple of p; DualPipe (DeepSeek-V3, section 3.2.1) with an even number of stages and
    of micro-batches."""
    if chunks > 1 and not interleaving(training):
        return False
    if training.pipeline_schedule == "dualpipe" and len(stage_layers) > 1 and (len(stage_layers) % 2 or
                                                                                micro_batches % 2):
        return False
    return stages.interleaving_allowed(stage_layers, chunks, micro_batches, training.balanced_stages)
