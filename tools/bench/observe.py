"""What `plait.observe` costs a training step, measured two ways on one DDP script.

    python tools/bench/observe.py [--rounds 5] [--steps 30] [--warmup 3] [--pairs 60]
                                  [--dim 256] [--bucket-mb 0.25]

The script is docs/observe.md's DDP example model (an embedding, four 256-wide blocks, a 512-token
head; 8 × 64 tokens per rank and step; 0.25 MB gradient buckets: six of them) on two Gloo
ranks (`run_distributed`), each step timed around the loop body as the user's own code would
(rank 0's times: the ranks wait for each other in every all-reduce). `--dim` widens the blocks
and `--bucket-mb` sets DDP's bucket size (25: DDP's default), for a step of a realistic length:
what observing costs is mostly per bucket, not per FLOP.

1. **Alternating runs.** Each run is a fresh pair of ranks training `--warmup` + `--steps`
   steps. Five kinds of run rotate within every round, each in every position in turn:
   `plain` (the script without plait), `plain again` (the same: the noise floor of comparing
   two runs on this machine), `torch hook` (the script with torch's own Python comm hook,
   `ddp_comm_hooks.default_hooks.allreduce_hook`: what any Python hook on DDP's buckets
   costs, the floor under per-bucket timing), `observed` (`plait.observe(model, optimizer=…)`
   and `with observer.step():`, exporting to a daemon in this process) and `no daemon` (the
   same lines, nothing listening: the observer warns once and steps on). Per round, each
   kind's median step over the plain run's, in wall time and in the CPU time of the rank's
   process (every thread: training, Gloo, exporter, gRPC; the figure a loaded machine
   disturbs least); the headline is the median of the per-round ratios.
2. **Alternating steps.** One run, two models of the same shape on the same ranks: one
   observed, one plain. `--pairs` rounds of three steps, the order rotating every round: a
   step of the observed model inside `observer.step()`, one of it outside (`idle hooks`: the
   hooks installed, DDP's buckets still timed by the observer's comm hook, no step report),
   and one of the plain model. Per round, each step over the plain one; the headline is the
   median of the per-round ratios: what observing costs a step, including DDP's comm hook,
   with the machine's noise between two runs taken out (the same process, interleaved).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from plait.daemon.server import DaemonServer
from plait.testing.distributed import run_distributed

KINDS = ("plain", "plain again", "torch hook", "observed", "no daemon")
STEP_KINDS = ("observed", "idle hooks", "plain")
VOCAB, DIM, SEQ_LEN, BATCH = 512, 256, 64, 8


def train(
    rank: int, world_size: int, kind: str, address: str, steps: int, warmup: int, shape: tuple
) -> dict[str, list[float]]:
    """One run of the DDP script; this rank's step times after the warm-up, in seconds (wall,
    and CPU time of the whole process)."""
    import plait

    torch.manual_seed(0)
    model = _ddp_model(*shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    observer = None
    if kind == "torch hook":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif not kind.startswith("plain"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            observer = plait.observe(
                model, optimizer=optimizer, daemon=address, job_id=f"bench-{time.time_ns()}"
            )
    data = torch.Generator().manual_seed(rank)
    times, cpu = [], []
    for _ in range(warmup + steps):
        cpu_start = time.process_time()
        start = time.perf_counter()
        step = observer.step() if observer is not None else _Nothing()
        with step:
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ_LEN + 1), generator=data)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    if observer is not None:
        observer.close()
    return {"wall": times[warmup:], "cpu": cpu[warmup:]}


def alternate(
    rank: int, world_size: int, address: str, pairs: int, warmup: int, shape: tuple
) -> dict:
    """An observed model and a plain one; their step times (wall and the process's CPU) in
    rounds of an observed step, an idle-hooks step and a plain step, interleaved."""
    import plait

    torch.manual_seed(0)
    plain = _ddp_model(*shape)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    torch.manual_seed(0)
    model = _ddp_model(*shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    observer = plait.observe(model, optimizer=optimizer, daemon=address, job_id="bench-steps")
    data = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {kind: [] for kind in STEP_KINDS}
    cpu: dict[str, list[float]] = {kind: [] for kind in STEP_KINDS}  # the process, all threads

    def step(kind: str) -> None:
        net, adam = (plain, plain_optimizer) if kind == "plain" else (model, optimizer)
        cpu_start = time.process_time()
        start = time.perf_counter()
        with observer.step() if kind == "observed" else _Nothing():
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ_LEN + 1), generator=data)
            logits = net(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            adam.step()
            adam.zero_grad()
        times[kind].append(time.perf_counter() - start)
        cpu[kind].append(time.process_time() - cpu_start)

    for index in range(warmup + pairs):
        shift = index % len(STEP_KINDS)
        for kind in STEP_KINDS[shift:] + STEP_KINDS[:shift]:
            step(kind)
    observer.close()
    return {
        "wall": {kind: values[warmup:] for kind, values in times.items()},
        "cpu": {kind: values[warmup:] for kind, values in cpu.items()},
    }


def _model(dim: int = DIM) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, dim),
        *[torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU()) for _ in range(4)],
        torch.nn.Linear(dim, VOCAB),
    )


def _ddp_model(dim: int, bucket_mb: float) -> DDP:
    return DDP(_model(dim), bucket_cap_mb=bucket_mb)


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: Any) -> None:
        return None


def closed_port() -> str:
    """An address nothing listens on (a port the OS handed out and took back)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def _print_runs(console: Console, medians: dict[str, list[float]], rounds: int, what: str) -> None:
    table = Table(title=f"1. DDP step {what}, 2 Gloo ranks, alternating runs (median per run)")
    table.add_column("round", justify="right")
    for kind in KINDS:
        table.add_column(kind, justify="right")
    for kind in KINDS[1:]:
        table.add_column(f"{kind} / plain", justify="right")
    for index in range(rounds):
        row = [medians[kind][index] for kind in KINDS]
        table.add_row(
            str(index + 1),
            *(f"{value * 1e3:.2f} ms" for value in row),
            *(f"{value / row[0]:.4f}" for value in row[1:]),
        )
    console.print(table)
    plain = medians["plain"]
    ratio = {
        kind: statistics.median(o / p for o, p in zip(medians[kind], plain, strict=True))
        for kind in KINDS[1:]
    }
    step = statistics.median(plain)
    console.print(
        f"{what}: median of {rounds} per-round ratios: observed / plain {ratio['observed']:.4f} "
        f"(goal ≤ 1.01; {(ratio['observed'] - 1) * step * 1e3:+.2f} ms on a {step * 1e3:.2f} ms "
        f"step), torch hook / plain {ratio['torch hook']:.4f}, no daemon / plain "
        f"{ratio['no daemon']:.4f}, plain again / plain {ratio['plain again']:.4f} (the noise "
        f"floor between two runs)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps per run not measured")
    parser.add_argument("--pairs", type=int, default=60, help="rounds of steps in part 2")
    parser.add_argument("--only-steps", action="store_true", help="part 2 only")
    parser.add_argument("--dim", type=int, default=DIM, help="width of the model's blocks")
    parser.add_argument("--bucket-mb", type=float, default=0.25, help="DDP's bucket_cap_mb")
    args = parser.parse_args()
    shape = (args.dim, args.bucket_mb)
    console = Console()
    medians: dict[str, dict[str, list[float]]] = {
        what: {kind: [] for kind in KINDS} for what in ("wall", "cpu")
    }
    with DaemonServer("127.0.0.1:0", host_interval=1.0) as server:
        nowhere = closed_port()
        for round_index in range(0 if args.only_steps else args.rounds):
            shift = round_index % len(KINDS)
            for kind in KINDS[shift:] + KINDS[:shift]:
                address = nowhere if kind == "no daemon" else server.address
                times = run_distributed(
                    train, 2, kind, address, args.steps, args.warmup, shape, timeout=600
                )[0]
                for what, values in times.items():
                    medians[what][kind].append(statistics.median(values))
        measured = run_distributed(
            alternate, 2, server.address, args.pairs, args.warmup, shape, timeout=600
        )[0]
        spans = server.store.spans_received
    if not args.only_steps:
        _print_runs(console, medians["wall"], args.rounds, "wall time")
        _print_runs(console, medians["cpu"], args.rounds, "CPU time of the rank's process")
    console.print(
        f"2. alternating steps in one run ({args.pairs} rounds of an observed, an idle-hooks "
        f"and a plain step; {spans} spans reached the daemon):"
    )
    for what, label in (("wall", "wall time"), ("cpu", "CPU time of the rank's process")):
        figures = measured[what]
        plain = statistics.median(figures["plain"])
        ratios = {
            kind: statistics.median(
                a / b for a, b in zip(figures[kind], figures["plain"], strict=True)
            )
            for kind in ("observed", "idle hooks")
        }
        console.print(
            f"   {label}: plain {plain * 1e3:.2f} ms, observed "
            f"{statistics.median(figures['observed']) * 1e3:.2f} ms, idle hooks "
            f"{statistics.median(figures['idle hooks']) * 1e3:.2f} ms; median per-round ratio "
            f"observed / plain {ratios['observed']:.4f} (goal ≤ 1.01; "
            f"{(ratios['observed'] - 1) * plain * 1e3:+.2f} ms), idle hooks / plain "
            f"{ratios['idle hooks']:.4f}"
        )


if __name__ == "__main__":
    main()
