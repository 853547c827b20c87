"""Benchmark: plait DDP vs torch DistributedDataParallel, same model, same data, same run.

    python tools/bench/dp.py [--world-size 2] [--steps 20] [--dim 256] [--layers 4]
                             [--vocab 256] [--model llama|user] [--interleave]

Both sides train the same model — the built-in Llama (plait kernels) or, with `--model user`,
the GPT of plain torch modules that `tools/bench/peers.py` brings as a user would — with AdamW,
global-norm clipping and gradient accumulation over micro-batches, on Gloo ranks spawned by this
script. Each contender runs in fresh processes (so peak RSS is its own); rounds alternate to
spread machine noise. Prints tokens/s, peak RSS and model-state bytes per rank, and the
plait/torch ratios.

`--interleave` instead builds both contenders in the same ranks and alternates them step by
step (which one goes first alternates too), timing each step between barriers: a burst of load
on a shared machine then hits both sides of each pair of steps, at the price of both sharing
one process (allocator, caches, and each other's background threads). Prints the median step
time of each and the median of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from plait.testing.distributed import run_distributed

MICRO_BATCH = 4


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": {
            "name": "llama",
            "size": "tiny",
            "overrides": {
                "dim": args.dim,
                "n_layers": args.layers,
                "n_heads": 8,
                "n_kv_heads": 4,
                "vocab_size": args.vocab,
            },
        },
        "data": {"seq_len": args.seq_len},
        "train": {"micro_batch_size": MICRO_BATCH, "max_grad_norm": 1.0, "seed": 0},
        "ddp": {"bucket_mb": 25.0},
        "telemetry": {"enabled": False},
    }


def _batches(args: argparse.Namespace, rank: int, world: int) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(0)
    local = args.global_batch // world
    out = []
    for _ in range(args.steps + args.warmup):
        tokens = torch.randint(0, args.vocab, (args.global_batch, args.seq_len + 1), generator=gen)
        mine = tokens[rank * local : (rank + 1) * local]
        out.append((mine[:, :-1], mine[:, 1:]))
    return out


Step = Callable[[tuple[torch.Tensor, ...]], Any]


def _user_model(args: argparse.Namespace) -> torch.nn.Module:
    """The GPT of plain torch modules, with the same initial weights on every rank and side."""
    from plait.tools.bench.peers import UserGPT

    torch.manual_seed(0)
    return UserGPT(args.vocab, args.dim, args.layers, 8, args.seq_len)


def plait_step(args: argparse.Namespace) -> tuple[Step, Callable[[], int]]:
    """plait's step and a function giving its model-state bytes."""
    from plait.core.engine import Engine
    from plait.core.plugins import Plugins

    config = _config(args)
    model = None
    if args.model == "user":
        model = _user_model(args)
        config.pop("model")
    engine = Engine(config=config, model=model, plugins=Plugins.create(autoload=False))
    return engine.train_step, lambda: engine.memory_report()["total"]


