"""Every check of the ZeRO chapter rejects plausible wrong answers with feedback that names the
mistake, and accepts correct answers written differently from the course's (a flat buffer of all
parameters or one tensor per parameter, all_gather lists or all_gather_single)."""
import pytest

from conftest import assert_fails, changed, graded, solution_cell, solution_notebook

ZERO1_CELL = solution_cell("zero", "ZeRO1Adam")
ZERO2_CELL = solution_cell("zero", "ZeRO2Adam")
ZERO3_CELL = solution_cell("zero", "ZeRO3Module")


# --- exercise 1: memory per GPU ---

MEMORY = '''
def zero_memory_per_gpu(n_params, n_gpus, stage):
    sharded = {{0: (), 1: ("optimizer",), 2: ("optimizer", "gradients"), 3: ("optimizer", "gradients", "weights")}}
    parts = {{"weights": 2, "gradients": 2, "optimizer": {OPTIMIZER}}}
    return {MEMORY}


def zero_saving_factor(n_gpus, stage):
    return {FACTOR}
'''
RIGHT_MEMORY = dict(OPTIMIZER="12", MEMORY="sum(n_params * b / (n_gpus if k in sharded[stage] else 1) for k, b in parts.items())",
                    FACTOR="zero_memory_per_gpu(1.0, 1, 0) / zero_memory_per_gpu(1.0, n_gpus, stage)")


def memory_variant(**changes) -> str:
    return MEMORY.format(**{**RIGHT_MEMORY, **changes})


def test_memory_accepts_a_table_driven_answer(tmp_notebook):
    assert graded(tmp_notebook, "zero.memory_per_gpu", {"zero_memory_per_gpu": memory_variant()}).status == "passed"


@pytest.mark.parametrize("changes, feedback", [
    (dict(MEMORY="4 * n_params if stage == 1 else " + RIGHT_MEMORY["MEMORY"]), "4x of the source notes"),
    (dict(MEMORY="2 * n_params if stage == 2 else " + RIGHT_MEMORY["MEMORY"]), "8x of the source notes"),
    (dict(MEMORY="sum(n_params * b / (n_gpus if k in sharded[max(stage - 1, 0)] else 1) for k, b in parts.items())"),
     "the previous stage's memory"),
    (dict(OPTIMIZER="8"), "mixed-precision Adam keeps 12"),
    (dict(FACTOR="zero_memory_per_gpu(1.0, n_gpus, stage) / zero_memory_per_gpu(1.0, 1, 0)"),
     "the saving factor is 16Ψ over memory per GPU"),
    (dict(FACTOR="{1: 4.0, 2: 8.0}.get(stage, float(n_gpus if stage == 3 else 1))"), "the Nd → ∞ limit"),
], ids=["zero1-is-4x", "zero2-is-8x", "stage-off-by-one", "optimizer-8-bytes", "factor-inverted", "factor-limit"])
def test_memory_rejects(tmp_notebook, changes, feedback):
    assert_fails(graded(tmp_notebook, "zero.memory_per_gpu", {"zero_memory_per_gpu": memory_variant(**changes)}),
                 feedback)


# --- exercise 2: ZeRO-1 ---

ZERO1_ALL_REDUCE_AND_FULL_ADAM = ZERO1_CELL + '''

class ZeRO1Adam:  # replaces the one above: every rank averages everything and updates the full model
    def __init__(self, model, lr, betas, eps):
        self.parameters = list(model.parameters())
        self.optimizer = torch.optim.Adam(self.parameters, lr=lr, betas=betas, eps=eps)

    def step(self):
        for parameter in self.parameters:
            dist.all_reduce(parameter.grad)
            parameter.grad /= dist.get_world_size()
        self.optimizer.step()
'''

