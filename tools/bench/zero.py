"""Benchmark: plait zero3 vs torch FSDP2 (`fully_shard` per block), and zero1/zero2 vs plait DDP.

    python tools/bench/zero.py [--rounds 3] [--steps 10] [--only zero3,fsdp2] [--dim 256]

Every contender trains the same built-in Llama (plait kernels, name-keyed init) with AdamW and
global-norm clipping on Gloo ranks spawned by this script, each in fresh processes. Each run
takes `--warmup` untimed steps, then times `--steps`; rounds run the contenders in alternating
order (forward, then reversed) so a burst of load on a shared machine does not always hit the
same one, and the table shows the median over rounds. FSDP2 wraps each `model.layers` entry and
then the root, like plait's default stage 3 units, and uses torch's foreach AdamW.

Besides wall-clock tokens/s the table shows CPU seconds per step (all threads of a rank, so the
Gloo threads' work counts), which a busy machine disturbs much less than wall-clock time.

Peak memory per rank is measured from the CPU allocator, not estimated: model-state bytes held
between steps (storage accounting, `plait.core.memory.storage_bytes` over parameters, gradients
and optimizer state; plait's `resident_total`, FSDP2's local shards) plus the highest net
allocation during a profiled step (`torch.profiler` with `profile_memory=True`: the running sum
of each op's own allocations minus frees, in start order). Two steps are profiled and the second
one is measured, so every buffer a step frees was allocated while the profiler watched.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from plait.testing.distributed import run_distributed

MICRO_BATCH = 4


def _config(args: argparse.Namespace, strategy: str) -> dict[str, Any]:
    return {
        "model": {
            "name": "llama",
            "size": "tiny",
            "overrides": {"dim": args.dim, "n_layers": args.layers, "n_heads": 8, "n_kv_heads": 4},
        },
        "data": {"seq_len": args.seq_len},
        "train": {"micro_batch_size": MICRO_BATCH, "max_grad_norm": 1.0, "seed": 0},
        "optimizer": {"weight_decay": 0.0},
        "parallel": {"dp_strategy": strategy},
        "telemetry": {"enabled": False},
    }


def _batches(args: argparse.Namespace, rank: int, world: int) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(0)
    local = args.global_batch // world
    out = []
    for _ in range(args.steps + args.warmup + 2):
        tokens = torch.randint(0, 256, (args.global_batch, args.seq_len + 1), generator=gen)
        mine = tokens[rank * local : (rank + 1) * local]
        out.append((mine[:, :-1], mine[:, 1:]))
    return out


def step_peak_bytes(step: Callable[[], None]) -> int:
    """Highest net bytes allocated at any point during a call of `step`, above what was held
    when it started: the running sum, in start-time order, of every profiled op's own
    allocations minus frees. `step` runs twice and the second call is measured, so its frees
    of buffers the first call left behind are seen too (the allocator reports a free only for
    memory allocated while profiling)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        with record_function("measured_step"):
            step()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    measured = next(e for e in events if e.name == "measured_step")
    start, end = measured.time_range.start, measured.time_range.end
    live = peak = 0
    for event in events:
        if event.time_range.start >= start and event.time_range.start <= end:
            live += event.self_cpu_memory_usage
            peak = max(peak, live)
    return peak


def _measure(
    args: argparse.Namespace, step: Callable[[Any], None], state_bytes: Callable[[], int]
) -> dict[str, float]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batches = _batches(args, rank, world)
    for batch in batches[: args.warmup]:
        step(batch)
    torch.distributed.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    for batch in batches[args.warmup : -2]:
        step(batch)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    held = state_bytes()  # what is held between steps, as at the start of the measured step
    profiled = iter(batches[-2:])
    peak = held + step_peak_bytes(lambda: step(next(profiled)))
    return {
        "tokens_per_second": args.steps * args.global_batch * args.seq_len / elapsed,
        "cpu_seconds_per_step": cpu / args.steps,
        "peak_mib": peak / 2**20,
        "state_mib": held / 2**20,
    }


def run_plait(rank: int, world: int, args: argparse.Namespace, strategy: str) -> dict[str, float]:
    from plait.core.engine import Engine
    from plait.core.plugins import Plugins
    from plait.plugins import zero

    del rank, world
    plugins = Plugins.create(autoload=False, extra=[("zero", zero)])
    engine = Engine(config=_config(args, strategy), plugins=plugins)

    def state_bytes() -> int:
        report = engine.memory_report()
        return report.get("resident_total", report["total"])

    return _measure(args, engine.train_step, state_bytes)


