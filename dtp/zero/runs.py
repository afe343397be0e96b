"""The chapter's training runs: one rank of plain data parallelism or of a ZeRO wrapper, trained
on its rows of each batch with everything it holds, sends and gathers recorded per step
(`train_zero_rank`), and the single-process run it must equal (`single_process_adam`). The
exercises' checks, the book and the tests all run these."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dtp.common.models import regression_batch, state_as_numpy, tiny_mlp
from dtp.common.traffic import CommunicationLog
from dtp.zero.measure import FullTensorTracker, clear_gradients, held_bytes, optimizers_in

ADAM = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-4}  # eps ≫ float32 rounding of a gradient near zero
STEPS, ROWS_PER_RANK = 3, 4
GATHERED_UNITS_LIMIT = 2  # ZeRO-3: the unit running, and one more (the next one prefetched, say)


def batches(sizes, batch_seed: int, world_size: int, steps: int = STEPS):
    """The global batches of a run: ROWS_PER_RANK rows per rank, regression targets."""
    return [regression_batch(ROWS_PER_RANK * world_size, sizes[0], sizes[-1], batch_seed + step) for step in range(steps)]


def rank_rows(rank: int) -> slice:
    return slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)


def _average_gradients(parameters) -> None:
    """Plain data parallelism's step: all-reduce every gradient and divide by the world size."""
    for parameter in parameters:
        dist.all_reduce(parameter.grad)
        parameter.grad /= dist.get_world_size()


def marked_step(log, tracker, loss_of, step=None, after_backward=None):
    """One training step inside `log` (a CommunicationLog) and `tracker` (a FullTensorTracker),
    each phase marked in both: "forward" (`loss_of()` computes the loss), "backward", "step".
    Given `step`: `after_backward()` runs in phase "after backward" (to measure what is held
    then), `step()` in phase "step", then a mark "end" and a sample "after step". Returns the loss."""
    log.mark("forward")
    tracker.phase = "forward"
    loss = loss_of()
    log.mark("backward")
    tracker.phase = "backward"
    loss.backward()
    log.mark("step")
    if step is None:
        tracker.phase = "step"
        return loss
    tracker.phase = "after backward"
    if after_backward is not None:
        after_backward()
    tracker.phase = "step"
    step()
    log.mark("end")
    tracker.phase = "after step"
    tracker.sample()
    return loss


def gathered_units(tracker) -> dict:
    """The most units whose gathered weights were alive at once, in forward and in backward."""
    return {phase: tracker.unit_peaks.get(phase, 0) for phase in ("forward", "backward")}


def _record_step(outcome: dict, log, tracker, loss, full_after_backward: int) -> None:
    """What every ZeRO run records per step: the loss, the collectives with the step's marks, the
    full weights alive (peaks in forward and backward, after backward and after the step), and
    the gathered units at once."""
    outcome["full weights"].append({"forward": tracker.peaks.get("forward", 0),
                                    "backward": tracker.peaks.get("backward", 0),
                                    "after backward": full_after_backward, "after step": tracker.full_bytes_alive()})
    outcome["gathered units"].append(gathered_units(tracker))
    outcome["losses"].append(float(loss.detach()))
    outcome["events"].append(log.kept(("op", "bytes", "label")))


def _first_momentum(optimizers) -> float | None:
    """Adam's first momentum after the first step, summed: (1 - beta1)·(the gradient it stepped with)."""
    moments = [state["exp_avg"] for o in optimizers for state in o.state.values() if "exp_avg" in state]
    return float(sum(m.abs().sum() for m in moments)) if moments else None


