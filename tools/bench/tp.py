"""Benchmark: plait Megatron TP vs torch DTensor `parallelize_module`, same model, same run.

    python tools/bench/tp.py [--world-size 2] [--steps 10] [--dim 256] [--layers 4]

Both sides train the same built-in Llama (plait kernels, name-keyed init) with AdamW and
gradient accumulation over micro-batches, tensor parallel over all spawned Gloo ranks:

- plait: the `megatron` strategy through the engine (column/row-parallel linears, vocab-parallel
  embedding and cross-entropy), and again with sequence parallelism (no DTensor peer row: the
  DTensor SP plan needs a model whose blocks take sequence-sharded RoPE tables);
- torch: `parallelize_module` with `ColwiseParallel` (wq/wk/wv/w1/w3, output head with
  `loss_parallel`), `RowwiseParallel` (wo/w2, the embedding with replicated input).

Gradient clipping is off on both sides (torch's `clip_grad_norm_` does not mix DTensor and plain
parameters); plait still computes the global norm every step, which torch does not. Each
contender runs in fresh processes; rounds alternate to spread machine noise. Prints tokens/s
per contender (mean over ranks, median over rounds) and the plait/torch ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from plait.testing.distributed import run_distributed

MICRO_BATCH = 4


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dim": args.dim,
        "n_layers": args.layers,
        "n_heads": 8,
        "n_kv_heads": 4,
        "vocab_size": 256,
        "max_seq_len": max(256, args.seq_len),
    }


def _config(args: argparse.Namespace, world: int, sequence_parallel: bool) -> dict[str, Any]:
    return {
        "model": {"name": "llama", "size": "tiny", "overrides": _overrides(args)},
        "parallel": {"tp": world, "dp": 1},
        "tp": {"sequence_parallel": sequence_parallel},
        "data": {"seq_len": args.seq_len},
        "train": {"micro_batch_size": MICRO_BATCH, "max_grad_norm": 0.0, "seed": 0},
        "optimizer": {"weight_decay": 0.0},
        "telemetry": {"enabled": False},
    }


def _batches(args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Every TP rank sees the whole batch.
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(args.steps + args.warmup):
        tokens = torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _timed(step: Any, args: argparse.Namespace) -> dict[str, float]:
    batches = _batches(args)
    for batch in batches[: args.warmup]:
        step(batch)
    start = time.perf_counter()
    for batch in batches[args.warmup :]:
        step(batch)
    elapsed = time.perf_counter() - start
    return {"tokens_per_second": args.steps * args.batch * args.seq_len / elapsed}


def run_plait(rank: int, world: int, args: argparse.Namespace, sp: bool) -> dict[str, float]:
    from plait.core.engine import Engine
    from plait.core.plugins import Plugins
    from plait.plugins import tensor_parallel

    del rank
    plugins = Plugins.create(autoload=False, extra=[("tensor_parallel", tensor_parallel)])
    engine = Engine(config=_config(args, world, sp), plugins=plugins)
    return _timed(engine.train_step, args)


def dtensor_llama_plan(n_layers: int) -> dict[str, Any]:
    """The built-in Llama's Megatron layout in DTensor's parallel styles (the peer's plan)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(n_layers):
        prefix = f"layers.{i}."
        for name in ("attention.wq", "attention.wk", "attention.wv"):
            plan[prefix + name] = ColwiseParallel()
        plan[prefix + "attention.wo"] = RowwiseParallel()
        plan[prefix + "feed_forward.w1"] = ColwiseParallel()
        plan[prefix + "feed_forward.w3"] = ColwiseParallel()
        plan[prefix + "feed_forward.w2"] = RowwiseParallel()
    return plan


def run_torch_dtensor(rank: int, world: int, args: argparse.Namespace) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        loss_parallel,
        parallelize_module,
    )

    from plait.core.kernels import Kernels
    from plait.core.plugins import Plugins

    del rank
    plugins = Plugins.create(autoload=False)
    record = plugins.model("llama")
    model_config = record.make_config("tiny", _overrides(args))
    with torch.device("meta"):
        model = record.build(model_config, Kernels(plugins))
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(seed=0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, dtensor_llama_plan(model_config.n_layers))
    # foreach kernels cannot mix DTensor and plain tensors: one parameter group of each.
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    plain = [p for p in model.parameters() if not isinstance(p, DTensor)]
    optimizer = torch.optim.AdamW(
        [{"params": sharded}, {"params": plain}],
        lr=3e-3,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        foreach=True,
    )
    ce = torch.nn.functional.cross_entropy

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        inputs, targets = batch
        chunks = list(zip(inputs.split(MICRO_BATCH), targets.split(MICRO_BATCH), strict=True))
        for x, y in chunks:
            with loss_parallel():
                loss = ce(model(x).flatten(0, 1), y.flatten()) / len(chunks)
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _timed(step, args)


def _plait_tp(rank: int, world: int, args: argparse.Namespace) -> dict[str, float]:
    return run_plait(rank, world, args, False)


def _plait_sp(rank: int, world: int, args: argparse.Namespace) -> dict[str, float]:
    return run_plait(rank, world, args, True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()

    contenders = {
        "plait tp": _plait_tp,
        "plait tp+sp": _plait_sp,
        "torch dtensor": run_torch_dtensor,
    }
    results: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            per_rank = run_distributed(fn, args.world_size, args, timeout=1800)
            results[name].append(sum(r["tokens_per_second"] for r in per_rank) / len(per_rank))
    summary = {name: statistics.median(runs) for name, runs in results.items()}
    print(
        f"TP benchmark: llama dim={args.dim} layers={args.layers} heads=8/4 seq={args.seq_len} "
        f"batch={args.batch} micro={MICRO_BATCH}, tp={args.world_size} Gloo ranks, "
        f"{args.steps} steps × {args.rounds} rounds (median)"
    )
    print(f"{'':14} {'tokens/s':>10} {'vs torch':>9}")
    peer = summary["torch dtensor"]
    for name, value in summary.items():
        print(f"{name:14} {value:10,.0f} {value / peer:8.3f}×")


if __name__ == "__main__":
    main()
