"""The practised step time (`Training.cost_model == "roofline"`), put together from the per-layer
compute of `dtp.topology.costs`, the pipeline's stages (`dtp.topology.stages`), each dimension's
communication exposed only where the overlap chapter's model (`dtp.overlap.model`) says nothing
hides it, NCCL's start-up latencies and the contention of overlapped work (`dtp.topology.collectives`).

The step of a GPU of the costliest stage (`roofline_step_time` states it in full):
    m · τ_max  +  (Σ τ_i - τ_max)/v  +  exposed PP, DP and the optimizer step,
where τ_i is stage i's time per micro-batch: its layers' forward and backward with their exposed
TP, EP and CP time, the output layer on the last stage, and with DeepSpeed's pipeline the sends and
receives it waits for.
"""
from __future__ import annotations

import dataclasses
import functools

from dtp.overlap import model as overlap
from dtp.topology import collectives, stages
from dtp.topology.costs import micro_batch_compute, optimizer_seconds, stage_compute
from dtp.topology.mesh import factors

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb (gradient buckets reduced during backward)
SCHEDULES = ("1f1b", "deepspeed", "dualpipe")


@functools.lru_cache(maxsize=4096)
def _pp_exposed(stages: int, micro_batches: int, message_over_forward: float) -> float:
    """dtp.overlap.model.pp_exposed in units of one forward (backward = 2 forwards), cached."""
    return overlap.pp_exposed(stages, micro_batches, message_over_forward, 1.0, 2.0)


def pp_exposed_seconds(stages: int, micro_batches: int, message_s: float, forward_s: float, chunks: int = 1) -> float:
    """Exposed time of the pipeline's activation and gradient messages, from the course's 1F1B
    simulator (dtp.overlap.model.pp_exposed); beyond 2p micro-batches the steady state adds the same
    per micro-batch, so it is extrapolated linearly from 2p. Interleaving sends v times as many
    messages, each between smaller chunks: the exposure of v pipelines' messages."""
    if stages == 1 or message_s == 0:
        return 0.0
    ratio = float(f"{message_s / forward_s:.3g}")
    cap = 2 * stages
    if micro_batches <= cap:
        exposed = _pp_exposed(stages, micro_batches, ratio)
    else:
        slope = (_pp_exposed(stages, cap, ratio) - _pp_exposed(stages, cap - stages, ratio)) / stages
        exposed = _pp_exposed(stages, cap, ratio) + slope * (micro_batches - cap)
    return exposed * forward_s * chunks


def dp_exposed_seconds(layout, training, sent: dict[str, float], bandwidth: float, compute: dict,
                       latency: dict[str, float] | None = None, contention: float = 0.0) -> float:
    """Exposed data-parallel time per step for `sent` = {"gradients": bytes, "weights": bytes}
    (dtp.zero.formulas.accumulation_bytes_sent_per_gpu) on a link of `bandwidth`, from dtp.overlap.model:
    - gradients reduced in buckets during the backward they come from (dtp.overlap.model.ddp_exposed,
      torch DDP's 25 MiB buckets): once per step under the last micro-batch's backward, or, with
      ZeRO-2/3 reducing every micro-batch, each micro-batch's share under its own backward;
    - ZeRO-3 gathers each layer's weights before its forward and again before its backward, the
      next layer's gather prefetched under this one's compute (fsdp_forward_exposed and
      fsdp_backward_exposed, one unit per layer);
    - ZeRO-1/2 all-gather the updated weights after the optimizer step: exposed, or hidden under
      the next forward when `training.overlap_param_gather` (Megatron's distributed optimizer);
    - without `training.dp_overlap`, the gradients are reduced after the step's last backward, all
      of it exposed (Megatron-LM 2021's own DistributedDataParallel all-reduced its gradient
      buffer in one call after backward; so does DeepSpeed's PipelineEngine).
    `latency`: {"gradients": s, "weights": s}, one collective's start-up (collectives.collective_latency_s),
    paid per bucket: the overlap model's alpha; `contention`: its epsilon, computation slowed while
    a collective it hides runs beside it."""
    latency = latency or {"gradients": 0.0, "weights": 0.0}
    m = layout.micro_batches
    reductions = m if layout.zero_stage >= 2 and layout.reduce_every_micro_batch else 1
    exposed = 0.0
    if sent["gradients"] and not training.dp_overlap:  # reduced after backward (Megatron-LM 2021's DDP)
        exposed += reductions * overlap.collective_time(sent["gradients"] / reductions, bandwidth, latency["gradients"])
    elif sent["gradients"]:
        per_reduction = sent["gradients"] / reductions
        buckets = max(1, round(per_reduction / DDP_BUCKET_BYTES))
        exposed += reductions * overlap.ddp_exposed(per_reduction / bandwidth, compute["backward"], buckets,
                                                    alpha=latency["gradients"], contention=contention)
    buckets = max(1, round(sent["weights"] / DDP_BUCKET_BYTES)) if training.dp_overlap else 1
    weight_s = buckets * overlap.collective_time(sent["weights"] / buckets, bandwidth, latency["weights"]) \
        if sent["weights"] else 0.0
    if layout.zero_stage == 3:
        units = compute["units"]
        gather = sent["weights"] / bandwidth / (2 * m * units)
        exposed += m * (overlap.fsdp_forward_exposed(units, gather, compute["layer_forward"], alpha=latency["weights"],
                                                     contention=contention)
                        + overlap.fsdp_backward_exposed(units, gather, 0.0, compute["layer_backward"],
                                                        alpha=latency["weights"], contention=contention))
    elif weight_s:
        exposed += overlap.exposed(weight_s, compute["forward"], contention) if training.overlap_param_gather \
            else weight_s
    return exposed