def torch_ddp_step(args: argparse.Namespace) -> tuple[Step, Callable[[], int]]:
    """torch DDP's step (bucket views, no_sync for all but the last micro-batch) and a function
    giving its model-state bytes."""
    from torch.nn.parallel import DistributedDataParallel

    from plait.core.kernels import Kernels
    from plait.core.memory import memory_report
    from plait.core.plugins import Plugins

    if args.model == "user":
        model = _user_model(args)
    else:
        # The identical model plait trains: same family, shape, kernels and name-keyed init.
        plugins = Plugins.create(autoload=False)
        record = plugins.model("llama")
        model_config = record.make_config("tiny", _config(args)["model"]["overrides"])
        with torch.device("meta"):
            model = record.build(model_config, Kernels(plugins))
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(seed=0)
    ddp = DistributedDataParallel(model, bucket_cap_mb=25, gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
    ce = torch.nn.functional.cross_entropy

    def step(batch: tuple[torch.Tensor, ...]) -> None:
        inputs, targets = batch
        chunks = list(zip(inputs.split(MICRO_BATCH), targets.split(MICRO_BATCH), strict=True))
        for i, (x, y) in enumerate(chunks):
            last = i == len(chunks) - 1
            context = ddp.no_sync() if not last else _nullcontext()
            with context:
                loss = ce(ddp(x).flatten(0, 1), y.flatten()) / len(chunks)
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reported = loss.detach().clone()
        torch.distributed.all_reduce(reported)

    return step, lambda: memory_report(model, optimizer)["total"]


def _timed(
    build: Callable[[argparse.Namespace], tuple[Step, Callable[[], int]]],
    rank: int,
    world: int,
    args: argparse.Namespace,
) -> dict[str, float]:
    step, state_bytes = build(args)
    batches = _batches(args, rank, world)
    for batch in batches[: args.warmup]:
        step(batch)
    start = time.perf_counter()
    for batch in batches[args.warmup :]:
        step(batch)
    elapsed = time.perf_counter() - start
    tokens = args.steps * args.global_batch * args.seq_len
    return {
        "tokens_per_second": tokens / elapsed,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "model_state_mib": state_bytes() / 2**20,
    }


def run_plait(rank: int, world: int, args: argparse.Namespace) -> dict[str, float]:
    return _timed(plait_step, rank, world, args)


def run_torch_ddp(rank: int, world: int, args: argparse.Namespace) -> dict[str, float]:
    return _timed(torch_ddp_step, rank, world, args)


def run_interleaved(rank: int, world: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Both contenders in these ranks, one step each in turn (alternating which goes first),
    each step timed between barriers."""
    contenders = {"plait ddp": plait_step(args)[0], "torch ddp": torch_ddp_step(args)[0]}
    batches = _batches(args, rank, world)
    for batch in batches[: args.warmup]:
        for step in contenders.values():
            step(batch)
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    order = list(contenders)
    for index, batch in enumerate(batches[args.warmup :]):
        for name in order if index % 2 == 0 else order[::-1]:
            torch.distributed.barrier()
            start = time.perf_counter()
            contenders[name](batch)
            seconds[name].append(time.perf_counter() - start)
    return seconds


def _print_interleaved(args: argparse.Namespace, per_rank: list[dict[str, list[float]]]) -> None:
    # A step ends on every rank at the same collective: rank 0's times are the job's.
    seconds = per_rank[0]
    plait, peer = seconds["plait ddp"], seconds["torch ddp"]
    ratios = sorted(p / t for p, t in zip(plait, peer, strict=True))
    print(
        f"DDP benchmark, interleaved: {args.model} dim={args.dim} layers={args.layers} "
        f"vocab={args.vocab} seq={args.seq_len} global batch={args.global_batch} "
        f"micro={MICRO_BATCH}, {args.world_size} Gloo ranks, {args.steps} steps each"
    )
    for name, values in seconds.items():
        print(f"{name:12} median step {statistics.median(values):.4f} s")
    print(
        f"ratio plait/torch step time: median {statistics.median(ratios):.3f} "
        f"(lowest {ratios[0]:.3f}, highest {ratios[-1]:.3f}); throughput "
        f"{1 / statistics.median(ratios):.3f}x"
    )


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--model", choices=("llama", "user"), default="llama")
    parser.add_argument("--interleave", action="store_true")
    parser.add_argument("--global-batch", type=int, default=16)
    args = parser.parse_args()
    if args.interleave:
        per_rank = run_distributed(run_interleaved, args.world_size, args, timeout=1800)
        _print_interleaved(args, per_rank)
        return

    results: dict[str, list[dict[str, float]]] = {"plait ddp": [], "torch ddp": []}
    for _ in range(args.rounds):
        for name, fn in (("plait ddp", run_plait), ("torch ddp", run_torch_ddp)):
            per_rank = run_distributed(fn, args.world_size, args, timeout=1800)
            results[name].append(
                {
                    "tokens_per_second": sum(r["tokens_per_second"] for r in per_rank)
                    / len(per_rank),
                    "peak_rss_mib": max(r["peak_rss_mib"] for r in per_rank),
                    "model_state_mib": max(r["model_state_mib"] for r in per_rank),
                }
            )
    summary = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in results.items()
    }
    print(
        f"DDP benchmark: {args.model} dim={args.dim} layers={args.layers} vocab={args.vocab} "
        f"seq={args.seq_len} "
        f"global batch={args.global_batch} micro={MICRO_BATCH}, {args.world_size} Gloo ranks, "
        f"{args.steps} steps × {args.rounds} rounds (median)"
    )
    print(f"{'':12} {'tokens/s':>12} {'peak RSS MiB':>14} {'model state MiB':>16}")
    for name, row in summary.items():
        print(
            f"{name:12} {row['tokens_per_second']:12,.0f} {row['peak_rss_mib']:14,.1f} "
            f"{row['model_state_mib']:16,.2f}"
        )
    plait, peer = summary["plait ddp"], summary["torch ddp"]
    throughput = plait["tokens_per_second"] / peer["tokens_per_second"]
    rss = plait["peak_rss_mib"] / peer["peak_rss_mib"]
    print(f"ratio plait/torch: throughput {throughput:.3f}×, peak RSS {rss:.3f}×")


if __name__ == "__main__":
    main()