def run_fsdp2(rank: int, world: int, args: argparse.Namespace) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from plait.core.kernels import Kernels
    from plait.core.memory import optimizer_state_tensors, storage_bytes
    from plait.core.plugins import Plugins

    del rank
    plugins = Plugins.create(autoload=False)
    record = plugins.model("llama")
    model_config = record.make_config("tiny", _config(args, "ddp")["model"]["overrides"])
    with torch.device("meta"):
        model = record.build(model_config, Kernels(plugins))
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(seed=0)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True, weight_decay=0.0)
    ce = torch.nn.functional.cross_entropy

    def step(batch: tuple[torch.Tensor, ...]) -> None:
        inputs, targets = batch
        chunks = list(zip(inputs.split(MICRO_BATCH), targets.split(MICRO_BATCH), strict=True))
        for x, y in chunks:
            loss = ce(model(x).flatten(0, 1), y.flatten()) / len(chunks)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reported = loss.detach().clone()
        torch.distributed.all_reduce(reported)

    def state_bytes() -> int:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        tensors = [*model.parameters(), *grads, *optimizer_state_tensors(optimizer)]
        return storage_bytes(t.to_local() if hasattr(t, "to_local") else t for t in tensors)

    return _measure(args, step, state_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--only", default="", help="comma-separated subset: zero1,zero2,zero3,fsdp2,ddp"
    )
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    args = parser.parse_args()

    contenders: dict[str, tuple[Callable[..., dict[str, float]], tuple[Any, ...]]] = {
        "plait zero3": (run_plait, ("zero3",)),
        "torch fsdp2": (run_fsdp2, ()),
        "plait ddp": (run_plait, ("ddp",)),
        "plait zero1": (run_plait, ("zero1",)),
        "plait zero2": (run_plait, ("zero2",)),
    }
    if args.only:
        wanted = {f"plait {n}" if n != "fsdp2" else "torch fsdp2" for n in args.only.split(",")}
        contenders = {name: c for name, c in contenders.items() if name in wanted}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    for round_index in range(args.rounds):
        order = list(contenders.items())
        for name, (fn, extra) in order if round_index % 2 == 0 else reversed(order):
            per_rank = run_distributed(fn, args.world_size, args, *extra, timeout=1800)
            results[name].append(
                {
                    "tokens_per_second": statistics.mean(r["tokens_per_second"] for r in per_rank),
                    "cpu_seconds_per_step": statistics.mean(
                        r["cpu_seconds_per_step"] for r in per_rank
                    ),
                    "peak_mib": max(r["peak_mib"] for r in per_rank),
                    "state_mib": max(r["state_mib"] for r in per_rank),
                }
            )
    summary = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in results.items()
    }
    print(
        f"ZeRO benchmark: llama dim={args.dim} layers={args.layers} seq={args.seq_len} "
        f"global batch={args.global_batch} micro={MICRO_BATCH}, {args.world_size} Gloo ranks, "
        f"{args.warmup} warm-up + {args.steps} timed steps, {args.rounds} alternating rounds "
        "(median)"
    )
    print(
        f"{'':12} {'tokens/s':>10} {'CPU s/step':>11} {'peak MiB/rank':>14} {'held MiB/rank':>14}"
    )
    for name, row in summary.items():
        print(
            f"{name:12} {row['tokens_per_second']:10,.0f} {row['cpu_seconds_per_step']:11.3f} "
            f"{row['peak_mib']:14,.2f} {row['state_mib']:14,.2f}"
        )
    for ours, peer in (
        ("plait zero3", "torch fsdp2"),
        ("plait zero1", "plait ddp"),
        ("plait zero2", "plait ddp"),
    ):
        if ours not in summary or peer not in summary:
            continue
        a, b = summary[ours], summary[peer]
        print(
            f"{ours} / {peer}: throughput {a['tokens_per_second'] / b['tokens_per_second']:.3f}×,"
            f" CPU per step {a['cpu_seconds_per_step'] / b['cpu_seconds_per_step']:.3f}×,"
            f" peak memory {a['peak_mib'] / b['peak_mib']:.3f}×"
        )


if __name__ == "__main__":
    main()
