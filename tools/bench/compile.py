"""Benchmark: compiled blocks vs eager blocks, under ZeRO-3, tensor parallelism with sequence
parallelism (every rank one tp shard), context parallelism (the ring: every rank one cut of each
sequence), and (as a reference) DDP, same run.

    python tools/bench/compile.py [--rounds 2] [--steps 5] [--warmup 3] [--backend inductor]
                                  [--dim 384] [--layers 6] [--vocab 4096] [--seq-len 128]
                                  [--global-batch 8] [--only zero3,tp+sp,cp,ddp]

Every contender trains the same built-in Llama (plait kernels, name-keyed init) on synthetic
tokens on Gloo ranks spawned by this script, each in fresh processes, with and without
`parallel.transforms = {compile = "compile"}`. Each run takes `--warmup` untimed steps (the
compiled run compiles in the first), then times `--steps`; rounds run the contenders in
alternating order (forward, then reversed) so a burst of load on a shared machine does not
always hit the same one, and the table shows the median over rounds.

Printed per contender: tokens/s, CPU seconds per step (all threads of a rank, which a busy
machine disturbs less than wall-clock time) and the first step's seconds; the compile watch's
own line (graphs, graph breaks, compile time) for the compiled runs; the compiled / eager
ratios per layout; and, from one profiled step on rank 0 of the last round, where the step's
CPU time went, by class of op (the compiled graph's own code, matrix products, attention,
communication, the optimizer, autograd's accumulation, other aten ops), with the top ops — so
a compiled run that is not faster shows what it did not speed up.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from plait.testing.distributed import run_distributed

LAYOUTS = ("zero3", "tp+sp", "cp", "ddp")
TENSOR_PARALLEL = "tp+sp"
CONTEXT_PARALLEL = "cp"
# Profiler op names by class, first match wins; self time, so no op is counted twice.
OP_CLASSES = (
    ("compiled graph", ("CompiledF", "Torch-Compiled Region", "cpp_fused", "inductor")),
    # Gradient accumulation (ZeRO's bucket copies run in its hooks) and the engine's own nodes.
    ("autograd", ("AccumulateGrad", "evaluate_function", "Backward")),
    ("communication", ("gloo", "c10d", "all_gather", "reduce_scatter", "all_reduce", "nccl")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")),
    ("attention", ("scaled_dot_product", "attention")),
    ("optimizer", ("Optimizer", "_foreach", "adam")),
    ("other aten", ("aten::",)),
)


def _config(args: argparse.Namespace, layout: str, compiled: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model": {
            "name": "llama",
            "size": "tiny",
            "overrides": {
                "dim": args.dim,
                "n_layers": args.layers,
                "n_heads": args.dim // 64,
                "n_kv_heads": max(1, args.dim // 128),
                "vocab_size": args.vocab,
                "max_seq_len": args.seq_len,
            },
        },
        "data": {"seq_len": args.seq_len},
        "train": {"micro_batch_size": args.global_batch // _dp(args, layout), "seed": 0},
        "optimizer": {"weight_decay": 0.0},
        "parallel": {"dp_strategy": layout, "transforms": {}},
        "telemetry": {"enabled": False},
    }
    if layout == TENSOR_PARALLEL:
        config["parallel"].update(dp_strategy="ddp", tp=args.world_size)
        config["tp"] = {"sequence_parallel": True}
        # The key/value heads split over the tp ranks (d = 384's 3 do not over 2).
        config["model"]["overrides"]["n_kv_heads"] = args.world_size
    if layout == CONTEXT_PARALLEL:
        config["parallel"].update(dp_strategy="ddp", cp=args.world_size, cp_strategy="ring")
    if compiled:
        config["parallel"]["transforms"]["compile"] = "compile"
        config["compile"] = {"backend": args.backend}
    return config


def _dp(args: argparse.Namespace, layout: str) -> int:
    """Data-parallel ranks: every rank under ZeRO-3 and DDP, one under tensor and context
    parallelism."""
    return 1 if layout in (TENSOR_PARALLEL, CONTEXT_PARALLEL) else args.world_size


def op_class(name: str) -> str:
    return next(
        (label for label, marks in OP_CLASSES if any(m.lower() in name.lower() for m in marks)),
        "other",
    )


def profile_step(step: Any) -> dict[str, Any]:
    """Self CPU seconds of one step by class of op, and the top ops."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    by_class: dict[str, float] = defaultdict(float)
    ops = []
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        by_class[op_class(event.key)] += seconds
        ops.append((seconds, event.key))
    return {"by_class": dict(by_class), "top": sorted(ops, reverse=True)[:6]}