def tp_exposed_seconds(tp_s: float, layout, training, compute: dict, contention: float = 0.0) -> float:
    """Exposed TP time per step (dtp.overlap.model.tp_layer_exposed): per layer and micro-batch, forward's
    two all-reduce-sized collectives are on the critical path; backward's two each run under
    half the layer's weight-gradient GEMMs (with full recomputation the repeated forward's two
    are exposed too). Without `training.tp_overlap` all of it is exposed."""
    if not tp_s or not training.tp_overlap:
        return tp_s
    layers = compute["units"]
    passes = 3 if training.recompute == "full" else 2
    per_collective = tp_s / (layout.micro_batches * layers * 2 * passes)
    per_layer = overlap.tp_layer_exposed(per_collective, compute["layer_forward_gemm"] / 2, contention=contention)
    if training.recompute == "full":
        per_layer += 2 * per_collective
    return layout.micro_batches * layers * per_layer


def ep_exposed_seconds(ep_s: float, layout, training, compute: dict, contention: float = 0.0) -> float:
    """Exposed EP time per step (dtp.overlap.model.ep_exposed): serial, all of it; with
    `training.ep_overlap` (two micro-batches interleaved, as DeepSeek-V3's DualPipe does), each
    micro-batch's all-to-alls under the other's compute."""
    if not ep_s:
        return 0.0
    if not training.ep_overlap:
        return ep_s
    pairs = layout.micro_batches / 2
    per_pair = ep_s / pairs / 2
    return pairs * overlap.ep_exposed(per_pair, compute["forward"] + compute["backward"], overlapped=True,
                                      contention=contention)


def cp_exposed_seconds(cp_s: float, layout, training, compute: dict, contention: float = 0.0) -> float:
    """Exposed context-parallel time per step: all of it with `cp_method="allgather"` (K/V
    gathered before attention starts, dK/dV reduced after it ends). Ring attention: per layer and
    micro-batch, forward takes c - 1 ring steps, each passing one K/V block while the GPU computes
    attention on the block it holds (1/c of the layer's attention); backward takes c steps that
    carry 2c - 1 blocks (K/V again, and their gradients) under 2/c of it each. A step's transfer
    sticks out by max(0, transfer - that compute) (dtp.overlap.model.exposed)."""
    c = layout.cp
    if c == 1 or not cp_s:
        return 0.0
    if training.cp_method == "allgather":  # Llama 3: "the all-gather communication latency is exposed"
        return cp_s
    per_layer = cp_s / (layout.micro_batches * compute["units"])
    forwards = 2 if training.recompute == "full" else 1
    # forward passes send K/V once each, backward K/V again and their gradients (dtp.cp.context_parallel)
    shares = {"forward": forwards * (c - 1), "backward": (c - 1) + c}
    unit = per_layer / (shares["forward"] + shares["backward"])
    attention = compute["layer_attention"]
    exposed = forwards * (c - 1) * overlap.exposed(unit, attention / c, contention)
    exposed += c * overlap.exposed(unit * (2 * c - 1) / c, 2 * attention / c, contention)  # c steps: 2c - 1 blocks
    return layout.micro_batches * compute["units"] * exposed