ZERO1_GATHERED_GRADIENTS_AND_FULL_ADAM = ZERO1_CELL + '''

class ZeRO1Adam:  # reduce-scatter and all-gather, but of gradients: every rank updates the full model
    def __init__(self, model, lr, betas, eps):
        self.parameters = list(model.parameters())
        self.optimizer = torch.optim.Adam(self.parameters, lr=lr, betas=betas, eps=eps)

    def step(self):
        for parameter in self.parameters:
            averaged = all_gather_full(reduce_scatter_mean(parameter.grad), parameter.numel())
            parameter.grad.copy_(averaged.view_as(parameter))
        self.optimizer.step()
'''

ZERO1_NO_ALL_GATHER = changed(ZERO1_CELL, (
    "                parameter.copy_(all_gather_full(piece, parameter.numel()).view_as(parameter))",
    "                pass  # each rank keeps its own update"))

ZERO1_KEEPS_A_GATHER_BUFFER = changed(ZERO1_CELL, (
    "        self.optimizer = torch.optim.Adam(self.pieces, lr=lr, betas=betas, eps=eps)",
    "        self.optimizer = torch.optim.Adam(self.pieces, lr=lr, betas=betas, eps=eps)\n"
    "        self.buffers = [torch.empty(p.numel()) for p in self.parameters]  # kept for every step"))

ZERO1_TORCH = ZERO1_CELL + '''

from torch.distributed.optim import ZeroRedundancyOptimizer

class ZeRO1Adam:
    def __init__(self, model, lr, betas, eps):
        self.optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=lr)
'''


@pytest.mark.parametrize("source, feedback", [
    (changed(ZERO1_CELL, ("return averaged.div_(world_size)", "return averaged.div_(world_size * world_size)")),
     "divided by the world size twice"),
    (changed(ZERO1_CELL, ("return averaged.div_(world_size)", "return averaged")), "the reduce-scatter sums"),
    (ZERO1_ALL_REDUCE_AND_FULL_ADAM, "called all_reduce"),
    (ZERO1_GATHERED_GRADIENTS_AND_FULL_ADAM, "covers all the parameters"),
    (ZERO1_NO_ALL_GATHER, "each parameter must be gathered once"),
    (ZERO1_KEEPS_A_GATHER_BUFFER, "neither weights, gradients nor optimizer state (zero.buffers"),
    (ZERO1_TORCH, "uses the course's reference"),
], ids=["averages-twice", "sums", "all-reduce-and-full-adam", "gathers-gradients-full-adam", "no-all-gather",
        "keeps-buffers", "zero-redundancy-optimizer"])
def test_zero1_rejects(tmp_notebook, source, feedback):
    assert_fails(graded(tmp_notebook, "zero.zero1", {"ZeRO1Adam": source}), feedback)


ZERO1_FLAT_VIEWS_AND_LISTS = ZERO1_CELL + '''

class ZeRO1Adam:  # ZeRO's own layout: one padded flat buffer holds every weight; the piece is a view of it
    def __init__(self, model, lr, betas, eps):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.parameters = list(model.parameters())
        self.numel = sum(p.numel() for p in self.parameters)
        self.piece_numel = -(-self.numel // self.world_size)
        self.flat = torch.zeros(self.piece_numel * self.world_size)
        offset = 0
        for parameter in self.parameters:
            self.flat[offset:offset + parameter.numel()] = parameter.detach().reshape(-1)
            parameter.data = self.flat[offset:offset + parameter.numel()].view_as(parameter)
            offset += parameter.numel()
        self.piece = self.flat[self.rank * self.piece_numel:(self.rank + 1) * self.piece_numel]
        self.optimizer = torch.optim.Adam([self.piece], lr=lr, betas=betas, eps=eps)

    def step(self):
        gradients = torch.zeros(self.flat.numel())
        gradients[:self.numel] = torch.cat([p.grad.reshape(-1) for p in self.parameters])
        averaged = torch.empty(self.piece_numel)
        dist.reduce_scatter(averaged, list(gradients.chunk(self.world_size)))
        self.piece.grad = averaged / self.world_size
        self.optimizer.step()
        gathered = [torch.empty(self.piece_numel) for _ in range(self.world_size)]
        dist.all_gather(gathered, self.piece.detach().clone())
        with torch.no_grad():
            self.flat.copy_(torch.cat(gathered))
'''