def train_zero_rank(rank, world_size, stage, make, sizes, seed, batch_seed, steps: int = STEPS) -> dict:
    """One rank of a run of `tiny_mlp(sizes, seed)` on its rows of each batch, recording per step
    the loss, the weights after the step, the collectives (`events`), the bytes held after
    backward (`held`), the full gradients alive after backward and their peak during it, the full
    weights alive (peaks in forward and backward, what is left after backward and after the
    step), the most gathered units alive at once in forward and in backward (stage 3), the first
    full gradient still alive after a later unit's reduce-scatter (stage 2, None if none), and
    once the summed |exp_avg| of Adam after the first step.

    stage 0: plain data parallelism (torch Adam, gradients all-reduced); stages 1 and 2:
    `make(model, lr=..., betas=..., eps=...)` returns a wrapper whose step() is called after
    backward; stage 3: `make(model, units)` returns a module whose parameters torch Adam steps."""
    model = tiny_mlp(sizes, seed)
    parameters = list(model.parameters())
    if stage == 3:  # exercise 4's wrapper, each Linear layer a unit (the Sequential root then has none left)
        module = make(model, [layer for layer in model if isinstance(layer, nn.Linear)])
        del model, parameters  # from here on, only the wrapper holds the weights
        optimizer = torch.optim.Adam(module.parameters(), **ADAM)
        forward, watched, roots = module, [], {"zero": module, "optimizer": optimizer}
        weights, step_function = list(module.parameters()), optimizer.step
    elif stage == 0:
        optimizer = torch.optim.Adam(parameters, **ADAM)
        forward, watched, roots = model, parameters, {"model": model, "optimizer": optimizer}
        weights = parameters

        def step_function():
            _average_gradients(parameters)
            optimizer.step()
    else:
        wrapper = make(model, **ADAM)
        forward, watched, roots = model, parameters, {"model": model, "zero": wrapper}
        weights, step_function = parameters, wrapper.step
    # ZeRO-3 counts the gathered units alive (two at most, once gloo has let go); ZeRO-2 follows
    # each full gradient until the next unit's reduce-scatter.
    tracker = FullTensorTracker(watched, unit_limit=GATHERED_UNITS_LIMIT if stage == 3 else None,
                                follow_reductions=stage == 2)
    outcome = {"losses": [], "states": [], "events": [], "held": [], "full grads after backward": [],
               "grad peak": [], "full weights": [], "gathered units": [], "stale gradients": [], "exp_avg": None}
    for step, (inputs, targets) in enumerate(batches(sizes, batch_seed, world_size, steps)):
        tracker.new_step()
        after_backward = {}

        def measure_after_backward():
            after_backward["full grads"] = tracker.grad_bytes_alive()
            after_backward["full weights"] = tracker.full_bytes_alive()
            after_backward["held"] = held_bytes(weights, **roots)

        with CommunicationLog() as log, tracker:
            loss = marked_step(log, tracker, lambda: nn.functional.mse_loss(forward(inputs[rank_rows(rank)]),
                                                                            targets[rank_rows(rank)]),
                               step_function, measure_after_backward)
        outcome["full grads after backward"].append(after_backward["full grads"])
        outcome["held"].append(after_backward["held"])
        _record_step(outcome, log, tracker, loss, after_backward["full weights"])
        outcome["grad peak"].append(tracker.grad_peaks.get("backward", 0))
        outcome["stale gradients"].append(tracker.stale)
        if step == 0:
            outcome["exp_avg"] = _first_momentum(optimizers_in(**roots))
        outcome["states"].append([p.detach().clone().numpy() for p in weights] if stage == 3 else state_as_numpy(forward))
        clear_gradients(watched, **roots)  # as a training loop's zero_grad, the pieces' gradients too
    return outcome


def single_process_adam(sizes, seed: int, global_batches, world_size: int) -> dict:
    """What plain data-parallel Adam computes: one process, Adam, the whole batch. The state
    after each step, each rank's loss on its rows before the step, and the summed |gradient| of
    the first step."""
    model = tiny_mlp(sizes, seed)
    optimizer = torch.optim.Adam(model.parameters(), **ADAM)
    states, losses, first_gradient = [], [], None
    for inputs, targets in global_batches:
        with torch.no_grad():
            losses.append([float(nn.functional.mse_loss(model(inputs[rank_rows(r)]), targets[rank_rows(r)]))
                           for r in range(world_size)])
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        if first_gradient is None:
            first_gradient = float(sum(p.grad.abs().sum() for p in model.parameters()))
        optimizer.step()
        states.append(state_as_numpy(model))
    return {"states": states, "losses": losses, "first gradient": first_gradient}


# --- ZeRO-3 around a small GPT (exercise 4) ---------------------------------------------------
# The learner's `ZeRO3Module(model, units)` wraps a GPT with tied embeddings, each block a unit
# and the root (the model) a unit for what is left; AdamW with weight decay steps its pieces.

ADAMW = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-4, "weight_decay": 0.1}  # eps: see ADAM
GPT_ROWS_PER_RANK, GPT_SEQ = 2, 6


