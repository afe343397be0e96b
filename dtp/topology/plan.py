"""The layout planner from the command line: the fastest layouts of a model on a cluster.

    python -m dtp.topology.plan --model llama3-405b --gpu h100 --gpus 16384
    python -m dtp.topology.plan --model moe-409b --gpu h100 --gpus 1024 --top 5 --json
    python -m dtp.topology.plan --layers 48 --hidden 6144 --heads 48 --vocab 51200 --seq 2048 \\
        --global-batch 1024 --gpu a100-80gb --gpus 512 --network-gbit 100

A model by preset (`dtp.topology.presets`) or by its shape; a cluster by GPU type, count, GPUs per
node and links (the practised model's measured constants, and its one calibrated constant,
`dtp.topology.validation.calibrated_gemm_share`); the sequence length and global batch (the preset's unless given); the framework
whose rules and switches the layouts follow (`dtp.topology.frameworks`). It prints the fastest
layouts as a table (or, with --json, as JSON for scripts), each with its memory per GPU, step time,
MFU and where the time goes; a progress bar on stderr while it searches when stderr is a terminal.
Bad input, and a model that fits nowhere, end with one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from dtp.topology import clusters, frameworks, presets, search, validation
from dtp.topology.shapes import ModelShape, Training

GIB = 2**30
PARTS = ("compute", "tp", "cp", "ep", "pp", "dp", "bubble", "optimizer")


class PlanError(Exception):
    """Input the planner cannot use, or a model that fits nowhere: one line for the user."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints its usage too: one line is enough
        raise PlanError(message)


def arguments() -> Parser:
    parser = Parser(prog="python -m dtp.topology.plan", description=__doc__.split("\n\n")[0])
    model = parser.add_argument_group("model: a preset, or a shape")
    model.add_argument("--model", help=f"one of {', '.join(presets.MODELS)}")
    for name, kind, text in (("layers", int, "transformer layers"), ("hidden", int, "hidden size h"),
                             ("heads", int, "attention heads"), ("kv-heads", int, "K/V heads (0: as many as heads)"),
                             ("ffn", int, "MLP width (default 4h)"), ("vocab", int, "vocabulary"),
                             ("experts", int, "experts per MoE layer (1: dense)"), ("top-k", int, "experts per token"),
                             ("expert-ffn", int, "an expert's MLP width")):
        model.add_argument(f"--{name}", type=kind, help=text)
    model.add_argument("--block", choices=("gpt", "llama"), help="GPT blocks (GeLU MLP) or Llama's (SwiGLU, GQA)")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--gpu", default="h100", help=f"one of {', '.join(clusters.GPUS)} (default h100)")
    cluster.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    cluster.add_argument("--gpus-per-node", type=int, default=8)
    cluster.add_argument("--network-gbit", type=float, help="network Gb/s per GPU and direction (default: DGX's)")
    cluster.add_argument("--nvlink-gbyte", type=float, help="NVLink GB/s per GPU and direction (default: the GPU's)")
    training = parser.add_argument_group("training")
    training.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    training.add_argument("--global-batch", type=int, help="sequences per step (default: the preset's)")
    training.add_argument("--framework", default="megatron-core", help=f"one of {', '.join(frameworks.FRAMEWORKS)}")
    training.add_argument("--max-cp", type=int, default=8, help="largest context-parallel size to consider")
    parser.add_argument("--top", type=int, default=10, help="layouts to show")
    parser.add_argument("--json", action="store_true", help="JSON on stdout, no progress bar")
    return parser


def positive(name: str, value) -> None:
    if value is not None and value < 1:
        raise PlanError(f"--{name} must be a positive number, got {value}")