# --- latency: how many collectives each dimension issues, and what one costs -------------------------

def group_nodes(model, cluster, training, layout) -> dict[str, int]:
    """Nodes one group of each dimension spans in the layout's rank order (nodes hold consecutive ranks)."""
    stride, strides, sizes = 1, {}, {}
    for name, size in factors(layout.sizes(model), layout.order(model, training.pp_outermost)):
        strides[name], sizes[name] = stride, size
        stride *= size
    g = cluster.gpus_per_node
    nodes = {name: collectives.nodes_of_group(sizes[name], strides[name], g) for name in sizes}
    # the DP group with EP carved out of it: its EP factor times its expert_dp factor; with CP, CP's too
    nodes["dp"] = min(layout.dp * layout.cp, nodes.get("dp", 1) * nodes.get("ep", 1) * nodes.get("expert_dp", 1)
                      * nodes.get("cp", 1))
    nodes.setdefault("expert_dp", nodes.get("dp", 1))
    return nodes


def latency_seconds(model, cluster, training, layout, units: int) -> dict[str, float]:
    """Start-up seconds per step of each dimension's collectives on a GPU of a stage of `units`
    layers (collectives.collective_latency_s): TP's per layer, micro-batch and pass (all-gathers and
    reduce-scatters with sequence parallelism, all-reduces without), CP's ring steps or gathers,
    EP's all-to-alls, PP's messages; "dp_gradients" and "dp_weights": one DP collective each (paid
    per bucket by dp_exposed_seconds)."""
    if not cluster.collective_base_s and not cluster.alpha_s:
        return {}
    nodes, m, t = group_nodes(model, cluster, training, layout), layout.micro_batches, layout.tp
    forwards = 2 if training.recompute == "full" else 1
    passes = forwards + 1
    latency = functools.partial(collectives.collective_latency_s, cluster)
    tp = (4 * latency("all_gather", t, nodes["tp"]) if training.sequence_parallel
          else 2 * latency("all_reduce", t, nodes["tp"]))
    found = {"tp": units * m * passes * tp,
             "pp": 2 * m * training.chunks * latency("send", 2, 2 if nodes.get("pp", 1) > 1 else 1) if layout.pp > 1
             else 0.0,
             "dp_gradients": latency("all_reduce" if layout.zero_stage == 0 else "reduce_scatter",
                                     layout.dp * layout.cp, nodes["dp"]),
             "dp_weights": latency("all_gather", layout.dp * layout.cp, nodes["dp"])}
    if layout.cp > 1:
        c = layout.cp
        per_layer = ((forwards * (c - 1) + c) * latency("send", 2, 2 if nodes["cp"] > 1 else 1)
                     if training.cp_method == "ring" else (forwards + 1) * latency("all_gather", c, nodes["cp"]))
        found["cp"] = units * m * per_layer
    if model.is_moe:
        group = layout.expert_ep
        found["ep"] = units * m * (2 * forwards + 2) * latency("all_to_all", group, 1 if group <= cluster.gpus_per_node
                                                                 else 2)
    return found


# --- the step ------------------------------------------------------------------------------------------