def test_zero1_accepts_one_flat_buffer_with_views_and_list_collectives(tmp_notebook):
    result = graded(tmp_notebook, "zero.zero1", {"ZeRO1Adam": ZERO1_FLAT_VIEWS_AND_LISTS})
    assert result.status == "passed", result


# --- exercise 3: ZeRO-2 ---

ZERO2_KEEPS_REFERENCES = changed(ZERO2_CELL, (
    "            parameter.grad = None  # the full gradient is gone as soon as its piece is averaged",
    "            kept.append(parameter.grad)\n            parameter.grad = None"), (
    "        def hook(parameter):", "        kept = []\n\n        def hook(parameter):"))


@pytest.mark.parametrize("source, feedback", [
    (changed(ZERO2_CELL, ("            parameter.grad = None  # the full gradient is gone as soon as its piece is averaged",
                          "")), "still holds"),
    (ZERO2_KEEPS_REFERENCES, "keep no other reference to it"),
    ("class ZeRO2Adam(ZeRO1Adam):\n    pass\n", "reduce-scattered gradients after backward"),
], ids=["keeps-full-gradients", "keeps-references-to-them", "reduces-after-backward"])
def test_zero2_rejects(tmp_notebook, source, feedback):
    assert_fails(graded(tmp_notebook, "zero.zero2", {"ZeRO2Adam": source}), feedback)


# Held until the end of backward (the first layer's hooks, the last to run), so nothing is left
# after backward and never all of them at once: only the order of reduce-scatters and frees shows it.
ZERO2_KEEPS_ALL_BUT_THE_FIRST_LAYER = '''
class ZeRO2Adam(ZeRO1Adam):
    def __init__(self, model, lr, betas, eps):
        super().__init__(model, lr, betas, eps)
        self.first_layer = set(map(id, self.parameters[:2]))
        self.kept = []
        for parameter, piece in zip(self.parameters, self.pieces):
            parameter.register_post_accumulate_grad_hook(self.reduce_as_produced(piece))

    def reduce_as_produced(self, piece):
        def hook(parameter):
            piece.grad = reduce_scatter_mean(parameter.grad)
            if id(parameter) in self.first_layer:
                self.kept.clear()  # backward is ending: the kept gradients go now
            else:
                self.kept.append(parameter.grad)
            parameter.grad = None
        return hook

    def step(self):
        self.update_and_gather()
'''

# Reduce-scatters every gradient once backward has produced them all, freeing each right after.
ZERO2_REDUCES_AT_THE_END_OF_BACKWARD = '''
class ZeRO2Adam(ZeRO1Adam):
    def __init__(self, model, lr, betas, eps):
        super().__init__(model, lr, betas, eps)
        self.ready = []
        for parameter, piece in zip(self.parameters, self.pieces):
            parameter.register_post_accumulate_grad_hook(lambda p, piece=piece: self.produced(p, piece))

    def produced(self, parameter, piece):
        self.ready.append((parameter, piece))
        if len(self.ready) == len(self.parameters):
            for done, its_piece in self.ready:
                its_piece.grad = reduce_scatter_mean(done.grad)
                done.grad = None
            self.ready = []

    def step(self):
        self.update_and_gather()
'''


@pytest.mark.parametrize("source, feedback", [
    (ZERO2_KEEPS_ALL_BUT_THE_FIRST_LAYER, "after they had been reduce-scattered"),
    (ZERO2_REDUCES_AT_THE_END_OF_BACKWARD, "at once"),
], ids=["keeps-all-but-one-layer-until-backward-ends", "reduces-all-at-the-end-of-backward"])
def test_zero2_requires_each_full_gradient_gone_once_reduced(tmp_notebook, source, feedback):
    assert_fails(graded(tmp_notebook, "zero.zero2", {"ZeRO2Adam": source}), feedback)


