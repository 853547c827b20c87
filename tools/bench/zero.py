"""Benchmark: plait zero3 vs torch FSDP2 (`fully_shard` per block), and zero1/zero2 vs plait DDP.

    python tools/bench/zero.py [--world-size 2] [--steps 10] [--dim 256] [--layers 4]

Every contender trains the same built-in Llama (plait kernels, name-keyed init) with AdamW and
global-norm clipping on Gloo ranks spawned by this script, each in fresh processes; rounds
alternate to spread machine noise. FSDP2 wraps each `model.layers` entry and then the root, like
plait's default stage 3 units, and uses torch's foreach AdamW.

Peak memory per rank is measured from the CPU allocator, not estimated: model-state bytes held
before a step (storage accounting, `plait.core.memory.storage_bytes` over parameters, gradients
and optimizer state; FSDP2's local shards) plus the highest net allocation during one profiled
step (`torch.profiler` with `profile_memory=True`: the running sum of each op's own allocations
minus frees, in start order). Storage freed during the step that was allocated before it (e.g.
stage 3 resharding) is not seen by the profiler, so the figure errs high, never low.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from plait.core.testing import run_distributed

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
    for _ in range(args.steps + args.warmup + 1):
        tokens = torch.randint(0, 256, (args.global_batch, args.seq_len + 1), generator=gen)
        mine = tokens[rank * local : (rank + 1) * local]
        out.append((mine[:, :-1], mine[:, 1:]))
    return out


def step_peak_bytes(step: Callable[[], None]) -> int:
    """Highest net bytes allocated at any point during `step`: the running sum, in start-time
    order, of every profiled op's own allocations minus frees (and of frees outside ops)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    live = peak = 0
    for event in events:
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
    start = time.perf_counter()
    for batch in batches[args.warmup : -1]:
        step(batch)
    elapsed = time.perf_counter() - start
    before = state_bytes()
    peak = before + step_peak_bytes(lambda: step(batches[-1]))
    return {
        "tokens_per_second": args.steps * args.global_batch * args.seq_len / elapsed,
        "peak_mib": peak / 2**20,
        "state_mib": before / 2**20,
    }


def run_plait(rank: int, world: int, args: argparse.Namespace, strategy: str) -> dict[str, float]:
    from plait.core.engine import Engine
    from plait.core.plugins import Plugins
    from plait.plugins import zero

    del rank, world
    plugins = Plugins.create(autoload=False, extra=[("zero", zero)])
    engine = Engine(config=_config(args, strategy), plugins=plugins)
    return _measure(args, engine.train_step, lambda: engine.memory_report()["total"])


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
    parser.add_argument("--rounds", type=int, default=2)
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
    results: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, (fn, extra) in contenders.items():
            per_rank = run_distributed(fn, args.world_size, args, *extra, timeout=1800)
            results[name].append(
                {
                    "tokens_per_second": statistics.mean(r["tokens_per_second"] for r in per_rank),
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
        f"{args.steps} steps × {args.rounds} rounds (median)"
    )
    print(f"{'':12} {'tokens/s':>10} {'peak MiB/rank':>14} {'state MiB/rank':>15}")
    for name, row in summary.items():
        print(
            f"{name:12} {row['tokens_per_second']:10,.0f} {row['peak_mib']:14,.2f} "
            f"{row['state_mib']:15,.2f}"
        )
    for ours, peer in (
        ("plait zero3", "torch fsdp2"),
        ("plait zero1", "plait ddp"),
        ("plait zero2", "plait ddp"),
    ):
        a, b = summary[ours], summary[peer]
        print(
            f"{ours} / {peer}: throughput {a['tokens_per_second'] / b['tokens_per_second']:.3f}×,"
            f" peak memory {a['peak_mib'] / b['peak_mib']:.3f}×"
        )


if __name__ == "__main__":
    main()