def roofline_step_time(model, cluster, training, layout, seconds: dict[str, float],
                       data_parallel: dict[str, tuple[dict, float]], stage_layers: tuple[int, ...],
                       parameters_per_gpu: float, latency: dict[str, float] | None = None) -> dict[str, float]:
    """`seconds`: each dimension's communication time, all of it, for the stage of the most layers
    (latency included); `data_parallel`: for "dp" (and "expert_dp") the bytes sent as gradients and
    weights and the link's bandwidth; `stage_layers`: layers per stage; `parameters_per_gpu`: what
    the busiest optimizer updates. The step's parts, for a GPU of the costliest stage:
    - "compute": m micro-batches of its layers (and the output layer on the last stage);
    - "tp", "ep", "cp": the exposed part of each (per layer, from the overlap model);
    - "pp": 1F1B's messages exposed as the course's simulator says, or with `pp_overlap`
      (Megatron-Core's `overlap_p2p_comm`) only what of each outlasts a chunk's forward; with
      DeepSpeed's pipeline every message a stage sends or receives, one after another with its
      computation;
    - "bubble": the fill and drain, (Σ τ_i - τ_max)/v over the stages' times per micro-batch;
      DualPipe's (DeepSeek-V3, section 3.2.1 and its Table 2): (p/2 - 1)(F&B + B - 3W), the
      overlapped forward-and-backward pair F&B taken as F + B and W the weight-gradient GEMMs,
      plus (p/2 - 1) micro-batches' exposed TP, EP and CP time, each micro-batch's two PP messages
      under a forward-and-backward pair;
    - "dp" (and "expert_dp"): exposed DP traffic; "optimizer": the memory-bound Adam pass.
    With `cluster.contention` ε, computation that runs beside a collective it hides runs at
    1/(1 + ε) of its speed (dtp.overlap.model's contention, passed to each of its functions above;
    the 1F1B simulator's messages are charged none: point-to-point sends take few SMs)."""
    latency = latency or {}
    if training.pipeline_schedule not in SCHEDULES:
        raise ValueError(f"pipeline_schedule must be one of {SCHEDULES}, got {training.pipeline_schedule!r}")
    compute = micro_batch_compute(model, cluster, training, layout)
    m, p, v = layout.micro_batches, layout.pp, training.chunks
    units = max(stage_layers)
    busiest = stage_compute(compute, units, False)
    compute.update(busiest, units=units)
    eps = cluster.contention
    exposed = {"tp": tp_exposed_seconds(seconds.get("tp", 0.0), layout, training, compute, eps),
               "ep": ep_exposed_seconds(seconds.get("ep", 0.0), layout, training, compute, eps),
               "cp": cp_exposed_seconds(seconds.get("cp", 0.0), layout, training, compute, eps)}
    per_layer = {name: value / (m * units) for name, value in exposed.items()}
    layer_comm = sum(per_layer.values())
    # one message: a micro-batch's activation (or gradient) across one boundary between chunks
    message = seconds.get("pp", 0.0) / (2 * m * v) if p > 1 else 0.0
    deepspeed = training.pipeline_schedule == "deepspeed"
    if deepspeed and v > 1:
        raise ValueError("DeepSpeed's pipeline does not interleave (chunks must be 1)")
    stage_times, stage_parts = [], []
    for index, layers in enumerate(stage_layers):
        work = stage_compute(compute, layers, index == p - 1, model.mtp_modules)
        # DeepSpeed: a stage waits for each message it receives and sends (two per micro-batch at
        # the ends of the pipeline, four in its interior), one instruction after another
        waits = (2 if index in (0, p - 1) else 4) * message if deepspeed and p > 1 else 0.0
        layers += model.mtp_modules if index == p - 1 else 0
        stage_parts.append((work, layers, waits))
        stage_times.append(work["forward"] + work["backward"] + layers * layer_comm + waits)
    slowest = max(range(p), key=stage_times.__getitem__)
    work, layers, waits = stage_parts[slowest]
    parts = {"compute": m * (work["forward"] + work["backward"])}
    for name in ("tp", "ep", "cp"):
        parts[name] = m * layers * per_layer[name]
    pipeline = stages.pipeline_seconds(stage_times, m, v)
    parts["bubble"] = pipeline["fill_drain"]
    if deepspeed:
        parts["pp"] = m * waits
    elif p > 1 and training.pp_overlap:  # each chunk's sends and receives under the next chunk's compute
        chunk = busiest["forward"] / v
        parts["pp"] = 2 * m * v * overlap.exposed(message, chunk, eps)
    elif p > 1:
        parts["pp"] = pp_exposed_seconds(p, m, message, busiest["forward"] / v, v)
    else:
        parts["pp"] = 0.0
    dp_latency = {"gradients": latency.get("dp_gradients", 0.0), "weights": latency.get("dp_weights", 0.0)}
    ddp_training = training if not deepspeed else dataclasses.replace(training, dp_overlap=False)
    for name, (sent, bandwidth) in data_parallel.items():
        parts[name] = dp_exposed_seconds(layout, ddp_training, sent, bandwidth, compute, dp_latency, eps)
    if training.pipeline_schedule == "dualpipe" and p > 1:
        if p % 2 or m % 2 or v > 1:
            raise ValueError(f"DualPipe needs even stages and micro-batches and no interleaving (p={p}, m={m}, v={v})")
        f, b, w = busiest["forward"], busiest["backward"], busiest["weight_gradient"]
        parts["pp"] = m * overlap.exposed(2 * message, f + b)
        parts["bubble"] = (p / 2 - 1) * (f + 2 * b - 3 * w + (parts["tp"] + parts["ep"] + parts["cp"]) / m)
    parts["optimizer"] = optimizer_seconds(parameters_per_gpu, cluster.hbm_bytes_per_s) \
        if training.optimizer_step else 0.0
    return parts