ZERO2_LAYER_BUCKETS = '''
class ZeRO2Adam:
    """One flat piece per layer (weight and bias): reduce-scattered once both gradients are ready."""

    def __init__(self, model, lr, betas, eps):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        self.layers = [layer for layer in model if isinstance(layer, nn.Linear)]
        self.pieces = [piece_of(torch.cat([l.weight.reshape(-1), l.bias.reshape(-1)]), rank, world_size)
                       for l in self.layers]
        self.optimizer = torch.optim.Adam(self.pieces, lr=lr, betas=betas, eps=eps)
        for layer, piece in zip(self.layers, self.pieces):
            for parameter in (layer.weight, layer.bias):
                parameter.register_post_accumulate_grad_hook(lambda p, layer=layer, piece=piece: self.ready(layer, piece))

    def ready(self, layer, piece):
        if layer.weight.grad is None or layer.bias.grad is None:
            return
        piece.grad = reduce_scatter_mean(torch.cat([layer.weight.grad.reshape(-1), layer.bias.grad]))
        layer.weight.grad = layer.bias.grad = None

    def step(self):
        self.optimizer.step()
        with torch.no_grad():
            for layer, piece in zip(self.layers, self.pieces):
                full = all_gather_full(piece, layer.weight.numel() + layer.bias.numel())
                layer.weight.copy_(full[:layer.weight.numel()].view_as(layer.weight))
                layer.bias.copy_(full[layer.weight.numel():])
'''


def test_zero2_accepts_one_flat_piece_per_layer(tmp_notebook):
    result = graded(tmp_notebook, "zero.zero2", {"ZeRO2Adam": ZERO2_LAYER_BUCKETS})
    assert result.status == "passed", result


# --- exercise 4: ZeRO-3 ---

# Without saved-tensor hooks autograd keeps every unit's gathered weights from forward to backward,
# and backward gathers nothing.
ZERO3_SAVES_GATHERED_WEIGHTS = changed(ZERO3_CELL, (
    "        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):\n"
    "            return self.model(*args, **kwargs)", "        return self.model(*args, **kwargs)"))

# A list of the gathered units, emptied only when the whole forward is done.
ZERO3_HOLDS_EVERY_UNIT = changed(ZERO3_CELL, (
    "            self.install(index, flat)\n", "            self.install(index, flat)\n            HELD.append(flat)\n"), (
    "            return self.model(*args, **kwargs)",
    "            output = self.model(*args, **kwargs)\n        HELD.clear()\n        return output")) + "\n\nHELD = []\n"

# Backward's copies are never freed: every unit is still gathered when backward ends.
ZERO3_KEEPS_BACKWARD_COPIES = changed(ZERO3_CELL, (
    "        ctx.wrapper.for_backward.pop(ctx.index, None)  # the unit's backward is over: free its weights\n", ""))

ZERO3_KEEPS_THE_MODEL = changed(ZERO3_CELL, (
    "        self.model = model\n", "        self.model = model\n"
    "        self.original = [p.detach().clone() for p in model.parameters()]  # 'for safety'\n"))