def run(
    rank: int, world: int, args: argparse.Namespace, layout: str, compiled: bool, profiled: bool
) -> dict[str, Any]:
    from plait.core.engine import Engine
    from plait.core.plugins import Plugins
    from plait.plugins import compile, ddp, zero

    torch._dynamo.reset()
    plugins = Plugins.create(autoload=False, extra=[("compile", compile), ("ddp", ddp),
                                                    ("zero", zero)])  # fmt: skip
    engine = Engine(config=_config(args, layout, compiled), plugins=plugins)
    gen = torch.Generator().manual_seed(0)
    dp_rank = engine.mesh.coordinate("dp")
    local = args.global_batch // engine.mesh.size("dp")
    batches = []
    for _ in range(args.warmup + args.steps + 1):
        tokens = torch.randint(0, args.vocab, (args.global_batch, args.seq_len + 1), generator=gen)
        mine = tokens[dp_rank * local : (dp_rank + 1) * local]
        batches.append((mine[:, :-1], mine[:, 1:]))
    start = time.perf_counter()
    engine.train_step(batches[0])
    first_step = time.perf_counter() - start
    for batch in batches[1 : args.warmup]:
        engine.train_step(batch)
    torch.distributed.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    for batch in batches[args.warmup : -1]:
        engine.train_step(batch)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    profile = profile_step(lambda: engine.train_step(batches[-1])) if profiled else None
    watch = plugins.manager.get_plugin(f"{compile.NAME}.watch")
    result = {
        "tokens_per_second": args.steps * args.global_batch * args.seq_len / elapsed,
        "cpu_seconds_per_step": cpu / args.steps,
        "first_step_seconds": first_step,
        "watch": list(watch.summaries) if watch is not None else [],
        "profile": profile,
    }
    engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--only", default="", help="comma-separated layouts: zero3,tp+sp,cp,ddp")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    args = parser.parse_args()

    layouts = [lay for lay in LAYOUTS if not args.only or lay in args.only.split(",")]
    contenders = [(layout, compiled) for layout in layouts for compiled in (False, True)]
    results: dict[tuple[str, bool], list[dict[str, Any]]] = {c: [] for c in contenders}
    for round_index in range(args.rounds):
        last = round_index == args.rounds - 1
        order = contenders if round_index % 2 == 0 else list(reversed(contenders))
        for layout, compiled in order:
            per_rank = run_distributed(
                run, args.world_size, args, layout, compiled, last, timeout=3600
            )
            results[(layout, compiled)].append(
                {
                    "tokens_per_second": statistics.mean(r["tokens_per_second"] for r in per_rank),
                    "cpu_seconds_per_step": statistics.mean(
                        r["cpu_seconds_per_step"] for r in per_rank
                    ),
                    "first_step_seconds": max(r["first_step_seconds"] for r in per_rank),
                    "watch": per_rank[0]["watch"],
                    "profile": per_rank[0]["profile"],
                }
            )
    numeric = ("tokens_per_second", "cpu_seconds_per_step", "first_step_seconds")
    summary = {
        c: {key: statistics.median(r[key] for r in runs) for key in numeric}
        for c, runs in results.items()
    }
    print(
        f"compile benchmark: llama dim={args.dim} layers={args.layers} vocab={args.vocab} "
        f"seq={args.seq_len} global batch={args.global_batch}, {args.world_size} Gloo ranks, "
        f"backend {args.backend}, {args.warmup} warm-up + {args.steps} timed steps, "
        f"{args.rounds} alternating rounds (median)"
    )
    print(f"{'':16} {'tokens/s':>10} {'CPU s/step':>11} {'step 1 s':>9}")
    for (layout, compiled), row in summary.items():
        name = f"{layout} {'compiled' if compiled else 'eager'}"
        print(
            f"{name:16} {row['tokens_per_second']:10,.0f} {row['cpu_seconds_per_step']:11.3f} "
            f"{row['first_step_seconds']:9.1f}"
        )
    for layout in layouts:
        eager, compiled = summary[(layout, False)], summary[(layout, True)]
        print(
            f"{layout} compiled / eager: throughput "
            f"{compiled['tokens_per_second'] / eager['tokens_per_second']:.3f}×, CPU per step "
            f"{compiled['cpu_seconds_per_step'] / eager['cpu_seconds_per_step']:.3f}×"
        )
        for line in results[(layout, True)][-1]["watch"]:
            print(f"  {line}")
    print("where one step's CPU time went (rank 0, self time, seconds):")
    for (layout, compiled), runs in results.items():
        profile = runs[-1]["profile"]
        name = f"{layout} {'compiled' if compiled else 'eager'}"
        classes = sorted(profile["by_class"].items(), key=lambda kv: -kv[1])
        print(f"  {name:16} " + ", ".join(f"{label} {s:.3f}" for label, s in classes if s >= 1e-3))
        print("  " + " " * 16 + " top: " + ", ".join(f"{op} {s:.3f}" for s, op in profile["top"]))


if __name__ == "__main__":
    main()
