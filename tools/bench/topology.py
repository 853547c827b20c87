"""Benchmark: data-parallel layouts on 2 nodes x 2 ranks over a simulated slow link between nodes.

    python tools/bench/topology.py [--mbps 50] [--rounds 2] [--steps 4] [--dim 128]

Four Gloo ranks on this machine are told they are two nodes of two (torchrun's environment of
two agents, `--nnodes 2`), and a comm-layer shim (`plait.plugins.collectives.slow_link`) makes
every op cost `cross-node bytes / --mbps` on the rank that sends them, bytes counted by
`plait.core.link_bytes` from the host map. Each layout trains the same Llama for `--warmup`
untimed and `--steps` timed steps, twice per round: with the slow link and with a free one
(bytes counted, no delay), so `added` is what the link cost the step. Rounds alternate the
layouts' order; the table has the median over rounds and, beside it, the cross-node bytes per
step (all ranks, and the busiest rank) and the link time they predict (busiest rank's bytes /
bandwidth): the added step time follows the predicted one, whatever the layout.

Layouts: ZeRO-3 flat (ring over all four ranks), ZeRO-3 with hierarchical collectives, HSDP
(`dp_shard = "node"`), hierarchical ZeRO-3 with ZeRO++'s int8 weights and gradients (qwZ +
qgZ), with int4 gradients, with hpZ (`secondary_shard = "node"`) and with hpZ plus both int8
codecs, and ZeRO-1 under HSDP with the optimizer state across replicas. Every layout reduces
gradients with a reduce-scatter (`gradient_reduction = "reduce_scatter"`, the GPU path).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

LAYOUTS: dict[str, dict[str, Any]] = {
    "zero3 flat": {"parallel": {"dp_strategy": "zero3"}, "comm": {"algorithm": "torch"}},
    "zero3 hierarchical": {
        "parallel": {"dp_strategy": "zero3"},
        "comm": {"algorithm": "hierarchical"},
    },
    "zero3 hsdp": {"parallel": {"dp_strategy": "zero3", "dp_shard": "node"}},
    "zero3 hier int8 w+g": {
        "parallel": {"dp_strategy": "zero3"},
        "comm": {"algorithm": "hierarchical"},
        "zero": {"quantize_weights": "int8", "quantize_gradients": "int8"},
    },
    "zero3 hier int4 g": {
        "parallel": {"dp_strategy": "zero3"},
        "comm": {"algorithm": "hierarchical"},
        "zero": {"quantize_gradients": "int4"},
    },
    "zero3 hier hpZ": {
        "parallel": {"dp_strategy": "zero3"},
        "comm": {"algorithm": "hierarchical"},
        "zero": {"secondary_shard": "node"},
    },
    "zero3 hier hpZ+int8": {
        "parallel": {"dp_strategy": "zero3"},
        "comm": {"algorithm": "hierarchical"},
        "zero": {
            "secondary_shard": "node",
            "quantize_weights": "int8",
            "quantize_gradients": "int8",
        },
    },
    "zero1 hsdp optim": {
        "parallel": {"dp_strategy": "zero1", "dp_shard": "node"},
        "zero": {"shard_optimizer_across_replicas": True},
    },
}
WORLD, NODES = 4, 2


def _as_two_nodes(rank: int) -> None:
    """What torchrun's agent of `--nnodes 2 --node-rank rank // 2` sets for its workers."""
    per_node = WORLD // NODES
    os.environ.update(
        {
            "RANK": str(rank),
            "GROUP_RANK": str(rank // per_node),
            "LOCAL_RANK": str(rank % per_node),
            "LOCAL_WORLD_SIZE": str(per_node),
            "WORLD_SIZE": str(WORLD),
            "GROUP_WORLD_SIZE": str(NODES),
            "ROLE_RANK": str(rank),
            "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": str(WORLD),
            "TORCHELASTIC_RUN_ID": "topology-bench",
        }
    )


def run_layout(
    rank: int, world: int, args: argparse.Namespace, layout: str, bytes_per_second: float
) -> dict[str, float]:
    from plait.core.engine import Engine
    from plait.core.plugins import Plugins
    from plait.plugins.collectives.slow_link import SlowCrossNodeLink
    from plait.testing.distributed import merged_config

    del world
    _as_two_nodes(rank)
    link = SlowCrossNodeLink(bytes_per_second=bytes_per_second)
    config = merged_config(
        {
            "model": {
                "name": "llama",
                "size": "tiny",
                "overrides": {"dim": args.dim, "n_layers": args.layers},
            },
            "data": {"seq_len": args.seq_len},
            "train": {"global_batch_size": args.global_batch, "micro_batch_size": 1},
            **LAYOUTS[layout],
        }
    )
    config["zero"] = {"gradient_reduction": "reduce_scatter", **config.get("zero", {})}
    engine = Engine(config=config, plugins=Plugins.create(extra=[("slow_link", link)]))
    link.host_map = engine.mesh.host_map
    share = args.global_batch // engine.mesh.size("dp")
    generator = torch.Generator().manual_seed(rank)
    rows = torch.randint(0, 256, (share, args.seq_len + 1), generator=generator)  # byte-level
    batch = (rows[:, :-1], rows[:, 1:])
    for _ in range(args.warmup):
        engine.train_step(batch)
    start_bytes = link.inter_node_bytes
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.train_step(batch)
    seconds = (time.perf_counter() - start) / args.steps
    inter = (link.inter_node_bytes - start_bytes) / args.steps
    engine.close()
    return {"step_seconds": seconds, "inter_node_bytes": inter}


def main() -> None:
    from plait.testing.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbps", type=float, default=50.0, help="cross-node link, MB/s")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--only", default="", help="comma-separated subset of the layouts")
    args = parser.parse_args()
    layouts = [n for n in LAYOUTS if not args.only or n in args.only.split(",")]
    bandwidth = args.mbps * 1e6
    runs: dict[tuple[str, bool], list[dict[str, float]]] = {}
    for round_index in range(args.rounds):
        order = layouts if round_index % 2 == 0 else layouts[::-1]
        for layout in order:
            for slow in (True, False) if round_index % 2 == 0 else (False, True):
                per_rank = run_distributed(
                    run_layout, WORLD, args, layout, bandwidth if slow else 0.0, timeout=1800
                )
                runs.setdefault((layout, slow), []).append(
                    {
                        # A step ends when its slowest rank does.
                        "step": max(r["step_seconds"] for r in per_rank),
                        "total": sum(r["inter_node_bytes"] for r in per_rank),
                        "busiest": max(r["inter_node_bytes"] for r in per_rank),
                    }
                )
    rows = {}
    for layout in layouts:
        slow, free = runs[(layout, True)], runs[(layout, False)]
        step = statistics.median(r["step"] for r in slow)
        base = statistics.median(r["step"] for r in free)
        busiest = statistics.median(r["busiest"] for r in slow)
        rows[layout] = {
            "total": statistics.median(r["total"] for r in slow),
            "busiest": busiest,
            "predicted": busiest / bandwidth,
            "step": step,
            "free": base,
            "added": step - base,
        }
    print(
        f"Topology benchmark: llama dim={args.dim} layers={args.layers} seq={args.seq_len} "
        f"global batch={args.global_batch} micro=1, {WORLD} Gloo ranks as {NODES} nodes x "
        f"{WORLD // NODES}, cross-node link {args.mbps:g} MB/s (simulated), {args.warmup} "
        f"warm-up + {args.steps} timed steps, {args.rounds} alternating rounds (median)"
    )
    print(
        f"{'':22} {'x-node MB/step':>14} {'busiest MB':>10} {'predicted ms':>12} "
        f"{'step ms':>8} {'free ms':>8} {'added ms':>8} {'bytes/flat':>10} {'step/flat':>9}"
    )
    flat = rows.get("zero3 flat")
    for layout, row in rows.items():
        bytes_ratio = row["total"] / flat["total"] if flat else float("nan")
        step_ratio = row["step"] / flat["step"] if flat else float("nan")
        print(
            f"{layout:22} {row['total'] / 1e6:14.3f} {row['busiest'] / 1e6:10.3f} "
            f"{row['predicted'] * 1e3:12.1f} {row['step'] * 1e3:8.1f} {row['free'] * 1e3:8.1f} "
            f"{row['added'] * 1e3:8.1f} {bytes_ratio:10.3f} {step_ratio:9.3f}"
        )


if __name__ == "__main__":
    main()