@pytest.mark.parametrize("source, feedback", [
    (ZERO3_SAVES_GATHERED_WEIGHTS, "all-gathered nothing during backward"),
    (ZERO3_HOLDS_EVERY_UNIT, "at once during forward"),
    (ZERO3_KEEPS_BACKWARD_COPIES, "the weights gathered for step 1's backward outlived it"),
    (ZERO3_KEEPS_THE_MODEL, "zero.original"),
    (changed(ZERO3_CELL, ("return reduce_scatter_mean(grad_full), None, None",
                          "return reduce_scatter_mean(grad_full) / dist.get_world_size(), None, None")),
     "divided by the world size twice"),
    (changed(ZERO3_CELL, ("return reduce_scatter_mean(grad_full), None, None",
                          "return reduce_scatter_mean(grad_full) * dist.get_world_size(), None, None")),
     "the reduce-scatter sums"),
    ("from torch.distributed.fsdp import fully_shard\n\ndef ZeRO3Module(model, units):\n"
     "    for unit in units:\n        fully_shard(unit)\n    return fully_shard(model)\n", "uses the course's reference"),
    ("from dtp.zero.sharded import ZeRO3\n\ndef ZeRO3Module(model, units):\n    return ZeRO3(model, units)\n",
     "uses the course's reference"),
], ids=["saves-gathered-weights", "holds-every-unit", "keeps-backward-copies", "keeps-the-model", "averages-twice",
        "sums", "fully-shard", "course-zero3"])
def test_zero3_rejects(tmp_notebook, source, feedback):
    assert_fails(graded(tmp_notebook, "zero.zero3", {"ZeRO3Module": source}), feedback)


# Correct, written otherwise: all_gather and reduce_scatter with lists, hooks that wrap each unit's
# forward instead of module hooks, and backward copies keyed by the unit's module.
ZERO3_LISTS_AND_WRAPPED_FORWARDS = changed(
    ZERO3_CELL,
    ("        return all_gather_full(piece, wrapper.numels[index])",
     "        parts = [torch.empty_like(piece) for _ in range(dist.get_world_size())]\n"
     "        dist.all_gather(parts, piece)\n"
     "        return torch.cat(parts)[:wrapper.numels[index]]"),
    ("        return reduce_scatter_mean(grad_full), None, None",
     "        n = dist.get_world_size()\n"
     "        c = -(-grad_full.numel() // n)\n"
     "        padded = torch.nn.functional.pad(grad_full, (0, n * c - grad_full.numel()))\n"
     "        out = torch.empty(c)\n"
     "        dist.reduce_scatter(out, list(padded.split(c)))\n"
     "        return out / n, None, None"),
    ("            unit.register_forward_pre_hook(self.gather_hook(len(self.uses) - 1))\n"
     "            unit.register_forward_hook(self.free_hook(len(self.uses) - 1))\n",
     "            unit.forward = self.wrapped(unit.forward, len(self.uses) - 1)\n"),
    ("    def gather_hook(self, index):",
     "    def wrapped(self, forward, index):\n"
     "        gather, free = self.gather_hook(index), self.free_hook(index)\n\n"
     "        def run(*args, **kwargs):\n"
     "            gather(None, args)\n"
     "            output = forward(*args, **kwargs)\n"
     "            free(None, args, output)\n"
     "            return output\n"
     "        return run\n\n"
     "    def gather_hook(self, index):"))


def test_zero3_accepts_list_collectives_and_wrapped_forwards(tmp_notebook):
    result = graded(tmp_notebook, "zero.zero3", {"ZeRO3Module": ZERO3_LISTS_AND_WRAPPED_FORWARDS})
    assert result.status == "passed", result


def test_zero3_draws_transformers_whose_units_need_padding():
    """Every world of every grading draws a GPT whose units (blocks and root) all need padding,
    so a wrapper that forgets to pad cannot pass."""
    import numpy as np

    from grader.checks.zero import zero3
    from grader.registry import find_exercise
    check = find_exercise("zero.zero3").check
    for seed in range(30):
        for n, config, _, _ in check.prepare(np.random.default_rng(seed)):
            assert all(size % n for size in zero3.unit_sizes(config)[1]), (seed, n, config)


# --- exercise 5: exact bytes ---