def model_of(options) -> tuple[ModelShape, int]:
    shape = {name: getattr(options, name.replace("-", "_")) for name in
             ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "experts", "top-k", "expert-ffn", "seq")}
    for name, value in shape.items():
        if name not in ("kv-heads",):
            positive(name, value)
    if options.model:
        if options.model not in presets.MODELS:
            raise PlanError(f"unknown model preset {options.model!r}: one of {', '.join(presets.MODELS)}")
        model, batch = presets.MODELS[options.model]
    else:
        missing = [name for name in ("layers", "hidden", "heads", "vocab", "seq") if shape[name] is None]
        if missing:
            raise PlanError("give --model, or the shape: --" + ", --".join(missing) + " missing")
        if options.global_batch is None:
            raise PlanError("give --global-batch with a model given by its shape")
        model, batch = ModelShape(layers=shape["layers"], hidden=shape["hidden"], heads=shape["heads"],
                                  vocab=shape["vocab"], seq=shape["seq"], name="your model"), 0
    changes = {"layers": shape["layers"], "hidden": shape["hidden"], "heads": shape["heads"],
               "kv_heads": shape["kv-heads"], "ffn_hidden": shape["ffn"], "vocab": shape["vocab"],
               "experts": shape["experts"], "top_k": shape["top-k"], "expert_hidden": shape["expert-ffn"],
               "seq": shape["seq"], "block": options.block}
    model = dataclasses.replace(model, **{name: value for name, value in changes.items() if value is not None})
    if model.hidden % model.heads or (model.kv_heads and model.heads % model.kv_heads):
        raise PlanError(f"{model.heads} heads do not divide h = {model.hidden} (or the K/V heads do not divide them)")
    if model.top_k > model.experts:
        raise PlanError(f"--top-k {model.top_k} is more than the {model.experts} experts")
    return model, options.global_batch or batch


def setup(argv) -> tuple:
    options = arguments().parse_args(argv)
    for name in ("gpus", "gpus-per-node", "global-batch", "max-cp", "top"):
        positive(name, getattr(options, name.replace("-", "_")))
    for name in ("network-gbit", "nvlink-gbyte"):
        value = getattr(options, name.replace("-", "_"))
        if value is not None and value <= 0:
            raise PlanError(f"--{name} must be positive, got {value}")
    model, batch = model_of(options)
    if options.gpu not in clusters.GPUS:
        raise PlanError(f"unknown GPU {options.gpu!r}: one of {', '.join(clusters.GPUS)}")
    if options.gpus % options.gpus_per_node:
        raise PlanError(f"{options.gpus} GPUs do not make whole nodes of {options.gpus_per_node}")
    if options.framework not in frameworks.FRAMEWORKS:
        raise PlanError(f"unknown framework {options.framework!r}: one of {', '.join(frameworks.FRAMEWORKS)}")
    # the practised model with its one calibrated constant (the GEMM share fitted on Megatron-LM 2021's Table 1)
    cluster = validation.calibrated(clusters.cluster(options.gpu, options.gpus, options.gpus_per_node,
                                                     options.network_gbit,
                                                     options.nvlink_gbyte * 1e9 if options.nvlink_gbyte else None))
    training = frameworks.practised(Training(global_batch=batch), options.framework,
                                    max_context_parallel=options.max_cp)
    return options, model, cluster, training


def undominated(rows: list[dict]) -> list[dict]:
    """The rows, fastest first, less those that another row with the same layout but another ZeRO
    choice beats or ties on both step time and memory (ZeRO-2 where ZeRO-1 is as fast and smaller)."""
    kept, best = [], {}
    for row in rows:
        key = tuple(row[name] for name in ("tp", "cp", "pp", "dp", "ep", "expert_tp", "micro_batch", "chunks",
                                           "recompute")) + (tuple(row["stage_layers"]),)
        rivals = best.setdefault(key, [])
        if any(rival["step_time_s"] <= row["step_time_s"] and rival["memory_bytes"] <= row["memory_bytes"]
               for rival in rivals):
            continue
        rivals.append(row)
        kept.append(row)
    return kept


def layout_of(row) -> dict:
    return {"tp": row["tp"], "cp": row["cp"], "pp": row["pp"], "v": row["chunks"], "ep": row["ep"],
            "expert_tp": row["expert_tp"], "effective_ep": row["ep"] * row["tp"] // row["expert_tp"], "dp": row["dp"],
            "zero": row["zero_stage"], "reduce_every_micro_batch": bool(row["reduce_every_micro_batch"]),
            "micro_batch": row["micro_batch"], "micro_batches": row["micro_batches"], "recompute": row["recompute"],
            "stage_layers": list(row["stage_layers"])}


def summary(row) -> dict:
    return {**layout_of(row), "memory_gib": row["memory_bytes"] / GIB, "step_time_s": row["step_time_s"],
            "mfu": row["mfu"], "seconds": {part: exposed(row["times"], part) for part in PARTS}}