def small_gpt(config: tuple, seed: int):
    """A GPT (dtp.common.gpt) with tied embeddings, from (vocabulary, layers, hidden, heads)."""
    from dtp.common.gpt import GPT, GPTConfig
    vocab, layers, hidden, heads = config
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab, n_positions=GPT_SEQ, n_layers=layers, hidden=hidden, n_heads=heads,
                         dropout=0.0))


def gpt_units(model) -> list[list[str]]:
    """The units of exercise 4, in the order of the wrapper's pieces: each block's parameters, then
    the root's (those in no block, a tied one once), each in `named_parameters()` order."""
    units = [[f"blocks.{i}.{name}" for name, _ in block.named_parameters()] for i, block in enumerate(model.blocks)]
    in_blocks = {name for unit in units for name in unit}
    return units + [[name for name, _ in model.named_parameters() if name not in in_blocks]]


def gpt_batches(config: tuple, batch_seed: int, world_size: int, steps: int = STEPS):
    generator = torch.Generator().manual_seed(batch_seed)
    return [torch.randint(0, config[0], (GPT_ROWS_PER_RANK * world_size, GPT_SEQ + 1), generator=generator)
            for _ in range(steps)]


def gpt_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def gpt_rows(rank: int) -> slice:
    return slice(rank * GPT_ROWS_PER_RANK, (rank + 1) * GPT_ROWS_PER_RANK)


def train_zero3_gpt_rank(rank, world_size, make, config, seed, batch_seed, steps: int = STEPS) -> dict:
    """One rank of exercise 4: `make(model, list(model.blocks))` wraps `small_gpt(config, seed)`,
    AdamW steps the wrapper's parameters. Records per step what `train_zero_rank` records for
    stage 3 (losses, pieces after the step, collectives with forward/backward/step marks, bytes held
    after backward, gathered weights alive and gathered units at once, AdamW's first momentum)."""
    model = small_gpt(config, seed)
    module = make(model, list(model.blocks))
    del model  # from here on, only the wrapper holds the weights
    optimizer = torch.optim.AdamW(module.parameters(), **ADAMW)
    roots = {"zero": module, "optimizer": optimizer}
    weights = list(module.parameters())
    tracker = FullTensorTracker([], unit_limit=GATHERED_UNITS_LIMIT)
    outcome = {"losses": [], "states": [], "events": [], "held": [], "full weights": [], "gathered units": [],
               "exp_avg": None}
    for step, tokens in enumerate(gpt_batches(config, batch_seed, world_size, steps)):
        tracker.new_step()
        after_backward = {}

        def measure_after_backward():
            after_backward["full weights"] = tracker.full_bytes_alive()
            after_backward["held"] = held_bytes(weights, **roots)

        with CommunicationLog() as log, tracker:
            loss = marked_step(log, tracker, lambda: gpt_loss(module, tokens[gpt_rows(rank)]), optimizer.step,
                               measure_after_backward)
        outcome["held"].append(after_backward["held"])
        _record_step(outcome, log, tracker, loss, after_backward["full weights"])
        if step == 0:
            outcome["exp_avg"] = _first_momentum([optimizer])
        outcome["states"].append([p.detach().clone().numpy() for p in weights])
        optimizer.zero_grad(set_to_none=True)
    return outcome


def single_process_adamw_gpt(config, seed: int, global_batches, world_size: int) -> dict:
    """What data-parallel AdamW computes on the GPT: the state after each step (by name), each
    rank's loss on its rows before the step, and the summed |gradient| of the first step."""
    model = small_gpt(config, seed)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    states, losses, first_gradient = [], [], None
    for tokens in global_batches:
        with torch.no_grad():
            losses.append([float(gpt_loss(model, tokens[gpt_rows(r)])) for r in range(world_size)])
        optimizer.zero_grad()
        # The mean of the ranks' mean losses (equal rows per rank): what averaged gradients descend.
        gpt_loss(model, tokens).backward()
        if first_gradient is None:
            first_gradient = float(sum(p.grad.abs().sum() for p in model.parameters()))
        optimizer.step()
        states.append({name: p.detach().clone().numpy() for name, p in model.named_parameters()})
    return {"states": states, "losses": losses, "first gradient": first_gradient}