BYTES = '''
import math

def zero_bytes_held(units, world_size, stage):
    psi, pieces = sum(units), {PIECES}
    if stage == 0:
        return dict(weights=4 * psi, gradients=4 * psi, **{{"optimizer states": 8 * psi}})
    return {{"weights": 4 * pieces if stage == 3 else 4 * (psi + {COPY}),
            "gradients": 4 * pieces if stage >= 2 else 4 * psi, "optimizer states": 8 * pieces}}


def zero_bytes_sent(units, world_size, stage):
    n = world_size
    if stage == 0:
        return sum(2 * (n - 1) / n * 4 * u for u in units)
    return {SENT}
'''
RIGHT_BYTES = dict(PIECES="sum(math.ceil(u / world_size) for u in units)", COPY="pieces",
                   SENT="(3 if stage == 3 else 2) * (n - 1) * 4 * sum(math.ceil(u / n) for u in units)")


def bytes_variant(**changes) -> str:
    return BYTES.format(**{**RIGHT_BYTES, **changes})


def test_bytes_accepts_math_ceil(tmp_notebook):
    assert graded(tmp_notebook, "zero.bytes_per_step", {"zero_bytes_held": bytes_variant()}).status == "passed"


@pytest.mark.parametrize("changes, feedback", [
    (dict(PIECES="sum(units) / world_size"), "that leaves out the padding"),
    (dict(PIECES="math.ceil(sum(units) / world_size)"), "padded on its own"),
    (dict(COPY="0"), "steps a copy of this rank's piece"),
    (dict(SENT="2 * (n - 1) * 4 * sum(math.ceil(u / n) for u in units)"), "3, not 2"),
    (dict(SENT="(4 if stage == 3 else 3) * (n - 1) * 4 * sum(math.ceil(u / n) for u in units)"), "what gloo moves"),
], ids=["no-padding", "flat-padding", "no-piece-copy", "zero3-two-collectives", "gloo-bytes"])
def test_bytes_rejects(tmp_notebook, changes, feedback):
    assert_fails(graded(tmp_notebook, "zero.bytes_per_step", {"zero_bytes_held": bytes_variant(**changes)}), feedback)


# --- exercise 6: interview ---

INTERVIEW = '''
import math


def interview_zero3_gb_per_gpu(n_params, n_gpus):
    return {GB}


def interview_fewest_gpus_zero3(n_params, gpu_mib, reserved_gib):
    return {FEWEST}


def interview_zero1_saving(n_gpus):
    return {SAVING}


def interview_zero2_gb_per_gpu(n_params, n_gpus):
    return {ZERO2}


def interview_zero3_gb_sent_per_gpu(n_params, n_gpus):
    return {SENT}
'''
RIGHT_INTERVIEW = dict(GB="16 * n_params / n_gpus / 1e9",
                       FEWEST="math.ceil(16 * n_params / (gpu_mib * 2**20 - reserved_gib * 2**30))",
                       SAVING="16 / (4 + 12 / n_gpus)", ZERO2="(2 + 14 / n_gpus) * n_params / 1e9",
                       SENT="3 * (n_gpus - 1) / n_gpus * 2 * n_params / 1e9")


def interview(**changes) -> str:
    return INTERVIEW.format(**{**RIGHT_INTERVIEW, **changes})


def test_interview_accepts_functions_of_the_question(tmp_notebook):
    assert graded(tmp_notebook, "zero.interview", {"interview_zero3_gb_per_gpu": interview()}).status == "passed"


@pytest.mark.parametrize("changes, feedback", [
    (dict(GB="16 * n_params / n_gpus / 2**30"), "that is in GiB"),
    (dict(FEWEST="math.ceil(16 * n_params / (gpu_mib * 1e6 - reserved_gib * 1e9))"), "10⁶ and 10⁹ bytes"),
    (dict(FEWEST="math.ceil(16 * n_params / (gpu_mib * 2**20))"), "no room for activations"),
    (dict(SAVING="4.0"), "4x is the limit"),
    (dict(ZERO2="(4 + 12 / n_gpus) * n_params / 1e9"), "the previous stage's memory"),
    (dict(SENT="2 * (n_gpus - 1) / n_gpus * 2 * n_params / 1e9"), "gathers the weights again for backward"),
    (dict(SENT="3 * (n_gpus - 1) / n_gpus * 4 * n_params / 1e9"), "16-bit"),
    # The asked questions' answers, copied from the page: right for the question, wrong for any other.
    (dict(GB="140.0"), "interview_zero3_gb_per_gpu("),
    (dict(FEWEST="17"), "interview_fewest_gpus_zero3("),
    (dict(SAVING="16 / 5.5"), "interview_zero1_saving("),
    (dict(SENT="413.4375"), "interview_zero3_gb_sent_per_gpu("),
], ids=["gib", "mib-as-1e6", "no-activations", "notes-4x", "zero2-as-zero1", "sent-as-dp", "sent-fp32",
        "copied-gb", "copied-fewest", "copied-saving", "copied-sent"])
