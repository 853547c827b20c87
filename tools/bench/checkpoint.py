"""Benchmark: what checkpoints cost a training job, asynchronous vs synchronous vs none, same run.

    python tools/bench/checkpoint.py [--world-size 1] [--steps 40] [--every 5] [--rounds 2]
                                     [--dim 256] [--layers 2] [--vocab 32768] [--seq-len 16]
                                     [--global-batch 2] [--dir DIR] [--threads N]

One job per contender — no checkpoints, `async_save = false`, `async_save = true` — each in
fresh Gloo ranks spawned by this script, training the built-in Llama on synthetic tokens and
saving every `--every` steps through the `Checkpointer` a `plait train` job uses, to `--dir`
(default: a temporary directory beside this checkout, on a real disk, since saves fsync). The
contenders alternate in each round (the order reverses every round) to spread machine noise.
The default model has a large vocabulary: a lot of state (weights and two Adam moments) for
little compute, so a synchronous save costs many steps.

Printed, from rank 0's clock (a step ends on every rank at the same collective):
- a plain step (median of the steps that do not save) and a saving step (median and worst of
  those that do), and their ratio, per contender;
- what a save blocked the step: for async the copy to host memory (also measured alone), and
  any wait for the previous save still writing;
- the background write's median duration, in plain steps (for sync it is the save itself);
- the job's total time to its last step and to the end of its last write (`close()`), as
  ratios to the job without checkpoints.

A write that takes longer than `--every` steps cannot be hidden: the next save waits for it.
Nor can one on a machine whose every core trains: the write costs CPU time (the copy into the
page cache, the serialisation, fsync) that a background thread takes from the steps beside it.
`--threads N` gives each rank N intra-op threads (`torch.set_num_threads`), leaving the rest of
the machine's cores free, as a GPU node's ranks leave most of theirs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from plait.testing.distributed import run_distributed

CONTENDERS = ("none", "sync", "async")


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": {
            "name": "llama",
            "size": "tiny",
            "overrides": {
                "dim": args.dim,
                "n_layers": args.layers,
                "n_heads": 4,
                "n_kv_heads": 2,
                "vocab_size": args.vocab,
                "max_seq_len": args.seq_len,
            },
        },
        "data": {"seq_len": args.seq_len},
        "train": {
            "steps": args.warmup + args.steps,
            "global_batch_size": args.global_batch,
            "micro_batch_size": args.global_batch // args.world_size,
            "seed": 0,
            "device": "cpu",
        },
        "telemetry": {"enabled": False},
    }


def _batches(args: argparse.Namespace, rank: int, world: int) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(0)
    local = args.global_batch // world
    out = []
    for _ in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (args.global_batch, args.seq_len + 1), generator=gen)
        mine = tokens[rank * local : (rank + 1) * local]
        out.append((mine[:, :-1], mine[:, 1:]))
    return out


def run_job(rank: int, world: int, args: argparse.Namespace, mode: str, where: str) -> Any:
    """Train `--steps` steps (after warm-up), saving every `--every` unless `mode` is none."""
    from plait.core.engine import Engine
    from plait.core.plugins import Plugins
    from plait.plugins.checkpoint.checkpointer import Checkpointer
    from plait.plugins.checkpoint.config import CheckpointIOConfig
    from plait.plugins.checkpoint.staging import HostStaging
    from plait.plugins.checkpoint.state import engine_state_dict

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(config=_config(args), plugins=Plugins.create(autoload=False))
    settings = CheckpointIOConfig(
        dir=where if mode != "none" else "", async_save=mode == "async", keep=2, resume=False
    )
    checkpointer = Checkpointer(engine, None, settings)
    batches = _batches(args, rank, world)
    for batch in batches[: args.warmup]:
        engine.train_step(batch)
    step_seconds: list[float] = []
    saving: list[bool] = []
    start = time.perf_counter()
    for index, batch in enumerate(batches[args.warmup :]):
        begun = time.perf_counter()
        engine.train_step(batch)
        saves = mode != "none" and (index + 1) % args.every == 0
        if saves:
            checkpointer.save(index + 1)
        step_seconds.append(time.perf_counter() - begun)
        saving.append(saves)
    last_step = time.perf_counter() - start
    checkpointer.close()
    closed = time.perf_counter() - start
    # The copy alone, off the clock of the job: what a save blocks a step for at least.
    staging = HostStaging()
    staging.stage(engine_state_dict(engine))  # first use allocates the buffers
    copy_started = time.perf_counter()
    staged = staging.stage(engine_state_dict(engine))
    copy_alone = time.perf_counter() - copy_started
    engine.close()
    del staged
    return {
        "steps": step_seconds,
        "saving": saving,
        "last_step": last_step,
        "closed": closed,
        "copy_alone": copy_alone,
        "state_bytes": staging.nbytes,
        "timings": [(t.blocked_s, t.waited_for_previous_s, t.copy_s, t.write_s)
                    for t in checkpointer.timings],
        "failed": [f.describe() for f in checkpointer.failed_saves],
    }  # fmt: skip


def _summarise(runs: list[dict[str, Any]]) -> dict[str, float]:
    pairs = [p for run in runs for p in zip(run["steps"], run["saving"], strict=True)]
    plain = [seconds for seconds, saves in pairs if not saves]
    saving = [seconds for seconds, saves in pairs if saves]
    timings = [t for run in runs for t in run["timings"]]
    row = {
        "plain": statistics.median(plain),
        "last_step": statistics.median(run["last_step"] for run in runs),
        "closed": statistics.median(run["closed"] for run in runs),
        "copy_alone": statistics.median(run["copy_alone"] for run in runs),
        "state_mib": runs[0]["state_bytes"] / 2**20,
    }
    if saving:
        row["saving"] = statistics.median(saving)
        row["saving_worst"] = max(saving)
        row["blocked"] = statistics.median(t[0] for t in timings)
        row["waited"] = statistics.median(t[1] for t in timings)
        row["copy"] = statistics.median(t[2] for t in timings)
        row["write"] = statistics.median(t[3] for t in timings)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--global-batch", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints go (a disk)")
    parser.add_argument(
        "--threads", type=int, default=0, help="intra-op threads per rank (0: torch's default)"
    )
    args = parser.parse_args()

    base = args.dir or Path(__file__).resolve().parents[2]
    root = Path(tempfile.mkdtemp(prefix=".bench-checkpoint-", dir=base))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONTENDERS}
    try:
        for round_index in range(args.rounds):
            order = CONTENDERS if round_index % 2 == 0 else CONTENDERS[::-1]
            for mode in order:
                where = root / f"{mode}-{round_index}"
                per_rank = run_distributed(
                    run_job, args.world_size, args, mode, str(where), timeout=3600
                )
                runs[mode].append(per_rank[0])
                shutil.rmtree(where, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for mode in CONTENDERS:
        for run in runs[mode]:
            for failure in run["failed"]:
                print(f"{mode}: {failure}")
    summary = {mode: _summarise(r) for mode, r in runs.items()}
    _print(args, summary)


def _print(args: argparse.Namespace, summary: dict[str, dict[str, float]]) -> None:
    none, sync, later = summary["none"], summary["sync"], summary["async"]
    plain = none["plain"]
    print(
        f"Checkpoint benchmark: llama dim={args.dim} layers={args.layers} vocab={args.vocab} "
        f"seq={args.seq_len} global batch={args.global_batch}, {args.world_size} Gloo rank(s), "
        f"{args.steps} steps, a save every {args.every}, {args.rounds} rounds (median); "
        f"{later['state_mib']:.1f} MiB of state per rank; "
        f"{args.threads or torch.get_num_threads()} threads per rank of {os.cpu_count()} cores"
    )
    print(
        f"plain step (no checkpoints) {plain:.4f} s; a synchronous save takes "
        f"{sync['write'] / plain:.1f} plain steps; the copy to host memory alone "
        f"{later['copy_alone']:.4f} s ({later['copy_alone'] / plain:.2f} steps)"
    )
    print(
        f"{'':7} {'plain step':>11} {'saving step':>12} {'worst':>8} {'saving/plain':>13} "
        f"{'blocked':>8} {'copy':>7} {'waited':>7} {'write':>7} {'last step':>10} {'closed':>8}"
    )
    for mode, row in summary.items():
        if mode == "none":
            print(
                f"{mode:7} {row['plain']:11.4f} {'':>12} {'':>8} {'':>13} {'':>8} {'':>7} "
                f"{'':>7} {'':>7} {row['last_step']:10.2f} {row['closed']:8.2f}"
            )
            continue
        print(
            f"{mode:7} {row['plain']:11.4f} {row['saving']:12.4f} {row['saving_worst']:8.3f} "
            f"{row['saving'] / row['plain']:12.2f}x {row['blocked']:8.3f} {row['copy']:7.3f} "
            f"{row['waited']:7.3f} {row['write']:7.3f} {row['last_step']:10.2f} "
            f"{row['closed']:8.2f}"
        )
    for mode in ("sync", "async"):
        row = summary[mode]
        ratio = row["saving"] / row["plain"]
        print(
            f"{mode:5}: saving step / plain step of the same job {ratio:.2f}x"
            f" (/ a step without checkpoints {row['saving'] / plain:.2f}x); job time to the last "
            f"step {row['last_step'] / none['last_step']:.3f}x, to the end of the last write "
            f"{row['closed'] / none['closed']:.3f}x that of the job without checkpoints"
        )


if __name__ == "__main__":
    main()