def exposed(times: dict, part: str) -> float:
    """A part of the step; "dp" with the experts' gradients (expert_dp) too."""
    return times.get(part, 0.0) + (times.get("expert_dp", 0.0) if part == "dp" else 0.0)


def table(rows: list[dict], model: ModelShape) -> str:
    header = ["#", "TP", "CP", "PP", "v", "EP", "DP", "ZeRO", "b", "recompute", "GiB", "step s", "MFU",
              "compute", "TP exp", "CP exp", "EP exp", "DP exp", "PP exp", "bubble"]
    lines = []
    for rank, row in enumerate(rows, 1):
        ep = "" if not model.is_moe else f"{row['ep']}" + (f" (x{row['tp']})" if row["expert_tp"] == 1 else "")
        zero = f"{row['zero_stage']}" + ("*" if row["reduce_every_micro_batch"] else "")
        times = row["times"]
        lines.append([str(rank), str(row["tp"]), str(row["cp"]), str(row["pp"]), str(row["chunks"]), ep or "-",
                      str(row["dp"]), zero, str(row["micro_batch"]), row["recompute"],
                      f"{row['memory_bytes'] / GIB:.1f}", f"{row['step_time_s']:.2f}", f"{row['mfu']:.1%}",
                      *(f"{exposed(times, part):.2f}" for part in ("compute", "tp", "cp", "ep", "dp", "pp", "bubble"))])
    widths = [max(len(cell) for cell in column) for column in zip(header, *lines)]
    show = lambda cells: "  ".join(cell.rjust(width) for cell, width in zip(cells, widths))
    return "\n".join([show(header)] + [show(line) for line in lines])


def progress_bar(stream):
    def show(done: int, total: int) -> None:
        filled = 30 * done // total
        stream.write(f"\rsearching layouts [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}")
        if done == total:
            stream.write("\r" + " " * 70 + "\r")
        stream.flush()
    return show


def run(argv=None, stdout=sys.stdout, stderr=sys.stderr) -> int:
    options, model, cluster, training = setup(argv)
    progress = progress_bar(stderr) if stderr.isatty() and not options.json else None
    found = search.plan(model, cluster, training, progress)
    rows = found["rows"]
    if not rows:
        needed, frugal = found["most_frugal"]
        if frugal is None:
            raise PlanError(f"no layout of {model.name} divides over {cluster.gpus} GPUs with a global batch of "
                            f"{training.global_batch}: try another batch or GPU count")
        layout = frugal["layout"]
        raise PlanError(f"{model.name} fits nowhere on {cluster.gpus} {options.gpu}: the most frugal layout (TP "
                        f"{layout.tp}, CP {layout.cp}, PP {layout.pp}, DP {layout.dp}, ZeRO-{layout.zero_stage}, "
                        f"recompute {frugal['recompute']}) needs {needed / GIB:.1f} GiB per GPU, "
                        f"{(needed - cluster.memory_bytes) / GIB:.1f} GiB more than the "
                        f"{cluster.memory_bytes / GIB:.1f} GiB a GPU has")
    shown = undominated(rows)[:options.top]
    if options.json:
        json.dump({"model": model.name, "gpus": cluster.gpus, "gpu": options.gpu, "framework": options.framework,
                   "seq": model.seq, "global_batch": training.global_batch, "fitting": len(rows),
                   "layouts": [summary(row) for row in shown]}, stdout, indent=1)
        stdout.write("\n")
    else:
        stdout.write(f"{model.name} on {cluster.name} ({options.framework}), {model.seq:,} tokens x "
                     f"{training.global_batch:,} sequences per step: {len(rows):,} layouts fit; the fastest, less "
                     f"those another ZeRO stage beats on both time and memory (seconds per step; 'exp': exposed "
                     f"communication; ZeRO *: reduced every micro-batch; EP (xt): experts whole, their all-to-all "
                     f"over the TP ranks too):\n")
        stdout.write(table(shown, model) + "\n")
    return 0


def main(argv=None) -> int:
    try:
        return run(argv)
    except PlanError as error:
        sys.stderr.write(f"plan: error: {error}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("plan: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
