"""Benchmark: compiled blocks vs eager blocks, under ZeRO-3, tensor parallelism with sequence
parallelism (every rank one tp shard), context parallelism (the ring: every rank one cut of each
sequence), and (as a reference) DDP, same run.

    python tools/bench/compile.py [--rounds 2] [--steps 5] [--warmup 3] [--backend inductor]
                                  [--dim 384] [--layers 6] [--vocab 4096] [--seq-len 128]
                                  [--global-batch 8] [--only zero3,tp+sp,cp,ddp]
                                  [--device cpu|cuda] [--devices N] [--json PATH]

Every contender trains the same built-in Llama (plait kernels, name-keyed init) on synthetic
tokens on Gloo ranks spawned by this script, each in fresh processes, with and without
`parallel.transforms = {compile = "compile"}`. Each run takes `--warmup` untimed steps (the
compiled run compiles in the first), then times `--steps`; rounds run the contenders in
alternating order (forward, then reversed) so a burst of load on a shared machine does not
always hit the same one, and the table shows the median over rounds.

Printed per contender: tokens/s, CPU seconds per step (all threads of a rank, which a busy
machine disturbs less than wall-clock time) and the first step's seconds; the compile watch's
own line (graphs, graph breaks, compile time) for the compiled runs; the compiled / eager
ratios per layout, with the largest difference between a compiled and an eager run's loss at any
step (warm-up included; the same batches from the same seed) and the recompilations the watch
saw after step 2; and, from one profiled step on rank 0 of the last round, where the step's
CPU time went, by class of op (the compiled graph's own code, matrix products, attention,
communication, the optimizer, autograd's accumulation, other aten ops), with the top ops — so
a compiled run that is not faster shows what it did not speed up.

`--device cuda` runs the same contenders on a GPU node: one NCCL rank per GPU, each rank on its
own GPU, with AMP bf16 (`transforms.precision = "amp"`, `amp.dtype = "bf16"`, as
`tools/bench/gpu.py` trains; on CPU the runs stay fp32), CUDA synchronised around the timed
steps, peak GPU memory per run, and the profiled step's GPU kernel time by class beside its CPU
time. A layout gets `--world-size` ranks, at most one per device: on a node with one GPU,
ZeRO-3 and DDP run on one rank (ZeRO-3's own units, hooks and sharded optimizer, its gathers
and reduce-scatters the copies a group of one makes), while tp + sp and cp, which need two
ranks (two NCCL ranks cannot share a GPU), are reported as skipped, with the reason, in the
table and the JSON. `--devices N` plans the ranks as on a node of N devices (default: the GPUs
found under `--device cuda`) and starts them as on a GPU node (a process per rank, spawned on
CUDA, on CPU forked from a server that imported torch and plait once; joined through
torch.distributed's environment rendezvous, the engine creating the group), so
`--device cpu --devices 1` rehearses the one-GPU run on a CPU (`tools/gpu_check.py --rehearse`
does). `--json PATH` writes the figures after every run, so a run cut off keeps the ones it
finished.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import pickle
import socket
import statistics
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from plait.core.plugins import BUILTIN_PLUGINS
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
# GPU kernels by class (the profiled step's self device time), first match wins.
KERNEL_CLASSES = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "wgmma", "matmul")),
    ("compiled graph", ("triton_",)),
    ("memory", ("memcpy", "memset")),
    ("optimizer", ("foreach", "adam")),
)
# What the server that forks `run_launched`'s ranks imports once: torch, the engine and the
# built-in plugins (every rank's `Plugins.create` imports them).
RANK_PRELOAD = ("torch", "torch.distributed", "plait.core.engine", *(m for _, m in BUILTIN_PLUGINS))
# Layouts that need two ranks (each rank one shard of the tensors or of the sequence).
TWO_RANKS = (TENSOR_PARALLEL, CONTEXT_PARALLEL)


def _config(args: argparse.Namespace, layout: str, compiled: bool, world: int) -> dict[str, Any]:
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
        "train": {
            "micro_batch_size": args.global_batch // _dp(layout, world),
            "seed": 0,
            "device": args.device,
        },
        "optimizer": {"weight_decay": 0.0},
        "parallel": {"dp_strategy": layout, "transforms": {}},
        "telemetry": {"enabled": False},
    }
    if layout == TENSOR_PARALLEL:
        config["parallel"].update(dp_strategy="ddp", tp=world)
        config["tp"] = {"sequence_parallel": True}
        # The key/value heads split over the tp ranks (d = 384's 3 do not over 2).
        config["model"]["overrides"]["n_kv_heads"] = world
    if layout == CONTEXT_PARALLEL:
        config["parallel"].update(dp_strategy="ddp", cp=world, cp_strategy="ring")
    if args.device == "cuda":  # bf16 autocast, as the GPU benches train
        config["parallel"]["transforms"]["precision"] = "amp"
        config["amp"] = {"dtype": "bf16"}
    if compiled:
        config["parallel"]["transforms"]["compile"] = "compile"
        config["compile"] = {"backend": args.backend}
    return config


def _dp(layout: str, world: int) -> int:
    """Data-parallel ranks: every rank under ZeRO-3 and DDP, one under tensor and context
    parallelism."""
    return 1 if layout in TWO_RANKS else world


def plan(layouts: list[str], world_size: int, devices: int | None) -> dict[str, dict[str, Any]]:
    """Ranks per layout: `world_size`, at most one per device where `devices` is given; a layout
    that needs two ranks on fewer than two devices is skipped, with the reason."""
    planned: dict[str, dict[str, Any]] = {}
    for layout in layouts:
        ranks = world_size if devices is None else min(world_size, devices)
        if layout in TWO_RANKS and ranks < 2:
            where = (
                f"{devices} device{'' if devices == 1 else 's'} here"
                if devices is not None and devices < 2
                else f"--world-size {world_size}"
            )
            reason = f"needs 2 ranks, one device each (two NCCL ranks cannot share a GPU); {where}"
            planned[layout] = {"ranks": 0, "skipped": reason}
        else:
            planned[layout] = {"ranks": max(1, ranks), "skipped": None}
    return planned


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    rank: int,
    world: int,
    port: int,
    result_dir: str,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple,
) -> None:
    """One rank as a launcher starts it: the engine joins the group from the environment
    (NCCL on CUDA, each rank on the GPU of its local rank; Gloo on CPU)."""
    os.environ.clear()  # the caller's environment, not the fork server's
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    outcome: tuple[str, Any]
    try:
        outcome = ("ok", fn(rank, world, *args))
    except BaseException as exc:
        outcome = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    (Path(result_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(outcome))
    # A forked rank leaves through os._exit, which skips the exit handlers (plait's teardown of
    # the group the engine created, inductor's compile workers): run them here, once.
    atexit._run_exitfuncs()


def run_launched(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float, cuda: bool = False
) -> list[Any]:
    """`fn(rank, world, *args)` on `world` fresh processes joined through the environment
    rendezvous, as on a GPU node; each rank's result. On CUDA the ranks are spawned (a CUDA
    process must not be forked, and a spawned one shares nothing); on CPU they are forked from
    a server that imported torch and plait once, which starts them as fresh, without the
    imports (the rehearsal's seconds)."""
    import torch.multiprocessing as mp

    if cuda:
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(RANK_PRELOAD))
    env = {**os.environ, "PLAIT_DISABLE_PLUGIN_AUTOLOAD": "1"}
    with tempfile.TemporaryDirectory(prefix="plait-compile-bench-") as tmp:
        port = _free_port()
        procs = [
            ctx.Process(
                target=_rank_main, args=(rank, world, port, tmp, env, fn, args), daemon=True
            )
            for rank in range(world)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        results, errors = [], []
        for rank, proc in enumerate(procs):
            path = Path(tmp) / f"rank{rank}.pkl"
            if not path.exists():
                errors.append(f"rank {rank}: exited with code {proc.exitcode} and no result")
                continue
            status, value = pickle.loads(path.read_bytes())
            (results if status == "ok" else errors).append(value)
        if errors:
            raise RuntimeError(f"{len(errors)} of {world} ranks failed:\n" + "\n".join(errors))
        return results


def op_class(name: str) -> str:
    return next(
        (label for label, marks in OP_CLASSES if any(m.lower() in name.lower() for m in marks)),
        "other",
    )


def kernel_class(name: str) -> str:
    return next(
        (label for label, marks in KERNEL_CLASSES if any(m in name.lower() for m in marks)),
        "other",
    )


def profile_step(step: Any, cuda: bool = False) -> dict[str, Any]:
    """Self CPU seconds of one step by class of op, and the top ops; on CUDA also the GPU's
    self (kernel) seconds by class of kernel, and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    by_class: dict[str, float] = defaultdict(float)
    by_kernel_class: dict[str, float] = defaultdict(float)
    ops, kernels = [], []
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        by_class[op_class(event.key)] += seconds
        ops.append((seconds, event.key))
        device_seconds = getattr(event, "self_device_time_total", 0) / 1e6
        if cuda and device_seconds > 0:
            by_kernel_class[kernel_class(event.key)] += device_seconds
            kernels.append((device_seconds, event.key[:80]))
    found: dict[str, Any] = {"by_class": dict(by_class), "top": sorted(ops, reverse=True)[:6]}
    if cuda:
        found["gpu_by_class"] = dict(by_kernel_class)
        found["gpu_top"] = sorted(kernels, reverse=True)[:6]
    return found


def run(
    rank: int, world: int, args: argparse.Namespace, layout: str, compiled: bool, profiled: bool
) -> dict[str, Any]:
    from plait.core.engine import Engine
    from plait.core.plugins import Plugins
    from plait.plugins import compile, ddp, zero

    torch._dynamo.reset()
    plugins = Plugins.create(autoload=False, extra=[("compile", compile), ("ddp", ddp),
                                                    ("zero", zero)])  # fmt: skip
    engine = Engine(config=_config(args, layout, compiled, world), plugins=plugins)
    cuda = args.device == "cuda"

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    gen = torch.Generator().manual_seed(0)
    dp_rank = engine.mesh.coordinate("dp")
    local = args.global_batch // engine.mesh.size("dp")
    batches = []
    for _ in range(args.warmup + args.steps + 1):
        tokens = torch.randint(0, args.vocab, (args.global_batch, args.seq_len + 1), generator=gen)
        mine = tokens[dp_rank * local : (dp_rank + 1) * local]
        batches.append((mine[:, :-1], mine[:, 1:]))
    start = time.perf_counter()
    losses = [engine.train_step(batches[0])]
    synchronize()
    first_step = time.perf_counter() - start
    for batch in batches[1 : args.warmup]:
        losses.append(engine.train_step(batch))
    synchronize()
    torch.distributed.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    for batch in batches[args.warmup : -1]:
        losses.append(engine.train_step(batch))
    synchronize()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    profile = None
    if profiled:
        try:
            profile = profile_step(lambda: engine.train_step(batches[-1]), cuda)
        except Exception as exc:  # a profiler that fails costs the profile, not the figures
            profile = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    watch = plugins.manager.get_plugin(f"{compile.NAME}.watch")
    result = {
        "tokens_per_second": args.steps * args.global_batch * args.seq_len / elapsed,
        "cpu_seconds_per_step": cpu / args.steps,
        "first_step_seconds": first_step,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        # How the rank joined its group: NCCL or Gloo; the environment rendezvous (as on a GPU
        # node, `run_launched`) or run_distributed's file store.
        "backend": torch.distributed.get_backend(),
        "rendezvous": "environment" if "MASTER_ADDR" in os.environ else "file store",
        "watch": list(watch.summaries) if watch is not None else [],
        # Recompilations after the warm-up steps the watch allows (one line each).
        "recompilations": watch.recompilations if watch is not None else 0,
        "losses": losses,  # every step's, warm-up included: compiled against eager
        "profile": profile,
    }
    engine.close()
    return result


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    numeric = ("tokens_per_second", "cpu_seconds_per_step", "first_step_seconds")
    row: dict[str, Any] = {key: statistics.median(r[key] for r in runs) for key in numeric}
    memory = [r["peak_memory_gib"] for r in runs if r.get("peak_memory_gib") is not None]
    row["peak_memory_gib"] = max(memory) if memory else None
    return row


def loss_difference(eager: list[dict[str, Any]], compiled: list[dict[str, Any]]) -> float:
    """The largest |compiled − eager| loss of any step, over the rounds (each trains the same
    batches from the same seed)."""
    return max(
        abs(c - e)
        for e_run, c_run in zip(eager, compiled, strict=False)
        for e, c in zip(e_run["losses"], c_run["losses"], strict=True)
    )


def figures(
    args: argparse.Namespace,
    planned: dict[str, dict[str, Any]],
    results: dict[tuple[str, bool], list[dict[str, Any]]],
    rounds_done: int,
) -> dict[str, Any]:
    """What `--json` holds: the setting, each layout's ranks or why it was skipped, the median
    of each contender's runs so far, and the compiled / eager ratios of each layout that has
    both."""
    cuda = args.device == "cuda"
    contenders = {
        f"{layout} {'compiled' if compiled else 'eager'}": {
            "median": _median_row(runs),
            "runs": [{k: v for k, v in r.items() if k != "profile"} for r in runs],
            "profile": runs[-1]["profile"],
        }
        for (layout, compiled), runs in results.items()
        if runs
    }
    ratios, equality = {}, {}
    for layout in planned:
        eager, compiled = results.get((layout, False)), results.get((layout, True))
        if eager and compiled:
            e, c = _median_row(eager), _median_row(compiled)
            ratios[layout] = {
                "throughput": c["tokens_per_second"] / e["tokens_per_second"],
                "cpu_per_step": c["cpu_seconds_per_step"] / e["cpu_seconds_per_step"],
            }
            equality[layout] = {
                "max_loss_difference": loss_difference(eager, compiled),
                "steps_compared": len(compiled[0]["losses"]),
                "recompilations": max(r["recompilations"] for r in compiled),
            }
    return {
        "device": args.device,
        "device_name": args.device_name,
        "precision": "bf16 autocast (amp)" if cuda else "fp32",
        "backend": args.backend,
        "model": {"dim": args.dim, "layers": args.layers, "vocab": args.vocab},
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
        "rounds_done": rounds_done,
        "layouts": planned,
        "skipped": {lay: p["skipped"] for lay, p in planned.items() if p["skipped"]},
        "contenders": contenders,
        "ratios": ratios,
        # Compiled equals eager: the largest loss difference at any step, and recompilations.
        "equality": equality,
    }


def save(path: Path | None, document: dict[str, Any]) -> None:
    if path is None:
        return
    scratch = path.with_name(path.name + ".tmp")
    scratch.write_text(json.dumps(document, indent=2, default=str))
    scratch.replace(path)


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
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, a GPU per rank"
    )
    parser.add_argument(
        "--devices",
        type=int,
        help="at most one rank per device, started as on a GPU node (default: the GPUs found "
        "under --device cuda; none under cpu: --world-size Gloo ranks share the cores)",
    )
    parser.add_argument("--json", type=Path, help="write the figures here after every run")
    args = parser.parse_args()
    devices = args.devices
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device here")
        devices = torch.cuda.device_count() if devices is None else devices
    launched = devices is not None  # a process per rank, as on a GPU node
    args.device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"

    layouts = [lay for lay in LAYOUTS if not args.only or lay in args.only.split(",")]
    planned = plan(layouts, args.world_size, devices)
    running = [lay for lay in layouts if not planned[lay]["skipped"]]
    contenders = [(layout, compiled) for layout in running for compiled in (False, True)]
    results: dict[tuple[str, bool], list[dict[str, Any]]] = {c: [] for c in contenders}
    save(args.json, figures(args, planned, results, 0))
    for round_index in range(args.rounds):
        last = round_index == args.rounds - 1
        order = contenders if round_index % 2 == 0 else list(reversed(contenders))
        for layout, compiled in order:
            world = planned[layout]["ranks"]
            spawn = run_distributed
            if launched:
                spawn = functools.partial(run_launched, cuda=args.device == "cuda")
            per_rank = spawn(run, world, args, layout, compiled, last, timeout=3600)
            results[(layout, compiled)].append(
                {
                    "tokens_per_second": statistics.mean(r["tokens_per_second"] for r in per_rank),
                    "cpu_seconds_per_step": statistics.mean(
                        r["cpu_seconds_per_step"] for r in per_rank
                    ),
                    "first_step_seconds": max(r["first_step_seconds"] for r in per_rank),
                    "peak_memory_gib": per_rank[0]["peak_memory_gib"],
                    "watch": per_rank[0]["watch"],
                    "recompilations": max(r["recompilations"] for r in per_rank),
                    "losses": per_rank[0]["losses"],  # the same on every rank
                    "profile": per_rank[0]["profile"],
                }
            )
            planned[layout].update(
                backend=per_rank[0]["backend"], rendezvous=per_rank[0]["rendezvous"]
            )
            save(args.json, figures(args, planned, results, round_index))
        save(args.json, figures(args, planned, results, round_index + 1))
    summary = {c: _median_row(runs) for c, runs in results.items()}
    cuda = args.device == "cuda"
    ranks = ", ".join(f"{lay} {p['ranks']}" for lay, p in planned.items() if not p["skipped"])
    where = (
        f"NCCL ranks on {devices} × {args.device_name} (bf16 autocast)"
        if cuda
        else f"Gloo ranks{' (as on a node of ' + str(devices) + ' devices)' if launched else ''}"
    )
    print(
        f"compile benchmark: llama dim={args.dim} layers={args.layers} vocab={args.vocab} "
        f"seq={args.seq_len} global batch={args.global_batch}, {where}: {ranks or 'none'}; "
        f"backend {args.backend}, {args.warmup} warm-up + {args.steps} timed steps, "
        f"{args.rounds} alternating rounds (median)"
    )
    memory_column = f" {'peak GiB':>9}" if cuda else ""
    print(f"{'':16} {'tokens/s':>10} {'CPU s/step':>11} {'step 1 s':>9}{memory_column}")
    for (layout, compiled), row in summary.items():
        name = f"{layout} {'compiled' if compiled else 'eager'}"
        memory = f" {row['peak_memory_gib']:9.2f}" if cuda else ""
        print(
            f"{name:16} {row['tokens_per_second']:10,.0f} {row['cpu_seconds_per_step']:11.3f} "
            f"{row['first_step_seconds']:9.1f}{memory}"
        )
    for layout, placed in planned.items():
        if placed["skipped"]:
            print(f"{layout}: skipped: {placed['skipped']}")
    for layout in running:
        eager, compiled = summary[(layout, False)], summary[(layout, True)]
        print(
            f"{layout} compiled / eager: throughput "
            f"{compiled['tokens_per_second'] / eager['tokens_per_second']:.3f}×, CPU per step "
            f"{compiled['cpu_seconds_per_step'] / eager['cpu_seconds_per_step']:.3f}×"
        )
        runs_compiled = results[(layout, True)]
        difference = loss_difference(results[(layout, False)], runs_compiled)
        print(
            f"  loss: max |compiled − eager| {difference:.2e} over "
            f"{len(runs_compiled[0]['losses'])} steps; recompilations after step 2: "
            f"{max(r['recompilations'] for r in runs_compiled)}"
        )
        for line in results[(layout, True)][-1]["watch"]:
            print(f"  {line}")
    what = "CPU and GPU time" if cuda else "CPU time"
    print(f"where one step's {what} went (rank 0, self time, seconds):")
    pad = "  " + " " * 16
    for (layout, compiled), runs in results.items():
        profile = runs[-1]["profile"]
        name = f"{layout} {'compiled' if compiled else 'eager'}"
        if profile is None or "error" in profile:
            print(f"  {name:16} no profile: {(profile or {}).get('error')}")
            continue
        for label, key, top in (("CPU", "by_class", "top"), ("GPU", "gpu_by_class", "gpu_top")):
            if key not in profile:
                continue
            classes = sorted(profile[key].items(), key=lambda kv: -kv[1])
            shown = ", ".join(f"{c} {s:.3f}" for c, s in classes if s >= 1e-3)
            head = f"  {name:16} " if label == "CPU" else pad + " "
            print(head + (f"{label}: " if cuda else "") + shown)
            print(pad + " top: " + ", ".join(f"{op} {s:.3f}" for s, op in profile[top]))


if __name__ == "__main__":
    main()
