"""Benchmark: context parallelism at cp = 1, 2, 4 on a long sequence, and plait's ring against
torch's ring attention, in the same run.

    python tools/bench/cp.py [--world-size 4] [--seq-len 4096] [--steps 3] [--rounds 3]
                             [--attention-only]

1. Training: the built-in Llama (tiny shape, 4 query / 2 key-value heads) on `world-size` Gloo
   ranks, one sequence of `seq-len` tokens per data-parallel replica, at cp = 1, 2, 4 (dp =
   world / cp, so every row trains the same global batch). Prints tokens/s (median step) and the
   peak activation memory per rank: the bytes autograd saves for backward during the forward
   (counted with `saved_tensors_hooks`, distinct storages, max over ranks). CPU has no allocator
   statistics; on CUDA the script also prints `torch.cuda.max_memory_allocated`.
2. Attention alone, cp = world size, the same load-balanced layout on both sides (rank i holds
   chunks i and 2·cp − 1 − i): plait's `ring` (forward) against torch's ring attention
   (`torch.distributed.tensor.experimental.context_parallel` on CUDA; on CPU, where
   `context_parallel` has no sharding rule for SDPA's CPU kernel, the same templated ring it
   dispatches to, driven with the CPU flash-attention op). Rounds alternate; prints each side's
   median forward time, the ratio, and the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from plait.testing.distributed import run_distributed

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _config(seq_len: int, cp: int, world: int) -> dict[str, Any]:
    return {
        "model": {
            "name": "llama",
            "size": "tiny",
            "overrides": {"n_heads": HEADS, "n_kv_heads": KV_HEADS, "max_seq_len": seq_len},
        },
        "parallel": {"cp": cp, "dp": world // cp},
        "data": {"seq_len": seq_len},
        "train": {"global_batch_size": world // cp, "seed": 0, "device": "auto"},
        "telemetry": {"enabled": False},
    }


class _SavedBytes:
    """Bytes of distinct storages autograd saves for backward during the forward, at most.

    Counting stops at the first unpack (backward has begun): what backward recomputes and
    saves then (the ring's per-block attention) is transient, not held activation memory.
    """

    def __init__(self) -> None:
        self.storages: set[int] = set()
        self.total = 0
        self.peak = 0
        self.in_backward = False

    def reset(self) -> None:
        self.storages.clear()
        self.total = 0
        self.in_backward = False

    def unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.in_backward = True
        return tensor

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.in_backward:
            return tensor
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.storages:
            self.storages.add(storage.data_ptr())
            self.total += storage.nbytes()
            self.peak = max(self.peak, self.total)
        return tensor


def train_rank(rank: int, world: int, seq_len: int, cp: int, steps: int) -> dict[str, float]:
    del rank
    from plait.core.engine import Engine

    engine = Engine(config=_config(seq_len, cp, world))
    replicas = engine.mesh.size("dp")
    tokens = torch.randint(0, 256, (steps + 1, replicas, seq_len + 1))
    dp = engine.mesh.coordinate("dp")
    times, saved = [], _SavedBytes()
    for step in range(steps + 1):  # the first step warms up
        batch = tokens[step, dp : dp + 1]
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            start = time.perf_counter()
            engine.train_step((batch[:, :-1], batch[:, 1:]))
            times.append(time.perf_counter() - start)
        saved.reset()
    engine.close()
    step_seconds = statistics.median(times[1:])
    result = {
        "tokens_per_s": replicas * seq_len / step_seconds,
        "saved_bytes": float(saved.peak),
    }
    if torch.cuda.is_available():
        result["cuda_peak"] = float(torch.cuda.max_memory_allocated())
    return result


def attention_rank(rank: int, world: int, seq_len: int, rounds: int) -> dict[str, Any]:
    import torch.distributed as dist

    from plait.core.comm import Comm, world_group
    from plait.core.kernels import Kernels
    from plait.core.plugins import Plugins
    from plait.core.transforms import ContextParallelism
    from plait.plugins.context_parallel.ring import Ring, ring_forward

    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    plugins = Plugins.create(autoload=False)
    layout = ContextParallelism(degree=world, rank=rank, strategy="ring", ring_degree=world)
    ring = Ring(
        comm=Comm(plugins),
        group=world_group(),
        kernels=Kernels(plugins),
        chunks_of=layout.ring_chunks,
        position=rank,
    )
    generator = torch.Generator().manual_seed(0)
    shape = (1, HEADS, seq_len, HEAD_DIM)
    q, k, v = (torch.randn(shape, generator=generator) for _ in range(3))
    positions = layout.positions(seq_len)
    q, k, v = (t[:, :, positions].contiguous().to(device) for t in (q, k, v))
    torch_ring = _torch_ring(world, device)
    plait_times, torch_times = [], []
    plait_out = torch_out = None
    for _ in range(rounds + 1):  # the first round warms up both
        for name in ("plait", "torch"):
            dist.barrier()
            start = time.perf_counter()
            with torch.no_grad():
                if name == "plait":
                    plait_out = ring_forward(ring, q, k, v)[0]
                else:
                    torch_out = torch_ring(q, k, v)
            if device.type == "cuda":
                torch.cuda.synchronize()
            (plait_times if name == "plait" else torch_times).append(time.perf_counter() - start)
    assert plait_out is not None and torch_out is not None
    return {
        "plait": statistics.median(plait_times[1:]),
        "torch": statistics.median(torch_times[1:]),
        "max_difference": float((plait_out - torch_out).abs().max()),
    }


def _torch_ring(world: int, device: torch.device) -> Any:
    """Causal ring attention from torch (load-balanced head-tail layout, as plait's)."""
    import torch.distributed as dist
    from torch.distributed.tensor.experimental import _attention as cp_attention

    cp_attention._cp_options.enable_load_balance = True
    group = dist.group.WORLD
    if device.type == "cuda":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cuda", (world,))

        def run_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # context_parallel shards full buffers itself: hand it the gathered sequence.
            full = [_gather(t, world) for t in (q, k, v)]
            with context_parallel(mesh, buffers=full, buffer_seq_dims=[2, 2, 2]):
                return torch.nn.functional.scaled_dot_product_attention(*full, is_causal=True)

        return run_cuda
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def run_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # The CPU flash kernel has no grouped-query path: repeat the shared heads.
        group_size = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group_size, 1), v.repeat_interleave(group_size, 1)
        return cp_attention._templated_ring_attention(group, 2, op, q, k, v, is_causal=True)[0]

    return run_cpu


def _gather(t: torch.Tensor, world: int) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--attention-only", action="store_true", help="skip the training table")
    args = parser.parse_args()
    world = args.world_size
    print(f"training: llama tiny ({HEADS} heads, {KV_HEADS} kv), {args.seq_len} tokens/sequence, "
          f"{world} ranks")  # fmt: skip
    print(f"{'cp':>3} {'dp':>3} {'tokens/s':>10} {'act. MiB/rank':>14} {'vs cp=1':>8}")
    baseline = None
    for cp in () if args.attention_only else (1, 2, 4):
        if world % cp:
            continue
        ranks = run_distributed(train_rank, world, args.seq_len, cp, args.steps, timeout=600)
        speed = statistics.mean(r["tokens_per_s"] for r in ranks)
        memory = max(r["saved_bytes"] for r in ranks) / 2**20
        baseline = baseline or memory
        line = f"{cp:>3} {world // cp:>3} {speed:>10.0f} {memory:>14.1f} {memory / baseline:>8.2f}"
        if "cuda_peak" in ranks[0]:
            line += f"  cuda peak {max(r['cuda_peak'] for r in ranks) / 2**20:.1f} MiB"
        print(line)
    ranks = run_distributed(attention_rank, world, args.seq_len, args.rounds, timeout=600)
    plait = statistics.median(r["plait"] for r in ranks)
    peer = statistics.median(r["torch"] for r in ranks)
    difference = max(r["max_difference"] for r in ranks)
    print(f"\nring attention forward, cp={world}, {args.seq_len} tokens: "
          f"plait {plait * 1e3:.1f} ms, torch {peer * 1e3:.1f} ms, plait/torch time "
          f"{plait / peer:.2f} (throughput ratio {peer / plait:.2f}); "
          f"max |difference| {difference:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