def test_interview_rejects(tmp_notebook, changes, feedback):
    assert_fails(graded(tmp_notebook, "zero.interview", {"interview_zero3_gb_per_gpu": interview(**changes)}),
                 feedback)


def test_interview_refuses_the_course_functions(tmp_notebook):
    source = "from dtp.zero.formulas import model_state_bytes_per_gpu\n" + interview(
        GB="model_state_bytes_per_gpu(n_params, n_gpus, 3) / 1e9")
    assert_fails(graded(tmp_notebook, "zero.interview", {"interview_zero3_gb_per_gpu": source}),
                 "uses the course's reference")


def test_interview_asks_the_notebooks_questions():
    from grader.checks.zero.interview import Interview
    statement = next(cell.source for cell in solution_notebook("zero").cells if cell.source.startswith("## Interview questions"))
    for name, question in Interview.asked.items():
        assert f"`{name}(" in statement
    assert all(text in statement for text in ("70B", "on 8 GPUs", "81559 MiB", "16 GiB", "1024 GPUs", "64 GPUs"))
    assert Interview.asked["interview_fewest_gpus_zero3"] == (70e9, 81559, 16)


def test_every_stage_grading_draws_models_that_need_padding():
    """An implementation that forgets to pad passes on a model whose units all divide by n (hidden
    sizes of 16, 20 and 24 on 4 ranks): every world of every grading must pad a parameter and a layer."""
    import numpy as np

    from grader.checks.zero import stages as checks
    from grader.registry import find_exercise
    for exercise_id in ("zero.zero1", "zero.zero2"):
        check = find_exercise(exercise_id).check
        for seed in range(100):
            for n, sizes, _, _ in check.prepare(np.random.default_rng(seed)):
                assert checks._needs_padding(sizes, n), (exercise_id, seed, n, sizes)


def test_no_cell_both_tries_an_exercise_and_checks_it():
    """Issue 21, item 22: a cell holding a demo and a check printed two lines for one unfinished
    exercise (the demo's "not implemented yet" and the check's "missing"); as in the other
    chapters, the check has a cell of its own, so every cell prints one line."""
    both = [cell.source[:60] for cell in solution_notebook("zero").cells
            if cell.cell_type == "code" and "with demo(" in cell.source and "check(" in cell.source]
    assert both == []


# Every unit but the first block stays gathered until forward ends: fewer bytes than all the
# weights, but three units (root, blocks 1 and 2) gathered at once, where ZeRO-3 needs two.
ZERO3_HOLDS_ALL_BUT_ONE_UNIT = changed(ZERO3_CELL, (
    "            self.install(index, flat)\n",
    "            self.install(index, flat)\n            if index != 0:\n                HELD.append(flat)\n"), (
    "            return self.model(*args, **kwargs)",
    "            output = self.model(*args, **kwargs)\n        HELD.clear()\n        return output")) + "\n\nHELD = []\n"


def test_zero3_allows_at_most_two_gathered_units(tmp_notebook):
    assert_fails(graded(tmp_notebook, "zero.zero3", {"ZeRO3Module": ZERO3_HOLDS_ALL_BUT_ONE_UNIT}),
                 "held the gathered weights of 3 units at once during forward")
